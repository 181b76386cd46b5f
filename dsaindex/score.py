"""The exact DSA indexer score and causal top-k: the oracle every other part is tested against.

Convention (one for all families)::

    score[s, t] = sum_h w[s, h] * relu(q[s, h, :] . k[t, :])

``w`` are *effective* head weights: the model's ``weights_proj(x)`` times ``n_heads ** -0.5`` times
``head_dim ** -0.5`` (the softmax scale, folded in because relu is positively homogeneous). Captured
head weights are stored in this form, so the score needs no family-specific constants.
"""

from __future__ import annotations

import math

import torch

from dsaindex.geometry import visible_key_count


def effective_head_weights(raw_weights: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """``weights_proj(x)`` -> effective weights ``raw * n_heads**-0.5 * head_dim**-0.5`` (fp32)."""
    return raw_weights.float() * (n_heads**-0.5) * (head_dim**-0.5)


def indexer_scores(
    queries: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, query_block: int | None = None
) -> torch.Tensor:
    """Exact indexer scores of every query against every key.

    Parameters
    ----------
    queries : [S, H, D] float (any float dtype; computed in fp32)
    keys : [T, D] float
    head_weights : [S, H] effective head weights (see module docstring)
    query_block : queries per step; bounds the [block, H, T] fp32 intermediate. Default keeps it
        near 256 MiB.

    Returns
    -------
    [S, T] float32 scores, without any causal mask.
    """
    assert queries.dim() == 3 and keys.dim() == 2 and head_weights.dim() == 2, "want q [S,H,D], k [T,D], w [S,H]"
    assert queries.shape[-1] == keys.shape[-1], f"head dim mismatch: q {queries.shape[-1]} vs k {keys.shape[-1]}"
    assert head_weights.shape == queries.shape[:2], f"w {tuple(head_weights.shape)} vs q {tuple(queries.shape)}"
    num_queries, n_heads, _ = queries.shape
    num_keys = keys.shape[0]
    if query_block is None:
        query_block = max(1, (1 << 26) // max(1, n_heads * num_keys))
    keys_t = keys.float().t()
    out = torch.empty(num_queries, num_keys, dtype=torch.float32, device=queries.device)
    for start in range(0, num_queries, query_block):
        q = queries[start : start + query_block].float()
        logits = torch.relu(torch.matmul(q, keys_t))  # [s, H, T]
        w = head_weights[start : start + query_block].float().unsqueeze(1)  # [s, 1, H]
        out[start : start + query_block] = torch.bmm(w, logits).squeeze(1)
    return out


def batched_index_scores(queries: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor) -> torch.Tensor:
    """The exact score of :func:`indexer_scores` for a batch of query chunks, differentiable (training,
    distillation and evaluation forwards take gradients through it).

    Parameters
    ----------
    queries : [B, c, H, D]; keys : [B, T, D]; head_weights : [B, c, H] effective weights

    Returns
    -------
    [B, c, T] float32 scores, without any causal mask. One [B, c*H, D] x [B, D, T] product, then a
    per-query [1, H] x [H, T] weighted sum over heads (the [B, c, H, T] relu intermediate is the caller's
    to bound by choosing ``c``).
    """
    b, c, h, d = queries.shape
    t = keys.shape[1]
    logits = torch.bmm(queries.reshape(b, c * h, d), keys.transpose(1, 2))  # [B, c*H, T]
    relu = torch.relu(logits).view(b * c, h, t)
    out = torch.bmm(head_weights.reshape(b * c, 1, h).to(relu.dtype), relu)  # [B*c, 1, T]
    return out.view(b, c, t).float()


def causal_mask(query_positions: torch.Tensor, num_keys: int, key_stride: int = 1) -> torch.Tensor:
    """[S, T] bool, True where key ``t`` is in the causal prefix of the query at ``query_positions``.

    Key ``t`` stands for token ``t`` (stride 1) or for V4 compressed entry ``t`` covering tokens
    ``[t*m, (t+1)*m)``, visible only once complete (:func:`dsaindex.geometry.visible_key_count`).
    """
    limit = visible_key_count(query_positions.long(), key_stride)
    return torch.arange(num_keys, device=query_positions.device).unsqueeze(0) < limit.unsqueeze(1)


def causal_topk(
    scores: torch.Tensor, query_positions: torch.Tensor, k: int, key_stride: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` keys per query among its causal prefix.

    Parameters
    ----------
    scores : [S, T] float scores (e.g. from :func:`indexer_scores`)
    query_positions : [S] token positions of the queries (keys are positions 0..T-1, or V4 entries)
    k : keys to keep; at most ``T`` are returned

    Returns
    -------
    (values [S, min(k, T)] float32, indices [S, min(k, T)] int64). Slots beyond a query's prefix
    hold index -1 and value -inf. Order within a row is by descending score.
    """
    num_keys = scores.shape[-1]
    kk = min(k, num_keys)
    mask = causal_mask(query_positions, num_keys, key_stride)
    masked = scores.float().masked_fill(~mask, -math.inf)
    values, indices = masked.topk(kk, dim=-1)
    invalid = ~torch.isfinite(values)
    return values.masked_fill(invalid, -math.inf), indices.masked_fill(invalid, -1)


def topk_agree(
    scores: torch.Tensor,
    ours: torch.Tensor,
    theirs: torch.Tensor,
    visible: torch.Tensor | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> torch.Tensor:
    """Per query: do two top-k index sets agree, counting ties at the k-th score as agreement?

    Both index tensors are [S, k] with -1 for empty slots. Sets agree when every key in one set but not
    the other scores within tolerance of the k-th best score (a tie the two selections broke
    differently). ``visible`` ([S] key counts, see :func:`dsaindex.geometry.visible_key_count`) drops indices outside a
    query's causal prefix first: engines pad short prefixes with arbitrary masked keys.

    Returns
    -------
    [S] bool
    """
    result = torch.ones(scores.shape[0], dtype=torch.bool)
    for s in range(scores.shape[0]):
        limit = int(visible[s]) if visible is not None else scores.shape[1]
        a = {int(i) for i in ours[s].tolist() if 0 <= i < limit}
        b = {int(i) for i in theirs[s].tolist() if 0 <= i < limit}
        if a == b:
            continue
        if len(a) != len(b):
            result[s] = False
            continue
        kth = min(float(scores[s, i]) for i in a)
        for i in a ^ b:
            if abs(float(scores[s, i]) - kth) > atol + rtol * abs(kth):
                result[s] = False
                break
    return result
