"""Triton kernel: a decode step's top-k threshold, miss filter, set-associative cache lookup and
placement, and rescoring list (jit code only)."""

import triton
import triton.language as tl

from dsaindex.kernels.topk_kernel import key_value, kth_key, order_keys


@triton.jit
def set_lookup(cache_pos_ptr, cand, valid, SETS: tl.constexpr, WAYS: tl.constexpr):
    """A candidate's cache lookup: a position lives only in set (position % SETS), in any of its WAYS rows.
    ``cache_pos_ptr``: the request's row of cache positions. Returns (home set, its rows' positions [C, WAYS],
    hit, hit row)."""
    home = tl.where(valid, cand.to(tl.int32) % SETS, 0)
    ways = tl.arange(0, WAYS)
    held = tl.load(cache_pos_ptr + home[:, None] * WAYS + ways[None, :], mask=valid[:, None], other=-2)
    match = held.to(tl.int32) == cand.to(tl.int32)[:, None]
    hit = valid & (tl.sum(match.to(tl.int32), axis=1) > 0)
    hit_row = home * WAYS + tl.sum(tl.where(match, ways[None, :], 0), axis=1)
    return home, held, hit, hit_row


@triton.jit
def miss_rows(cache_stamp_ptr, set_count_ptr, home, held, fetch, step32, WAYS: tl.constexpr):
    """Each miss's turn in its set (an atomic counter, ``set_count_ptr`` the request's) and the row that turn
    takes: empty rows first, then least recently used, never a row hit this step (stamped ``step32``).
    Returns (owner: a row was free for it, that row)."""
    ways = tl.arange(0, WAYS)
    empty_way = held < 0
    stamp = tl.load(cache_stamp_ptr + home[:, None] * WAYS + ways[None, :], mask=fetch[:, None], other=0).to(tl.int32)
    free = stamp != step32
    prio = tl.where(free, tl.where(empty_way, -1, stamp), 2147483647)
    order = tl.zeros(prio.shape, dtype=tl.int32)
    for i in tl.static_range(WAYS):
        prio_i = tl.sum(tl.where(ways[None, :] == i, prio, 0), axis=1)[:, None]
        order += ((prio_i < prio) | ((prio_i == prio) & (i < ways[None, :]))).to(tl.int32)
    n_free = tl.sum(free.to(tl.int32), axis=1)
    turn = tl.atomic_add(set_count_ptr + home, 1, mask=fetch)
    owner = fetch & (turn < n_free)
    way_row = home * WAYS + tl.sum(tl.where(order == turn[:, None], ways[None, :], 0), axis=1)
    return owner, way_row


