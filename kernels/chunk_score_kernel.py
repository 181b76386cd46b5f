"""Triton kernel: exact indexer scores of a chunk of queries against one shared bf16 key array (jit only).

Two modes (``GATHER``):
- prefix: query ``q`` scores keys ``0 .. n_out - 1``; keys at or past ``lengths[q]`` (its causal
  prefix) score -inf. ``QG`` queries share each key tile, loaded once.
- gather: query ``q`` scores the rows ``rows[q, i]`` of the key array (-1 = none, -inf).
"""

import triton
import triton.language as tl

from dsaindex.kernels.select_kernel import load_queries, weighted_relu_heads


@triton.jit
def chunk_score_kernel(
    keys_ptr,  # [N, D] bf16
    q_ptr,  # [Q, N_HEADS, D] bf16
    w_ptr,  # [Q, N_HEADS] float32 effective head weights
    rows_ptr,  # [Q, n_out] int32 rows to score (gather mode)
    lengths_ptr,  # [Q] int32 keys each query may see (prefix mode)
    out_ptr,  # [Q, n_out] float32
    n_queries,
    n_out,
    N_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QG: tl.constexpr,
    GATHER: tl.constexpr,
    F32: tl.constexpr,
):
    pid_n = tl.program_id(0)
    q0 = tl.program_id(1) * QG
    idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = idx < n_out
    dims = tl.arange(0, D)
    if GATHER:
        q = q0.to(tl.int64)
        rows = tl.load(rows_ptr + q * n_out + idx, mask=inside, other=-1)
        valid = rows >= 0
        keys = tl.load(keys_ptr + rows.to(tl.int64)[:, None] * D + dims[None, :], mask=valid[:, None], other=0.0)
        q_t, w = load_queries(q_ptr + q * N_HEADS * D, w_ptr + q * N_HEADS, N_HEADS, H_PAD, D)
        score = weighted_relu_heads(keys, q_t, w, F32)
        tl.store(out_ptr + q * n_out + idx, tl.where(valid, score, float("-inf")), mask=inside)
    else:
        keys = tl.load(keys_ptr + idx.to(tl.int64)[:, None] * D + dims[None, :], mask=inside[:, None], other=0.0)
        for g in tl.static_range(QG):
            q = (q0 + g).to(tl.int64)
            if q < n_queries:
                length = tl.load(lengths_ptr + q)
                q_t, w = load_queries(q_ptr + q * N_HEADS * D, w_ptr + q * N_HEADS, N_HEADS, H_PAD, D)
                score = weighted_relu_heads(keys, q_t, w, F32)
                tl.store(out_ptr + q * n_out + idx, tl.where(idx < length, score, float("-inf")), mask=inside)
