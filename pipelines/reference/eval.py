"""Evaluation of the reference DSA checkpoint on held-out text, through the transformers forward itself.

Two measurements:

* **bits per byte**, dense (every indexer keeps ``index_topk >= context`` keys, i.e. dense attention) vs
  sparse (``index_topk`` = the checkpoint's top-k): the mean next-token cross-entropy in bits over every
  predicted token of consecutive held-out windows (BOS, then ``seq_len - 1`` bytes; the EOS separators
  between files count as tokens too).
* **attention-mass coverage** at several context lengths ``L``: run the model dense on windows of ``L``
  tokens; in every layer, for the last ``query_count`` queries of each window, the main attention
  distribution (probabilities summed over heads, L1-normalized) is compared with the indexer's top-k
  over the causal prefix, both recomputed from the layer's own inputs (captured with forward
  pre-hooks). Coverage is the attention mass inside the indexer's top-k. For context, the same mass
  is given for the best possible k keys (``oracle``) and for the most recent k keys (``window``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsaindex.indexer import mla_qkv, set_index_topk
from dsaindex.pipelines.capture.presets import BOS_ID
from dsaindex.pipelines.capture.tokens import checkpoint_streams, heldout_windows
from dsaindex.pipelines.reference.forward import ROPE_LAYOUT, load_checkpoint
from dsaindex.score import batched_index_scores

if TYPE_CHECKING:
    import torch

COVERAGE_CONTEXTS = (1024, 2048, 4096)


def coverage_contexts(seq_len: int) -> list[int]:
    """Context lengths of the coverage measurement: those of :data:`COVERAGE_CONTEXTS` up to ``seq_len``,
    or ``seq_len`` alone when it is shorter than all of them."""
    return [c for c in COVERAGE_CONTEXTS if c <= seq_len] or [seq_len]


def _autocast(device_type: str):
    import torch

    return torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=device_type == "cuda")


def bits_per_byte(model, input_ids, labels, index_topk: int, batch: int = 2) -> float:
    """Mean next-token loss in bits of ``model(input_ids)`` with every indexer keeping ``index_topk`` keys.

    input_ids, labels : [N, S] int64 on the model's device. The model's previous top-k is restored.
    """
    import torch
    import torch.nn.functional as F

    previous = model.config.index_topk
    set_index_topk(model, index_topk)
    total, count = 0.0, 0
    try:
        with torch.no_grad(), _autocast(input_ids.device.type):
            for start in range(0, input_ids.shape[0], batch):
                ids, lab = input_ids[start : start + batch], labels[start : start + batch]
                logits = model(input_ids=ids, use_cache=False).logits.float()
                nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab.reshape(-1), reduction="sum")
                total += float(nll)
                count += lab.numel()
    finally:
        set_index_topk(model, previous)
    return total / count / math.log(2)


def attention_coverage(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    topk: int,
    query_count: int = 256,
    batch: int = 2,
    query_block: int = 64,
) -> dict[str, Any]:
    """Main-attention mass covered by each layer's indexer top-``topk``, on dense forwards.

    Parameters
    ----------
    input_ids : [N, L] int64 windows on the model's device
    query_count : the last ``query_count`` query positions of every window are measured

    Returns
    -------
    ``{"coverage", "oracle", "window", "per_layer": {"coverage": [...], ...}, "context", "queries"}``
    with means over windows, queries and layers (per layer: means over windows and queries).
    """
    import torch

    from dsaindex.hooks import ModuleHooks
    from dsaindex.indexer import mla_indexer_tensors

    n, seq_len = input_ids.shape
    layers = model.model.layers
    captured: dict[tuple[str, int], dict[str, Any]] = {}
    inputs = ModuleHooks()  # each layer's attention and indexer inputs of the latest forward
    for i, layer in enumerate(layers):
        for kind, module in (("attn", layer.self_attn), ("index", layer.self_attn.indexer)):

            def keep(_module: Any, arguments: dict[str, Any], key: tuple[str, int] = (kind, i)) -> None:
                captured[key] = arguments

            inputs.register(module, pre=keep)

    sums = {key: [0.0] * len(layers) for key in ("coverage", "oracle", "window")}
    measured = 0
    nq = min(query_count, seq_len)
    rows = torch.arange(seq_len - nq, seq_len, device=input_ids.device)
    previous = model.config.index_topk
    set_index_topk(model, seq_len)  # dense forward
    try:
        for start in range(0, n, batch):
            ids = input_ids[start : start + batch]
            captured.clear()
            with torch.no_grad(), _autocast(ids.device.type):
                model(input_ids=ids, use_cache=False)
            with torch.no_grad():
                for i, layer in enumerate(layers):
                    attn = layer.self_attn
                    a = captured[("attn", i)]
                    x = a["hidden_states"].float()
                    cos, sin = (t.float() for t in a["position_embeddings"])
                    q, k, _, _ = mla_qkv(attn, x, cos, sin)
                    ix = captured[("index", i)]
                    icos, isin = (t.float() for t in ix["position_embeddings"])
                    keys, queries, weights = mla_indexer_tensors(
                        attn.indexer,
                        ROPE_LAYOUT,
                        ix["hidden_states"].float(),
                        ix["q_resid"].float(),
                        icos,
                        isin,
                        query_rows=rows,
                    )
                    for r0 in range(0, nq, query_block):
                        r = rows[r0 : r0 + query_block]
                        causal = torch.arange(seq_len, device=ids.device)[None, :] <= r[:, None]  # [c, L]
                        logits = torch.matmul(q[:, :, r], k.transpose(-1, -2)) * attn.scaling
                        p = torch.softmax(logits.masked_fill(~causal, -math.inf), dim=-1).mean(1)  # [B, c, L]
                        scores = batched_index_scores(
                            queries[:, r0 : r0 + query_block], keys, weights[:, r0 : r0 + query_block]
                        )
                        kk = min(topk, seq_len)
                        vals, idx = scores.masked_fill(~causal, -math.inf).topk(kk, dim=-1)
                        cover = p.gather(-1, idx).masked_fill(~torch.isfinite(vals), 0.0).sum(-1)
                        oracle = p.topk(kk, dim=-1).values.sum(-1)
                        recent = (
                            torch.arange(seq_len, device=ids.device)[None, :] > (r[:, None] - kk)
                        ) & causal
                        window = (p * recent).sum(-1)
                        sums["coverage"][i] += float(cover.sum())
                        sums["oracle"][i] += float(oracle.sum())
                        sums["window"][i] += float(window.sum())
            measured += ids.shape[0] * nq
    finally:
        set_index_topk(model, previous)
        inputs.remove()
    per_layer = {key: [v / measured for v in vals] for key, vals in sums.items()}
    out: dict[str, Any] = {key: sum(v) / len(v) for key, v in per_layer.items()}
    out.update({"per_layer": per_layer, "context": seq_len, "queries": measured, "topk": topk})
    return out


def evaluate(
    model: torch.nn.Module,
    heldout_stream: torch.Tensor,
    seq_len: int = 4096,
    topk: int = 256,
    bpb_windows: int = 32,
    coverage_windows: int = 8,
    contexts: Sequence[int] | None = None,
    query_count: int = 256,
    batch: int = 2,
    bos: int = BOS_ID,
    bytes_per_token: float = 1.0,
) -> dict[str, Any]:
    """Held-out bits per byte dense vs sparse and attention-mass coverage at each of ``contexts``
    (default: :func:`coverage_contexts`; lengths above ``seq_len`` are left out).

    heldout_stream : 1-D int tensor of held-out tokens on the model's device; ``bos`` the id each window
    starts with; ``bytes_per_token`` converts bits per token to bits per byte (1 for byte tokens).
    """
    contexts = coverage_contexts(seq_len) if contexts is None else contexts
    input_ids, labels = heldout_windows(heldout_stream, seq_len, bpb_windows, bos)
    if input_ids.shape[0] == 0:
        raise ValueError(
            f"held-out stream of {heldout_stream.numel()} tokens is shorter than one window of {seq_len}"
        )
    dense = bits_per_byte(model, input_ids, labels, index_topk=seq_len, batch=batch) / bytes_per_token
    sparse = bits_per_byte(model, input_ids, labels, index_topk=topk, batch=batch) / bytes_per_token
    result: dict[str, Any] = {
        "seq_len": seq_len,
        "topk": topk,
        "windows": int(input_ids.shape[0]),
        "tokens": int(labels.numel()),
        "bytes_per_token": bytes_per_token,
        "bits_per_byte": {"dense": dense, "sparse": sparse, "sparse_over_dense": sparse / dense},
        "coverage": {},
    }
    cov_ids, _ = heldout_windows(heldout_stream, seq_len, coverage_windows, bos)
    for ctx in contexts:
        if ctx > seq_len:
            continue
        result["coverage"][str(ctx)] = attention_coverage(
            model, cov_ids[:, :ctx].contiguous(), topk, query_count=query_count, batch=batch
        )
    longest = str(max(int(c) for c in result["coverage"])) if result["coverage"] else None
    result["checks"] = {
        "sparse_within_5pct_of_dense": sparse <= dense * 1.05,
        "coverage_at_longest_context": None if longest is None else result["coverage"][longest]["coverage"],
        "coverage_at_longest_context_ge_0.9": None
        if longest is None
        else result["coverage"][longest]["coverage"] >= 0.9,
    }
    return result


def evaluate_checkpoint(
    model: str,
    *,
    seq_len: int,
    topk: int | None,
    windows: int,
    coverage_windows: int,
    max_heldout_mb: float,
    heldout_percent: float,
    batch: int,
    device: str,
    corpus: Path | None = None,
) -> dict[str, Any]:
    """:func:`evaluate` of a saved checkpoint (``reference`` or a folder) on held-out data (``dsaindex
    reference eval``): for a byte-token checkpoint the held-out files of its training split, for one with
    its own tokenizer the held-out documents of ``corpus`` (the folder ``dsaindex reference corpus``
    wrote), in that corpus's tokens, bits per byte over its bytes per token. Such a checkpoint without
    ``corpus`` is refused (byte tokens would measure nothing). ``topk`` ``None`` takes the checkpoint's own.

    Returns the evaluation with ``model`` (the checkpoint folder) and ``heldout_files`` (byte tokens) or
    ``corpus`` added.
    """
    import torch

    from dsaindex.console import resolve_device
    from dsaindex.pipelines.capture.models import resolve_model_dir

    dev = resolve_device(device)
    path = resolve_model_dir(model)
    own = next((f for f in ("tokenizer.json", "tokenizer_config.json") if (path / f).is_file()), None)
    vocab_size = int(json.loads((path / "config.json").read_text())["vocab_size"])
    streams, vocab = checkpoint_streams(str(path), own, corpus, vocab_size, 0, int(max_heldout_mb * 1e6),
                                        heldout_percent=heldout_percent)
    heldout = torch.from_numpy(streams.heldout).to(dev)
    net = load_checkpoint(path, dev)
    topk = int(net.config.index_topk) if topk is None else topk
    result = evaluate(net, heldout, seq_len=seq_len, topk=topk, bpb_windows=windows,
                      coverage_windows=coverage_windows, batch=batch, bos=vocab.bos,
                      bytes_per_token=vocab.bytes_per_token)
    result["model"] = str(path)
    if corpus is not None:
        result["corpus"] = streams.info
    else:
        result["heldout_files"] = streams.info["heldout_files"]
    return result
