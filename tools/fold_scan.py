"""The fold scan (:mod:`dsaindex.kernels.pq_fold_cuda`) on the GPU: its scores and kept rows against the torch
reference, then its time beside the shipped stage 1 over the same B x 1M paged keys (a shuffled page table).

Per batch size: a plain read of the code bytes (the floor); the shipped stage 1 (``_stage1``: sampling pass and
CUDA scan, int8 tables) at P = 4 of a C grown to 32,768 at 1M (band 131,072: the served point); the fold stage 1
(:func:`pq_fold_topc`: operands, sampling launch, threshold, scan) at P = 1 and 2 of the same C; its parts; and
the scan's compile-time variants (one block a tile, steps in flight, rows a block, parts taken out, a
conflict-free layout). CUDA-graph medians in us (a GPU; not part of the package).

``python3 tools/fold_scan.py [OUT.json] [BATCHES]``: BATCHES a comma list (default 8,32). ``DIAG=1``: the scan's
variants and the operands only; ``QUICK=1``: the stages at one P each and the variants of :data:`QUICK_SET` at 8,192 rows a block."""

import json
import os
import sys

import torch

from dsaindex.kernels import pq_fold_cuda as fold
from dsaindex.kernels import pq_stage2_cuda as s2
from dsaindex.kernels import select
from dsaindex.kernels.pq_select import _stage1, paged_codes_reference
from dsaindex.pipelines.bench.timing import graph_median_ms

N, C, BAND, MOST = 1 << 20, 4096, 131072, 8
SP = "#define SPLIT 1\n"
# name: (defines, one block a tile, threads a block); the others' blocks one a multiprocessor (fold.launch_grid),
# tiles in turn. More threads a block are more warps a multiprocessor (one block fits, for its 128 KB of codebooks):
# 768 and 1,024 threads build in 80 and 63 registers with one step in flight (NVRTC 12.9, sm_90, no spills)
VARIANTS = {"four codebooks, 2 steps in flight (default)": ("", False, 512), "one block a tile": ("", True, 512),
            "3 steps in flight": ("#define DEPTH 3\n", False, 512), "4 steps in flight": ("#define DEPTH 4\n", False, 512),
            "split pairs (1 wavefront a lookup)": (SP, False, 512),
            "768 threads, 1 step in flight": ("#define THREADS 768\n#define DEPTH 1\n", False, 768),
            "768 threads, 2 steps in flight (12 bytes spilled)": ("#define THREADS 768\n", False, 768),
            "768 threads, split pairs, 1 step in flight": ("#define THREADS 768\n#define DEPTH 1\n" + SP, False, 768),
            "1024 threads, 1 step in flight": ("#define THREADS 1024\n#define DEPTH 1\n", False, 1024),
            "diag: no lookups": ("#define DIAG_NO_LOOKUP 1\n", False, 512),
            "diag: no mma": ("#define DIAG_NO_MMA 1\n", False, 512),
            "diag: no epilogue": ("#define DIAG_NO_EPILOGUE 1\n", False, 512)}
QUICK_SET = ("four codebooks, 2 steps in flight (default)", "split pairs (1 wavefront a lookup)",
             "768 threads, 1 step in flight", "768 threads, 2 steps in flight (12 bytes spilled)",
             "768 threads, split pairs, 1 step in flight",
             "1024 threads, 1 step in flight")
DIAG = os.environ.get("DIAG") == "1"  # the scan's variants and the operands' launches only
QUICK = os.environ.get("QUICK") == "1"  # the stages at one P and QUICK_SET at 8,192 rows a block only


