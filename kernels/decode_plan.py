"""One decode step's bookkeeping after the coarse stages, as one Triton kernel per request group.

Given each request's C candidates (positions and coarse scores, in any order), :func:`decode_plan`
decides, per request:

* LeanSparse's miss filter (:func:`dsaindex.coarse.miss_filter_keep`: a miss below the k-th best coarse
  score minus ``filter_width`` standard deviations is dropped); hits are always kept;
* the cache lookup. The cache is set-associative: ``cap`` rows in ``cap / ways`` sets of ``ways`` rows,
  and a position ``p`` can only live in set ``p % sets``. A lookup reads ``ways`` rows, so no sort and no
  search is needed, whatever the cache size;
* where each kept miss goes: a row of its set, empty rows first, then the least recently used, never
  a row that this step hits; a miss whose set has no such row left goes to one of ``spill`` rows of the
  pool (``cap + 1 + page + i``) and is used this step without entering the cache (past those rows, a
  rare event, it is dropped);
* the rows and key positions the exact rescoring reads: cache or spill rows of the kept candidates, then
  the tail (pool rows ``cap + 1 + j`` for the incomplete page's ``j``-th key).

It updates the cache's positions and stamps in place: the rows it assigns hold the fetched keys once
the caller has copied them there. :func:`decode_plan_reference` is the torch spec; the misses of one set
take its rows in candidate order there, in the kernel in the order of an atomic counter (the same rows,
perhaps to different misses: the selection does not change).
"""

from __future__ import annotations

import torch

from dsaindex.coarse import FILTER_WIDTH, check_filter_width, miss_filter_keep
from dsaindex.kernels import checks

WAYS = 4
ONE_TILE_UPTO = 8192  # candidates the plan holds in one tile (a fixed C's); wider lists without the miss filter
PLAN_CHUNK = 1024  # (a grown C's) go through the chunked kernel, this many candidates at a time


