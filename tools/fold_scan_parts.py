"""What a stage 1 on 16 folded queries would cost: the int8 stage-2 kernel in its 16-head form (``#define MTILES
1``: one m-tile of the tensor cores) run over every row of B x 1M paged keys behind a shuffled page table, its
scores written, beside the shipped CUDA scan's selecting pass over the same codes (keeping about 19% of the rows,
the served point's share) and a plain read of the code bytes (the floor). Also the kernel's 64-head form over every
row: stage 2's full score of every key. CUDA-graph medians per launch in us (a GPU; not part of the package).

The 16-head launch reads a row list and writes a score per key (8 bytes a key besides the 32 code bytes), which
a kernel of its own would not (its rows are consecutive, and it appends the keys above a threshold): its time
bounds such a kernel's from above.

``python3 tools/fold_scan_parts.py [OUT.json] [BATCHES]``: BATCHES a comma list (default 8,32)."""

import json
import sys

import torch

from dsaindex.kernels import pq_scan_cuda as scan
from dsaindex.kernels import pq_stage2_cuda as s2
from dsaindex.pipelines.bench.timing import graph_median_ms

N, SHARE = 1 << 20, 0.1875  # keys a request; stage 1's share at the served point (1.5 x P x C / N, P = 4)
SPANS = (8192, 16384, 32768)  # rows a block of the stage-2 kernel


def timed(b: int, kernels: dict) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(b)
    pages = b * N // 64
    table = torch.randperm(pages, device="cuda", generator=g).view(b, -1).int().contiguous()
    codes = torch.randint(0, 256, (pages, 64, 32), device="cuda", generator=g, dtype=torch.int32).to(torch.uint8)
    lengths = torch.full((b,), N, dtype=torch.int32, device="cuda")
    flat = codes.view(-1, 4).view(torch.int32)
    floor = graph_median_ms(lambda: flat.max()) * 1000
    res = [dict(batch=b, keys=N, variant="read (torch max over the codes, 32 bytes a key)", us=round(floor, 1))]
    print(res[-1], flush=True)

    # the shipped scan's selecting pass, its threshold the (1 - SHARE) quantile of sampled rows' sums
    lut = torch.randint(-127, 128, (b, 32, 256), device="cuda", generator=g, dtype=torch.int32).to(torch.int8)
    sample = torch.randint(0, N, (b, 65536), device="cuda", generator=g)
    at = table.long()[torch.arange(b, device="cuda")[:, None], sample // 64] * 64 + sample % 64
    sums = lut.int().gather(2, codes.view(-1, 32)[at].permute(0, 2, 1).long()).sum(1).float()
    thr = torch.quantile(sums, 1 - SHARE, dim=1).contiguous()
    cap = int(1.5 * SHARE * N)
    buf_p = torch.empty(b, cap, dtype=torch.int32, device="cuda")
    counts = torch.zeros(b, dtype=torch.int32, device="cuda")
    args = [codes, lengths, lut, thr, torch.empty(b, cap, dtype=torch.float32, device="cuda"), buf_p, counts, table,
            table.shape[1], N, cap, 8192, 1]
    k = kernels["scan"]

    def scan_call():
        counts.zero_()
        k(grid=(N // 8192, b, 1), block=(scan.THREADS, 1, 1), shared_mem=scan.SHARED, args=args)
    us = graph_median_ms(scan_call) * 1000
    res.append(dict(batch=b, keys=N, variant="the shipped scan's selecting pass", rows_a_block=8192, us=round(us, 1),
                    vs_read=round(us / floor, 3), kept=int(counts.sum())))
    print(res[-1], flush=True)

    # the stage-2 kernel over every row: 16 folded queries (weights +-1) or 64 heads
    rows = torch.arange(N, dtype=torch.int32, device="cuda").repeat(b, 1).contiguous()
    book = (torch.randn(32, 256, 4, device="cuda", generator=g) * 0.4).to(torch.bfloat16)
    kb = float(book.float().pow(2).sum(2).amax(1).sum().sqrt())
    out = torch.empty(b, N, dtype=torch.float32, device="cuda")
    for heads in (16, 64):
        q = torch.randn(b, heads, 128, device="cuda", generator=g).to(torch.bfloat16)
        w = torch.where(torch.rand(b, heads, device="cuda", generator=g) < 0.5, -1.0, 1.0)
        q8, w8, book8, bounds = s2.int8_operands_reference(q, w, book, kb)
        k = kernels[heads]
        for span in SPANS:
            launch = [codes, rows, lengths, book8, q8, w8, out, rows, rows, table, table.shape[1], N, N, span, 1, 1,
                      0, kb, bounds]

            def call(k=k, span=span, launch=launch):
                k(grid=(N // span, b, 1), block=(s2.THREADS, 1, 1), shared_mem=s2.SHARED_SCORES8, args=launch)
            us = graph_median_ms(call) * 1000
            call()
            res.append(dict(batch=b, keys=N, variant=f"stage 2's int8 kernel, {heads} heads, every row, scores out",
                            rows_a_block=span, us=round(us, 1), vs_read=round(us / floor, 3),
                            same_scores=check(out, codes, table, q8, w8, book8)))
            print(res[-1], flush=True)
    return res


def check(out, codes, table, q8, w8, book8, rows: int = 4096) -> bool:
    """Whether the scores of each request's first ``rows`` keys are those of the integer operands."""
    b = out.shape[0]
    at = table.long()[:, : rows // 64, None] * 64 + torch.arange(64, device="cuda")  # [B, rows / 64, 64]
    c = codes.view(-1, 32)[at.reshape(b, rows)].long()  # [B, rows, 32]
    keys = book8.long()[torch.arange(32, device="cuda"), c].reshape(b, rows, 128)  # [B, rows, 128]
    dots = torch.einsum("brd,bhd->brh", keys.double(), q8.double())
    want = (dots.clamp_min(0) * w8.double()[:, None, :]).sum(-1)
    return bool(torch.allclose(out[:, :rows].double(), want, rtol=1e-5, atol=1e-6 * float(want.abs().max())))


def main() -> None:
    kernels = {"scan": torch.cuda._compile_kernel(scan.source(), scan.KERNEL)}
    kernels["scan"].set_shared_memory_config(scan.SHARED)
    for heads in (16, 64):
        src = ("#define MTILES 1\n" if heads == 16 else "") + s2.source(int8=True)
        kernels[heads] = torch.cuda._compile_kernel(src, s2.KERNEL)
        kernels[heads].set_shared_memory_config(s2.SHARED_BINS8)
    res = []
    for b in [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else (8, 32):
        res += timed(b, kernels)
        torch.cuda.empty_cache()
        if len(sys.argv) > 1:
            with open(sys.argv[1], "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
