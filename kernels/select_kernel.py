"""Triton jit helpers shared by the scoring kernels: append above a threshold, weighted ReLU over heads."""

import triton
import triton.language as tl


@triton.jit
def append_above(score, rows, valid, thr, out_score_ptr, out_pos_ptr, count_ptr, CAPACITY: tl.constexpr):
    """Append (row, score) of every valid row whose score reaches ``thr`` to one request's buffer.

    One atomic per tile reserves the slots; a prefix sum places the rows. Rows past ``CAPACITY`` are
    counted but not stored (the caller sees the overflow in the count).
    """
    keep = valid & (score >= thr)
    n_keep = tl.sum(keep.to(tl.int32), axis=0)
    if n_keep > 0:
        base = tl.atomic_add(count_ptr, n_keep)
        slot = base + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        ok = keep & (slot < CAPACITY)
        tl.store(out_score_ptr + slot, score, mask=ok)
        tl.store(out_pos_ptr + slot, rows.to(tl.int32), mask=ok)


@triton.jit
def scan_rows(idx, stride, n_out, length, SAMPLE: tl.constexpr):
    """Rows of one request a tile covers, and which are real: the sampling pass reads rows
    ``idx * stride`` (``n_out`` samples), the selecting pass every row ``idx``; both stop at ``length``."""
    if SAMPLE:
        rows = idx * stride
        valid = (idx < n_out) & (rows < length)
    else:
        rows = idx
        valid = rows < length
    return rows, valid


@triton.jit
def binned_slots(live, bins, sel_ptr, ctr_ptr):
    """Slots of a tile of one request's stage-2 candidates a binned selection keeps: those above the boundary
    bin (``sel_ptr``: boundary, above, kept) take slots from 0, those in it from ``above``, each group by one
    atomic on its counter (``ctr_ptr``, two int32, zero before the launch) and a prefix sum; a tied candidate
    past ``kept`` is dropped, and no slot reaches ``kept``. ``live``: the tile's real candidates (an empty
    slot's bin was never written, so it must not be live). Returns (slot, keep)."""
    edge = tl.load(sel_ptr)
    above = tl.load(sel_ptr + 1)
    kept = tl.load(sel_ptr + 2)
    strict = live & (bins > edge)
    tied = live & (bins == edge)
    base_s = tl.atomic_add(ctr_ptr, tl.sum(strict.to(tl.int32), axis=0))
    base_t = tl.atomic_add(ctr_ptr + 1, tl.sum(tied.to(tl.int32), axis=0))
    slot = tl.where(strict, base_s + tl.cumsum(strict.to(tl.int32), axis=0) - 1,
                    above + base_t + tl.cumsum(tied.to(tl.int32), axis=0) - 1)
    return slot, (strict | tied) & (slot < kept)  # strict slots are below `above` <= kept


@triton.jit
def load_queries(q_ptr, w_ptr, N_HEADS: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr):
    """One request's queries as a [D, H_PAD] bf16 tile and its weights [H_PAD] float32.

    q_ptr : queries [N_HEADS, D] bf16; w_ptr : weights [N_HEADS] float32. Heads past ``N_HEADS`` (the
    padding up to a tensor-core shape, at least 16) get zero queries and weights.
    """
    heads = tl.arange(0, H_PAD)
    dims = tl.arange(0, D)
    live = heads < N_HEADS
    q_t = tl.load(q_ptr + heads[None, :] * D + dims[:, None], mask=live[None, :], other=0.0)
    w = tl.load(w_ptr + heads, mask=live, other=0.0)
    return q_t, w


@triton.jit
def weighted_relu_heads(keys, q_t, w, F32: tl.constexpr):
    """``sum_h w_h relu(q_h . k)`` for a tile of keys [BLOCK, D] bf16 and queries ``q_t`` [D, H] bf16 (or
    both FP8 e4m3), on tensor cores -> [BLOCK] float32.

    ``F32`` multiplies in float32 instead (Triton's CPU interpreter mis-multiplies bf16 dots).
    """
    if F32:
        dots = tl.dot(keys.to(tl.float32), q_t.to(tl.float32))
    else:
        dots = tl.dot(keys, q_t)  # [BLOCK, H_PAD] float32
    return tl.sum(tl.maximum(dots, 0.0) * w[None, :], axis=1)


@triton.jit
def gather_host_rows_kernel(
    host_fp8_ptr,  # [P * PAGE, D] pinned host pool of FP8 bits, as uint8 or int32 words (read through unified addressing)
    host_scale_ptr,  # [P * PAGE] float32
    page_table_ptr,  # [B, max_pages] int32 host page of each request page
    src_pos_ptr,  # [B, n] int64 key positions to read (-1 = none)
    dst_slot_ptr,  # [B, n] int64 destination rows in the device pool
    pool_fp8_ptr,  # [B, pool_rows, D] device pool, same element type as the host pool
    pool_scale_ptr,  # [B, pool_rows] float32
    n,
    max_pages,
    pool_rows,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    inside = idx < n
    pos = tl.load(src_pos_ptr + b * n + idx, mask=inside, other=-1)
    live = inside & (pos >= 0)
    page = tl.load(page_table_ptr + b * max_pages + pos // PAGE, mask=live, other=0).to(tl.int64)
    src = page * PAGE + pos % PAGE
    dst = b * pool_rows + tl.load(dst_slot_ptr + b * n + idx, mask=live, other=0)
    dims = tl.arange(0, D)
    raw = tl.load(host_fp8_ptr + src[:, None] * D + dims[None, :], mask=live[:, None], other=0)
    tl.store(pool_fp8_ptr + dst[:, None] * D + dims[None, :], raw, mask=live[:, None])
    tl.store(pool_scale_ptr + dst, tl.load(host_scale_ptr + src, mask=live, other=0.0), mask=live)


@triton.jit
def grown(count, length, band, most):
    """``count`` times the power of two that covers ``length`` in units of ``band`` keys (1 up to ``band``,
    2 up to twice it, 4 up to four times), at most ``most`` (a power of two); ``count`` as it is where
    ``band`` is 0. A request's C by its prefix length; the torch twin is
    :func:`dsaindex.kernels.pq_select.grown_counts`."""
    need = tl.maximum((length + band - 1) // tl.maximum(band, 1), 1)
    mult = length * 0 + 1
    for _ in tl.static_range(16):
        mult = tl.where((mult < need) & (mult < most), mult * 2, mult)
    return tl.where(band > 0, count * mult, count)
