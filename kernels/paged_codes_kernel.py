"""Triton kernels of the PQ codes kept beside an engine's paged index-K cache (jit code only).

``stale_pages_kernel``: one program per (request, tile of its page table) compares each completed
page's signature words (or only the last ``window`` ones' of each request, and with ``SWEEP`` one table
column in ``sweep`` of the older ones, a phase that turns each step) with those its codes were made from,
counts the stale ones and lists up to ``E`` of them (slots reserved by one atomic per tile).
``encode_pages_kernel``: one program per (listed page, subspace) reads the page's 64 FP8 keys in place,
whitens the subspace (with ``ROTATE``: projects each whole key through the subspace's rows of the OPQ
rotation, whitening folded in), and writes the nearest centroid of each key; the scratch page is skipped.
With ``WRITE_SIG`` the page's first program also records its signature words and marks it valid, so a
step's catch-up is two launches (list, encode) rather than five.
``with_tail_kernel``: a decode step's rescoring list, each request's candidates followed by the keys of its
open (incomplete) last page, -1 past its length.
"""

import triton
import triton.language as tl


@triton.jit
def stale_pages_kernel(
    words_ptr,  # the cache as int64 words; page p's word j at p * page_words + j
    page_words,
    table_ptr,  # [B, table_width] int32 pages of each request
    table_width,
    lengths_ptr,  # [B] int32 keys per request
    sig_ptr,  # [P + 1, 4] int64 signatures the codes were made from
    valid_ptr,  # [P + 1] uint8: 1 where a page holds codes
    pick_ptr,  # [B, E] int64, scratch on entry: E of the stale pages written here
    count_ptr,  # [B] int32, zero on entry: stale pages in all
    n_pages,
    window,  # > 0: only the last `window` completed pages of each request are checked (and the sweep's)
    sweep,  # > 1: also the older pages at table columns c with c % sweep == the step's phase
    phase_ptr,  # [1] int32 step counter (SWEEP): the phase is its value mod sweep
    w0, w1, w2, w3,  # word offsets of the signature within a page
    E: tl.constexpr,
    BLOCK: tl.constexpr,
    SWEEP: tl.constexpr = False,
):
    # one program per (request, tile of BLOCK table columns); tiles reserve their slots by one atomic
    b = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK
    full = tl.load(lengths_ptr + b) // 64
    lo = 0
    if window > 0:
        lo = tl.maximum(full - window, 0)
    if (start < full) & ((start + BLOCK > lo) | SWEEP):
        cols = start + tl.arange(0, BLOCK)
        checked = cols >= lo
        if SWEEP:
            checked = checked | ((cols % sweep) == (tl.load(phase_ptr) % sweep))
        live = checked & (cols < full) & (cols < table_width)
        page = tl.load(table_ptr + b * table_width + cols, mask=live, other=0).to(tl.int64)
        page = tl.minimum(tl.maximum(page, 0), n_pages - 1)
        ok = tl.load(valid_ptr + page, mask=live, other=0) != 0
        base = words_ptr + page * page_words
        ok = ok & (tl.load(base + w0, mask=live, other=0) == tl.load(sig_ptr + page * 4, mask=live, other=0))
        ok = ok & (tl.load(base + w1, mask=live, other=0) == tl.load(sig_ptr + page * 4 + 1, mask=live, other=0))
        ok = ok & (tl.load(base + w2, mask=live, other=0) == tl.load(sig_ptr + page * 4 + 2, mask=live, other=0))
        ok = ok & (tl.load(base + w3, mask=live, other=0) == tl.load(sig_ptr + page * 4 + 3, mask=live, other=0))
        stale = (live & ~ok).to(tl.int32)
        n_stale = tl.sum(stale, axis=0)
        if n_stale > 0:
            first = tl.atomic_add(count_ptr + b, n_stale)
            order = first + tl.cumsum(stale, axis=0) - stale
            tl.store(pick_ptr + b * E + order, page, mask=(stale > 0) & (order < E))


