"""Each family's indexer projections, recomputed from a transformers indexer module's own weights.

Capture hooks see an indexer's inputs; these functions turn them into the tensors the exact score
(:mod:`dsaindex.score`) consumes: keys as scored (after norm and RoPE), queries (after RoPE) and
effective head weights. Tests check that scoring these reproduces the module's own top-k.
"""

from __future__ import annotations

import re

import torch

from dsaindex.geometry import IndexerGeometry
from dsaindex.score import effective_head_weights


def rope_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE with pairs ``(i, i + r/2)``; ``cos``/``sin`` hold r values (the angle list repeated twice)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE with pairs ``(2i, 2i + 1)``; ``cos``/``sin`` hold r values whose first r/2 are the angles."""
    c = cos[..., : cos.shape[-1] // 2]
    s = sin[..., : sin.shape[-1] // 2]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)


def mla_indexer_tensors(
    indexer: torch.nn.Module,
    rope_layout: str,
    hidden_states: torch.Tensor,
    q_resid: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    query_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys, queries and head weights of a V3.2 / GLM-5 indexer (``DeepseekV32Indexer``,
    ``GlmMoeDsaIndexer``) for one forward call.

    Parameters
    ----------
    hidden_states : [B, S, hidden]; q_resid : [B, S, q_lora_rank]
    cos, sin : [B, S, rope_dim] as the model passes them to the indexer
    rope_layout : ``half_split_head`` (V3.2) or ``interleaved_head`` (GLM-5)
    query_rows : optional [s] indices into S; queries/weights are computed only there

    Returns
    -------
    keys [B, S, D] float32, queries [B, s, H, D] float32, head_weights [B, s, H] float32 (effective).
    """
    rope = rope_half_split if rope_layout == "half_split_head" else rope_interleaved
    batch, seq_len, _ = hidden_states.shape
    n_heads, head_dim, rope_dim = indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim

    keys = indexer.k_norm(indexer.wk(hidden_states))  # [B, S, D], module dtype
    keys = torch.cat([rope(keys[..., :rope_dim], cos, sin), keys[..., rope_dim:]], dim=-1)

    if query_rows is not None:
        q_resid, hidden_states = q_resid[:, query_rows], hidden_states[:, query_rows]
        cos, sin = cos[:, query_rows], sin[:, query_rows]
    queries = indexer.wq_b(q_resid).view(batch, q_resid.shape[1], n_heads, head_dim)
    q_rot = rope(queries[..., :rope_dim], cos.unsqueeze(2), sin.unsqueeze(2))
    queries = torch.cat([q_rot, queries[..., rope_dim:]], dim=-1)
    raw_weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype))
    return keys.float(), queries.float(), effective_head_weights(raw_weights, n_heads, head_dim)


def v4_scorer_tensors(
    scorer: torch.nn.Module,
    queries: torch.Tensor,
    compressed_keys: torch.Tensor,
    hidden_states: torch.Tensor,
    query_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys, queries and head weights of a V4 indexer from the inputs of its ``DeepseekV4IndexerScorer``.

    Parameters
    ----------
    queries : [B, S, H, D] after RoPE; compressed_keys : [B, T, D] (every entry so far, after norm and
    RoPE); hidden_states : [B, S, hidden]

    Returns
    -------
    keys [B, T, D] float32, queries [B, s, H, D] float32, head_weights [B, s, H] float32 (effective).
    """
    if query_rows is not None:
        queries, hidden_states = queries[:, query_rows], hidden_states[:, query_rows]
    n_heads, head_dim = queries.shape[-2], queries.shape[-1]
    raw = scorer.weights_proj(hidden_states)
    return compressed_keys.float(), queries.float(), effective_head_weights(raw, n_heads, head_dim)


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def find_indexers(model: torch.nn.Module, geometry: IndexerGeometry) -> dict[int, torch.nn.Module]:
    """Map layer id -> indexer module (``*Indexer`` class) for every layer ``geometry`` (an
    :class:`dsaindex.geometry.IndexerGeometry`) lists."""
    found: dict[int, torch.nn.Module] = {}
    for name, module in model.named_modules():
        cls = type(module).__name__
        if not cls.endswith("Indexer"):
            continue
        match = _LAYER_RE.search(name + ".")
        if match:
            found[int(match.group(1))] = module
    missing = [i for i in geometry.indexer_layers if i not in found]
    if missing:
        raise RuntimeError(f"indexer modules not found for layers {missing}; found {sorted(found)}")
    return {i: found[i] for i in geometry.indexer_layers}


def cache_argument(module: torch.nn.Module) -> str:
    """The keyword a transformers model's forward takes its KV cache by: transformers renamed
    ``past_key_values`` to ``cache`` (5.2x); this is whichever the installed version takes."""
    import inspect

    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"
