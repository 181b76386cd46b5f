"""``MODEL_CARD.md`` of the reference DSA checkpoint, written from its ``metrics.json`` dictionary.

:func:`dsaindex.pipelines.reference_train.train_reference` assembles the metrics (model, data, training
stages with the lineage of earlier runs, held-out evaluation, machine, command) and writes both files;
this module only turns the metrics into the card's text.
"""

from __future__ import annotations

from typing import Any


def model_card(metrics: dict[str, Any]) -> str:
    """``MODEL_CARD.md`` text from a ``metrics.json`` dictionary."""
    m, d, t = metrics["model"], metrics["data"], metrics["training"]
    cfg = m["config"]
    lines = [
        "# dsaindex reference DSA checkpoint",
        "",
        "A small `DeepseekV32ForCausalLM` (transformers) trained from scratch on byte-level Python source",
        "with DeepSeek-V3.2's lightning-indexer recipe: dense pre-training, dense indexer warm-up (KL to the",
        "main attention, main model frozen), sparse training with top-k attention. The indexer has the",
        f"production V3.2 geometry: {cfg['index_n_heads']} heads x {cfg['index_head_dim']} dims, RoPE on the first "
        f"{cfg['qk_rope_head_dim']} dims (half-split), top-{cfg['index_topk']} keys at a {t['seq_len']}-token context.",
        "",
        "Load offline on CPU: `AutoModelForCausalLM.from_pretrained(dir, local_files_only=True)`. There is no",
        "tokenizer file: tokens are UTF-8 bytes 0..255, 256 = BOS, 257 = EOS (document separator); training",
        "windows start with BOS.",
        "",
        "## Model",
        "",
        f"- parameters: {m['parameters']:,} ({m['indexer_parameters']:,} in the indexers); "
        f"`model.safetensors` {m['safetensors_bytes'] / 1e6:.1f} MB (bf16; indexer `weights_proj` fp32)",
        f"- hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers (dense MLPs, intermediate "
        f"{cfg['intermediate_size']}), MLA with {cfg['num_attention_heads']} heads, q_lora_rank {cfg['q_lora_rank']}, "
        f"kv_lora_rank {cfg['kv_lora_rank']}, qk {cfg['qk_nope_head_dim']}+{cfg['qk_rope_head_dim']}, v {cfg['v_head_dim']}; "
        f"vocab {cfg['vocab_size']}",
        "",
        "## Data and split",
        "",
        f"- sources: {'; '.join(d['roots'])} (all `.py` files up to 400 kB; raw bytes, files joined with EOS)",
        f"- {d['files_available']:,} files available; training read {d['train_files']:,} files "
        f"({d['train_tokens'] / 1e6:.1f}M tokens), held-out {d['heldout_files']:,} files ({d['heldout_tokens'] / 1e6:.2f}M tokens)",
        f"- split: {d['split']} (heldout_percent = {d['heldout_percent']})",
        "",
        "## Training",
        "",
        "| stage | attention | trained | steps | windows/step | tokens | seconds | final train loss |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    what = {
        "dense": ("dense", "all but indexers (LM loss)"),
        "warmup": ("dense", "indexers only (KL, causal prefix)"),
        "sparse": (f"top-{cfg['index_topk']}", "main (LM loss) + indexers (KL on the top-k set)"),
    }
    for s in t.get("earlier_stages", []) + t["stages"]:
        att, trained = what[s["mode"]]
        if s in t.get("earlier_stages", []) and s["mode"] == "sparse":
            att = f"top-{s['config']['topk']}"
        losses = []
        if s["final_lm_loss"] is not None:
            losses.append(f"{s['final_lm_loss'] / 0.6931471805599453:.3f} bits/byte")
        if s["final_kl"] is not None:
            losses.append(f"KL {s['final_kl']:.4f}")
        lines.append(
            f"| {s['name']} | {att} | {trained} | {s['steps']} | {s['config']['batch']} | "
            f"{s['tokens'] / 1e6:.1f}M | {s['seconds']:.0f} | {', '.join(losses)} |"
        )
    lines += [
        "",
        f"Tokens seen in all: {t['tokens_total'] / 1e6:.1f}M. Context {t['seq_len']}; AdamW (0.9, 0.95), warm-up then "
        "cosine decay per stage, bf16 autocast, gradient clipping 1.0. Loss curve: `loss_curve.png`.",
        "",
    ]
    ev = metrics.get("eval")
    if ev:
        b = ev["bits_per_byte"]
        lines += [
            "## Held-out evaluation",
            "",
            f"{ev['windows']} held-out windows of {ev['seq_len']} tokens ({ev['tokens']:,} predicted tokens), "
            "through the transformers forward (`index_topk` set on every indexer):",
            "",
            "| attention | bits per byte |",
            "| --- | --- |",
            f"| dense (index_topk >= context) | {b['dense']:.4f} |",
            f"| sparse (index_topk = {ev['topk']}) | {b['sparse']:.4f} |",
            "",
            f"Sparse / dense = {b['sparse_over_dense']:.4f}.",
            "",
            f"Attention-mass coverage: share of the main attention (dense forward; probabilities summed over heads, "
            f"normalized per query) inside the indexer's top-{ev['topk']}, for the last 256 queries of each window, "
            "mean over layers (oracle = the best possible k keys; window = the most recent k keys):",
            "",
            "| context | indexer top-k | oracle top-k | recent-k window | per layer (indexer) |",
            "| --- | --- | --- | --- | --- |",
        ]
        for ctx, c in ev["coverage"].items():
            per = ", ".join(f"{v:.3f}" for v in c["per_layer"]["coverage"])
            lines.append(f"| {ctx} | {c['coverage']:.4f} | {c['oracle']:.4f} | {c['window']:.4f} | {per} |")
        lines.append("")
    for extra in metrics.get("extra_evals", []):
        r = extra["result"]
        b = r["bits_per_byte"]
        lines += [
            f"### Also measured: top-{r['topk']}",
            "",
            f"`{extra['command']}` ({r['windows']} windows for bits per byte): dense {b['dense']:.4f}, "
            f"sparse {b['sparse']:.4f} (ratio {b['sparse_over_dense']:.4f}); coverage of the main attention by the "
            f"indexer's top-{r['topk']}:",
            "",
            "| context | indexer top-k | oracle top-k | recent-k window |",
            "| --- | --- | --- | --- |",
            *[f"| {ctx} | {c['coverage']:.4f} | {c['oracle']:.4f} | {c['window']:.4f} |" for ctx, c in r["coverage"].items()],
            "",
        ]
    lines += [
        "## Reproduce",
        "",
        f"Machine: {metrics['machine']}.",
        "",
        "```",
        *[f"{c}  # earlier run" for c in metrics.get("earlier_runs", []) if c],
        metrics["command"],
        "```",
        "",
        "(`dsaindex reference train ...` is the same command through the main CLI; a later run continues from",
        "the checkpoint the earlier one wrote, through `--init-from`.) Evaluate with",
        "`dsaindex reference eval --json` (defaults to this checkpoint). Training time is budgeted by wall",
        "clock, so step counts on another machine differ; pass `--dense-steps/--warmup-steps/--sparse-steps`",
        "(and a large `--minutes`) to fix them.",
        "",
    ]
    return "\n".join(lines)
