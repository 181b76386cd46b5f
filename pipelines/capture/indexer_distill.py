"""``dsaindex train indexer-distill``: indexer-only distillation for a cross-layer reuse plan.

Under a reuse plan (IndexCache) a kept layer's indexer chooses the top-k for itself and for every layer
that reuses it, but it was trained (the DSA warm-up) to predict its own layer's attention only.
Distillation retrains only the kept layers' indexer weights, the model frozen, so that each predicts
the union of the attention of the layers it serves: the loss of kept layer K is

    KL( mean over the layers l that use K of p_l  ||  softmax(scores_K) )

over each query's causal prefix, where p_l is layer l's attention averaged over heads, from a dense
forward of the frozen model (the warm-up's setting: dense attention, so the targets do not depend on
the selection being trained).

The result is a checkpoint overlay: ``indexer_overlay.safetensors`` (the kept layers' indexer tensors)
and ``overlay.json`` (lineage: the plan's bundle, retention and method, and the base checkpoint's
fingerprint; the metrics). :func:`apply_overlay` loads it onto that checkpoint and no other.

Quality is bits per byte on held-out windows with sparse attention under the plan
(:func:`plan_bits_per_byte`: each layer attends the top-k chosen by the indexer of its source layer):
the unmodified model (every layer its own indexer), the plan with the original indexers, the plan with
the distilled ones.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

OVERLAY_WEIGHTS = "indexer_overlay.safetensors"
OVERLAY_MANIFEST = "overlay.json"


def _layer_tensors(layer, h, cos, sin):
    from dsaindex.indexer import mla_qkv

    attn = layer.self_attn
    x = layer.input_layernorm(h)
    q, k, v, q_resid = mla_qkv(attn, x, cos, sin)
    return attn, x, q, k, v, q_resid


def _index_scores(indexer, x, q_resid, cos, sin):
    """[B, S, S] float32 indexer scores of every query against every key (causality applied by callers)."""
    from dsaindex.indexer import mla_indexer_tensors
    from dsaindex.score import batched_index_scores

    keys, queries, weights = mla_indexer_tensors(indexer, "half_split_head", x, q_resid, cos, sin)  # V3.2 classes (mla_qkv)
    return batched_index_scores(queries, keys, weights)


def _prelude(model, input_ids):
    import torch

    core = model.model
    b, s = input_ids.shape
    h = core.embed_tokens(input_ids)
    position_ids = torch.arange(s, device=input_ids.device)[None, :].expand(b, -1)
    cos, sin = core.rotary_emb(h, position_ids)
    causal = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).tril()
    return core, h, cos, sin, causal


def plan_forward_loss(model, input_ids, labels, sources: list[int], topk: int) -> tuple[float, list[float]]:
    """Sparse attention under a plan: layer ``i`` attends the top-``topk`` keys of each query's causal
    prefix scored by the indexer of layer ``sources[i]`` (``sources[i] == i``: its own; an earlier layer
    that also attends another's, as under the MLI lag, :func:`dsaindex.artifacts.kinds.lagged_sources`).
    Returns (the mean
    next-token cross-entropy in nats, per layer the share of the top-k its own indexer would choose that
    the one it attends keeps: the retained recall, 1 for a kept layer). No gradient."""
    import torch
    import torch.nn.functional as F

    def top_mask(scores):
        idx = scores.masked_fill(~causal, -math.inf).topk(min(topk, s), dim=-1).indices
        return torch.zeros(b, s, s, dtype=torch.bool, device=h.device).scatter_(-1, idx, True) & causal

    with torch.no_grad():
        core, h, cos, sin, causal = _prelude(model, input_ids)
        b, s = input_ids.shape
        masks: dict[int, torch.Tensor] = {}
        wanted = set(sources)
        recall = []
        for i, layer in enumerate(core.layers):
            attn, x, q, k, v, q_resid = _layer_tensors(layer, h, cos, sin)
            src = sources[i]
            if src != i and src not in masks:
                raise ValueError(f"layer {i} reuses layer {src}, which is not an earlier kept layer")
            own = top_mask(_index_scores(attn.indexer, x, q_resid, cos, sin))
            if i in wanted:  # a kept layer: it or later layers attend its selection (the MLI lag: later only)
                masks[i] = own
            recall.append(float((own & masks[src]).sum()) / max(1, int(own.sum())))
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=masks[src][:, None], scale=attn.scaling)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(b, s, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = model.lm_head(core.norm(h)).float()
        return float(F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))), recall


def plan_quality(model, input_ids, labels, sources: list[int], topk: int, batch: int = 2,
                 bytes_per_token: float = 1.0) -> dict:
    """Held-out bits per byte (bits per token over ``bytes_per_token``: 1 for byte tokens) and per-layer
    retained recall under ``sources``, over windows ``input_ids`` / ``labels`` [N, S]."""
    total, count, recall, windows = 0.0, 0, [0.0] * len(sources), 0
    for start in range(0, input_ids.shape[0], batch):
        ids, lab = input_ids[start : start + batch], labels[start : start + batch]
        loss, kept = plan_forward_loss(model, ids, lab, sources, topk)
        total += loss * lab.numel()
        count += lab.numel()
        recall = [a + b * ids.shape[0] for a, b in zip(recall, kept, strict=True)]
        windows += ids.shape[0]
    return {"bits_per_byte": round(total / count / math.log(2) / bytes_per_token, 5),
            "retained_recall": [round(r / windows, 4) for r in recall]}


def served_by(sources: list[int]) -> dict[int, list[int]]:
    """Kept layer -> the layers that use its selection (itself first)."""
    out: dict[int, list[int]] = {}
    for layer, src in enumerate(sources):
        out.setdefault(src, []).append(layer)
    return out


def distill_loss(model, input_ids, sources: list[int], objective: str = "dense", topk: int | None = None):
    """Mean over kept layers of the per-query KL(union target || softmax(indexer scores)) over each
    query's causal prefix; gradient only through the kept layers' indexers.

    ``objective``: ``dense``, the target is the served layers' mean attention over the whole prefix;
    ``selected``, that target restricted to the union of the served layers' own top-``topk`` keys (as
    their own indexers choose them) and renormalized: the kept indexer is pushed to put its mass, hence
    its top-k, on the keys the layers it serves would have selected."""
    if objective not in ("dense", "selected"):
        raise ValueError(f"objective {objective!r}: pass 'dense' or 'selected'")
    import torch
    import torch.nn.functional as F

    serving = served_by(sources)
    core, h, cos, sin, causal = _prelude(model, input_ids)
    b, s = input_ids.shape
    targets: dict[int, torch.Tensor] = {}
    union: dict[int, torch.Tensor] = {}
    inputs: dict[int, tuple] = {}
    with torch.no_grad():  # the frozen model, dense: every layer's head-averaged attention
        for i, layer in enumerate(core.layers):
            attn, x, q, k, v, q_resid = _layer_tensors(layer, h, cos, sin)
            if i in serving:
                inputs[i] = (attn.indexer, x, q_resid)
            logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * attn.scaling
            p = torch.softmax(logits.masked_fill(~causal, -math.inf), dim=-1).mean(1)  # [B, S, S]
            targets[sources[i]] = targets.get(sources[i], 0) + p / len(serving[sources[i]])
            if objective == "selected":
                own = _index_scores(attn.indexer, x, q_resid, cos, sin).masked_fill(~causal, -math.inf)
                idx = own.topk(min(topk or s, s), dim=-1).indices
                chosen = torch.zeros(b, s, s, dtype=torch.bool, device=h.device).scatter_(-1, idx, True) & causal
                union[sources[i]] = union.get(sources[i], chosen) | chosen
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(b, s, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
    losses = []
    for kept, (indexer, x, q_resid) in inputs.items():
        scores = _index_scores(indexer, x, q_resid, cos, sin)
        log_q = F.log_softmax(scores.masked_fill(~causal, -math.inf), dim=-1).masked_fill(~causal, 0.0)
        p = targets[kept]
        if objective == "selected":
            p = p * union[kept]
            p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
        kl = (p * (torch.log(p.clamp_min(1e-30)) - log_q)).masked_fill(~causal, 0.0).sum(-1)
        losses.append(kl.mean())
    return torch.stack(losses).mean()


def kept_indexer_parameters(model, kept: list[int]) -> dict[str, Any]:
    """name -> parameter of the indexers of the ``kept`` layers."""
    out = {}
    for layer in kept:
        for name, param in model.model.layers[layer].self_attn.indexer.named_parameters():
            out[f"model.layers.{layer}.self_attn.indexer.{name}"] = param
    return out


def distill(model, sources: list[int], train_stream, steps: int, batch: int, seq_len: int, lr: float,
            seed: int = 0, progress: Callable[[int, int, float], None] | None = None, objective: str = "dense",
            topk: int | None = None, bos: int | None = None) -> list[dict]:
    """AdamW on the kept layers' indexer parameters only (everything else frozen); returns the loss
    history (one entry per step: step, kl, seconds). ``bos``: the vocabulary's begin token (default: the
    byte vocabulary's)."""
    import torch

    from dsaindex.pipelines.capture.presets import BOS_ID
    from dsaindex.pipelines.capture.tokens import sample_windows

    kept = sorted(set(sources))
    params = kept_indexer_parameters(model, kept)
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params.values():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(list(params.values()), lr=lr, weight_decay=0.0)
    gen = torch.Generator(device=train_stream.device).manual_seed(seed)
    history = []
    start = time.perf_counter()
    model.train(False)
    for step in range(steps):
        ids, _ = sample_windows(train_stream, batch, seq_len, gen, BOS_ID if bos is None else bos)
        loss = distill_loss(model, ids, sources, objective, topk)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        for g in opt.param_groups:  # linear decay to 10%
            g["lr"] = lr * (1.0 - 0.9 * step / max(1, steps - 1))
        opt.step()
        history.append({"step": step, "kl": round(float(loss.detach()), 5), "seconds": round(time.perf_counter() - start, 2)})
        if progress:
            progress(step + 1, steps, float(loss.detach()))
    for p in params.values():
        p.requires_grad_(False)
    return history


