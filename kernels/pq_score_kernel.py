"""Triton kernel: PQ coarse indexer scores from per-head lookup tables (jit code only)."""

import triton
import triton.language as tl


@triton.jit
def pq_coarse_score_kernel(
    lut_ptr,  # [H, M, K] float32: lut[h, m, c] = q_h[m-th subspace] . codebook[m, c]
    codes_ptr,  # [N, M] uint8 PQ codes, row-major
    weights_ptr,  # [H] float32 effective head weights
    out_ptr,  # [N] float32 coarse scores
    n_keys,
    N_HEADS: tl.constexpr,
    M: tl.constexpr,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = rows < n_keys
    sub = tl.arange(0, M)
    codes = tl.load(codes_ptr + rows[:, None] * M + sub[None, :], mask=valid[:, None], other=0).to(tl.int32)
    table_offsets = sub[None, :] * K + codes  # [BLOCK_N, M] offsets inside one head's table
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for h in range(N_HEADS):
        parts = tl.load(lut_ptr + h * M * K + table_offsets, mask=valid[:, None], other=0.0)
        dot = tl.sum(parts, axis=1)
        acc += tl.load(weights_ptr + h) * tl.maximum(dot, 0.0)
    tl.store(out_ptr + rows, acc, mask=valid)
