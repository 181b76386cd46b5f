"""Triton kernel: keep the entries of each row at or above its threshold (jit code only)."""

import triton
import triton.language as tl

from dsaindex.kernels.select_kernel import append_above


@triton.jit
def rows_above_kernel(
    logits_ptr,  # [B, row_stride] float32 scores
    lengths_ptr,  # [B] int32 valid entries of each row
    thr_ptr,  # [B] float32 thresholds
    out_score_ptr,  # [B, CAPACITY] float32 buffer
    out_pos_ptr,  # [B, CAPACITY] int32 buffer positions
    count_ptr,  # [B] int32 appended counts
    row_stride,
    BLOCK_N: tl.constexpr,
    ITERS: tl.constexpr,
    CAPACITY: tl.constexpr,
):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    length = tl.load(lengths_ptr + b)
    thr = tl.load(thr_ptr + b)
    for it in range(ITERS):
        idx = (pid * ITERS + it) * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = idx < length
        score = tl.load(logits_ptr + b * row_stride + idx, mask=valid, other=float("-inf"))
        append_above(score, idx, valid, thr, out_score_ptr + b * CAPACITY, out_pos_ptr + b * CAPACITY,
                     count_ptr + b, CAPACITY)


@triton.jit
def order_keys(x):
    """int32 keys of float32 values whose signed order is the values' order (-inf lowest, NaN aside)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def key_value(key):
    """The float32 value of an :func:`order_keys` key."""
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def kth_key(key, live, rank):
    """The ``rank``-th largest of the ``live`` entries of ``key`` (int32 order keys), by bisection on the
    key bits: counting passes over registers, no sort. A pass whose count is exactly ``rank`` ends the
    search (the answer is then the smallest key at or above its pivot), so distinct keys take about
    log2(entries) + 2 passes instead of 32, fewer still as the search starts from the live keys' range.
    With fewer than ``rank`` live entries it is the lowest int32,
    which no live key is below. (Two or three pivots per pass, their counts packed in one sum, and radix
    passes with a histogram each, measured slower on the H200: a pass costs its per-entry work and a
    block-wide reduction.)"""
    # the search starts between the smallest and largest live key (scores of one row share most of
    # their exponent bits: several passes fewer than the whole int32 range)
    lo = tl.min(tl.where(live, key, 2147483647), axis=0).to(tl.int64)
    hi = tl.max(tl.where(live, key, -2147483648), axis=0).to(tl.int64)
    lo = tl.minimum(lo, hi)
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        count = tl.sum((live & (key >= mid.to(tl.int32))).to(tl.int32), axis=0)
        enough = count >= rank
        lo = tl.where(enough, mid, lo)
        hi = tl.where(count == rank, mid, tl.where(enough, hi, mid - 1))
    at_or_above = live & (key >= lo.to(tl.int32))
    smallest = tl.min(tl.where(at_or_above, key, 2147483647), axis=0)
    found = tl.sum(live.to(tl.int32), axis=0) >= rank
    return tl.where(found, smallest, -2147483648)


@triton.jit
def take_top(key, live, rank, threshold):
    """Mask of the ``rank`` largest live entries: every key above ``threshold`` (the rank-th largest)
    and, of the keys equal to it, the first ones in order."""
    above = live & (key > threshold)
    tied = live & (key == threshold)
    room = rank - tl.sum(above.to(tl.int32), axis=0)
    return above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= room))


@triton.jit
def row_topk_kernel(
    val_ptr,  # [B, n] float32 values
    pay_ptr,  # [B, n] int32 / int64 payload (HAS_PAYLOAD; else the column is the payload)
    out_val_ptr,  # [B, k] float32 out: the k largest, in column order (-inf past a short row)
    out_pay_ptr,  # [B, k] int64 out: their payload (-1 past a short row)
    count_ptr,  # [B] int32 filled entries of each row (HAS_COUNTS; the rest is never read)
    n,
    k,
    BLOCK: tl.constexpr,
    K_BLOCK: tl.constexpr,
    HAS_PAYLOAD: tl.constexpr,
    HAS_COUNTS: tl.constexpr = False,
):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    filled = n
    if HAS_COUNTS:
        filled = tl.minimum(tl.load(count_ptr + b), n)
    inside = offs < filled
    x = tl.load(val_ptr + b * n + offs, mask=inside, other=float("-inf"))
    key = order_keys(x)
    take = take_top(key, inside, k, kth_key(key, inside, k))
    slot = tl.cumsum(take.to(tl.int32), axis=0) - 1
    if HAS_PAYLOAD:
        pay = tl.load(pay_ptr + b * n + offs, mask=inside, other=-1).to(tl.int64)
    else:
        pay = offs.to(tl.int64)
    pay = tl.where(x == float("-inf"), -1, pay)
    tl.store(out_val_ptr + b * k + slot, x, mask=take)
    tl.store(out_pay_ptr + b * k + slot, pay, mask=take)
    rest = tl.arange(0, K_BLOCK)
    empty = (rest >= tl.sum(take.to(tl.int32), axis=0)) & (rest < k)
    tl.store(out_val_ptr + b * k + rest, float("-inf"), mask=empty)
    tl.store(out_pay_ptr + b * k + rest, -1, mask=empty)


@triton.jit
def sample_rank(length, stride, target, oversample):
    """The rank among a request's strided samples whose score is its threshold: ``oversample x target``
    keys scaled to the samples (at least 1, at most the samples), the rule of
    :func:`dsaindex.kernels.select.thresholds_from_samples`."""
    n_sampled = tl.maximum((length + stride - 1) // stride, 1)
    want = oversample * target * n_sampled.to(tl.float64) / tl.maximum(length, 1).to(tl.float64)
    return tl.minimum(tl.maximum(tl.ceil(want).to(tl.int32), 1), n_sampled)


@triton.jit
def sample_threshold_kernel(
    sample_ptr,  # float32 scores of rows 0, stride, 2 stride, ... of each request, at the strides below
    lengths_ptr,  # [B] int32 keys per request
    thr_ptr,  # [B] float32 out
    count_ptr,  # [B] int32 out: zeroed (ZERO_COUNTS), for the appending pass that follows
    n_samples,
    row_stride,  # elements between two requests' samples
    col_stride,  # elements between two samples of a request (a strided view of a score row)
    stride,
    target,
    capacity,
    oversample,
    BLOCK: tl.constexpr,
    ZERO_COUNTS: tl.constexpr = False,
):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    length = tl.load(lengths_ptr + b)
    inside = (offs < n_samples) & (offs.to(tl.int64) * stride < length)  # entries past the length are unread
    x = tl.load(sample_ptr + b * row_stride + offs.to(tl.int64) * col_stride, mask=inside, other=float("-inf"))
    if ZERO_COUNTS:
        tl.store(count_ptr + b, 0)
    thr = key_value(kth_key(order_keys(x), inside, sample_rank(length, stride, target, oversample)))
    tl.store(thr_ptr + b, tl.where(length <= capacity, float("-inf"), thr))
