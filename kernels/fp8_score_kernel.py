"""Triton kernel: exact indexer scores of FP8 e4m3 + ue8m0 keys (jit code only).

Three modes share one body (``MODE``):
0 ``sample``: rows ``i * stride`` of each request, every score written to ``out_score[b, i]``;
1 ``select``: every row of each request, rows scoring at least ``thr[b]`` appended to the buffer;
2 ``gather``: rows ``rows[b, i]`` (-1 = none) of a per-request key pool, scores written to ``out_score[b, i]``.

``FP8_DOT`` multiplies FP8 keys by FP8-rounded queries on the FP8 tensor cores (twice the bf16 rate), the
products DeepGEMM's logits compute; otherwise keys are widened to bf16 and multiplied by bf16 queries.
"""

import triton
import triton.language as tl

from dsaindex.kernels.select_kernel import (
    append_above,
    binned_slots,
    load_queries,
    scan_rows,
    weighted_relu_heads,
)


@triton.jit
def fp8_score_kernel(
    keys_ptr,  # uint8 FP8 e4m3 bits of the keys: row r of request b at the offset below
    scales_ptr,  # float32 ue8m0 (power-of-two) scale per key, same addressing
    lengths_ptr,  # [B] int32: valid rows per request (modes 0 and 1)
    q_ptr,  # [B, N_HEADS, D] bf16 queries
    w_ptr,  # [B, N_HEADS] float32 effective head weights
    rows_ptr,  # [B, n_out] int32 rows to score (mode 2)
    thr_ptr,  # [B] float32 thresholds (mode 1)
    out_score_ptr,  # [B, n_out] float32 (modes 0, 2) or [B, CAPACITY] buffer (mode 1)
    out_pos_ptr,  # [B, CAPACITY] int32 buffer positions (mode 1)
    count_ptr,  # [B] int32 appended counts (mode 1)
    key_slot_stride,  # elements between requests, between 64-key pages, for keys and for scales: rows
    key_page_stride,  # contiguous per request ([B, n_rows, D]: n_rows * D, 64 * D, n_rows, 64), or the
    scale_slot_stride,  # engines' pages (64 x D key bytes then 64 scales per page)
    scale_page_stride,
    table_ptr,  # [B, table_width] int32 page of each request page (HAS_TABLE: pages shared by requests)
    table_width,
    n_out,
    stride,
    N_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ITERS: tl.constexpr,
    CAPACITY: tl.constexpr,
    MODE: tl.constexpr,
    F32: tl.constexpr,
    HAS_TABLE: tl.constexpr = False,
    FP8_DOT: tl.constexpr = False,
):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    q_t, w = load_queries(q_ptr + b * N_HEADS * D, w_ptr + b * N_HEADS, N_HEADS, H_PAD, D)
    if FP8_DOT:  # queries rounded to FP8 e4m3 as the engines' DeepGEMM path does; FP8 x FP8 tensor-core products
        q_t = q_t.to(tl.float32).to(tl.float8e4nv)
    length = tl.load(lengths_ptr + b)
    dims = tl.arange(0, D)
    thr = 0.0
    if MODE == 1:
        thr = tl.load(thr_ptr + b)
    for it in range(ITERS):
        idx = (pid * ITERS + it) * BLOCK_N + tl.arange(0, BLOCK_N)
        if MODE == 2:
            rows = tl.load(rows_ptr + b * n_out + idx, mask=idx < n_out, other=-1)
            valid = rows >= 0
        else:
            rows, valid = scan_rows(idx, stride, n_out, length, MODE == 0)
        empty = False
        if MODE == 2:  # a block of no candidates (a C grown for other requests of the step): no key read
            empty = tl.max(valid.to(tl.int32), axis=0) == 0
        if empty:
            tl.store(out_score_ptr + b * n_out + idx, float("-inf"), mask=idx < n_out)
        else:
            page = rows.to(tl.int64) // 64
            if HAS_TABLE:
                page = tl.load(table_ptr + b * table_width + page, mask=valid, other=0).to(tl.int64)
            within = rows.to(tl.int64) % 64
            key_at = b * key_slot_stride + page * key_page_stride + within * D
            raw = tl.load(keys_ptr + key_at[:, None] + dims[None, :], mask=valid[:, None], other=0)
            if FP8_DOT:
                keys = raw.to(tl.float8e4nv, bitcast=True)
            else:
                keys = raw.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
            scale = tl.load(scales_ptr + b * scale_slot_stride + page * scale_page_stride + within, mask=valid, other=0.0)
            # relu(s * x) = s * relu(x) for the positive ue8m0 scale: apply it after the head sum
            score = weighted_relu_heads(keys, q_t, w, F32) * scale
            if MODE == 1:
                append_above(score, rows, valid, thr, out_score_ptr + b * CAPACITY, out_pos_ptr + b * CAPACITY,
                             count_ptr + b, CAPACITY)
            else:
                tl.store(out_score_ptr + b * n_out + idx, tl.where(valid, score, float("-inf")), mask=idx < n_out)


