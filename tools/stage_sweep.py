"""The paged decode step's stage 1 by launch shape and stage 2 with and without score bins, alone, at B x 1M paged
keys (C = 4,096, stage 1 at 4 x C, random codes behind a shuffled page table): CUDA-graph medians per call, and
whether each launch keeps the same keys (a GPU; not part of the package). ``python3 tools/stage_sweep.py
[OUT.json]``; the numbers in docs/results.md ("Stage 1's lookups: ...") came from runs of these steps."""

import json
import sys

import torch
from topk_warps import median_us

from dsaindex.kernels.pq_select import (
    BIN_COUNT,
    decoded_key_bound,
    pq_candidate_bins,
    pq_candidate_scores,
    pq_linear_topc,
)

LAUNCHES = [dict(scan="triton", block_n=256, iters=8, num_warps=4), dict(scan="triton", block_n=256, iters=2, num_warps=4),
            dict(scan="triton", block_n=512, iters=1, num_warps=8), dict(scan="triton", block_n=128, iters=4, num_warps=4),
            dict(scan="cuda")]  # the selecting pass with the tables in shared memory (kernels/pq_scan_cuda.py)
C, C1 = 4096, 16384


def sweep(b: int, n: int = 1 << 20) -> list[dict]:
    """Stage 1 at every launch of :data:`LAUNCHES` and stage 2 both ways, for ``b`` requests of ``n`` keys."""
    pages = b * n // 64
    table = torch.randperm(pages, generator=torch.Generator().manual_seed(0)).cuda().view(b, -1).int()
    lengths = torch.full((b,), n, dtype=torch.int32, device="cuda")
    q = torch.randn(b, 64, 128, device="cuda").bfloat16()
    w = torch.rand(b, 64, device="cuda")
    codes = torch.randint(0, 256, (pages, 64, 32), dtype=torch.uint8, device="cuda")
    cb = torch.randn(32, 256, 4, device="cuda") * 0.3
    default = dict(scan="cuda")  # the decode step's default where the CUDA scan runs

    def stage1(**launch):
        return pq_linear_topc(codes, lengths, q, w, cb, C1, capacity=2 * C1, keep_all=True, return_counts=True,
                              table_dtype=torch.int8, page_table=table, **launch)

    rows, kept = [], None
    for launch in LAUNCHES:
        _, rows1, counts1 = stage1(**launch)
        mine = [torch.sort(rows1[i, : int(counts1[i])]).values for i in range(b)]
        same = kept is None or all(torch.equal(x, y) for x, y in zip(kept, mine, strict=True))
        kept = kept or mine
        us = median_us(lambda launch=launch: stage1(**launch))
        rows.append(dict(stage=1, batch=b, keys=n, launch=launch, default=launch == default, us=us, same_keys=same))
    _, rows1, counts1 = stage1(**default)
    scratch = torch.zeros(b, BIN_COUNT + 4, dtype=torch.int32, device="cuda")
    bound, table_bf16 = decoded_key_bound(cb), cb.bfloat16()
    steps = {"scores": lambda: pq_candidate_scores(codes, rows1, q, w, table_bf16, counts=counts1, block_n=128,
                                                   page_table=table),
             "scores + bins": lambda: pq_candidate_bins(codes, rows1, counts1, q, w, table_bf16, bound, C, C + 256,
                                                        scratch, page_table=table)}
    rows += [dict(stage=2, batch=b, keys=n, form=name, us=median_us(step)) for name, step in steps.items()]
    return rows


def main() -> None:
    rows = []
    for b in (1, 2, 4, 8, 32, 64):
        rows += sweep(b)
        for row in rows[-len(LAUNCHES) - 2 :]:
            print(row, flush=True)
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        json.dump(rows, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
