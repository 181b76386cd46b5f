"""The reference trainer's model and training forward.

The training forward runs the model's own submodules (projections, norms, MLPs, rotary embedding) in the
same order as ``DeepseekV32Attention.forward``, but calls fused attention kernels and a chunked,
differentiable indexer score (:func:`dsaindex.score.batched_index_scores`; the DSA math it shares with
capture and serving is in :mod:`dsaindex.indexer`). Tests check that it reproduces the transformers
forward. The indexer losses (:func:`indexer_kl_layer`, :func:`indexer_kl_sampled`) fit each layer's
indexer distribution ``softmax_t(score[s, t])`` to its main attention.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsaindex.indexer import mla_indexer_tensors, mla_qkv, topk_allowed
from dsaindex.pipelines.capture.presets import model_class
from dsaindex.score import batched_index_scores

ROPE_LAYOUT = "half_split_head"  # the reference checkpoint is a DeepSeek-V3.2 class


def build_model(config: Any, seed: int = 0, device: str = "cpu") -> Any:
    """A freshly initialized ``DeepseekV32ForCausalLM`` (fp32) for ``config``
    (:func:`dsaindex.pipelines.capture.presets.reference_config`)."""
    import torch

    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class("deepseek_v32")(config)
    return model.float()


def load_checkpoint(path: str | Path, device: str = "cpu") -> Any:
    """``DeepseekV32ForCausalLM.from_pretrained(path, local_files_only=True)`` in fp32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
    return model.to(device).eval()


def is_indexer_param(name: str) -> bool:
    return ".self_attn.indexer." in name


def indexer_parameters(model) -> list:
    """Parameters of every layer's ``self_attn.indexer`` (wq_b, wk, k_norm, weights_proj)."""
    return [p for n, p in model.named_parameters() if is_indexer_param(n)]


def main_parameters(model) -> list:
    """Every parameter that is not an indexer's."""
    return [p for n, p in model.named_parameters() if not is_indexer_param(n)]


def indexer_kl_layer(
    indexer, x, q_resid, cos, sin, q, k, scaling: float, topk: int | None, query_chunk: int = 256
):
    """KL loss of one layer's indexer against its main attention, and the top-k selection mask.

    Parameters
    ----------
    indexer : the layer's ``DeepseekV32Indexer``
    x : [B, S, hidden] indexer hidden-state input; q_resid : [B, S, q_lora_rank]; both are detached here
    cos, sin : [B, S, rope_dim]
    q, k : [B, nh, S, qk_head_dim] main-attention queries / keys (used without gradient)
    topk : ``None`` for the dense warm-up (KL over the whole causal prefix), else the number of keys
        kept per query (KL over the selected set; the set is returned as the attention mask)
    query_chunk : queries per step (bounds the [B, chunk, H, T] intermediate; each chunk is
        recomputed in backward)

    Returns
    -------
    (kl: scalar tensor, mean over queries of KL(p_main || softmax(score)); allowed: [B, S, S] bool
    mask of the keys each query may attend (top-k within its causal prefix), or ``None`` when dense).
    """
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    b, s, _ = x.shape
    keys, queries, weights = mla_indexer_tensors(indexer, ROPE_LAYOUT, x.detach(), q_resid.detach(), cos, sin)
    allowed_full = torch.zeros(b, s, s, dtype=torch.bool, device=x.device) if topk is not None else None
    kl_sum = x.new_zeros((), dtype=torch.float32)
    q_det, k_det = q.detach(), k.detach()
    positions = torch.arange(s, device=x.device)
    for s0 in range(0, s, query_chunk):
        s1 = min(s, s0 + query_chunk)
        t = s1  # keys beyond the chunk's last query are never visible
        if torch.is_grad_enabled():
            scores = checkpoint(
                batched_index_scores, queries[:, s0:s1], keys[:, :t], weights[:, s0:s1], use_reentrant=False
            )
        else:
            scores = batched_index_scores(queries[:, s0:s1], keys[:, :t], weights[:, s0:s1])  # [B, c, t]
        causal = positions[:t][None, :] <= positions[s0:s1][:, None]  # [c, t]
        with torch.no_grad():
            if topk is None:
                allowed = causal.expand(b, -1, -1)
            else:
                kk = min(topk, t)
                idx = scores.detach().masked_fill(~causal, -math.inf).topk(kk, dim=-1).indices
                allowed = torch.zeros(b, s1 - s0, t, dtype=torch.bool, device=x.device).scatter_(
                    -1, idx, True
                )
                allowed &= causal
                allowed_full[:, s0:s1, :t] = allowed
            logits = (
                torch.matmul(q_det[:, :, s0:s1].float(), k_det[:, :, :t].float().transpose(-1, -2)) * scaling
            )
            p = torch.softmax(logits.masked_fill(~allowed[:, None], -math.inf), dim=-1).mean(1)  # [B, c, t]
            log_p = torch.log(p.clamp_min(1e-30))
        log_q = F.log_softmax(scores.masked_fill(~allowed, -math.inf), dim=-1).masked_fill(~allowed, 0.0)
        kl = (p * (log_p - log_q)).masked_fill(~allowed, 0.0).sum(-1)  # [B, c]
        kl_sum = kl_sum + kl.sum()
    return kl_sum / (b * s), allowed_full


