"""One decode step's bookkeeping after the coarse stages, as one Triton kernel per request group.

Given the top-C candidates of each request (positions and coarse scores, best first) and the cache
row each one hits (``cap`` for a miss), :func:`decode_plan` decides, per request:

* LeanSparse's miss filter (:func:`dsaindex.coarse.miss_filter_keep`); hits are always kept;
* where each kept miss goes: the ``r``-th kept miss takes the ``r``-th row of ``lru`` (cache rows,
  least recently used first);
* the rows and key positions the exact rescoring reads: cache rows of hits and fetched misses, then
  the tail (pool rows ``cap + 1 + j`` for the incomplete page's ``j``-th key).

:func:`decode_plan_reference` is the torch spec (a dozen small kernels); the Triton kernel does the
same in one launch, which matters at decode, where a step's fixed cost is mostly kernel launches.
"""

from __future__ import annotations

import torch

from dsaindex.coarse import miss_filter_keep
from dsaindex.kernels import checks


def decode_plan_reference(cand: torch.Tensor, cand_scores: torch.Tensor, hit_row: torch.Tensor, lru: torch.Tensor,
                          n_encoded: torch.Tensor, tail_len: torch.Tensor, topk: int, cap: int, page: int,
                          miss_filter: bool = True,
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The spec of :func:`decode_plan` (inputs described there).

    Returns (src [B, C] int64 positions to fetch or -1, dst [B, C] int64 cache rows or ``cap``,
    rows [B, C + page] int32 pool rows to rescore or -1, positions [B, C + page] int64 or -1,
    stats [B, 4] int32: valid, hits, fetched, dropped)."""
    b, c = cand.shape
    valid = cand >= 0
    hit = valid & (hit_row < cap)
    keep = hit | (miss_filter_keep(cand_scores, valid, topk) if miss_filter and c > 1 else valid)
    fetch = keep & ~hit
    rank = (fetch.long().cumsum(1) - 1).clamp(0, cap - 1)
    dst = torch.where(fetch, lru.gather(1, rank), torch.full_like(rank, cap))
    src = torch.where(fetch, cand, torch.full_like(cand, -1))
    cand_rows = torch.where(hit, hit_row, torch.where(fetch, dst, torch.full_like(dst, -1)))
    j = torch.arange(page, device=cand.device)
    live = j[None, :] < tail_len[:, None]
    tail_rows = torch.where(live, cap + 1 + j[None, :], torch.full_like(j, -1)[None, :])
    tail_pos = torch.where(live, n_encoded[:, None].long() + j[None, :], torch.full_like(j, -1)[None, :])
    rows = torch.cat([cand_rows, tail_rows], dim=1).to(torch.int32)
    positions = torch.cat([cand, tail_pos], dim=1)
    stats = torch.stack([valid.sum(1), hit.sum(1), fetch.sum(1), (valid & ~keep).sum(1)], dim=1).to(torch.int32)
    return src, dst, rows, positions, stats


def decode_plan(cand: torch.Tensor, cand_scores: torch.Tensor, hit_row: torch.Tensor, lru: torch.Tensor,
                n_encoded: torch.Tensor, tail_len: torch.Tensor, topk: int, cap: int, page: int,
                miss_filter: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`decode_plan_reference` in one Triton launch (one program per request).

    cand [B, C] int64 positions (-1 = none), cand_scores [B, C] float32 sorted descending, hit_row
    [B, C] int64 (cache row of a hit, ``cap`` for a miss), lru [B, cap] int64 cache rows least recently
    used first, n_encoded / tail_len [B] int32; all on one device. topk : keys the step selects (the
    miss filter's k); cap : cache rows; page : keys per page (a power of two, the tail's capacity).
    Returns the reference's tuple; raises ``ValueError`` on an input of the wrong dtype, shape or device.
    """
    import triton

    from dsaindex.kernels.decode_plan_kernel import decode_plan_kernel

    checks.rank("cand", cand, 2, "B, C")
    b, c = cand.shape
    checks.shape("cand_scores", cand_scores, (b, c), "B, C")
    checks.shape("hit_row", hit_row, (b, c), "B, C")
    checks.shape("lru", lru, (b, cap), "B, cap")
    checks.shape("n_encoded", n_encoded, (b,), "B")
    checks.shape("tail_len", tail_len, (b,), "B")
    for name, t in (("cand", cand), ("hit_row", hit_row), ("lru", lru)):
        checks.dtype(name, t, torch.int32, torch.int64)
    checks.floating("cand_scores", cand_scores)
    checks.power_of_two("page", page)
    checks.at_least("cap", cap, 1)
    checks.same_device(cand=cand, cand_scores=cand_scores, hit_row=hit_row, lru=lru, n_encoded=n_encoded,
                       tail_len=tail_len)
    dev = cand.device
    src = torch.empty(b, c, dtype=torch.long, device=dev)
    dst = torch.empty(b, c, dtype=torch.long, device=dev)
    rows = torch.empty(b, c + page, dtype=torch.int32, device=dev)
    positions = torch.empty(b, c + page, dtype=torch.long, device=dev)
    stats = torch.empty(b, 4, dtype=torch.int32, device=dev)
    if b == 0:
        return src, dst, rows, positions, stats
    decode_plan_kernel[(b,)](
        cand.contiguous(), cand_scores.contiguous(), hit_row.contiguous(), lru.contiguous(),
        n_encoded.to(torch.int32).contiguous(), tail_len.to(torch.int32).contiguous(),
        src, dst, rows, positions, stats, c, max(0, min(topk, c) - 1),
        CAP=cap, PAGE=page, BLOCK_C=max(16, triton.next_power_of_2(c)), MISS_FILTER=bool(miss_filter and c > 1),
        num_warps=8 if c > 1024 else 4)
    return src, dst, rows, positions, stats