def decode_plan_reference(cand: torch.Tensor, cand_scores: torch.Tensor, cache_pos: torch.Tensor,
                          cache_stamp: torch.Tensor, step: torch.Tensor, n_encoded: torch.Tensor,
                          tail_len: torch.Tensor, topk: int, page: int, miss_filter: bool = True, ways: int = WAYS,
                          spill: int = 256, set_count: torch.Tensor | None = None,
                          filter_width: float = FILTER_WIDTH, num_warps: int | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The spec of :func:`decode_plan` (inputs described there; ``set_count`` is unused).

    Returns (src [B, C] int64 positions to fetch or -1, dst [B, C] int64 pool rows or ``cap``,
    rows [B, C + page] int32 pool rows to rescore or -1, positions [B, C + page] int64 or -1,
    stats [B, 4] int32: valid, hits, fetched, dropped); updates ``cache_pos`` and ``cache_stamp`` and
    advances ``step``."""
    b, c = cand.shape
    cap = cache_pos.shape[1]
    sets = cap // ways
    dev = cand.device
    valid = cand >= 0
    home = torch.where(valid, cand % sets, torch.zeros_like(cand))
    way_rows = home[:, :, None] * ways + torch.arange(ways, device=dev)  # [B, C, W]
    held = cache_pos.gather(1, way_rows.reshape(b, -1)).reshape(b, c, ways)
    match = (held == cand[:, :, None]) & valid[:, :, None]
    hit = match.any(-1)
    hit_row = (way_rows * match).sum(-1)
    if miss_filter and c > 1:
        order = cand_scores.argsort(dim=1, descending=True)
        ranked = cand_scores.gather(1, order)
        keep_ranked = miss_filter_keep(ranked, valid.gather(1, order), topk, filter_width)
        keep = hit | torch.zeros_like(valid).scatter(1, order, keep_ranked)
    else:
        keep = valid.clone()
    fetch = keep & ~hit
    step += 1
    stamps = step.to(cache_stamp.dtype)
    rows_b, cols_b = hit.nonzero(as_tuple=True)
    cache_stamp[rows_b, hit_row[rows_b, cols_b]] = stamps[rows_b]
    dst = torch.full_like(cand, cap)
    for i in range(b):
        idx = fetch[i].nonzero().squeeze(1)  # candidate order
        if idx.numel() == 0:
            continue
        t = stamps[i]
        s = home[i, idx]
        rows = way_rows[i, idx]  # [F, W]
        stamp = cache_stamp[i].gather(0, rows.reshape(-1)).reshape(rows.shape)
        prio = torch.where(cache_pos[i].gather(0, rows.reshape(-1)).reshape(rows.shape) < 0,
                           torch.full_like(stamp, -1), stamp)
        free = stamp != t
        prio = torch.where(free, prio, torch.full_like(prio, torch.iinfo(torch.long).max))
        by_prio = prio.argsort(dim=1, stable=True)  # rows of the set, best to replace first
        # misses of the same set before this one, in candidate order
        by_set = s.argsort(stable=True)
        grouped = s[by_set]
        turn = torch.empty_like(s)
        turn[by_set] = torch.arange(s.numel(), device=dev) - torch.searchsorted(grouped, grouped)
        owner = turn < free.sum(1)
        way_row = rows.gather(1, by_prio.gather(1, turn.clamp_max(ways - 1)[:, None]))[:, 0]
        spill_rank = (~owner).long().cumsum(0) - 1
        lost = ~owner & (spill_rank >= spill)
        fetch[i, idx[lost]] = False
        keep[i, idx[lost]] = False
        dst[i, idx] = torch.where(owner, way_row, torch.where(lost, cap, cap + 1 + page + spill_rank))
        cache_pos[i, way_row[owner]] = cand[i, idx[owner]]
        cache_stamp[i, way_row[owner]] = t
    src = torch.where(fetch, cand, torch.full_like(cand, -1))
    cand_rows = torch.where(hit, hit_row, torch.where(fetch, dst, torch.full_like(dst, -1)))
    j = torch.arange(page, device=dev)
    live = j[None, :] < tail_len[:, None]
    tail_rows = torch.where(live, cap + 1 + j[None, :], torch.full_like(j, -1)[None, :])
    tail_pos = torch.where(live, n_encoded[:, None].long() + j[None, :], torch.full_like(j, -1)[None, :])
    rows = torch.cat([cand_rows, tail_rows], dim=1).to(torch.int32)
    positions = torch.cat([torch.where(keep, cand, torch.full_like(cand, -1)), tail_pos], dim=1)
    stats = torch.stack([valid.sum(1), hit.sum(1), fetch.sum(1), (valid & ~keep).sum(1)], dim=1).to(torch.int32)
    return src, dst, rows, positions, stats


def decode_plan(cand: torch.Tensor, cand_scores: torch.Tensor, cache_pos: torch.Tensor, cache_stamp: torch.Tensor,
                step: torch.Tensor, n_encoded: torch.Tensor, tail_len: torch.Tensor, topk: int, page: int,
                miss_filter: bool = True, ways: int = WAYS, spill: int = 256, set_count: torch.Tensor | None = None,
                filter_width: float = FILTER_WIDTH, num_warps: int | None = None, chunk: int | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`decode_plan_reference` in one Triton launch (one program per request).

    cand [B, C] int64 positions (-1 = none; below 2**31: the kernel holds them as int32), cand_scores
    [B, C] float32 (-inf for none), any order;
    cache_pos [B, cap] int64 (-1 = empty) and cache_stamp [B, cap] int64, updated in place; step [B] int64
    each request's step counter, advanced by one here, the new value this step's stamp (on the device:
    steps replay in CUDA graphs); n_encoded / tail_len [B] int32;
    topk : keys the step selects (the miss filter's k); page : keys per page (a power of two, the tail's
    capacity); ways : rows per cache set (a power of two dividing cap); spill : pool rows past the tail
    for misses whose set is full; set_count : [B, cap / ways] int32
    zeros, a scratch the kernel leaves zeroed (allocated per call if not given); filter_width : the miss
    filter's margin below the k-th coarse score, in standard deviations; num_warps : the launch's warps
    (default: 4 candidates a thread, 4 to 16 warps); chunk : without the miss filter, take the candidates this
    many at a time (a power of two; default: :data:`PLAN_CHUNK` past :data:`ONE_TILE_UPTO` candidates, where one
    tile of all of them would spill registers: a grown C's list), else all at once. All on one device. The
    pool needs ``cap + 1 + page + spill`` rows. Raises ``ValueError`` on an input of the wrong dtype,
    shape or device.
    """
    import triton

    from dsaindex.kernels.decode_plan_kernel import decode_plan_kernel

    checks.rank("cand", cand, 2, "B, C")
    b, c = cand.shape
    checks.rank("cache_pos", cache_pos, 2, "B, cap")
    cap = cache_pos.shape[1]
    checks.shape("cand_scores", cand_scores, (b, c), "B, C")
    checks.shape("cache_pos", cache_pos, (b, None), "B, cap")
    checks.shape("cache_stamp", cache_stamp, (b, cap), "B, cap")
    checks.shape("n_encoded", n_encoded, (b,), "B")
    checks.shape("tail_len", tail_len, (b,), "B")
    checks.shape("step", step, (b,), "B")
    checks.dtype("step", step, torch.int64)
    checks.dtype("cand", cand, torch.int64)
    checks.dtype("cache_pos", cache_pos, torch.int64)
    checks.dtype("cache_stamp", cache_stamp, torch.int64)
    checks.floating("cand_scores", cand_scores)
    checks.power_of_two("page", page)
    filter_width = check_filter_width(filter_width)
    checks.power_of_two("ways", ways)
    if cap % ways or cap < ways:
        raise ValueError(f"cache_pos.shape[1] (cap): got {cap}, want a multiple of ways ({ways})")
    checks.same_device(cand=cand, cand_scores=cand_scores, cache_pos=cache_pos, cache_stamp=cache_stamp, step=step,
                       n_encoded=n_encoded, tail_len=tail_len)
    dev = cand.device
    if set_count is None:
        set_count = torch.zeros(b, cap // ways, dtype=torch.int32, device=dev)
    src = torch.empty(b, c, dtype=torch.long, device=dev)
    dst = torch.empty(b, c, dtype=torch.long, device=dev)
    rows = torch.empty(b, c + page, dtype=torch.int32, device=dev)
    positions = torch.empty(b, c + page, dtype=torch.long, device=dev)
    stats = torch.empty(b, 4, dtype=torch.int32, device=dev)
    if b == 0:
        return src, dst, rows, positions, stats
    filtered = bool(miss_filter and c > 1)
    if chunk is None and not filtered and c > ONE_TILE_UPTO:
        chunk = PLAN_CHUNK
    if chunk is not None and not filtered:
        from dsaindex.kernels.decode_plan_kernel import decode_plan_chunked_kernel

        checks.power_of_two("chunk", chunk)
        decode_plan_chunked_kernel[(b,)](
            cand.contiguous(), cache_pos, cache_stamp, set_count, step, n_encoded.to(torch.int32).contiguous(),
            tail_len.to(torch.int32).contiguous(), src, dst, rows, positions, stats, c, CAP=cap, WAYS=ways, PAGE=page,
            SPILL=spill, CHUNK=chunk, num_warps=num_warps or max(4, min(8, chunk // 128)))
        return src, dst, rows, positions, stats
    block_c = max(16, triton.next_power_of_2(c))
    warps = min(16, max(4, block_c // 128))  # 4 candidates a thread: with 8 the kernel spilled on the H200
    decode_plan_kernel[(b,)](
        cand.contiguous(), cand_scores.float().contiguous(), cache_pos, cache_stamp, set_count, step,
        n_encoded.to(torch.int32).contiguous(), tail_len.to(torch.int32).contiguous(),
        src, dst, rows, positions, stats, c, max(1, min(topk, c)), filter_width,
        CAP=cap, WAYS=ways, PAGE=page, SPILL=spill, BLOCK_C=block_c,
        MISS_FILTER=filtered, num_warps=num_warps or warps)
    return src, dst, rows, positions, stats
