"""The DSA forward math, recomputed from a transformers model's own modules: the one home of it.

Capture hooks see an indexer's inputs; these functions turn them into the tensors the exact score
(:mod:`dsaindex.score`) consumes: keys as scored (after norm and RoPE), queries (after RoPE) and
effective head weights. Tests check that scoring these reproduces the module's own top-k. Beside them:
both RoPE layouts, the MLA main-attention tensors (:func:`mla_qkv`), the top-k mask sparse attention
attends (:func:`topk_allowed`) and the indexer's top-k setting (:func:`set_index_topk`), which the
reference trainer, indexer distillation, the gates and the serving commands share.
"""

from __future__ import annotations

import math
import re

import torch

from dsaindex.geometry import IndexerGeometry
from dsaindex.score import batched_index_scores, effective_head_weights


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


def mla_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """MLA's main-attention RoPE (transformers' ``apply_rotary_pos_emb_interleave``): pairs ``(2i, 2i + 1)``
    rotated, the output in half-split order (unlike :func:`rope_interleaved`, which keeps the pairs
    interleaved). ``x`` [B, heads, S, r]; ``cos``/``sin`` [B, S, r] (angles repeated twice)."""
    c = cos[..., : cos.shape[-1] // 2].unsqueeze(1)
    s = sin[..., : sin.shape[-1] // 2].unsqueeze(1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def mla_qkv(attn: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Main-attention tensors of one ``DeepseekV32Attention`` for its (normed) input.

    Parameters
    ----------
    x : [B, S, hidden] (the layer's ``input_layernorm`` output); cos, sin : [B, S, qk_rope_head_dim]

    Returns
    -------
    q [B, nh, S, qk_head_dim], k [B, nh, S, qk_head_dim], v [B, nh, S, v_head_dim],
    q_resid [B, S, q_lora_rank] (the indexer's query input).
    """
    b, s, _ = x.shape
    nope, rope_d, vd = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
    q = attn.q_b_proj(q_resid).view(b, s, -1, nope + rope_d).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [nope, rope_d], dim=-1)
    kv_pass, k_rot = torch.split(attn.kv_a_proj_with_mqa(x), [attn.kv_lora_rank, rope_d], dim=-1)
    kv = attn.kv_b_proj(attn.kv_a_layernorm(kv_pass)).view(b, s, -1, nope + vd).transpose(1, 2)
    k_nope, v = torch.split(kv, [nope, vd], dim=-1)
    q_rot = mla_rope(q_rot, cos, sin)
    k_rot = mla_rope(k_rot.view(b, 1, s, rope_d), cos, sin)
    q = torch.cat([q_pass, q_rot], dim=-1)
    k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
    return q, k, v, q_resid


def topk_allowed(indexer: torch.nn.Module, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, topk: int, query_chunk: int = 256,
                 rope_layout: str = "half_split_head") -> torch.Tensor:
    """[B, S, S] bool: the keys each query may attend with top-``topk`` sparse attention (the indexer's
    top-k of its causal prefix, :func:`dsaindex.score.batched_index_scores`), computed without gradients,
    ``query_chunk`` queries at a time (long contexts). ``x`` [B, S, hidden] and ``q_resid`` as
    :func:`mla_indexer_tensors` takes them."""
    b, s, _ = x.shape
    with torch.no_grad():
        keys, queries, weights = mla_indexer_tensors(indexer, rope_layout, x, q_resid, cos, sin)
        allowed = torch.zeros(b, s, s, dtype=torch.bool, device=x.device)
        positions = torch.arange(s, device=x.device)
        for s0 in range(0, s, query_chunk):
            s1 = min(s, s0 + query_chunk)
            scores = batched_index_scores(queries[:, s0:s1], keys[:, :s1], weights[:, s0:s1])
            causal = positions[:s1][None, :] <= positions[s0:s1][:, None]
            idx = scores.masked_fill(~causal, -math.inf).topk(min(topk, s1), dim=-1).indices
            chunk = torch.zeros(b, s1 - s0, s1, dtype=torch.bool, device=x.device).scatter_(-1, idx, True)
            allowed[:, s0:s1, :s1] = chunk & causal
    return allowed


def set_index_topk(model: torch.nn.Module, k: int) -> None:
    """Keys each indexer of a transformers DSA model keeps: the config value and every indexer module's
    cached copy (``model.model.layers[i].self_attn.indexer.index_topk``)."""
    model.config.index_topk = int(k)
    for layer in model.model.layers:
        layer.self_attn.indexer.index_topk = int(k)


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
