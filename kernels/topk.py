"""Top-k of precomputed score rows (the exact path's logits), faster than ``torch.topk`` on long rows.

A strided sample of each row gives a threshold that about ``1.5 target`` entries reach (``target`` at
least k; :func:`dsaindex.kernels.select.thresholds_from_samples`); one pass of :func:`rows_topk` appends the
entries at or above it to a small buffer, and a top-k of the buffer finishes. The pass reads each
score once (4 bytes) and writes only the survivors, where ``torch.topk`` of a million-entry row runs
several passes. The buffer's top-k is :func:`small_topk`: one program per row, the k-th value by
bisection on its bits, no sort. :func:`rows_topk_reference` is the spec: the exhaustive top-k of each row's prefix.
"""

from __future__ import annotations

import torch

from dsaindex.kernels import checks, select

TOPK_TARGET = 2048  # rows_topk's default threshold target: about 1.5 x this many entries reach the buffer


def rows_topk_reference(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``k`` of each row's first ``lengths[b]`` entries: (values [B, k], columns [B, k] int64; -inf / -1
    past a short row's end)."""
    return select.topk_of_prefixes(logits, lengths.to(logits.device), k)


def rows_topk(logits: torch.Tensor, lengths: torch.Tensor, k: int, target: int | None = None,
              capacity: int | None = None, block_n: int = 1024, iters: int = 4, num_warps: int = 4,
              return_counts: bool = False, index_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, ...]:
    """:func:`rows_topk_reference` by threshold selection on Triton.

    logits : [B, N] float32 (a row's entries past its length are ignored); lengths : [B] int; k : entries
    kept; target : entries the threshold aims to pass (default ``max(k, TOPK_TARGET)``: the threshold is
    the sample whose rank matches ``1.5 target``; at 1M entries that rank is 24 of 8192 samples, which
    keeps its spread small even when k is small against a long row); capacity : buffer slots per row
    (default ``4 target``)

    Returns (values [B, k], columns [B, k] int64, or ``index_dtype``), and with ``return_counts`` the appended counts [B]: a
    count outside ``[min(k, length), capacity]`` means that row's result is not provably exact
    (:func:`dsaindex.kernels.select.check_counts`), which a sampled threshold makes rare, not impossible.
    """
    import triton

    from dsaindex.kernels.topk_kernel import rows_above_kernel

    checks.rank("logits", logits, 2, "B, N")
    checks.dtype("logits", logits, torch.float32)
    b, n = logits.shape
    checks.shape("lengths", lengths, (b,), "B")
    checks.at_least("k", k, 1)
    target = max(k, TOPK_TARGET) if target is None else max(target, k)
    capacity = 4 * target if capacity is None else capacity
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    lengths = lengths.to(device=logits.device, dtype=torch.int32)
    stride = select.sample_stride(n)
    # three launches: the threshold (reading the strided sample in place, zeroing the counts), the
    # appending pass, the buffer's top-k (reading only the filled slots: the buffer is never filled)
    counts = torch.empty(b, dtype=torch.int32, device=logits.device)
    thr = select.sample_thresholds(logits[:, ::stride], lengths, stride, target, capacity, counts=counts)
    buf_scores = torch.empty(b, capacity, dtype=torch.float32, device=logits.device)
    buf_pos = torch.empty(b, capacity, dtype=torch.int32, device=logits.device)
    if b and n:
        rows_above_kernel[(triton.cdiv(n, block_n * iters), b)](
            logits, lengths, thr, buf_scores, buf_pos, counts, logits.stride(0),
            BLOCK_N=block_n, ITERS=iters, CAPACITY=capacity, num_warps=num_warps)
    if capacity <= SMALL_TOPK_MAX:  # one program per row finishes (in column order)
        values, columns = small_topk(buf_scores, k, buf_pos, counts=counts, index_dtype=index_dtype)
    else:
        filled = torch.arange(capacity, device=logits.device)[None, :] < counts[:, None]
        values, columns = select.top_of_buffer(buf_scores.masked_fill(~filled, float("-inf")), buf_pos, k)
        columns = columns.to(index_dtype)
    return (values, columns, counts) if return_counts else (values, columns)


SMALL_TOPK_MAX = 32768  # entries a row of :func:`small_topk` may have: one program holds it in registers
# a row at most this share past a power of two may hold its k-th search as that power plus a short tail
# (``split_tail``)
SPLIT_TAIL_SHARE = 1 / 8
# the smallest main block :func:`small_topk` splits at by default (0: never). A grown C's top-2,048 of 16,704 as
# 16,384 + 512 took 30.7-34.3 us on the H100 against 35.6-41.8 as 32,768 (B = 1-32, CUDA graphs); a fixed C's
# 4,416 as 4,096 + 512 took 16.1-18.4 against 15.5-17.6 as 8,192, so rows below 16,384 stay whole
SPLIT_TAIL_FROM = 16384


def split_tail_block(n: int) -> tuple[int, int]:
    """(main block, tail) of a row of ``n`` entries held as a power of two and a short tail: the largest power
    of two below ``n`` and the power of two that holds the rest (at least 16); (next power of two, 0) where
    the rest is more than :data:`SPLIT_TAIL_SHARE` of the main block."""
    block = 16
    while block < n:
        block *= 2
    half = block // 2
    rest = n - half
    if half < 2048 or rest <= 0 or rest > half * SPLIT_TAIL_SHARE:
        return block, 0
    tail = 16
    while tail < rest:
        tail *= 2
    return half, tail


def row_warps(block: int, tail: int = 0) -> int:
    """Warps of :func:`small_topk`'s program for a row held as ``block`` slots (+ ``tail``). 8 at 8,192 slots: the
    paged step's final top-2,048 of 4,416 took 17.4-19.8 us on the H200 against 17.9-20.5 at 16 warps and 21.9-24.2
    at 4 (B = 1-32, CUDA graphs); 16 at 32,768: a grown C's top-2,048 of 16,448 took 43.8-47.6 us on the H100
    against 47.3-51.6 at 8 warps and 47.7-48.9 at 32 (B = 8-64); 8 with a tail: 16,384 + 512 took 30.7-34.3 us on
    the H100 against 30.7-35.0 at 16."""
    return 16 if block >= 16384 and not tail else 8 if block >= 2048 else 4


def small_topk_reference(values: torch.Tensor, k: int,
                         payload: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of each row of ``values`` [B, n] float32: (values [B, k], payload [B, k] int64),
    best first here; ``payload`` [B, n] defaults to the column. Entries past a short row (or at -inf) give
    -inf / -1. The spec of :func:`small_topk`, which returns the same set in column order."""
    b, n = values.shape
    vals, at = values.topk(min(k, n), dim=1)
    pay = at if payload is None else payload.gather(1, at).long()
    pay = torch.where(vals > float("-inf"), pay, torch.full_like(pay, -1))  # +inf is a value (a forced key)
    if k > n:
        vals = torch.cat([vals, vals.new_full((b, k - n), float("-inf"))], dim=1)
        pay = torch.cat([pay, pay.new_full((b, k - n), -1)], dim=1)
    return vals, pay


def _topk_outputs(values: torch.Tensor, k: int, payload: torch.Tensor | None, counts: torch.Tensor | None,
                  index_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The checks :func:`small_topk` and :func:`radix_topk` share (``ValueError`` naming the argument), then their
    outputs, uninitialised: values [B, k] float32, payload [B, k] ``index_dtype``."""
    checks.rank("values", values, 2, "B, n")
    checks.dtype("values", values, torch.float32)
    b, n = values.shape
    checks.at_least("k", k, 1)
    if payload is not None:
        checks.shape("payload", payload, (b, n), "B, n")
        checks.dtype("payload", payload, torch.int32, torch.int64)
        checks.same_device(values=values, payload=payload)
    if counts is not None:
        checks.shape("counts", counts, (b,), "B")
        checks.dtype("counts", counts, torch.int32)
        checks.same_device(values=values, counts=counts)
    if index_dtype not in (torch.int32, torch.int64):
        raise ValueError(f"index_dtype must be torch.int32 or torch.int64, got {index_dtype}")
    return (torch.empty(b, k, dtype=torch.float32, device=values.device),
            torch.empty(b, k, dtype=index_dtype, device=values.device))


def small_topk(values: torch.Tensor, k: int, payload: torch.Tensor | None = None,
               num_warps: int | None = None, counts: torch.Tensor | None = None,
               index_dtype: torch.dtype = torch.int64,
               split_tail: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`small_topk_reference` in one Triton launch, one program per row holding the row in registers
    (rows of at most :data:`SMALL_TOPK_MAX` entries): the k-th largest by bisection on the float bits, then
    one compaction (4,096 entries at a time, prefix sums along 128-entry rows); no sort, so a single row
    costs a few microseconds where ``torch.topk`` runs one block for tens. Ties at the k-th value are taken
    in column order; the result is in column order, except that -inf entries (a row with fewer than k
    finite values) come last, as in :func:`small_topk_reference`: a row's real entries lead.
    ``counts`` [B] int32 (optional): only a row's first ``counts[b]`` entries are filled (a candidate
    buffer as an appending pass left it); the rest is never read, so the buffer needs no fill.
    ``index_dtype``: the payload's output dtype (int64, or int32: no cast kernel after it).
    ``split_tail``: a row just past a power of two (the paged step's final row: a fixed C's 4,416 slots, a grown
    C's 16,704) holds its k-th search as that power and a short tail (:func:`split_tail_block`), not as the next
    power: the same result, half the registers per pass. By default (None) a row whose main block would be at
    least :data:`SPLIT_TAIL_FROM` slots is split.
    Raises ``ValueError`` on an input of the wrong dtype, shape or size."""
    import triton

    from dsaindex.kernels.topk_kernel import row_topk_kernel

    out_val, out_pay = _topk_outputs(values, k, payload, counts, index_dtype)
    b, n = values.shape
    checks.at_most("values.shape[1] (row length)", n, SMALL_TOPK_MAX, "one program holds a row")
    if b == 0:
        return out_val, out_pay
    block, tail = split_tail_block(n)
    split = split_tail if split_tail is not None else 0 < SPLIT_TAIL_FROM <= block
    if tail and not split:  # the whole row as the next power of two
        block, tail = 2 * block, 0
    warps = num_warps or row_warps(block, tail)
    row_topk_kernel[(b,)](
        values.contiguous(), payload.contiguous() if payload is not None else values, out_val, out_pay,
        counts if counts is not None else out_val, n, k,
        BLOCK=block, K_BLOCK=max(16, triton.next_power_of_2(k)), HAS_PAYLOAD=payload is not None,
        HAS_COUNTS=counts is not None, WIDTH=min(block, 128), CHUNK=min(block, 4096), TAIL=tail, num_warps=warps)
    return out_val, out_pay


# entries a program of :func:`radix_topk` takes, and the bits of a digit: a grown C's top-2,048 of 16,704 took
# 18.8-30.8 us on the H100 at 512 entries and 8 bits (B = 1-32, 4 warps, CUDA graphs), 19.9-31.3 at 1,024,
# 23.1-35.4 at 2,048, and 29.8-119.7 with 11-bit digits (fewer passes, but a histogram 8 times wider)
RADIX_BLOCK = 512
RADIX_DIGIT_BITS = 8
# :func:`final_topk` spreads each row over programs (:func:`radix_topk`) for up to this many rows of at least
# RADIX_FROM_SLOTS entries. A grown C's top-2,048 of 16,704 took 18.8 / 19.2 / 21.4 / 30.8 us at B = 1 / 2 / 8 / 32
# on the H100 against 30.7 / 32.2 / 32.8 / 34.3 in one program a row (split); a fixed C's 4,416 took 17.5-22.6
# against 15.5-17.6, so short rows keep one program
RADIX_UP_TO_ROWS = 32
RADIX_FROM_SLOTS = 8192


def radix_scratch_words(digit_bits: int = RADIX_DIGIT_BITS) -> int:
    """int64 words of a row's :func:`radix_topk` scratch: a histogram a pass (three of 2,048 bins for 11-bit
    digits, four of 256 for 8-bit), then 16 words of the select's state and counters."""
    return (3 * 2048 if digit_bits == 11 else 4 * 256) + 16


def radix_scratch(rows: int, device: torch.device | str, digit_bits: int = RADIX_DIGIT_BITS) -> torch.Tensor:
    """A zeroed scratch for :func:`radix_topk` over ``rows`` rows, which every call leaves zeroed: a caller that
    keeps one (per batch size) saves the fill kernel each step."""
    return torch.zeros(rows, radix_scratch_words(digit_bits), dtype=torch.int64, device=device)


def radix_topk(values: torch.Tensor, k: int, payload: torch.Tensor | None = None, counts: torch.Tensor | None = None,
               index_dtype: torch.dtype = torch.int64, block: int = RADIX_BLOCK, num_warps: int = 4,
               digit_bits: int = RADIX_DIGIT_BITS, scratch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`small_topk`'s selection with each row spread over ``ceil(n / block)`` programs: a radix select of the
    k-th largest (a pass a digit of the float's order key, each program adding its entries' digits to a histogram
    and the last one to finish choosing the digit), then one pass appending what is above it and the ties it may
    take. Four or five launches and a zeroed scratch, where small_topk is one program a row: for a few
    rows, most of a GPU works on them. The same entries as small_topk (ties at the k-th value: the first ones by
    column), in no particular order: a row's real entries first, then -inf / -1. Rows of any length.
    ``counts``, ``payload``, ``index_dtype`` as small_topk's; ``digit_bits``: 11 (three passes of 2,048-bin
    histograms) or 8 (four of 256 bins); ``scratch``: :func:`radix_scratch` of these rows and digits, zeroed, which
    the call leaves zeroed (None: one is made, a fill kernel). Raises ``ValueError`` on an input of the wrong dtype,
    shape or size."""
    import triton

    from dsaindex.kernels.topk_kernel import radix_digit_kernel, radix_take_kernel

    out_val, out_pay = _topk_outputs(values, k, payload, counts, index_dtype)
    b, n = values.shape
    checks.power_of_two("block", block)
    if digit_bits not in (8, 11):
        raise ValueError(f"digit_bits: got {digit_bits}, want 11 (three passes) or 8 (four passes)")
    words = radix_scratch_words(digit_bits)
    if scratch is None:
        scratch = radix_scratch(b, values.device, digit_bits)
    checks.shape("scratch", scratch, (b, words), f"B, {words} (radix_scratch of these rows and digits)")
    checks.dtype("scratch", scratch, torch.int64)
    checks.same_device(values=values, scratch=scratch)
    if b == 0:
        return out_val, out_pay
    values = values.contiguous()
    grid = (b, max(1, triton.cdiv(n, block)))
    cnt = counts if counts is not None else scratch
    wide = digit_bits == 11
    for p in range(3 if wide else 4):
        radix_digit_kernel[grid](values, cnt, scratch, n, k, PASS=p, WIDE=wide, BLOCK=block,
                                 HAS_COUNTS=counts is not None, SCRATCH=words, num_warps=num_warps)
    radix_take_kernel[grid](values, cnt, scratch, payload.contiguous() if payload is not None else values, out_val,
                            out_pay, n, k, BLOCK=block, K_BLOCK=max(16, triton.next_power_of_2(k)),
                            HAS_COUNTS=counts is not None, HAS_PAYLOAD=payload is not None, SCRATCH=words, WIDE=wide,
                            SCRATCH_PAD=min(1024, triton.next_power_of_2(words)), num_warps=num_warps)
    return out_val, out_pay


def final_takes_radix(rows: int, slots: int) -> bool:
    """Whether :func:`final_topk` spreads ``rows`` rows of ``slots`` entries over programs (:func:`radix_topk`)."""
    return rows <= RADIX_UP_TO_ROWS and slots >= RADIX_FROM_SLOTS


def final_topk(values: torch.Tensor, k: int, payload: torch.Tensor, index_dtype: torch.dtype = torch.int64,
               scratch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's final top-k of its rescored candidates: :func:`radix_topk` for up to
    :data:`RADIX_UP_TO_ROWS` rows of at least :data:`RADIX_FROM_SLOTS` entries (each row over many programs;
    ``scratch``: its zeroed :func:`radix_scratch`, left zeroed, None: made here), else :func:`small_topk` (one
    program a row). The same entries either way; in column order only from small_topk."""
    if final_takes_radix(*values.shape):
        return radix_topk(values, k, payload, index_dtype=index_dtype, scratch=scratch)
    return small_topk(values, k, payload, index_dtype=index_dtype)

