"""Triton kernel: one prefill query's IVF candidate list (jit code only).

``ivf_candidates_kernel``, one program per query: the reserved slots (sinks, then the open window; the
newest of them if they alone overflow the budget), then the members of the best-scored clusters until
the budget is full. The clusters to take come from a weighted k-th search (bisection on the scores'
order keys, each cluster weighted by its size): every cluster scored above the threshold is taken
whole, those at it fill what is left (the last one cut). No sort: the candidate set is the same as
taking clusters in rank order, only the slots' order differs.
"""

import triton
import triton.language as tl

from dsaindex.kernels.topk_kernel import order_keys


@triton.jit
def ivf_candidates_kernel(
    score_ptr,  # [Q, n_clusters] float32 routing scores
    pos_ptr,  # [Q] int64 query positions
    starts_ptr,  # [n_clusters + 1] int64: members of cluster c are order[starts[c]:starts[c + 1]]
    order_ptr,  # [M] int64 member positions, grouped by cluster
    out_ptr,  # [Q, budget] int32 out: candidate positions, -1 = unused
    pick_ptr,  # [Q, C_PAD] int32 scratch: taken clusters (id, slot offset, members taken) packed below
    n_clusters,
    upto,  # keys [0, upto) are clustered; later ones are the open window
    sinks,
    budget,
    C_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SIZE_PAD: tl.constexpr,
):
    q = tl.program_id(0).to(tl.int64)
    visible = tl.load(pos_ptr + q) + 1
    n_sink = tl.minimum(visible, sinks)
    open_lo = tl.maximum(upto, sinks)
    n_open = tl.maximum(visible - open_lo, 0)
    reserved = n_sink + n_open
    shift = tl.maximum(reserved - budget, 0)
    room = budget - tl.minimum(reserved, budget)
    # the clusters: a weighted k-th search for the threshold, then the taken ones listed in index order
    c = tl.arange(0, C_PAD)
    live = c < n_clusters
    key = order_keys(tl.load(score_ptr + q * n_clusters + c, mask=live, other=float("-inf")))
    first = tl.load(starts_ptr + c, mask=live, other=0)
    size = tl.where(live, tl.load(starts_ptr + c + 1, mask=live, other=0) - first, 0).to(tl.int32)
    lo = tl.min(tl.where(live, key, 2147483647), axis=0).to(tl.int64)
    hi = tl.max(tl.where(live, key, -2147483648), axis=0).to(tl.int64)
    lo = tl.minimum(lo, hi)
    while lo < hi:  # the largest threshold whose clusters at or above it hold at least `room` keys
        mid = (lo + hi + 1) >> 1
        weight = tl.sum(tl.where(live & (key >= mid.to(tl.int32)), size, 0), axis=0)
        enough = weight >= room
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    thr = lo.to(tl.int32)
    above = live & (key > thr)
    rest = room - tl.sum(tl.where(above, size, 0), axis=0)
    tied = live & (key == thr)
    tied_before = tl.cumsum(tl.where(tied, size, 0), axis=0) - tl.where(tied, size, 0)
    take = tl.where(above, size, tl.where(tied, tl.minimum(size, tl.maximum(rest - tied_before, 0)), 0))
    take = tl.where(room > 0, take, 0)
    taken = take > 0
    offset = reserved + tl.cumsum(take, axis=0) - take  # slot of each taken cluster's first member
    filled = tl.sum(take, axis=0)
    rank = tl.cumsum(taken.to(tl.int32), axis=0) - 1
    n_taken = tl.sum(taken.to(tl.int32), axis=0)
    base = pick_ptr + q * C_PAD * 3
    tl.store(base + rank * 3, c, mask=taken)
    tl.store(base + rank * 3 + 1, offset.to(tl.int32), mask=taken)
    tl.store(base + rank * 3 + 2, take.to(tl.int32), mask=taken)
    # reserved slots and the unused tail (disjoint from the members' slots written below)
    row = out_ptr + q * budget
    for s0 in range(0, budget, BLOCK_S):
        slot = s0 + tl.arange(0, BLOCK_S)
        i = slot + shift
        val = tl.where(i < n_sink, i, open_lo + i - n_sink)
        val = tl.where(i < reserved, val, -1)
        write = (slot < budget) & ((slot < reserved) | (slot >= reserved + filled))
        tl.store(row + slot, val.to(tl.int32), mask=write)
    tl.debug_barrier()  # the scratch list is read back by every thread
    m = tl.arange(0, SIZE_PAD)
    for j in range(n_taken):
        cl = tl.load(base + j * 3)
        at = tl.load(base + j * 3 + 1)
        n = tl.load(base + j * 3 + 2)
        st = tl.load(starts_ptr + cl)
        members = tl.load(order_ptr + st + m, mask=m < n, other=-1)
        tl.store(row + at + m, members.to(tl.int32), mask=m < n)