@triton.jit
def decode_plan_kernel(
    cand_ptr,  # [B, C] int64 candidate positions, any order (-1 = none)
    score_ptr,  # [B, C] float32 their coarse scores (-inf for none)
    cache_pos_ptr,  # [B, CAP] int64 position held by each cache row (-1 = empty); updated
    cache_stamp_ptr,  # [B, CAP] int64 step of each row's last use; updated
    set_count_ptr,  # [B, CAP // WAYS] int32 scratch, zero on entry and on exit
    step_ptr,  # [B] int64 each request's step counter, advanced here (the new value is this step's stamp)
    n_encoded_ptr,  # [B] int32 encoded keys (the tail's first position)
    tail_len_ptr,  # [B] int32 keys in the tail
    src_ptr,  # [B, C] int64 out: position to fetch, -1
    dst_ptr,  # [B, C] int64 out: pool row it goes to (cache row, spill row), CAP (trash row) when none
    rows_ptr,  # [B, C + PAGE] int32 out: pool rows to rescore (-1 = none)
    pos_ptr,  # [B, C + PAGE] int64 out: their key positions (-1 = none)
    stats_ptr,  # [B, 4] int32 out: valid, hits, fetched, dropped
    c,
    topk,
    filter_width,  # the miss filter's margin, in standard deviations
    CAP: tl.constexpr,
    WAYS: tl.constexpr,
    PAGE: tl.constexpr,
    SPILL: tl.constexpr,
    BLOCK_C: tl.constexpr,
    MISS_FILTER: tl.constexpr,
):
    SETS: tl.constexpr = CAP // WAYS
    # positions, rows and stamps are held as int32 in registers (a position or a step count fits), which
    # halves the [BLOCK_C, WAYS] tiles: in int64 the kernel spilled registers
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    inside = offs < c
    cand = tl.load(cand_ptr + b * c + offs, mask=inside, other=-1)
    score = tl.load(score_ptr + b * c + offs, mask=inside, other=float("-inf"))
    valid = cand >= 0
    step = tl.load(step_ptr + b) + 1
    tl.store(step_ptr + b, step)
    step32 = step.to(tl.int32)
    home, held, hit, hit_row = set_lookup(cache_pos_ptr + b * CAP, cand, valid, SETS, WAYS)
    keep = hit | valid
    if MISS_FILTER:  # LeanSparse: drop misses below (k-th best coarse score - filter_width std of the scores)
        n_valid = tl.sum(valid.to(tl.int32), axis=0)
        n_div = tl.maximum(n_valid, 2).to(tl.float32)
        mean = tl.sum(tl.where(valid, score, 0.0), axis=0) / n_div
        centred = tl.where(valid, score - mean, 0.0)
        std = tl.sqrt(tl.sum(centred * centred, axis=0) / (n_div - 1.0))
        kth = key_value(kth_key(order_keys(score), valid, topk))
        kth = tl.where(n_valid >= topk, kth, float("-inf"))
        keep = hit | (valid & (score >= kth - filter_width * std))
    fetch = keep & (hit == 0)
    # phase 1: this step's hits are used now (their rows are not replaced below)
    tl.store(cache_stamp_ptr + b * CAP + hit_row, step, mask=hit)
    tl.debug_barrier()
    # phase 2: each kept miss takes a row of its set: empty rows first, then least recently used, never
    # a row hit this step; the misses of one set are numbered by an atomic counter
    owner, way_row = miss_rows(cache_stamp_ptr + b * CAP, set_count_ptr + b * SETS, home, held, fetch, step32, WAYS)
    tl.debug_barrier()
    # phase 3: reset the counters, claim the rows; a miss whose set is full goes to a spill row (past the
    # SPILL rows, it is dropped)
    tl.store(set_count_ptr + b * SETS + home, 0, mask=fetch)
    tl.store(cache_pos_ptr + b * CAP + way_row, cand, mask=owner)
    tl.store(cache_stamp_ptr + b * CAP + way_row, step, mask=owner)
    spill = fetch & (owner == 0)
    spill_rank = tl.cumsum(spill.to(tl.int32), axis=0) - 1
    lost = spill & (spill_rank >= SPILL)
    fetch = fetch & (lost == 0)
    keep = keep & (lost == 0)
    dst = tl.where(owner, way_row, tl.where(fetch, CAP + 1 + PAGE + spill_rank, CAP)).to(tl.int64)
    tl.store(src_ptr + b * c + offs, tl.where(fetch, cand, -1), mask=inside)
    tl.store(dst_ptr + b * c + offs, dst, mask=inside)
    row = tl.where(hit, hit_row, tl.where(fetch, dst, -1))
    width = c + PAGE
    tl.store(rows_ptr + b * width + offs, row.to(tl.int32), mask=inside)
    tl.store(pos_ptr + b * width + offs, tl.where(keep, cand, -1), mask=inside)
    j = tl.arange(0, PAGE)
    live = j < tl.load(tail_len_ptr + b)
    first = tl.load(n_encoded_ptr + b).to(tl.int64)
    tl.store(rows_ptr + b * width + c + j, tl.where(live, CAP + 1 + j, -1).to(tl.int32))
    tl.store(pos_ptr + b * width + c + j, tl.where(live, first + j, -1))
    tl.store(stats_ptr + b * 4 + 0, tl.sum(valid.to(tl.int32), axis=0))
    tl.store(stats_ptr + b * 4 + 1, tl.sum(hit.to(tl.int32), axis=0))
    tl.store(stats_ptr + b * 4 + 2, tl.sum(fetch.to(tl.int32), axis=0))
    tl.store(stats_ptr + b * 4 + 3, tl.sum((valid & (keep == 0)).to(tl.int32), axis=0))