def indexer_kl_sampled(indexer, x, q_resid, cos, sin, q, k, scaling: float, rows, allowed=None):
    """KL of one layer's indexer against its main attention at the query positions ``rows`` [n] only
    (sorted, int64): what makes the indexer losses of a 32K window fit. ``allowed`` [B, S, S] (sparse
    training) restricts both distributions to each query's selected keys; None: the causal prefix.
    Returns the mean KL over the sampled queries (a scalar with gradients into the indexer only)."""
    import torch
    import torch.nn.functional as F

    b = x.shape[0]
    t = int(rows[-1]) + 1  # keys past the last sampled query are never visible
    keys, queries, weights = mla_indexer_tensors(indexer, ROPE_LAYOUT, x.detach(), q_resid.detach(), cos, sin,
                                                 query_rows=rows)
    scores = batched_index_scores(queries, keys[:, :t], weights)  # [B, n, t]
    visible = torch.arange(t, device=x.device)[None, :] <= rows[:, None]  # [n, t]
    mask = visible.expand(b, -1, -1) if allowed is None else allowed[:, rows, :t] & visible
    with torch.no_grad():
        logits = torch.matmul(q.detach()[:, :, rows].float(), k.detach()[:, :, :t].float().transpose(-1, -2)) * scaling
        p = torch.softmax(logits.masked_fill(~mask[:, None], -math.inf), dim=-1).mean(1)  # [B, n, t]
        log_p = torch.log(p.clamp_min(1e-30))
    log_q = F.log_softmax(scores.masked_fill(~mask, -math.inf), dim=-1).masked_fill(~mask, 0.0)
    return (p * (log_p - log_q)).masked_fill(~mask, 0.0).sum(-1).mean()


