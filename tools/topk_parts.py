"""The decode step's final top-k (``small_topk``, k = 2,048 of a grown C's 16,704 slots) taken apart: the whole
kernel, held as one 32,768-slot block and as 16,384 slots + a 512-slot tail (``split_tail``), each row spread over
programs (``radix_topk``, 512-2,048 entries a program), its k-th search alone
(the row loaded into registers, ``kth_key``, the threshold stored), the load alone, and the k-th search over a
16,384-slot block (what a row that fit it would cost), at B = 1, 2, 8, 32 and 8-32 warps.
CUDA-graph medians per call in us (a GPU; not part of the package). ``python3 tools/topk_parts.py [OUT.json]``."""

import json
import sys

import torch
import triton
import triton.language as tl
from topk_warps import by_warps, median_us

from dsaindex.kernels.topk import radix_topk
from dsaindex.kernels.topk_kernel import kth_key, order_keys

N, K = 16704, 2048


@triton.jit
def kth_only_kernel(val_ptr, out_ptr, n, k, BLOCK: tl.constexpr, WIDTH: tl.constexpr, SEARCH: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK // WIDTH)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]
    key = order_keys(tl.load(val_ptr + b * n + offs, mask=offs < n, other=float("-inf")))
    if SEARCH:
        t = kth_key(key, offs < n, k)
    else:
        t = tl.max(key)
    tl.store(out_ptr + b, t)


def sweep(b: int) -> list[dict]:
    """Every part and launch at ``b`` rows."""
    res = []
    x = torch.randn(b, N, device="cuda") * 3
    pay = torch.randint(0, 1 << 20, (b, N), device="cuda", dtype=torch.int32)
    out = torch.empty(b, dtype=torch.int32, device="cuda")
    want = set(pay[0][x[0].topk(K).indices].tolist())
    res += by_warps(x, K, pay, want, batch=b, part="small_topk", split_tail=False)
    res += by_warps(x, K, pay, want, (8, 16), batch=b, part="small_topk, 16,384 + a 512-slot tail", split_tail=True)
    # a fixed C's row: 4,096 candidates, 256 tie slots and the open page, as 8,192 slots or 4,096 + a 512-slot tail
    x4, pay4 = x[:, :4416].contiguous(), pay[:, :4416].contiguous()
    want4 = set(pay4[0][x4[0].topk(K).indices].tolist())
    res += by_warps(x4, K, pay4, want4, (4, 8, 16), batch=b, part="small_topk of 4,416", split_tail=False)
    res += by_warps(x4, K, pay4, want4, (4, 8), batch=b, part="small_topk of 4,416 as 4,096 + 512", split_tail=True)
    # each row spread over programs: a radix select in four launches (kernels.topk.radix_topk)
    for rows, p, w_set, name in ((x, pay, want, "radix_topk"), (x4, pay4, want4, "radix_topk of 4,416")):
        for bits in (11, 8):
            for block in (512, 1024, 2048):
                for warps in (4, 8):
                    def step(rows=rows, p=p, block=block, warps=warps, bits=bits):
                        return radix_topk(rows, K, p, index_dtype=torch.int32, block=block, num_warps=warps,
                                          digit_bits=bits)
                    same = set(step()[1][0].tolist()) == w_set
                    res.append(dict(batch=b, part=name, digit_bits=bits, block=block, num_warps=warps, same=same,
                                    us=round(median_us(step), 1)))
                    print(res[-1], flush=True)
    for warps in (8, 16, 32):
        for block, search, n in ((32768, True, N), (32768, False, N), (16384, True, 16384)):
            def part(warps=warps, block=block, search=search, n=n):
                kth_only_kernel[(b,)](x, out, n, K, BLOCK=block, WIDTH=128, SEARCH=search, num_warps=warps)
            res.append(dict(batch=b, part="kth search" if search else "load and max", block=block, slots=n,
                            num_warps=warps, us=round(median_us(part), 1)))
            print(res[-1], flush=True)
    return res


def main() -> None:
    res = []
    for b in (1, 2, 8, 32):
        res += sweep(b)
        # written after each batch size: a run stopped at its time limit keeps what it measured
        if len(sys.argv) > 1:
            with open(sys.argv[1], "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
