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
