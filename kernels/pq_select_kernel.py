"""Triton kernels of the PQ coarse stages (jit code only).

``pq_linear_kernel``: one lookup table per request (the head-folded query against every centroid), 32
lookups per key (int8 tables summed as integers); sampling or threshold-append mode like
:mod:`fp8_score_kernel`. With int8 tables the sampling mode also counts the integer scores in a histogram,
and the last sampling program of a request turns it into the request's threshold.
``pq_candidate_kernel``: candidates' keys decoded from their codes into a bf16 tile (a residual code's
as the sum of its whole-key codewords), then every head on tensor cores (``sum_h w_h relu(q_h . k)``);
scores written per candidate.
``pq_encode_kernel``: nearest centroid per subspace (page encoding).
``lookup_table_kernel``: the stage-1 tables, one program per request, subspace and block of codewords
(float32; float16 or int8 scaled per request).
"""

import triton
import triton.language as tl

from dsaindex.kernels.select_kernel import (
    append_above,
    binned_slots,
    grown,
    load_queries,
    scan_rows,
    weighted_relu_heads,
)
from dsaindex.kernels.topk_kernel import sample_rank


@triton.jit
def _entry(ptr, INT_TABLE: tl.constexpr, STREAM: tl.constexpr = 0):
    """Table entries at ``ptr``: int8 widened to int32 (sums of 32 stay exact), else float32."""
    if STREAM:
        raw = tl.load(ptr, eviction_policy="evict_last")
    else:
        raw = tl.load(ptr)
    if INT_TABLE:
        value = raw.to(tl.int32)
    else:
        value = raw.to(tl.float32)
    return value


@triton.jit
def _load_codes(codes_ptr, flat, valid, sub, M: tl.constexpr, STREAM: tl.constexpr):
    """Code bytes ``sub`` of rows ``flat`` [BLOCK_N, len(sub)] (0 where not ``valid``); ``STREAM`` 1 reads them
    past L1 (``.cg``), 2 marks them first to go, so they do not evict the tables."""
    at = codes_ptr + flat[:, None] * M + sub[None, :]
    if STREAM == 1:
        codes = tl.load(at, mask=valid[:, None], other=0, cache_modifier=".cg")
    elif STREAM == 2:
        codes = tl.load(at, mask=valid[:, None], other=0, eviction_policy="evict_first")
    else:
        codes = tl.load(at, mask=valid[:, None], other=0)
    return codes


