"""Triton kernel: a decode step's miss filter, cache-row assignment and rescoring list (jit code only)."""

import triton
import triton.language as tl


@triton.jit
def decode_plan_kernel(
    cand_ptr,  # [B, C] int64 candidate positions, best first (-1 = none)
    score_ptr,  # [B, C] float32 their coarse scores (-inf for none)
    hit_ptr,  # [B, C] int64 cache row of a hit, CAP for a miss
    lru_ptr,  # [B, CAP] int64 cache rows, least recently used first
    n_encoded_ptr,  # [B] int32 encoded keys (the tail's first position)
    tail_len_ptr,  # [B] int32 keys in the tail
    src_ptr,  # [B, C] int64 out: position to fetch, -1
    dst_ptr,  # [B, C] int64 out: cache row to fill, CAP (trash row) when nothing is fetched
    rows_ptr,  # [B, C + PAGE] int32 out: pool rows to rescore (-1 = none)
    pos_ptr,  # [B, C + PAGE] int64 out: their key positions (-1 = none)
    stats_ptr,  # [B, 4] int32 out: valid, hits, fetched, dropped
    c,
    kth_index,
    CAP: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    MISS_FILTER: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    inside = offs < c
    cand = tl.load(cand_ptr + b * c + offs, mask=inside, other=-1)
    score = tl.load(score_ptr + b * c + offs, mask=inside, other=float("-inf"))
    hit_row = tl.load(hit_ptr + b * c + offs, mask=inside, other=CAP)
    valid = cand >= 0
    hit = valid & (hit_row < CAP)
    keep = hit
    if MISS_FILTER:
        n_valid = tl.maximum(tl.sum(valid.to(tl.int32), axis=0), 2).to(tl.float32)
        mean = tl.sum(tl.where(valid, score, 0.0), axis=0) / n_valid
        centred = tl.where(valid, score - mean, 0.0)
        std = tl.sqrt(tl.sum(centred * centred, axis=0) / (n_valid - 1.0))
        kth = tl.load(score_ptr + b * c + kth_index)
        keep = keep | (valid & (score >= kth - std))
    else:
        keep = keep | valid
    fetch = keep & (hit == 0)
    rank = tl.cumsum(fetch.to(tl.int32), axis=0) - 1
    rank = tl.minimum(tl.maximum(rank, 0), CAP - 1)
    dst = tl.load(lru_ptr + b * CAP + rank, mask=fetch, other=CAP)
    dst = tl.where(fetch, dst, CAP)
    tl.store(src_ptr + b * c + offs, tl.where(fetch, cand, -1), mask=inside)
    tl.store(dst_ptr + b * c + offs, dst, mask=inside)
    row = tl.where(hit, hit_row, tl.where(fetch, dst, -1))
    width = c + PAGE
    tl.store(rows_ptr + b * width + offs, row.to(tl.int32), mask=inside)
    tl.store(pos_ptr + b * width + offs, cand, mask=inside)
    j = tl.arange(0, PAGE)
    live = j < tl.load(tail_len_ptr + b)
    first = tl.load(n_encoded_ptr + b).to(tl.int64)
    tl.store(rows_ptr + b * width + c + j, tl.where(live, CAP + 1 + j, -1).to(tl.int32))
    tl.store(pos_ptr + b * width + c + j, tl.where(live, first + j, -1))
    tl.store(stats_ptr + b * 4 + 0, tl.sum(valid.to(tl.int32), axis=0))
    tl.store(stats_ptr + b * 4 + 1, tl.sum(hit.to(tl.int32), axis=0))
    tl.store(stats_ptr + b * 4 + 2, tl.sum(fetch.to(tl.int32), axis=0))
    tl.store(stats_ptr + b * 4 + 3, tl.sum((valid & (keep == 0)).to(tl.int32), axis=0))