def chunked_attention(q, k, v, scale: float, allowed=None, chunk: int = 2048):
    """Causal (or ``allowed`` [B, S, S]-masked) attention over query chunks of ``chunk`` rows, each one
    recomputed in backward: a 32K window's masked attention without a [B, heads, S, S] intermediate."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    s = q.shape[2]
    positions = torch.arange(s, device=q.device)
    outs = []
    for s0 in range(0, s, chunk):
        s1 = min(s, s0 + chunk)
        if allowed is None:
            mask = (positions[:s1][None, :] <= positions[s0:s1][:, None])[None, None]
        else:
            mask = allowed[:, None, s0:s1, :s1]
        args = (q[:, :, s0:s1], k[:, :, :s1], v[:, :, :s1])
        if torch.is_grad_enabled():
            outs.append(checkpoint(F.scaled_dot_product_attention, *args, attn_mask=mask, scale=scale,
                                   use_reentrant=False))
        else:
            outs.append(F.scaled_dot_product_attention(*args, attn_mask=mask, scale=scale))
    return torch.cat(outs, dim=2)


def sampled_rows(seq_len: int, count: int, generator, device) -> Any:
    """``count`` distinct query positions of a window, sorted (int64), drawn uniformly; always including
    the last (the longest prefix)."""
    import torch

    if count >= seq_len:
        return torch.arange(seq_len, device=device)
    g_dev = getattr(generator, "device", torch.device("cpu"))
    picks = torch.randperm(seq_len - 1, generator=generator, device=g_dev)[: count - 1].to(device)
    return torch.cat([picks.sort().values, torch.tensor([seq_len - 1], device=device)])


@dataclass
class ForwardResult:
    """Losses of one training forward: ``lm`` (mean next-token cross-entropy, nats), ``kl`` (mean over
    layers of the per-query indexer KL), ``task`` (mean cross-entropy of the passkey answer tokens) and
    ``objective`` (the LM loss minimized: ``lm`` with the answer tokens weighted); each ``None`` when the
    mode or batch does not compute it."""

    lm: Any = None
    kl: Any = None
    task: Any = None
    objective: Any = None


def run_layers(model, input_ids, attend: Callable[..., Any]):
    """The decoder stack of a ``DeepseekV32ForCausalLM`` as its forward runs it, with each layer's attention
    chosen by the caller: ``attend(i, attn, x, q, k, v, q_resid, cos, sin)`` returns the attention output
    [B, heads, S, v_dim] of layer ``i`` (``x`` its normed input, ``q``/``k``/``v`` from :func:`mla_qkv`), or
    None to stop there. Returns the last hidden state [B, S, hidden] (before the final norm), or None when
    stopped."""
    import torch

    core = model.model
    b, s = input_ids.shape
    h = core.embed_tokens(input_ids)
    position_ids = torch.arange(s, device=input_ids.device)[None, :].expand(b, -1)
    cos, sin = core.rotary_emb(h, position_ids)
    for i, layer in enumerate(core.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q, k, v, q_resid = mla_qkv(attn, x, cos, sin)
        o = attend(i, attn, x, q, k, v, q_resid, cos, sin)
        if o is None:
            return None
        h = h + attn.o_proj(o.transpose(1, 2).reshape(b, s, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h


def training_forward(model, input_ids, labels, mode: str, topk: int | None = None, query_chunk: int = 256,
                     kl_rows=None, attn_chunk: int | None = None, answer=None, answer_weight: float = 1.0):
    """One forward pass of the recipe.

    Parameters
    ----------
    model : ``DeepseekV32ForCausalLM``
    input_ids, labels : [B, S] int64
    mode : ``dense`` (LM loss, dense causal attention), ``warmup`` (indexer KL over the causal prefix; the
        main model's output and LM loss are not computed), ``sparse`` (LM loss with top-``topk`` sparse
        attention + indexer KL over the selected set)
    kl_rows : [n] sorted query positions: the indexer KL is computed at these queries only
        (:func:`indexer_kl_sampled`; long windows), the top-k for every query without gradients
    attn_chunk : main attention over query chunks of this many rows (:func:`chunked_attention`), so a
        sparse 32K window needs no [B, heads, S, S] intermediate
    answer : [B, S] bool, the labels that are passkey answers (:mod:`reference_tasks`); their
        cross-entropy is reported as ``task`` and weighs ``answer_weight`` times a token in ``objective``
    """
    import torch
    import torch.nn.functional as F

    assert mode in ("dense", "warmup", "sparse"), mode
    if mode == "sparse":
        assert topk is not None
    kls = []
    n_layers = len(model.model.layers)

    def attend(i, attn, x, q, k, v, q_resid, cos, sin):
        if mode == "dense":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling)
        if mode == "warmup":
            if kl_rows is not None:
                kl = indexer_kl_sampled(attn.indexer, x, q_resid, cos, sin, q, k, attn.scaling, kl_rows)
            else:
                kl, _ = indexer_kl_layer(attn.indexer, x, q_resid, cos, sin, q, k, attn.scaling, None, query_chunk)
            kls.append(kl)
            if i == n_layers - 1:
                return None  # the warm-up needs no output
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling)
        if kl_rows is not None:
            allowed = topk_allowed(attn.indexer, x.detach(), q_resid.detach(), cos, sin, topk, query_chunk)
            kl = indexer_kl_sampled(attn.indexer, x, q_resid, cos, sin, q, k, attn.scaling, kl_rows, allowed)
        else:
            kl, allowed = indexer_kl_layer(attn.indexer, x, q_resid, cos, sin, q, k, attn.scaling, topk, query_chunk)
        kls.append(kl)
        if attn_chunk:
            return chunked_attention(q, k, v, attn.scaling, allowed, attn_chunk)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=attn.scaling)

    h = run_layers(model, input_ids, attend)
    result = ForwardResult(kl=torch.stack(kls).mean() if kls else None)
    if mode != "warmup":
        logits = model.lm_head(model.model.norm(h)).float()
        ce = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        result.lm = result.objective = ce.mean()
        if answer is not None and bool(answer.any()):
            mask = answer.reshape(-1)
            result.task = ce[mask].mean()
            weights = 1.0 + (answer_weight - 1.0) * mask.float()
            result.objective = (ce * weights).sum() / weights.sum()
    return result