@triton.jit
def fp8_host_select_kernel(
    host_keys_ptr,  # [P * PAGE, D] uint8 FP8 bits of the host pages (pinned: read through unified addressing)
    host_scales_ptr,  # [P * PAGE] float32
    table_ptr,  # [B, table_width] int32 host page of each request page
    rows_ptr,  # [B, n_in] int32 stage-2 candidates' key positions
    bins_ptr,  # [B, n_in] int32 their score bins
    count_ptr,  # [B] int32 filled candidate slots
    sel_ptr,  # [B, 4] int32 boundary bin, candidates above it, candidates kept, -
    ctr_ptr,  # append counters: two int32 per request at ctr_ptr + b * ctr_stride, zero on entry
    pool_keys_ptr,  # [B, pool_rows, D] uint8 device pool: the tail is rows tail_row0 + j
    pool_scales_ptr,  # [B, pool_rows] float32
    tail_len_ptr,  # [B] int32 keys in the tail
    n_encoded_ptr,  # [B] int32 the tail's first position
    q_ptr,  # [B, N_HEADS, D] bf16 queries
    w_ptr,  # [B, N_HEADS] float32 effective head weights
    out_score_ptr,  # [B, CAPC + PAGE] float32 out: kept candidates' exact scores, -inf to CAPC, then the tail
    out_pos_ptr,  # [B, CAPC + PAGE] int64 out: their positions (-1 for none)
    stats_ptr,  # [B, 4] int32 out: candidates, hits (0), read from the host, dropped (0)
    table_width,
    n_in,
    pool_rows,
    tail_row0,
    ctr_stride,
    N_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAPC: tl.constexpr,
    CAPC_PAD: tl.constexpr,
    F32: tl.constexpr,
):
    # programs 0 .. n-2 each take BLOCK_N stage-2 slots: the candidates above the boundary bin, and those in
    # it while room is left, get slots by one atomic per program and a prefix sum (binned_slots), and are
    # read straight from their host pages and scored; the last program scores the tail and pads the unused
    # slots
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    q_t, w = load_queries(q_ptr + b * N_HEADS * D, w_ptr + b * N_HEADS, N_HEADS, H_PAD, D)
    dims = tl.arange(0, D)
    width = CAPC + PAGE
    kept = tl.load(sel_ptr + b * 4 + 2)
    if pid < tl.num_programs(0) - 1:
        idx = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        live = idx < tl.minimum(tl.load(count_ptr + b), n_in)
        row = tl.load(rows_ptr + b * n_in + idx, mask=live, other=-1)
        live = live & (row >= 0)  # stage 2 wrote no bin for an empty slot
        bins = tl.load(bins_ptr + b * n_in + idx, mask=live, other=-1)
        slot, keep = binned_slots(live, bins, sel_ptr + b * 4, ctr_ptr + b * ctr_stride)
        pos = tl.where(keep, row, 0).to(tl.int64)
        page = tl.load(table_ptr + b * table_width + pos // PAGE, mask=keep, other=0).to(tl.int64)
        host_row = page * PAGE + pos % PAGE
        raw = tl.load(host_keys_ptr + host_row[:, None] * D + dims[None, :], mask=keep[:, None], other=0)
        scale = tl.load(host_scales_ptr + host_row, mask=keep, other=0.0)
        score = weighted_relu_heads(raw.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16), q_t, w, F32) * scale
        tl.store(out_score_ptr + b * width + slot, score, mask=keep)
        tl.store(out_pos_ptr + b * width + slot, pos, mask=keep)
    else:
        j = tl.arange(0, PAGE)
        in_tail = j < tl.load(tail_len_ptr + b)
        pool_row = b * pool_rows + tail_row0 + j
        raw = tl.load(pool_keys_ptr + pool_row[:, None] * D + dims[None, :], mask=in_tail[:, None], other=0)
        scale = tl.load(pool_scales_ptr + pool_row, mask=in_tail, other=0.0)
        score = weighted_relu_heads(raw.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16), q_t, w, F32) * scale
        first = tl.load(n_encoded_ptr + b).to(tl.int64)
        tl.store(out_score_ptr + b * width + CAPC + j, tl.where(in_tail, score, float("-inf")))
        tl.store(out_pos_ptr + b * width + CAPC + j, tl.where(in_tail, first + j, -1))
        PIECE: tl.constexpr = 4096 if CAPC_PAD > 4096 else CAPC_PAD  # a grown C's slots, a piece at a time
        for start in range(0, CAPC, PIECE):
            rest = start + tl.arange(0, PIECE)
            empty = (rest >= kept) & (rest < CAPC)
            tl.store(out_score_ptr + b * width + rest, float("-inf"), mask=empty)
            tl.store(out_pos_ptr + b * width + rest, -1, mask=empty)
        four = tl.arange(0, 4)
        tl.store(stats_ptr + b * 4 + four, tl.where(four % 2 == 0, kept, 0))