@triton.jit
def encode_pages_kernel(
    keys_ptr,  # uint8 FP8 bits of the cache: page p's key r at p * page_stride + r * D
    scales_ptr,  # float32 view starting at page 0's scales: page p's scale r at p * page_stride / 4 + r
    page_stride,  # bytes between pages
    pages_ptr,  # [n] int64 pages to encode (scratch: skipped)
    codebook_ptr,  # [M, K, DSUB] float32 centroids, whitened where the codec has a metric
    white_ptr,  # [M, DSUB, DSUB] float32 L^T of each subspace's metric (HAS_METRIC), or [M, DSUB, D] (ROTATE)
    codes_ptr,  # [P + 1, 64, M] uint8 out
    scratch,
    sig_ptr,  # [P + 1, 4] int64 out (WRITE_SIG): the page's signature words, read as its codes are made
    valid_ptr,  # [P + 1] uint8 out (WRITE_SIG): 1, the page holds codes
    w0, w1, w2, w3,  # word offsets of the signature within a page
    D: tl.constexpr,
    M: tl.constexpr,
    K: tl.constexpr,
    DSUB: tl.constexpr,
    HAS_METRIC: tl.constexpr,
    ROTATE: tl.constexpr = False,
    WRITE_SIG: tl.constexpr = False,
    lengths_ptr=None,  # [B] int32 keys of each request (STEP)
    coded_ptr=None,  # [B] int32 out (STEP): the keys of each request's completed pages, lengths rounded down to 64
    phase_ptr=None,  # [1] int32 (STEP and SWEEP): the catch-up's step counter, advanced once
    n_requests=0,
    STEP: tl.constexpr = False,  # a decode step's bookkeeping done here (programs i < n_requests), no kernels of its own
    SWEEP: tl.constexpr = False,
):
    i = tl.program_id(0)
    m = tl.program_id(1)
    if STEP:
        if (m == 0) & (i < n_requests):
            tl.store(coded_ptr + i, tl.load(lengths_ptr + i) // 64 * 64)
        if SWEEP:
            if (m == 0) & (i == 0):  # stale_pages read the phase in the launch before this one
                tl.store(phase_ptr, tl.load(phase_ptr) + 1)
    page = tl.load(pages_ptr + i)
    if WRITE_SIG and m == 0 and page != scratch:  # one program per page records what its codes are made from
        words = keys_ptr.to(tl.pointer_type(tl.int64)) + page * (page_stride // 8)
        tl.store(sig_ptr + page * 4, tl.load(words + w0))
        tl.store(sig_ptr + page * 4 + 1, tl.load(words + w1))
        tl.store(sig_ptr + page * 4 + 2, tl.load(words + w2))
        tl.store(sig_ptr + page * 4 + 3, tl.load(words + w3))
        tl.store(valid_ptr + page, 1)
    if page != scratch:
        rows = tl.arange(0, 64)
        key_at = keys_ptr + page * page_stride + rows * D + m * DSUB
        scale = tl.load(scales_ptr + page * (page_stride // 4) + rows)
        cents = tl.arange(0, K)
        dist = tl.zeros([64, K], dtype=tl.float32)
        if ROTATE:  # the page's whole keys [64, D], dequantized once per program
            dims = tl.arange(0, D)
            page_keys = tl.load(keys_ptr + page * page_stride + rows[:, None] * D + dims[None, :])
            page_keys = page_keys.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
        for a in tl.static_range(DSUB):
            if ROTATE:  # coordinate a of the subspace: the key . row a of the projection (DSUB < 16: no tl.dot)
                x = tl.sum(page_keys * tl.load(white_ptr + (m * DSUB + a) * D + dims)[None, :], axis=1)
            elif HAS_METRIC:  # whitened coordinate a: sum_j x_j L^T[a, j]
                x = tl.zeros([64], dtype=tl.float32)
                for j in tl.static_range(DSUB):
                    xj = tl.load(key_at + j).to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
                    x += xj * tl.load(white_ptr + (m * DSUB + a) * DSUB + j)
            else:
                x = tl.load(key_at + a).to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
            c = tl.load(codebook_ptr + (m * K + cents) * DSUB + a)
            diff = x[:, None] - c[None, :]
            dist += diff * diff
        best = tl.argmin(dist, axis=1)
        tl.store(codes_ptr + (page * 64 + rows) * M + m, best.to(tl.uint8))


@triton.jit
def with_tail_kernel(
    cand_ptr,  # [B, C] int64 candidate positions (-1 = none)
    lengths_ptr,  # [B] int32 keys per request
    out_ptr,  # [B, C + PAGE] int64 or int32 out
    c,
    PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(1).to(tl.int64)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    width = c + PAGE
    length = tl.load(lengths_ptr + b).to(tl.int64)
    cand = tl.load(cand_ptr + b * c + idx, mask=idx < c, other=-1)
    tail = (length // PAGE) * PAGE + (idx - c)
    tail = tl.where(tail < length, tail, -1)
    tl.store(out_ptr + b * width + idx, tl.where(idx < c, cand, tail).to(out_ptr.dtype.element_ty), mask=idx < width)