@triton.jit
def decode_plan_chunked_kernel(
    cand_ptr, cache_pos_ptr, cache_stamp_ptr, set_count_ptr, step_ptr, n_encoded_ptr, tail_len_ptr,
    src_ptr, dst_ptr, rows_ptr, pos_ptr, stats_ptr,  # as decode_plan_kernel's
    c,
    CAP: tl.constexpr,
    WAYS: tl.constexpr,
    PAGE: tl.constexpr,
    SPILL: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # decode_plan_kernel without its miss filter, for candidate lists wider than one program holds at once (a
    # grown C: up to 16K and more): the same three phases, each a loop over CHUNK candidates, the state between
    # them in the outputs (a hit's row in rows, a miss's cache row in dst, claimed only once every miss of the
    # request has counted its turn in its set and read its set's stamps)
    SETS: tl.constexpr = CAP // WAYS
    b = tl.program_id(0).to(tl.int64)
    step = tl.load(step_ptr + b) + 1
    tl.store(step_ptr + b, step)
    step32 = step.to(tl.int32)
    width = c + PAGE
    n_valid = tl.zeros([], dtype=tl.int32)
    n_hit = tl.zeros([], dtype=tl.int32)
    # phase 1: lookups; this step's hits are stamped (their rows are not replaced below), their rows written
    for start in range(0, c, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        inside = offs < c
        cand = tl.load(cand_ptr + b * c + offs, mask=inside, other=-1)
        valid = cand >= 0
        _, _, hit, hit_row = set_lookup(cache_pos_ptr + b * CAP, cand, valid, SETS, WAYS)
        tl.store(cache_stamp_ptr + b * CAP + hit_row, step, mask=hit)
        tl.store(rows_ptr + b * width + offs, tl.where(hit, hit_row, -1).to(tl.int32), mask=inside)
        n_valid += tl.sum(valid.to(tl.int32), axis=0)
        n_hit += tl.sum(hit.to(tl.int32), axis=0)
    tl.debug_barrier()
    # phase 2: each miss's turn in its set (an atomic counter) and the row that turn takes: empty rows first,
    # then least recently used, never a row hit this step; -1 where its set has no such row left
    for start in range(0, c, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        inside = offs < c
        cand = tl.load(cand_ptr + b * c + offs, mask=inside, other=-1)
        hit = tl.load(rows_ptr + b * width + offs, mask=inside, other=-1) >= 0
        fetch = (cand >= 0) & (hit == 0)
        home, held, _, _ = set_lookup(cache_pos_ptr + b * CAP, cand, fetch, SETS, WAYS)
        owner, way_row = miss_rows(cache_stamp_ptr + b * CAP, set_count_ptr + b * SETS, home, held, fetch, step32,
                                   WAYS)
        tl.store(dst_ptr + b * c + offs, tl.where(owner, way_row, tl.where(fetch, -1, CAP)).to(tl.int64), mask=inside)
    tl.debug_barrier()
    # phase 3: the counters reset, the rows claimed; a miss whose set is full takes a spill row (past the SPILL
    # rows, it is dropped); the fetch and rescoring lists
    spilled = tl.zeros([], dtype=tl.int32)
    n_fetch = tl.zeros([], dtype=tl.int32)
    n_lost = tl.zeros([], dtype=tl.int32)
    for start in range(0, c, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        inside = offs < c
        cand = tl.load(cand_ptr + b * c + offs, mask=inside, other=-1)
        valid = cand >= 0
        hit_row = tl.load(rows_ptr + b * width + offs, mask=inside, other=-1)
        hit = hit_row >= 0
        fetch = valid & (hit == 0)
        way_row = tl.load(dst_ptr + b * c + offs, mask=inside, other=CAP)
        owner = fetch & (way_row >= 0)
        home = tl.where(fetch, cand.to(tl.int32) % SETS, 0)
        tl.store(set_count_ptr + b * SETS + home, 0, mask=fetch)
        tl.store(cache_pos_ptr + b * CAP + way_row, cand, mask=owner)
        tl.store(cache_stamp_ptr + b * CAP + way_row, step, mask=owner)
        spill = fetch & (owner == 0)
        spill_rank = spilled + tl.cumsum(spill.to(tl.int32), axis=0) - 1
        spilled += tl.sum(spill.to(tl.int32), axis=0)
        lost = spill & (spill_rank >= SPILL)
        fetch = fetch & (lost == 0)
        dst = tl.where(owner, way_row, tl.where(fetch, CAP + 1 + PAGE + spill_rank, CAP)).to(tl.int64)
        tl.store(src_ptr + b * c + offs, tl.where(fetch, cand, -1), mask=inside)
        tl.store(dst_ptr + b * c + offs, dst, mask=inside)
        row = tl.where(hit, hit_row, tl.where(fetch, dst, -1).to(tl.int32))
        tl.store(rows_ptr + b * width + offs, row.to(tl.int32), mask=inside)
        tl.store(pos_ptr + b * width + offs, tl.where(valid & (lost == 0), cand, -1), mask=inside)
        n_fetch += tl.sum(fetch.to(tl.int32), axis=0)
        n_lost += tl.sum(lost.to(tl.int32), axis=0)
    j = tl.arange(0, PAGE)
    live = j < tl.load(tail_len_ptr + b)
    first = tl.load(n_encoded_ptr + b).to(tl.int64)
    tl.store(rows_ptr + b * width + c + j, tl.where(live, CAP + 1 + j, -1).to(tl.int32))
    tl.store(pos_ptr + b * width + c + j, tl.where(live, first + j, -1))
    tl.store(stats_ptr + b * 4 + 0, n_valid)
    tl.store(stats_ptr + b * 4 + 1, n_hit)
    tl.store(stats_ptr + b * 4 + 2, n_fetch)
    tl.store(stats_ptr + b * 4 + 3, n_lost)
