"""Triton kernel: keep the entries of each row at or above its threshold (jit code only)."""

import triton
import triton.language as tl

from dsaindex.kernels.select_kernel import append_above, grown


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
    With fewer than ``rank`` live entries it is the lowest int32, which no live key is below. ``key`` and
    ``live`` may be 1D or 2D (every axis is reduced). (Two or three pivots per pass, their counts packed in
    one sum, radix passes with a histogram each, and interpolating the pivot from the bounds' counts measured
    slower on the H200 or no faster: a pass costs its per-entry work and a block-wide reduction.)"""
    # the search starts between the smallest and largest live key (scores of one row share most of
    # their exponent bits: several passes fewer than the whole int32 range)
    found = tl.sum(live.to(tl.int32)) >= rank
    lo = tl.min(tl.where(live, key, 2147483647)).to(tl.int64)
    key = tl.where(live, key, -2147483648)  # below every live key and every pivot: the passes need no mask
    hi = tl.max(key).to(tl.int64)
    lo = tl.minimum(lo, hi)
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        count = tl.sum((key >= mid.to(tl.int32)).to(tl.int32))
        enough = count >= rank
        lo = tl.where(enough, mid, lo)
        hi = tl.where(count == rank, mid, tl.where(enough, hi, mid - 1))
    smallest = tl.min(tl.where(key >= lo.to(tl.int32), key, 2147483647))
    return tl.where(found, smallest, -2147483648)


@triton.jit
def kth_key_pair(key, live, key2, live2, rank):
    """:func:`kth_key` over the entries of two tensors taken together (``key2`` a small second block: a row
    just past a power of two held as that power and a short tail, not as twice the registers). Each pass
    counts both and adds the counts."""
    found = (tl.sum(live.to(tl.int32)) + tl.sum(live2.to(tl.int32))) >= rank
    lo = tl.minimum(tl.min(tl.where(live, key, 2147483647)),
                    tl.min(tl.where(live2, key2, 2147483647))).to(tl.int64)
    key = tl.where(live, key, -2147483648)
    key2 = tl.where(live2, key2, -2147483648)
    hi = tl.maximum(tl.max(key), tl.max(key2)).to(tl.int64)
    lo = tl.minimum(lo, hi)
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        pivot = mid.to(tl.int32)
        count = tl.sum((key >= pivot).to(tl.int32)) + tl.sum((key2 >= pivot).to(tl.int32))
        enough = count >= rank
        lo = tl.where(enough, mid, lo)
        hi = tl.where(count == rank, mid, tl.where(enough, hi, mid - 1))
    at = lo.to(tl.int32)
    smallest = tl.minimum(tl.min(tl.where(key >= at, key, 2147483647)),
                          tl.min(tl.where(key2 >= at, key2, 2147483647)))
    return tl.where(found, smallest, -2147483648)


@triton.jit
def row_major_prefix(m):
    """Inclusive prefix sums of an [R, W] int32 tile in row-major order. A row of a tile loaded along its
    last axis sits in one warp, so the scan along it needs no block-wide step; only the R row totals are
    scanned across warps."""
    per_row = tl.sum(m, axis=1)
    return (tl.cumsum(per_row, axis=0) - per_row)[:, None] + tl.cumsum(m, axis=1)


@triton.jit
def row_topk_kernel(
    val_ptr,  # [B, n] float32 values
    pay_ptr,  # [B, n] int32 / int64 payload (HAS_PAYLOAD; else the column is the payload)
    out_val_ptr,  # [B, k] float32 out: the k largest, finite ones in column order, then -inf (a short row)
    out_pay_ptr,  # [B, k] int64 (or int32) out: their payload (-1 past a short row)
    count_ptr,  # [B] int32 filled entries of each row (HAS_COUNTS; the rest is never read)
    n,
    k,
    BLOCK: tl.constexpr,
    K_BLOCK: tl.constexpr,
    HAS_PAYLOAD: tl.constexpr,
    HAS_COUNTS: tl.constexpr = False,
    WIDTH: tl.constexpr = 128,
    CHUNK: tl.constexpr = 4096,
    TAIL: tl.constexpr = 0,
):
    # the row's keys stay in registers for the k-th search only; the compaction then reads the row again
    # CHUNK entries at a time (from cache), as [CHUNK / WIDTH, WIDTH] tiles whose prefix sums run along
    # the tile's rows (row_major_prefix): holding the whole row and its payload at once spilled registers
    # (H200, 12K of 16K slots filled, top 2,048: 23 us this way, 31 with the row held and 1D scans)
    b = tl.program_id(0).to(tl.int64)
    filled = n
    if HAS_COUNTS:
        filled = tl.minimum(tl.load(count_ptr + b), n)
    offs = tl.arange(0, BLOCK // WIDTH)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]
    key = order_keys(tl.load(val_ptr + b * n + offs, mask=offs < filled, other=float("-inf")))
    if TAIL > 0:  # a row past BLOCK: its last entries as a short second block (kth_key_pair)
        offs2 = BLOCK + tl.arange(0, TAIL)
        key2 = order_keys(tl.load(val_ptr + b * n + offs2, mask=offs2 < filled, other=float("-inf")))
        threshold = kth_key_pair(key, offs < filled, key2, offs2 < filled, k)
        room = k - tl.sum(((offs < filled) & (key > threshold)).to(tl.int32)) - tl.sum(
            ((offs2 < filled) & (key2 > threshold)).to(tl.int32))
        ties = tl.sum(((offs < filled) & (key == threshold)).to(tl.int32)) + tl.sum(
            ((offs2 < filled) & (key2 == threshold)).to(tl.int32))
    else:
        threshold = kth_key(key, offs < filled, k)
        room = k - tl.sum(((offs < filled) & (key > threshold)).to(tl.int32))
        ties = tl.sum(((offs < filled) & (key == threshold)).to(tl.int32))
    crowded = ties > room  # not every tie fits
    tile = tl.arange(0, CHUNK // WIDTH)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]
    taken = tl.zeros([], dtype=tl.int32)
    tied_before = tl.zeros([], dtype=tl.int32)
    for start in range(0, filled, CHUNK):
        at = start + tile
        inside = at < filled
        x = tl.load(val_ptr + b * n + at, mask=inside, other=float("-inf"))
        y = order_keys(x)
        tied = inside & (y == threshold)
        take = inside & (y >= threshold)
        if crowded:  # the first ties in column order fill the room (distinct scores skip this scan)
            take = (inside & (y > threshold)) | (tied & (tied_before + row_major_prefix(tied.to(tl.int32)) <= room))
        # -inf entries (nothing there: a short row's padding) are never taken: the fill after the loop
        # writes them, so a row's real entries come first and its padding after
        take = take & (x > float("-inf"))
        slot = taken + row_major_prefix(take.to(tl.int32)) - 1
        if HAS_PAYLOAD:
            pay = tl.load(pay_ptr + b * n + at, mask=take, other=-1).to(tl.int64)
        else:
            pay = at.to(tl.int64)
        pay = tl.where(x == float("-inf"), -1, pay)
        tl.store(out_val_ptr + b * k + slot, x, mask=take)
        tl.store(out_pay_ptr + b * k + slot, pay, mask=take)
        taken += tl.sum(take.to(tl.int32))
        tied_before += tl.sum(tied.to(tl.int32))
    rest = tl.arange(0, K_BLOCK)
    empty = (rest >= taken) & (rest < k)
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
    band=0,  # target and capacity grown by each request's length (``grown``; 0: as given)
    most=1,
):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    length = tl.load(lengths_ptr + b)
    inside = (offs < n_samples) & (offs.to(tl.int64) * stride < length)  # entries past the length are unread
    x = tl.load(sample_ptr + b * row_stride + offs.to(tl.int64) * col_stride, mask=inside, other=float("-inf"))
    if ZERO_COUNTS:
        tl.store(count_ptr + b, 0)
    want = grown(target, length, band, most)
    thr = key_value(kth_key(order_keys(x), inside, sample_rank(length, stride, want, oversample)))
    tl.store(thr_ptr + b, tl.where(length <= grown(capacity, length, band, most), float("-inf"), thr))


@triton.jit
def radix_keys(val_ptr, count_ptr, b, n, BLOCK: tl.constexpr, HAS_COUNTS: tl.constexpr):
    """A program's slice of row ``b`` for :func:`radix_digit_kernel` / :func:`radix_take_kernel`: (its offsets, which
    are filled, the values, their keys as int64 in [0, 2**32) whose order is the values', the row's filled count)."""
    filled = n
    if HAS_COUNTS:
        filled = tl.minimum(tl.load(count_ptr + b), n)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < filled
    x = tl.load(val_ptr + b * n + offs, mask=inside, other=float("-inf"))
    return offs, inside, x, order_keys(x).to(tl.int64) + 2147483648, filled


@triton.jit
def radix_state_at(WIDE: tl.constexpr):
    """Where a row's state starts in :func:`radix_digit_kernel`'s scratch: after three 2,048-bin histograms (11-bit
    digits) or four of 256 bins (8-bit); :func:`dsaindex.kernels.topk.radix_scratch_words` sizes a row alike."""
    return 3 * 2048 if WIDE else 4 * 256


@triton.jit
def radix_digit_kernel(
    val_ptr,  # [B, n] float32
    count_ptr,  # [B] int32 filled entries of each row (HAS_COUNTS)
    scratch_ptr,  # [B, SCRATCH] int64, zero on entry: a histogram a pass (radix_scratch_words), then the row's state
    n,
    k,
    PASS: tl.constexpr,  # the digit: 0 the highest
    WIDE: tl.constexpr,  # three digits of the key's bits 31-21, 20-10, 9-0; else four of 8 bits
    BLOCK: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
    SCRATCH: tl.constexpr,
):
    # one digit of a radix select of the k-th largest, a row spread over programs (axis 1): each program adds its
    # entries' digits (those whose higher digits are the ones chosen so far) to the pass's histogram; the last
    # program to finish picks the digit the k-th largest has and what rank is left inside it
    if WIDE:
        SHIFT: tl.constexpr = 21 if PASS == 0 else (10 if PASS == 1 else 0)
        BITS: tl.constexpr = 10 if PASS == 2 else 11
    else:
        SHIFT: tl.constexpr = 24 - 8 * PASS
        BITS: tl.constexpr = 8
    b = tl.program_id(0).to(tl.int64)
    row = scratch_ptr + b * SCRATCH
    # prefix (the digits chosen), rank left, entries at the prefix, each pass's counter; then the take's two
    state = row + radix_state_at(WIDE)
    _, inside, _, u, _ = radix_keys(val_ptr, count_ptr, b, n, BLOCK, HAS_COUNTS)
    if PASS == 0:
        prefix = tl.zeros([], dtype=tl.int64)
        match = inside
    else:
        prefix = tl.load(state, volatile=True)
        match = inside & ((u >> (SHIFT + BITS)) == prefix)
    bins = tl.arange(0, 1 << BITS)
    digit = tl.where(match, (u >> SHIFT) & ((1 << BITS) - 1), 0).to(tl.int32)
    h = tl.histogram(digit, 1 << BITS).to(tl.int64)
    h -= tl.where(bins == 0, tl.sum((match == 0).to(tl.int64)), 0)  # the entries that do not match went to bin 0
    hist = row + PASS * (2048 if WIDE else 256)
    tl.atomic_add(hist + bins, h, mask=h > 0, sem="relaxed")
    tl.debug_barrier()  # every thread's histogram atomics are issued before the counter's release
    done = tl.atomic_add(state + 3 + PASS, 1, sem="acq_rel")
    if done == tl.num_programs(1) - 1:
        counts = tl.load(hist + bins, volatile=True).to(tl.int32)  # read through to L2: the other programs' adds
        if PASS == 0:
            rank = tl.zeros([], dtype=tl.int64) + k
        else:
            rank = tl.load(state + 1, volatile=True)
        at_or_above = tl.sum(counts) - tl.cumsum(counts) + counts
        # the largest digit with at least `rank` entries at or above it (0 where the row has fewer than k)
        chosen = tl.max(tl.where(at_or_above >= rank, bins, 0)).to(tl.int64)
        above = tl.sum(tl.where(bins > chosen, counts, 0))
        tl.store(state, (prefix << BITS) | chosen)
        tl.store(state + 1, rank - above.to(tl.int64))
        tl.store(state + 2, tl.sum(tl.where(bins == chosen, counts, 0)).to(tl.int64))


@triton.jit
def radix_take_kernel(
    val_ptr, count_ptr, scratch_ptr,  # as radix_digit_kernel's, after its passes
    pay_ptr,  # [B, n] int32 / int64 payload (HAS_PAYLOAD; else the column)
    out_val_ptr,  # [B, k] float32 out: the k largest finite entries (any order), then -inf
    out_pay_ptr,  # [B, k] int64 / int32 out: their payload, then -1
    n,
    k,
    BLOCK: tl.constexpr,
    K_BLOCK: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
    HAS_PAYLOAD: tl.constexpr,
    SCRATCH: tl.constexpr,
    WIDE: tl.constexpr = False,  # the digits radix_digit_kernel took (where the state sits)
    SCRATCH_PAD: tl.constexpr = 1024,  # a power of two: the last program zeroes the row's SCRATCH words in these
):
    # each program appends its entries above the k-th largest key and the ties it may take (the first ones by
    # column, as small_topk takes them); the last program to finish fills the slots past the row's count and
    # zeroes the row's scratch, so the next select can use it without a fill
    b = tl.program_id(0).to(tl.int64)
    state = scratch_ptr + b * SCRATCH + radix_state_at(WIDE)
    offs, inside, x, u, filled = radix_keys(val_ptr, count_ptr, b, n, BLOCK, HAS_COUNTS)
    kth = tl.load(state, volatile=True)
    room = tl.load(state + 1, volatile=True)
    ties = tl.load(state + 2, volatile=True)
    short = (offs * 0 + filled) <= k  # every entry is taken (a tensor: the interpreter mistypes a scalar's mask)
    strict = inside & ((u > kth) | short)
    tied = inside & (u == kth) & (short == 0)
    if ties > room:  # not every tie fits: the ties in the slices before this one, counted from the row
        before = tl.zeros([], dtype=tl.int64)
        for start in range(0, tl.program_id(1) * BLOCK, BLOCK):
            at = start + tl.arange(0, BLOCK)
            y = tl.load(val_ptr + b * n + at, mask=at < filled, other=float("-inf"))
            before += tl.sum(((at < filled) & (order_keys(y).to(tl.int64) + 2147483648 == kth)).to(tl.int64))
        tied = tied & (before + tl.cumsum(tied.to(tl.int32), axis=0).to(tl.int64) <= room)
    take = (strict | tied) & (x > float("-inf"))  # -inf is nothing there: the fill writes it
    n_take = tl.sum(take.to(tl.int32)).to(tl.int64)
    slot = tl.atomic_add(state + 7, n_take) + tl.cumsum(take.to(tl.int32), axis=0).to(tl.int64) - 1
    if HAS_PAYLOAD:
        pay = tl.load(pay_ptr + b * n + offs, mask=take, other=-1).to(tl.int64)
    else:
        pay = offs.to(tl.int64)
    tl.store(out_val_ptr + b * k + slot, x, mask=take)
    tl.store(out_pay_ptr + b * k + slot, pay, mask=take)
    tl.debug_barrier()
    done = tl.atomic_add(state + 8, 1, sem="acq_rel")
    if done == tl.num_programs(1) - 1:
        taken = tl.load(state + 7, volatile=True)
        rest = tl.arange(0, K_BLOCK)
        empty = (rest >= taken) & (rest < k)
        tl.store(out_val_ptr + b * k + rest, float("-inf"), mask=empty)
        tl.store(out_pay_ptr + b * k + rest, -1, mask=empty)
        for start in range(0, SCRATCH, SCRATCH_PAD):  # every program has read the state: zero it all
            at = start + tl.arange(0, SCRATCH_PAD)
            tl.store(scratch_ptr + b * SCRATCH + at, tl.zeros([SCRATCH_PAD], dtype=tl.int64), mask=at < SCRATCH)