def write_overlay(model, kept: list[int], out: Path, lineage: dict, metrics: dict) -> dict:
    """Write the kept layers' indexer tensors (safetensors) and the manifest; returns the manifest."""
    import hashlib

    from safetensors.torch import save_file

    from dsaindex.errors import DsaIndexError

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise DsaIndexError(f"{out} exists and is not empty.", "pass a new --out folder.")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().cpu().contiguous() for name, p in kept_indexer_parameters(model, kept).items()}
    weights = out / OVERLAY_WEIGHTS
    partial = out / (OVERLAY_WEIGHTS + ".partial")
    save_file(tensors, str(partial))
    partial.replace(weights)
    manifest = {"schema": "dsaindex.indexer-overlay/1", "kept_layers": kept, "tensors": sorted(tensors),
                "weights_sha256": hashlib.sha256(weights.read_bytes()).hexdigest(), "lineage": lineage,
                "metrics": metrics}
    (out / OVERLAY_MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def apply_overlay(model, overlay: Path, base_fingerprint: dict) -> dict:
    """Load an overlay's indexer tensors onto ``model``, which must be the checkpoint it was trained from
    (``base_fingerprint``: its config and weights digests). Returns the overlay's manifest. Raises
    :class:`dsaindex.errors.DsaIndexError` on another checkpoint, a missing or altered file, or a
    tensor the model does not have / of another shape."""
    import hashlib

    import torch
    from safetensors.torch import load_file

    from dsaindex.artifacts.fingerprint import configs_match
    from dsaindex.errors import DsaIndexError

    overlay = Path(overlay)
    manifest_path, weights = overlay / OVERLAY_MANIFEST, overlay / OVERLAY_WEIGHTS
    if not manifest_path.is_file() or not weights.is_file():
        raise DsaIndexError(f"{overlay} is not an indexer overlay (it needs {OVERLAY_MANIFEST} and {OVERLAY_WEIGHTS}).",
                            "pass the folder `dsaindex train indexer-distill --out` wrote.")
    manifest = json.loads(manifest_path.read_text())
    if hashlib.sha256(weights.read_bytes()).hexdigest() != manifest.get("weights_sha256"):
        raise DsaIndexError(f"{weights} does not match the digest in {manifest_path}.",
                            "the overlay was altered or partly copied: distill it again.")
    base = manifest["lineage"]["base_checkpoint"]
    for key in ("config_digest", "weights_digest"):
        agree = key == "config_digest" and configs_match(base.get(key), base.get("config_fields"),
                                                         base_fingerprint.get(key), base_fingerprint.get("config_fields"))
        if base.get(key) != base_fingerprint.get(key) and not agree:
            raise DsaIndexError(f"The overlay was distilled from another checkpoint ({key} {base.get(key)} vs the "
                                f"served {base_fingerprint.get(key)}).",
                                "apply it to the checkpoint it names in overlay.json, or distill one for this one.")
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in load_file(str(weights)).items():
            if name not in named or named[name].shape != tensor.shape:
                raise DsaIndexError(f"The overlay's tensor {name} {tuple(tensor.shape)} has no counterpart in the model.",
                                    "apply it to the checkpoint it was distilled from.")
            named[name].copy_(tensor.to(named[name].device, named[name].dtype))
    return manifest
