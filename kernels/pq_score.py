"""PQ coarse scores on Triton: ``score[i] = sum_h w_h relu(sum_m LUT[h, m, code[i, m]])``.

The reference is :func:`dsaindex.runtime.pq_decode.pq_coarse_scores` (same contract). This first
kernel reads the per-head tables from global memory (cached in L1/L2); it does not fuse the top-C
selection yet.
"""

from __future__ import annotations

import torch
import triton


def pq_lookup_tables(queries: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
    """[H, D] queries and [M, K, D/M] codebooks -> [H, M, K] float32 tables of sub-dot-products."""
    m, _, d = codebooks.shape
    return torch.einsum("hmd,mkd->hmk", queries.float().view(queries.shape[0], m, d), codebooks.float()).contiguous()


def pq_coarse_scores_triton(queries: torch.Tensor, head_weights: torch.Tensor, codes: torch.Tensor,
                            codebooks: torch.Tensor, block_n: int = 128) -> torch.Tensor:
    """Coarse scores [N] float32 of PQ codes for one query.

    Parameters
    ----------
    queries : [H, D] float; head_weights : [H] float (effective weights); codes : [N, M] uint8,
    contiguous; codebooks : [M, K, D/M] float. All on one device (CPU only under TRITON_INTERPRET=1).
    M must be a power of two (16, 32, 64).
    """
    from dsaindex.kernels.pq_score_kernel import pq_coarse_score_kernel

    n_heads, dim = queries.shape
    m, k, d = codebooks.shape
    assert m * d == dim, f"codebooks cover {m * d} dims, queries have {dim}"
    assert m & (m - 1) == 0, f"subspace count {m} must be a power of two"
    assert codes.dtype == torch.uint8, f"codes must be uint8, got {codes.dtype}"
    assert codes.dim() == 2 and codes.shape[1] == m, f"codes {tuple(codes.shape)} vs {m} subspaces"
    assert head_weights.shape == (n_heads,), f"head weights {tuple(head_weights.shape)} vs {n_heads} heads"
    assert queries.device == codes.device == codebooks.device == head_weights.device, "tensors on different devices"
    codes = codes.contiguous()
    lut = pq_lookup_tables(queries, codebooks)
    out = torch.empty(codes.shape[0], dtype=torch.float32, device=codes.device)
    n = codes.shape[0]
    if n == 0:
        return out
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    pq_coarse_score_kernel[grid](lut, codes, head_weights.float().contiguous(), out, n,
                                 N_HEADS=n_heads, M=m, K=k, BLOCK_N=block_n)
    return out