@triton.jit
def pq_linear_kernel(
    codes_ptr,  # [B, n_rows, M] uint8 PQ codes
    lengths_ptr,  # [B] int32 valid rows per request
    lut_ptr,  # [B, M, K] float32 / float16 / int8 (INT_TABLE): lut[b, m, c] ~ folded query's m-th part . codebook[m, c]
    thr_ptr,  # [B] float32 thresholds (select mode)
    out_score_ptr,  # [B, n_out] float32 (sample mode) or [B, CAPACITY] buffer (select mode)
    out_pos_ptr,  # [B, CAPACITY] int32 buffer positions (select mode)
    count_ptr,  # [B] int32 appended counts (select mode)
    table_ptr,  # [B, table_width] int32 physical page of each 64-row page (HAS_TABLE: codes [P, 64, M])
    table_width,
    n_rows,
    n_out,
    stride,
    M: tl.constexpr,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ITERS: tl.constexpr,
    CAPACITY: tl.constexpr,
    SAMPLE: tl.constexpr,
    INT_TABLE: tl.constexpr = False,
    HAS_TABLE: tl.constexpr = False,
    hist_ptr=None,  # [B, NBINS + M] int32 (HIST): the samples' histogram by integer score, then a done counter
    target=0,  # (HIST) keys the threshold aims at, before ``oversample``
    capacity=0,  # (HIST) buffer slots: a request of at most this many keys takes every key (-inf)
    oversample=1.5,  # (HIST) the launch passes coarse.STAGE1_OVERSAMPLE
    HIST: tl.constexpr = False,
    NBINS: tl.constexpr = 1,
    CHUNK: tl.constexpr = 0,  # code bytes per load of a row (0: all M)
    STREAM: tl.constexpr = 0,  # codes read past L1 or evicted first (see _load_codes), tables kept in L1
    band=0,  # (HIST) > 0: target and capacity grow with the request's length (grown); 0: as given
    most=1,  # (HIST) the most they grow by
):
    # a lane reads CH code bytes of one row at once (one 16-byte load for CH = 16), so a warp's lookups at a
    # time all read one subspace's table, two cache lines (a lane per code byte, the old layout, spread a
    # warp's lookups over 16 tables: 4% slower at 32 x 1M on the H200; bytes split from wider words, twice)
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    length = tl.load(lengths_ptr + b)
    CH: tl.constexpr = M if CHUNK == 0 else CHUNK
    if SAMPLE and pid == 0:
        tl.store(count_ptr + b, 0)  # the selecting pass that follows appends from zero
    thr = 0.0
    if not SAMPLE:
        thr = tl.load(thr_ptr + b)
    # the selecting pass skips the tiles past the request's length (a grid sized for the longest request,
    # or for a preallocated page table, launches them); the sampling pass writes -inf there (or, counting
    # a histogram, nothing)
    first = pid * ITERS * BLOCK_N
    if SAMPLE:
        first = -1
    if first < length:
        for it in range(ITERS):
            idx = (pid * ITERS + it) * BLOCK_N + tl.arange(0, BLOCK_N)
            rows, valid = scan_rows(idx, stride, n_out, length, SAMPLE)
            flat = _code_row(b, rows, valid, n_rows, table_ptr, table_width, HAS_TABLE)
            exact = _chunk_sum(codes_ptr, lut_ptr + b * M * K, flat, valid, 0, M, K, CH, INT_TABLE, STREAM)
            for h in tl.static_range(1, M // CH):
                exact += _chunk_sum(codes_ptr, lut_ptr + b * M * K, flat, valid, h, M, K, CH, INT_TABLE, STREAM)
            score = exact.to(tl.float32)
            if HIST:  # int8 tables: integer scores in [-127 M, 127 M], one bin each
                bins = tl.minimum(tl.maximum(exact + NBINS // 2, 0), NBINS - 1)
                tl.atomic_add(hist_ptr + b * (NBINS + M) + bins, 1, mask=valid, sem="relaxed")
            elif SAMPLE:
                tl.store(out_score_ptr + b * n_out + idx, tl.where(valid, score, float("-inf")), mask=idx < n_out)
            else:
                append_above(score, rows, valid, thr, out_score_ptr + b * CAPACITY, out_pos_ptr + b * CAPACITY,
                             count_ptr + b, CAPACITY)
    if HIST:
        _threshold_of_histogram(hist_ptr + b * (NBINS + M), thr_ptr + b, length, stride,
                                grown(target, length, band, most), grown(capacity, length, band, most),
                                oversample, NBINS)


@triton.jit
def grown_exact_rule_kernel(lengths_ptr, n, out_ptr, per_request, offset, band, most, BLOCK: tl.constexpr,
                            BOTH: tl.constexpr = False):
    """The paged step's exact-path predicate where C grows by length, in one program: the longest of the
    ``n`` requests' lengths N takes the exact path when N <= ``per_request`` + ``offset`` x N's growth
    (:func:`grown`; each request's share of the codes' step grows with its stage-1 width). ``BOTH``: its negation
    too, after it (the codes' conditional node's predicate, no kernel of its own)."""
    at = tl.arange(0, BLOCK)
    longest = tl.max(tl.load(lengths_ptr + at, mask=at < n, other=0), axis=0)
    share = grown(offset, longest, band, most).to(tl.int64)
    exact = longest.to(tl.int64) <= per_request + share
    tl.store(out_ptr, exact)
    if BOTH:
        tl.store(out_ptr + 1, exact == 0)


@triton.jit
def _threshold_of_histogram(hist_ptr, thr_ptr, length, stride, target, capacity, oversample, NBINS: tl.constexpr):
    """The last sampling program of a request to finish turns the request's histogram into its threshold:
    the rank-th largest sample score (the rank of :func:`dsaindex.kernels.select.thresholds_from_samples`),
    which for integer scores is the largest bin whose suffix count reaches the rank. It replaces a
    bisection over the samples in a kernel of its own. Counter and histogram are zeroed by the lookup
    table kernel of the same step."""
    tl.debug_barrier()  # every thread's histogram atomics are issued before the counter's release
    done = tl.atomic_add(hist_ptr + NBINS, 1, sem="acq_rel")
    if done == tl.num_programs(0) - 1:
        h = tl.load(hist_ptr + tl.arange(0, NBINS), volatile=True)  # read through to L2: the other programs' adds
        suffix = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h  # samples at or above each bin
        rank = sample_rank(length, stride, target, oversample)
        top = tl.sum((suffix >= rank).to(tl.int32), axis=0) - 1 - NBINS // 2
        tl.store(thr_ptr, tl.where(length <= capacity, float("-inf"), top.to(tl.float32)))


@triton.jit
def _chunk_sum(codes_ptr, lut_ptr, flat, valid, h, M: tl.constexpr, K: tl.constexpr, CH: tl.constexpr,
               INT_TABLE: tl.constexpr, STREAM: tl.constexpr = 0):
    """Table lookups of code bytes ``[h CH, (h + 1) CH)`` of each row, summed per row."""
    sub = h * CH + tl.arange(0, CH)
    codes = _load_codes(codes_ptr, flat, valid, sub, M, STREAM)
    return tl.sum(_entry(lut_ptr + sub[None, :] * K + codes.to(tl.int32), INT_TABLE, STREAM), axis=1)


@triton.jit
def _code_row(b, rows, valid, n_rows, table_ptr, table_width, HAS_TABLE: tl.constexpr):
    """Row of the code array holding request ``b``'s rows: ``b * n_rows + row`` for per-request codes
    [B, n_rows, M], or through the page table for codes kept per physical 64-key page [P, 64, M]."""
    if HAS_TABLE:
        page = tl.load(table_ptr + b * table_width + rows // 64, mask=valid, other=0).to(tl.int64)
        flat = page * 64 + (rows % 64).to(tl.int64)
    else:
        flat = b * n_rows + rows.to(tl.int64)
    return flat


@triton.jit
def pq_candidate_kernel(
    codes_ptr,  # [B, n_rows, M] uint8 PQ codes
    rows_ptr,  # [B, n_out] int32 candidate rows (-1 = none)
    codebook_ptr,  # [M, K, D // M] bf16 codebooks (WIDE: viewed as [M, K] int64, D // M == 4; RESIDUAL: [M, K, D])
    q_ptr,  # [B, N_HEADS, D] bf16 queries
    w_ptr,  # [B, N_HEADS] float32 effective head weights
    out_ptr,  # [B, n_out] float32 scores (-inf for none)
    count_ptr,  # [B] int32 filled rows of each request's list (HAS_COUNTS; rows past it are -1)
    table_ptr,  # [B, table_width] int32 physical page of each 64-row page (HAS_TABLE: codes [P, 64, M])
    table_width,
    n_rows,
    n_out,
    N_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    D: tl.constexpr,
    M: tl.constexpr,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    F32: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
    WIDE: tl.constexpr = False,
    ITERS: tl.constexpr = 1,
    HAS_TABLE: tl.constexpr = False,
    bins_ptr=None,  # [B, n_out] int32 out (BINS): each candidate's score bin (score_bin)
    scratch_ptr=None,  # [B, NBINS + 4] int32 (BINS): histogram, -, two append counters; zero on entry
    key_bound=1.0,  # (BINS) largest norm of a decoded key: the bins' scale with the queries' norms
    BINS: tl.constexpr = False,
    NBINS: tl.constexpr = 8192,
    RESIDUAL: tl.constexpr = False,  # codebook [M, K, D] whole-key codewords: a key is their sum
    STREAM: tl.constexpr = 0,  # codes read past L1 or evicted first (see _load_codes), codebooks kept in L1
    DEDUP: tl.constexpr = False,  # (BINS) one histogram atomic per distinct bin of a tile, adding its count
):
    # ITERS consecutive tiles per program: the queries are loaded once for all of them
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n_live = n_out
    if HAS_COUNTS:  # rows past the request's count are empty: their tiles only write -inf
        n_live = tl.minimum(tl.load(count_ptr + b), n_out)
    q_t, w = load_queries(q_ptr + b * N_HEADS * D, w_ptr + b * N_HEADS, N_HEADS, H_PAD, D)
    bound = 1.0
    if BINS:  # every program computes the same bound of the request's scores: sum_h |w_h| |q_h| max |k|
        q_f = q_t.to(tl.float32)
        bound = tl.maximum(tl.sum(tl.abs(w) * tl.sqrt(tl.sum(q_f * q_f, axis=0)), axis=0) * key_bound, 1e-30)
    for it in range(ITERS):
        tile = pid * ITERS + it
        idx = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        score = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
        if tile * BLOCK_N < n_live:
            rows = tl.load(rows_ptr + b * n_out + idx, mask=idx < n_live, other=-1)
            valid = rows >= 0
            flat = _code_row(b, rows, valid, n_rows, table_ptr, table_width, HAS_TABLE)
            if RESIDUAL:  # a key is the sum of its M whole-key codewords (rows of D bf16 values), in float32
                dims = tl.arange(0, D)
                acc = tl.zeros([BLOCK_N, D], dtype=tl.float32)
                for j in range(M):
                    code = tl.load(codes_ptr + flat * M + j, mask=valid, other=0).to(tl.int32)
                    acc += tl.load(codebook_ptr + (j * K + code)[:, None] * D + dims[None, :]).to(tl.float32)
                keys = acc.to(tl.bfloat16)
            elif WIDE:  # D/M == 4: one 8-byte load per subspace brings its 4 bf16 centroid values
                sub = tl.arange(0, M)
                codes = _load_codes(codes_ptr, flat, valid, sub, M, STREAM)
                if STREAM:
                    words = tl.load(codebook_ptr + sub[None, :] * K + codes.to(tl.int32), eviction_policy="evict_last")
                else:
                    words = tl.load(codebook_ptr + sub[None, :] * K + codes.to(tl.int32))  # [BLOCK_N, M] int64
                lane0 = words.to(tl.int16).to(tl.bfloat16, bitcast=True)
                lane1 = (words >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
                lane2 = (words >> 32).to(tl.int16).to(tl.bfloat16, bitcast=True)
                lane3 = (words >> 48).to(tl.int16).to(tl.bfloat16, bitcast=True)
                keys = tl.reshape(tl.join(tl.join(lane0, lane2), tl.join(lane1, lane3)), [BLOCK_N, D])
            else:
                dims = tl.arange(0, D)
                sub_of_dim = dims // (D // M)
                # column j of the decoded key reads code byte j // (D/M) (repeated loads hit L1)
                codes = tl.load(codes_ptr + flat[:, None] * M + sub_of_dim[None, :], mask=valid[:, None], other=0)
                keys = tl.load(codebook_ptr + (sub_of_dim[None, :] * K + codes.to(tl.int32)) * (D // M)
                               + (dims % (D // M))[None, :])
            score = tl.where(valid, weighted_relu_heads(keys, q_t, w, F32), float("-inf"))
            if BINS:
                bins = score_bin(score, bound, NBINS)
                tl.store(bins_ptr + b * n_out + idx, bins, mask=valid)
                if DEDUP:  # a tile's candidates crowd into few bins: count each bin's once, add it once
                    tagged = tl.where(valid, bins, -1)
                    same = tagged[:, None] == tagged[None, :]
                    lane = tl.arange(0, BLOCK_N)
                    count = tl.sum(same.to(tl.int32), axis=1)
                    before = tl.sum((same & (lane[None, :] < lane[:, None])).to(tl.int32), axis=1)
                    tl.atomic_add(scratch_ptr + b * (NBINS + 4) + bins, count, mask=valid & (before == 0),
                                  sem="relaxed")
                else:
                    tl.atomic_add(scratch_ptr + b * (NBINS + 4) + bins, 1, mask=valid, sem="relaxed")
        tl.store(out_ptr + b * n_out + idx, score, mask=idx < n_out)


# the bins of :func:`score_bin`: log-spaced over BIN_OCTAVES octaves ending BIN_TOP octaves above the bound
BIN_OCTAVES = tl.constexpr(12.0)
BIN_TOP = tl.constexpr(1.0)


@triton.jit
def score_bin(score, bound, NBINS: tl.constexpr):
    """Bin of each stage-2 score on a signed log scale relative to the request's score bound: the upper
    half of the NBINS bins holds positive scores (and zero), the lower half negative ones, each half
    log-spaced over [bound * 2**(BIN_TOP - BIN_OCTAVES), bound * 2**BIN_TOP] (0.2% wide for 8192 bins);
    magnitudes below that range sit next to zero, -inf in bin 0. Negative scores are real: head weights
    can be negative. The torch twin is :func:`dsaindex.kernels.pq_select.score_bins`."""
    HALF: tl.constexpr = NBINS // 2
    ratio = tl.maximum(tl.abs(score) / bound, 1e-30)
    at = tl.floor((tl.log2(ratio) + (BIN_OCTAVES - BIN_TOP)) * (HALF / BIN_OCTAVES))
    at = tl.minimum(tl.maximum(at, 0.0), HALF - 1).to(tl.int32)
    return tl.where(score >= 0, HALF + at, HALF - 1 - at)


@triton.jit
def boundary_of_bins_kernel(scratch_ptr, sel_ptr, c, capacity, NBINS: tl.constexpr, lengths_ptr=None, band=0,
                            most=1):
    """One program a request reads the histogram of its stage-2 candidates' score bins: the boundary bin is
    the highest whose suffix count reaches ``c`` (0 when fewer candidates), the candidates above it all fit
    (fewer than ``c``), and those in it fill the rest up to ``capacity``. It writes (boundary, above, kept, 0)
    and leaves the histogram and the counters zeroed. (A launch of its own: when the last stage-2 program of a
    request did this, every program paid a device-wide fence before its done-counter, 8 us of a 53 us stage 2
    at 8 x 1M on the H200.) ``band`` > 0: ``c`` grows with the request's length ``lengths_ptr[b]``
    (:func:`grown`), and ``capacity`` keeps its slack past it."""
    b = tl.program_id(0).to(tl.int64)
    if band > 0:
        wanted = grown(c, tl.load(lengths_ptr + b), band, most)
        capacity = wanted + capacity - c
        c = wanted
    row = scratch_ptr + b * (NBINS + 4)
    at = tl.arange(0, NBINS)
    h = tl.load(row + at)
    suffix = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h  # candidates in or above each bin
    edge = tl.maximum(tl.sum((suffix >= c).to(tl.int32), axis=0) - 1, 0)
    above = tl.sum(tl.where(at == edge + 1, suffix, 0), axis=0)
    kept = tl.minimum(tl.sum(tl.where(at == edge, suffix, 0), axis=0), capacity)
    four = tl.arange(0, 4)
    tl.store(sel_ptr + b * 4 + four, tl.where(four == 0, edge, tl.where(four == 1, above, tl.where(four == 2, kept, 0))))
    tl.store(row + at, tl.zeros([NBINS], dtype=tl.int32))
    tl.store(row + NBINS + four, tl.zeros([4], dtype=tl.int32))


@triton.jit
def keep_binned_kernel(
    rows_ptr,  # [B, n_in] int32 stage-2 candidates' key positions
    bins_ptr,  # [B, n_in] int32 their score bins (score_bin)
    count_ptr,  # [B] int32 filled candidate slots
    sel_ptr,  # [B, 4] int32 boundary bin, candidates above it, candidates kept, -
    ctr_ptr,  # append counters: two int32 per request at ctr_ptr + b * ctr_stride, zero on entry
    out_ptr,  # [B, CAPC] int64 out: the kept candidates' positions (in no particular order), then -1
    n_in,
    ctr_stride,
    CAPC: tl.constexpr,
    CAPC_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # the top-C step of the paged decode step without a top-C kernel: programs 0 .. n-2 each take BLOCK_N
    # stage-2 slots, and the candidates above the boundary bin, and those in it while room is left, get
    # slots by one atomic per program and a prefix sum (binned_slots); the last pads with -1
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    kept = tl.load(sel_ptr + b * 4 + 2)
    filled = tl.minimum(tl.load(count_ptr + b), n_in)
    if pid < tl.num_programs(0) - 1:
        # a program past the request's filled slots (a grown C's buffer is sized for the widest request, and
        # stage 1 fills about 3/4 of it) returns before its loads and its two atomics
        if pid * BLOCK_N < filled:
            idx = pid * BLOCK_N + tl.arange(0, BLOCK_N)
            live = idx < filled
            pos = tl.load(rows_ptr + b * n_in + idx, mask=live, other=-1)
            live = live & (pos >= 0)  # stage 2 wrote no bin for an empty slot
            bins = tl.load(bins_ptr + b * n_in + idx, mask=live, other=-1)
            slot, keep = binned_slots(live, bins, sel_ptr + b * 4, ctr_ptr + b * ctr_stride)
            tl.store(out_ptr + b * CAPC + slot, pos.to(tl.int64), mask=keep)
    else:  # in pieces of at most 4,096 slots: a grown C's buffer is wider than a program holds at once
        PIECE: tl.constexpr = 4096 if CAPC_PAD > 4096 else CAPC_PAD
        for start in range(0, CAPC, PIECE):
            rest = start + tl.arange(0, PIECE)
            tl.store(out_ptr + b * CAPC + rest, -1, mask=(rest >= kept) & (rest < CAPC))


@triton.jit
def pq_encode_kernel(
    keys_ptr,  # [N, M, DSUB] float32 keys, already in the codebook's (whitened) metric
    codebook_ptr,  # [M, K, DSUB] float32 codebooks in the same metric
    codes_ptr,  # [N, M] uint8 out
    n_keys,
    M: tl.constexpr,
    K: tl.constexpr,
    DSUB: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    m = tl.program_id(1)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = rows < n_keys
    cents = tl.arange(0, K)
    dist = tl.zeros([BLOCK_N, K], dtype=tl.float32)
    for j in range(DSUB):
        x = tl.load(keys_ptr + (rows * M + m) * DSUB + j, mask=valid, other=0.0)
        c = tl.load(codebook_ptr + (m * K + cents) * DSUB + j)
        diff = x[:, None] - c[None, :]
        dist += diff * diff
    best = tl.argmin(dist, axis=1)
    tl.store(codes_ptr + rows * M + m, best.to(tl.uint8), mask=valid)


@triton.jit
def lookup_table_kernel(
    q_ptr,  # [B, N_HEADS, D] bf16 / float queries
    w_ptr,  # [B, N_HEADS] float32 head weights
    codebook_ptr,  # [M, K, DSUB] float32 (WHOLE: DSUB == D, whole-key codewords of a residual code)
    cmax_ptr,  # [M] float32 largest centroid norm of each subspace (INT8)
    out_ptr,  # [B, M, K] float32, float16 (HALF) or int8 (INT8): the table, divided by the request's scale if scaled
    scale_ptr,  # [B] float32 out (HALF, INT8): what each table entry was divided by
    N_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    D: tl.constexpr,
    M: tl.constexpr,
    K: tl.constexpr,
    DSUB: tl.constexpr,
    HALF: tl.constexpr,
    INT8: tl.constexpr = False,
    zero_ptr=None,  # [B, ZERO_N + M] int32 scratch zeroed here (ZERO_N > 0): a histogram and M counters
    ZERO_N: tl.constexpr = 0,
    WHOLE: tl.constexpr = False,  # residual code: every codebook m scores against the whole folded query
    K_BLOCK: tl.constexpr = 256,  # codewords per program (grid axis 2: K / K_BLOCK programs per table row)
):
    b = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1)
    kb = tl.program_id(2)  # this program's K_BLOCK codewords (one block for product codes' small tiles)
    if ZERO_N > 0 and kb == 0:  # each program zeroes a slice of the histogram and one counter
        row = zero_ptr + b * (ZERO_N + M)
        tl.store(row + m * (ZERO_N // M) + tl.arange(0, ZERO_N // M), tl.zeros([ZERO_N // M], dtype=tl.int32))
        tl.store(row + ZERO_N + m, 0)
    heads = tl.arange(0, H_PAD)
    live = heads < N_HEADS
    w = tl.load(w_ptr + b * N_HEADS + heads, mask=live, other=0.0)
    first = m * DSUB
    if WHOLE:
        first = 0
    part = first + tl.arange(0, DSUB)
    q = tl.load(q_ptr + b * N_HEADS * D + heads[:, None] * D + part[None, :], mask=live[:, None], other=0.0)
    folded = tl.sum(w[:, None] * q.to(tl.float32), axis=0)  # [DSUB]: this subspace of sum_h w_h q_h (WHOLE: all)
    scale = 1.0
    if HALF or INT8:
        dims = tl.arange(0, D)
        q_all = tl.load(q_ptr + b * N_HEADS * D + heads[:, None] * D + dims[None, :], mask=live[:, None], other=0.0)
        whole = tl.sum(w[:, None] * q_all.to(tl.float32), axis=0)  # [D] the folded query
        if INT8:
            # a bound on every entry of the request's table, known to each program without the others:
            # |folded_m . c| <= |folded_m| * (largest centroid norm of subspace m), maximized over m (WHOLE:
            # |folded| * the largest codeword norm of any codebook)
            if WHOLE:
                bound = tl.sqrt(tl.sum(whole * whole, axis=0)) * tl.max(tl.load(cmax_ptr + tl.arange(0, M)), axis=0)
            else:
                parts = tl.reshape(whole * whole, [M, DSUB])
                bound = tl.max(tl.sqrt(tl.sum(parts, axis=1)) * tl.load(cmax_ptr + tl.arange(0, M)), axis=0)
            scale = tl.maximum(bound, 1e-30) / 127.0
        else:
            # divided by |folded|, an entry is at most its centroid's norm: well inside float16's range
            scale = tl.maximum(tl.sqrt(tl.sum(whole * whole, axis=0)), 1e-30)
        if m == 0 and kb == 0:
            tl.store(scale_ptr + b, scale)
    cents = kb * K_BLOCK + tl.arange(0, K_BLOCK)
    cb = tl.load(codebook_ptr + (m * K + cents[:, None]) * DSUB + tl.arange(0, DSUB)[None, :])
    table = tl.sum(cb * folded[None, :], axis=1)
    if INT8:
        tl.store(out_ptr + (b * M + m) * K + cents, tl.floor(table / scale + 0.5).to(tl.int8))
    elif HALF:
        tl.store(out_ptr + (b * M + m) * K + cents, (table / scale).to(tl.float16))
    else:
        tl.store(out_ptr + (b * M + m) * K + cents, table)


@triton.jit
def rq_encode_kernel(
    x_ptr,  # [N, D] float32 keys in the residual code's (whitened) space
    cb_ptr,  # [M, K, D] float32 whole-key codebooks in the same space
    norm_ptr,  # [M, K] float32 squared codeword norms
    scratch_ptr,  # [P, BP, K] float32: each program's candidate errors for one codebook at a time
    codes_ptr,  # [N, M] uint8 out: the best beam's codes
    n_keys,
    M: tl.constexpr,
    MP: tl.constexpr,  # M padded to a power of two of at least 16 (a tensor-core dot's width)
    K: tl.constexpr,
    D: tl.constexpr,
    BEAM: tl.constexpr,
    BP: tl.constexpr,  # BEAM padded to a power of two of at least 16
    KC: tl.constexpr,  # codewords per dot (a [KC, D] tile of the codebook at a time)
):
    # beam search, one key per program at a time (grid-stride): for each codebook, the error of every live
    # beam's residual against every codeword goes to the program's scratch rows, the BEAM smallest become
    # the next beams (one-hot products gather their parents' residuals and codes)
    pid = tl.program_id(0)
    dims = tl.arange(0, D)
    beams = tl.arange(0, BP)
    flat = tl.arange(0, BP * K)
    cols = tl.arange(0, MP)
    scratch = scratch_ptr + pid.to(tl.int64) * BP * K
    first = pid.to(tl.int64)
    step = tl.num_programs(0)
    for i in range(0, tl.cdiv(n_keys - pid, step)):
        row = first + i * step
        x = tl.load(x_ptr + row * D + dims)
        res = tl.where(beams[:, None] == 0, x[None, :], 0.0)  # [BP, D]
        live = beams == 0
        history = tl.zeros([BP, MP], dtype=tl.float32)  # each beam's codes so far (integers, exact in float32)
        for m in range(M):
            sq = tl.sum(res * res, axis=1)
            for c in tl.static_range(K // KC):
                cents = c * KC + tl.arange(0, KC)
                cb = tl.load(cb_ptr + (m * K + cents)[:, None] * D + dims[None, :])  # [KC, D]
                dots = tl.dot(res, tl.trans(cb), input_precision="ieee")  # [BP, KC]
                err = sq[:, None] - 2 * dots + tl.load(norm_ptr + m * K + cents)[None, :]
                tl.store(scratch + beams[:, None] * K + cents[None, :], tl.where(live[:, None], err, float("inf")))
            tl.debug_barrier()  # every thread's errors are written before any is read back
            errs = tl.load(scratch + flat)
            tl.debug_barrier()  # read before the next codebook's errors overwrite them
            parent = tl.zeros([BP], dtype=tl.int32)
            code = tl.zeros([BP], dtype=tl.int32)
            chosen = tl.full([BP], float("inf"), dtype=tl.float32)  # each new beam's error (inf: none)
            for j in tl.static_range(BEAM):
                best = tl.argmin(errs, axis=0)
                chosen = tl.where(beams == j, tl.min(errs, axis=0), chosen)
                parent = tl.where(beams == j, best // K, parent)
                code = tl.where(beams == j, best % K, code)
                errs = tl.where(flat == best, float("inf"), errs)
            pick = (parent[:, None] == beams[None, :]).to(tl.float32)  # row j: a one-hot of beam j's parent
            word = tl.load(cb_ptr + (m * K + code)[:, None] * D + dims[None, :])
            res = tl.dot(pick, res, input_precision="ieee") - word
            history = tl.dot(pick, history, input_precision="ieee")
            history = tl.where(cols[None, :] == m, code.to(tl.float32)[:, None], history)
            live = chosen < float("inf")
        best_codes = tl.sum(tl.where(beams[:, None] == 0, history, 0.0), axis=0)  # beam 0: the smallest error
        tl.store(codes_ptr + row * M + cols, best_codes.to(tl.int32).to(tl.uint8), mask=cols < M)
