"""Exact indexer scores of a chunk of prefill queries against one request's keys: every key of each
query's causal prefix (exhaustive selection) or a per-query list of candidate rows (IVF refine).

The torch reference and the Triton kernel (:mod:`dsaindex.kernels.chunk_score_kernel`) share the
contract: ``[Q, n]`` float32 scores, -inf where a key is outside the query's prefix or a row is -1.
"""

from __future__ import annotations

import torch

from dsaindex.kernels import checks, select
from dsaindex.score import indexer_scores


def chunk_scores_reference(keys: torch.Tensor, queries: torch.Tensor, head_weights: torch.Tensor,
                           rows: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
                           n_out: int | None = None, query_block: int = 16) -> torch.Tensor:
    """Scores [Q, n] float32 of ``keys`` [N, D] for ``queries`` [Q, H, D] and ``head_weights`` [Q, H]: of
    the rows ``rows`` [Q, n] int (-1 = none: -inf), or with ``lengths`` [Q] int of the first ``n_out``
    keys (default N), -inf past each query's ``lengths[q]``. Pass one of ``rows`` and ``lengths``.
    ``query_block`` bounds the gather's memory. The spec of :func:`chunk_scores`."""
    q_n = queries.shape[0]
    if rows is not None:
        out = torch.empty(rows.shape, dtype=torch.float32, device=keys.device)
        for lo in range(0, q_n, query_block):
            r = rows[lo : lo + query_block]
            picked = keys[r.clamp_min(0).long()].float()  # [b, n, D]
            dots = torch.relu(torch.einsum("bhd,bnd->bhn", queries[lo : lo + query_block].float(), picked))
            s = torch.einsum("bh,bhn->bn", head_weights[lo : lo + query_block].float(), dots)
            out[lo : lo + query_block] = s.masked_fill(r < 0, float("-inf"))
        return out
    n_out = keys.shape[0] if n_out is None else n_out
    scores = indexer_scores(queries, keys[:n_out], head_weights)
    visible = torch.arange(n_out, device=keys.device)[None, :] < lengths.to(keys.device).long()[:, None]
    return scores.masked_fill(~visible, float("-inf"))


def chunk_scores(keys: torch.Tensor, queries: torch.Tensor, head_weights: torch.Tensor,
                 rows: torch.Tensor | None = None, lengths: torch.Tensor | None = None, n_out: int | None = None,
                 block_n: int = 64, queries_per_tile: int = 4, num_warps: int = 4) -> torch.Tensor:
    """The Triton kernel, same contract as :func:`chunk_scores_reference`: keys and queries are read as
    bf16, D must be a power of two >= 16, and every tensor but ``lengths`` (copied to the keys' device
    if elsewhere) on one device. Raises ``ValueError`` on an input of the wrong dtype, shape or device."""
    import triton

    from dsaindex.kernels.chunk_score_kernel import chunk_score_kernel

    checks.rank("keys", keys, 2, "N, D")
    n, d = keys.shape
    checks.key_dim("keys.shape[1] (key dim D)", d)
    checks.shape("queries", queries, (None, None, d), "Q, H, D")
    q_n, h, _ = queries.shape
    checks.shape("head_weights", head_weights, (q_n, h), "Q, H")
    checks.exactly_one(rows=rows, lengths=lengths)
    if rows is not None:
        checks.shape("rows", rows, (q_n, None), "Q, n")
        checks.dtype("rows", rows, torch.int32, torch.int64)
    else:
        checks.shape("lengths", lengths, (q_n,), "Q")
    checks.same_device(keys=keys, queries=queries, head_weights=head_weights, rows=rows)
    gather = rows is not None
    n_out = rows.shape[1] if gather else (n if n_out is None else n_out)
    qg = 1 if gather else queries_per_tile
    out = torch.empty(q_n, n_out, dtype=torch.float32, device=keys.device)
    if q_n == 0 or n_out == 0:
        return out
    dummy = torch.empty(1, dtype=torch.int32, device=keys.device)
    grid = (triton.cdiv(n_out, block_n), triton.cdiv(q_n, qg))
    chunk_score_kernel[grid](
        keys.to(torch.bfloat16).contiguous(), queries.to(torch.bfloat16).contiguous(),
        head_weights.float().contiguous(),
        rows.to(torch.int32).contiguous() if gather else dummy,
        dummy if gather else lengths.to(device=keys.device, dtype=torch.int32).contiguous(),
        out, q_n, n_out,
        N_HEADS=h, H_PAD=max(16, triton.next_power_of_2(h)), D=d, BLOCK_N=block_n, QG=qg, GATHER=gather,
        F32=select.interpreted(), num_warps=num_warps,
    )
    return out
