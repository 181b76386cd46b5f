"""Stage 2's CUDA kernel taken apart: the kernel as shipped, and with parts of its work removed by editing its
source (the codebook lookups, the ``mma``, the queries' ``ldmatrix``, the code loads), at a grown C's shape: 32
requests x 1M keys, 96K candidates each (random positions). CUDA-graph medians per launch, in us (a GPU; not part
of the package). ``python3 tools/stage2_parts.py [VARIANTS] [OUT.json]``: VARIANTS a comma list of ``base`` and
``+``-joined removals (default: ``base,no_book+no_mma+no_ldsm``). The table in docs/results.md ("Stage 2 as a
CUDA kernel") came from it."""

import json
import sys

import torch

from dsaindex.kernels import pq_stage2_cuda as s2
from dsaindex.pipelines.bench.timing import graph_median_ms

B, N, KEPT, SLOTS = 32, 1 << 20, 98304, 131072
# each removal: (text of the shipped source, what replaces it), keeping the data dependencies alive
REMOVALS = {
    "no_mma": ("for (int nt = 0; nt < 4; ++nt) mma_bf16(acc[nt], a, kf[nt][step][0], kf[nt][step][1]);",
               "for (int nt = 0; nt < 4; ++nt) { acc[nt][0] += __uint_as_float((kf[nt][step][0] ^ a[0]) & 0x3f800000u); "
               "acc[nt][1] += __uint_as_float((kf[nt][step][1] ^ a[1]) & 0x3f800000u); }"),
    "no_book": ("u[i] = book_s[code * 32 + ((first_sub + 4 * i) & 31)];", "u[i] = make_uint2(code, code + i);"),
    "no_codes": ("if (r_nxt[nt] >= 0) cur[nt] = __ldg(reinterpret_cast<const uint2*>(codes_b + (size_t)r_nxt[nt] * 32));",
                 "cur[nt] = make_uint2(r_nxt[nt], r_nxt[nt] * 3);"),
    "no_ldsm": ("ldsm_x4(a, q_s + h * 64 + (((2 * step + (j >> 1)) ^ (h & 7)) << 2));",
                "a[0] = step * 0x10001u + h; a[1] = a[0] + 1; a[2] = a[0] + 2; a[3] = a[0] + 3;"),
}


def variant_source(name: str) -> str:
    """The kernel's source with the removals ``name`` joins by ``+`` (``base``: as shipped)."""
    src = s2.source()
    for part in name.split("+"):
        if part == "base":
            continue
        old, new = REMOVALS[part]
        if old not in src:
            raise SystemExit(f"{part}: the kernel's source no longer holds {old!r}; update tools/stage2_parts.py")
        src = src.replace(old, new)
    return src


def main() -> None:
    names = (sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] else "base,no_book+no_mma+no_ldsm").split(",")
    g = torch.Generator(device="cuda").manual_seed(0)
    codes = torch.randint(0, 256, (B, N, 32), device="cuda", generator=g, dtype=torch.int32).to(torch.uint8)
    rows = torch.randint(0, N, (B, SLOTS), device="cuda", generator=g, dtype=torch.int32)
    counts = torch.full((B,), KEPT, dtype=torch.int32, device="cuda")
    q = torch.randn(B, 64, 128, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.rand(B, 64, device="cuda", generator=g) * 0.1
    cb = (torch.randn(32, 256, 4, device="cuda", generator=g) * 0.3).to(torch.bfloat16)
    out = torch.empty(B, SLOTS, dtype=torch.float32, device="cuda")
    bins = torch.empty(B, SLOTS, dtype=torch.int32, device="cuda")
    scratch = torch.zeros(B, s2.NBINS + 4, dtype=torch.int32, device="cuda")
    res = {}
    for name in names:
        kernel = torch.cuda._compile_kernel(variant_source(name), s2.KERNEL)
        kernel.set_shared_memory_config(s2.SHARED_BINS)
        for per_block, with_bins in ((4096, False), (8192, False), (4096, True)):
            def call(k=kernel, pb=per_block, wb=with_bins):
                k(grid=(-(-SLOTS // pb), B, 1), block=(s2.THREADS, 1, 1),
                  shared_mem=s2.SHARED_BINS if wb else s2.SHARED_SCORES,
                  args=[codes, rows, counts, cb, q, w, out, bins, scratch, counts, 0, N, SLOTS, pb, 0, 1, int(wb), 1.0])
            call()
            scratch.zero_()
            tag = f"{name}_{per_block}{'_bins' if with_bins else ''}"
            res[tag] = round(graph_median_ms(call) * 1000, 1)
            print(tag, res[tag], "us", flush=True)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
