"""Writing a trained reference checkpoint: weights and config, its tokenizer, its loss curve."""

from __future__ import annotations

import math
from pathlib import Path

from dsaindex.indexer import set_index_topk
from dsaindex.pipelines.capture.tokens import Vocabulary


def save_checkpoint(model, out_dir: Path, index_topk: int) -> dict:
    """``config.json`` + ``model.safetensors`` (bf16, in shards of 15 MB at most; indexer ``weights_proj``
    kept fp32 as the class loads it), with ``index_topk`` in the config. Returns ``{"params", "safetensors_bytes"}``."""
    import copy

    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    clone = copy.deepcopy(model).cpu()
    clone.to(torch.bfloat16)
    for layer in clone.model.layers:
        layer.self_attn.indexer.weights_proj.float()
    set_index_topk(clone, index_topk)
    clone.config.use_cache = True
    # shards of at most 15 MB: small enough to travel back from a GPU machine one file at a time
    clone.save_pretrained(str(out_dir), safe_serialization=True, max_shard_size="15MB")
    size = sum(p.stat().st_size for p in out_dir.glob("model*.safetensors"))
    return {"params": sum(p.numel() for p in model.parameters()), "safetensors_bytes": size}


def save_tokenizer(vocab: Vocabulary, out_dir: Path) -> None:
    """The run's BPE tokenizer as transformers loads it beside the weights (``tokenizer.json`` and a
    ``tokenizer_config.json`` naming its BOS / EOS / PAD tokens), so ``AutoTokenizer`` and capture
    separate documents with the right EOS."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(vocab.tokenizer), bos_token="<|bos|>", eos_token="<|eos|>",
                                  pad_token="<|pad|>")
    tok.save_pretrained(str(out_dir))


def plot_loss_curve(history: list[dict], path: Path) -> None:
    """Loss curve: LM loss in bits per byte (dense and sparse stages) and indexer KL (warm-up, sparse)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    colors = {"dense": "tab:blue", "warmup": "tab:orange", "sparse": "tab:green"}
    for stage in ("dense", "warmup", "sparse"):
        rows = [r for r in history if r["stage"] == stage]
        lm = [(r["step"], r["lm"] / math.log(2)) for r in rows if r["lm"] is not None]
        kl = [(r["step"], r["kl"]) for r in rows if r["kl"] is not None]
        if lm:
            ax1.plot(*zip(*lm, strict=True), color=colors[stage], label=f"{stage}: train LM loss", lw=0.8)
        if kl:
            ax2.plot(*zip(*kl, strict=True), color=colors[stage], label=f"{stage}: indexer KL", lw=0.8)
    ax1.set_ylabel("bits per byte (train batch)")
    ax1.set_ylim(bottom=0)
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.set_ylabel("KL (nats per query, mean over layers)")
    ax2.set_yscale("log")
    ax2.set_xlabel("optimizer step")
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.suptitle("Reference DSA checkpoint: dense pre-training -> indexer warm-up -> sparse training")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