def check(b: int, codes, table, lengths, q8, slopes, book8) -> dict:
    """The compiled kernel against the reference on each request's first 8,192 rows: scores, kept set."""
    rows = 8192
    view = paged_codes_reference(codes, table[:, : rows // 64])
    want = fold.fold_scores_reference(view, q8, slopes, book8)
    got = fold.pq_fold_samples(codes, lengths, q8, slopes, book8, 1, rows, table)
    close = bool(torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-6 * float(want.abs().max())))
    thr = got.quantile(0.9, dim=1).contiguous()
    short = torch.full_like(lengths, rows)
    out = torch.full((b, rows), -1, dtype=torch.int32, device="cuda")
    counts = torch.zeros(b, dtype=torch.int32, device="cuda")
    fold.pq_fold_scan(codes, short, q8, slopes, book8, thr, out, counts, rows, table)
    same = all(set(out[i, : counts[i]].tolist()) == set(torch.nonzero(got[i] >= thr[i]).flatten().tolist())
               for i in range(b))
    return dict(batch=b, check="compiled kernel vs reference, first 8,192 rows", scores_close=close, kept_same=same)


def timed(b: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(b)
    pages = b * N // 64
    table = torch.randperm(pages, device="cuda", generator=g).view(b, -1).int().contiguous()
    codes = torch.randint(0, 256, (pages, 64, 32), device="cuda", generator=g, dtype=torch.int32).to(torch.uint8)
    lengths = torch.full((b,), N, dtype=torch.int32, device="cuda")
    book = (torch.randn(32, 256, 4, device="cuda", generator=g) * 0.4)
    queries = torch.randn(b, 64, 128, device="cuda", generator=g).to(torch.bfloat16)
    weights = torch.randn(b, 64, device="cuda", generator=g) * 0.1
    q8, slopes, book8 = fold.fold_operands(queries, weights, book.to(torch.bfloat16))
    res = [check(b, codes, table, lengths, q8, slopes, book8)]
    print(res[-1], flush=True)
    flat = codes.view(-1, 4).view(torch.int32)
    floor = graph_median_ms(lambda: flat.max()) * 1000
    res.append(dict(batch=b, keys=N, variant="read (torch max over the codes, 32 bytes a key)", us=round(floor, 1)))
    print(res[-1], flush=True)

    def add(name, fn, **extra):
        us = graph_median_ms(fn) * 1000
        res.append(dict(batch=b, keys=N, variant=name, us=round(us, 1), vs_read=round(us / floor, 3), **extra))
        print(res[-1], flush=True)

    grow = (BAND, MOST)
    bf = book.to(torch.bfloat16)
    scale = s2.int8_codebook(bf)[1]
    for warps in (8,) if QUICK else (4, 8, 16):
        add(f"fold operands, one Triton launch, {warps} warps",
            lambda warps=warps: fold._fold_operands_fused(queries, weights, scale, 16, 3, 0.05, warps))
    if not QUICK:
        add("fold operands, torch ops", lambda: fold.fold_operands(queries, weights, bf, fused=False))
    for p in (() if DIAG else (4,) if QUICK else (4, 2)):
        def shipped(p=p):
            return _stage1(codes, lengths, queries, weights, book, p * C, None, table, None, None, "auto", grow)
        rows, counts = shipped()
        add(f"shipped stage 1 (codes), P = {p}", shipped, kept=int(counts.float().mean()))
    for p in (() if DIAG else (2,) if QUICK else (2, 1)):
        cap = 2 * p * C

        def folds(p=p, cap=cap):
            return fold.pq_fold_topc(codes, lengths, queries, weights, book.to(torch.bfloat16), p * C, cap, table,
                                     None, grow)
        rows, counts = folds()
        add(f"fold stage 1, P = {p}", folds, kept=int(counts.float().mean()), target=int(1.5 * p * C * MOST))

    # the parts at P = 2
    stride = select.sample_stride(N)
    n_samples = -(-N // stride)
    add("fold sampling launch", lambda: fold.pq_fold_samples(codes, lengths, q8, slopes, book8, stride, n_samples, table))
    samples = fold.pq_fold_samples(codes, lengths, q8, slopes, book8, stride, n_samples, table)
    cap = 4 * C
    counts = torch.zeros(b, dtype=torch.int32, device="cuda")
    add("threshold (sample_thresholds, grown)",
        lambda: select.sample_thresholds(samples, lengths, stride, 2 * C, cap, counts=counts, grow=grow))
    thr = select.sample_thresholds(samples, lengths, stride, 2 * C, cap, counts=counts, grow=grow)
    out = torch.empty(b, cap * MOST, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    reference = None  # the default variant's kept rows, each request's a set
    for name, (defines, one_a_tile, threads) in VARIANTS.items():
        if QUICK and name not in QUICK_SET:
            continue
        kernel = torch.cuda._compile_kernel(defines + fold.source(), fold.KERNEL)
        kernel.set_shared_memory_config(fold.SHARED)
        for rows_a_block in (8192,) if QUICK or DIAG else (2048, 4096, 8192):
            tiles_x = N // rows_a_block
            grid = b * tiles_x if one_a_tile else fold.launch_grid(b * tiles_x, sms)

            def scan(kernel=kernel, rows_a_block=rows_a_block, grid=grid, tiles_x=tiles_x, threads=threads):
                counts.zero_()
                kernel(grid=(grid, 1, 1), block=(threads, 1, 1), shared_mem=fold.shared_bytes(rows_a_block),
                       args=[codes, lengths, book8, q8, slopes, thr, out, counts, thr, table, table.shape[1], N,
                             out.shape[1], rows_a_block, 1, 0, 0, b, tiles_x])
            add(f"fold scan alone, {name}", scan, rows_a_block=rows_a_block, blocks=grid, threads=threads)
            res[-1]["kept"] = int(counts.float().mean())  # the last replay's: the same for every variant
            scan()
            torch.cuda.synchronize()
            kept = [set(out[i, : counts[i]].tolist()) for i in range(b)]
            reference = kept if reference is None else reference  # the first variant timed: the default
            res[-1]["kept_as_default"] = name.startswith("diag") or kept == reference
    return res


def main() -> None:
    res = []
    for b in [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else (8, 32):
        res += timed(b)
        torch.cuda.empty_cache()
        if len(sys.argv) > 1:
            with open(sys.argv[1], "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
