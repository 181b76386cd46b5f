"""PQ coarse scores on Triton: ``score[i] = sum_h w_h relu(sum_m LUT[h, m, code[i, m]])``.

:func:`pq_coarse_scores` is the torch reference (the spec); :func:`pq_coarse_scores_triton` the
kernel wrapper, checked against it. This first kernel reads the per-head tables from global memory
(cached in L1/L2); it does not fuse the top-C selection yet. Triton is imported only by the wrapper.
"""

from __future__ import annotations

import torch


def pq_lookup_tables(queries: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
    """[H, D] queries and [M, K, D/M] codebooks -> [H, M, K] float32 tables of sub-dot-products."""
    m, _, d = codebooks.shape
    return torch.einsum("hmd,mkd->hmk", queries.float().view(queries.shape[0], m, d), codebooks.float()).contiguous()


def pq_coarse_scores(queries: torch.Tensor, head_weights: torch.Tensor, codes: torch.Tensor,
                     codebooks: torch.Tensor, block: int = 16384) -> torch.Tensor:
    """Coarse scores of PQ-coded keys for one query.

    Parameters
    ----------
    queries : [H, D]; head_weights : [H] effective weights; codes : [N, M] uint8; codebooks : [M, K, D/M]

    Returns
    -------
    [N] float32, equal to the exact score of the decoded keys
    """
    n_heads = queries.shape[0]
    m, k, _ = codebooks.shape
    lut = pq_lookup_tables(queries, codebooks).reshape(n_heads, m * k)
    offsets = torch.arange(m, device=codes.device) * k
    out = torch.empty(codes.shape[0], dtype=torch.float32, device=codes.device)
    for start in range(0, codes.shape[0], block):
        idx = codes[start : start + block].long() + offsets  # [n, M] rows of the flattened table
        dots = lut[:, idx].sum(-1)  # [H, n]
        out[start : start + block] = head_weights.float() @ torch.relu(dots)
    return out


def pq_coarse_scores_triton(queries: torch.Tensor, head_weights: torch.Tensor, codes: torch.Tensor,
                            codebooks: torch.Tensor, block_n: int = 128) -> torch.Tensor:
    """Coarse scores [N] float32 of PQ codes for one query.

    Parameters
    ----------
    queries : [H, D] float; head_weights : [H] float (effective weights); codes : [N, M] uint8,
    contiguous; codebooks : [M, K, D/M] float. All on one device (CPU only under TRITON_INTERPRET=1).
    M must be a power of two (16, 32, 64).
    """
    import triton

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
