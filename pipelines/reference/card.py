"""``MODEL_CARD.md`` of the reference DSA checkpoint, written from its ``metrics.json`` dictionary.

:func:`dsaindex.pipelines.reference.train.train_reference` assembles the metrics (model, data, training
stages with the lineage of earlier runs, held-out evaluation, machine, command) and writes both files;
this module only turns the metrics into the card's text.
"""

from __future__ import annotations

from typing import Any

# How the card's first paragraph names each source of a ``dsaindex reference corpus`` (its corpus.json).
_V2_SOURCES = {"code": "code", "austen": "novels", "sotu": "addresses", "email": "mail threads",
               "dictionary": "a dictionary", "bible": "the King James Bible", "kernel": "Linux kernel C source",
               "synthetic": "synthetic long-range tasks"}


def model_card(metrics: dict[str, Any]) -> str:
    """``MODEL_CARD.md`` text from a ``metrics.json`` dictionary."""
    m, d, t = metrics["model"], metrics["data"], metrics["training"]
    cfg = m["config"]
    vocab = m.get("vocabulary") or {}
    bpt = float(vocab.get("heldout_bytes_per_token") or 1.0)  # train losses are per token: per byte below
    bpe = bool(vocab.get("tokenizer"))
    corpus_sources = [r["name"] for r in (metrics.get("corpus") or {}).get("sources", [])] or [
        "code", "austen", "sotu", "email", "dictionary", "synthetic"]  # the v2 checkpoint's corpus
    trained_on = (f"the long-range v2 corpus ({', '.join(_V2_SOURCES.get(s, s) for s in corpus_sources)}) with a "
                  "byte-level BPE tokenizer" if bpe else "byte-level Python source")
    tokens_note = ([f"`tokenizer.json` (shipped beside the weights) is a byte-level BPE of {vocab['entries']} entries; "
                    f"<|bos|> = {vocab['bos']}, <|eos|> = {vocab['eos']} (document separator), <|pad|> = {vocab['pad']}; "
                    f"training windows start with <|bos|>; {bpt:.3f} bytes of held-out text per token."]
                   if bpe else
                   ["There is no tokenizer file: tokens are UTF-8 bytes 0..255, 256 = BOS, 257 = EOS (document separator);",
                    "training windows start with BOS."])
    status = metrics.get("status")  # a line on where the checkpoint stands (e.g. which gates it misses)
    lines = [
        "# dsaindex reference DSA checkpoint",
        "",
        *([f"**Status:** {status}", ""] if status else []),
        f"A small `DeepseekV32ForCausalLM` (transformers) trained from scratch on {trained_on}",
        "with DeepSeek-V3.2's lightning-indexer recipe: dense pre-training, dense indexer warm-up (KL to the",
        "main attention, main model frozen), sparse training with top-k attention. The indexer has the",
        f"production V3.2 geometry: {cfg['index_n_heads']} heads x {cfg['index_head_dim']} dims, RoPE on the first "
        f"{cfg['qk_rope_head_dim']} dims (half-split), top-{cfg['index_topk']} keys at a {t['seq_len']}-token context.",
        "",
        "Load offline on CPU: `AutoModelForCausalLM.from_pretrained(dir, local_files_only=True)`.",
        *tokens_note,
        "",
        "## Model",
        "",
        f"- parameters: {m['parameters']:,} ({m['indexer_parameters']:,} in the indexers); "
        f"`model*.safetensors` {m['safetensors_bytes'] / 1e6:.1f} MB (bf16; indexer `weights_proj` fp32)",
        f"- hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers (dense MLPs, intermediate "
        f"{cfg['intermediate_size']}), MLA with {cfg['num_attention_heads']} heads, q_lora_rank {cfg['q_lora_rank']}, "
        f"kv_lora_rank {cfg['kv_lora_rank']}, qk {cfg['qk_nope_head_dim']}+{cfg['qk_rope_head_dim']}, v {cfg['v_head_dim']}; "
        f"vocab {cfg['vocab_size']}; RoPE {cfg.get('rope_parameters') or 'base 1e4'}, positions up to "
        f"{cfg.get('max_position_embeddings', 'n/a')}",
        "",
        "## Data and split",
        "",
        *(_corpus_lines(d, metrics.get("corpus")) if bpe else _source_lines(d)),
        "",
        "## Training",
        "",
        "| stage | attention | trained | steps | windows x tokens per step | tokens | seconds | final train loss |",
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
            losses.append(f"{s['final_lm_loss'] / 0.6931471805599453 / bpt:.3f} bits/byte")
        if s["final_kl"] is not None:
            losses.append(f"KL {s['final_kl']:.4f}")
        if s.get("final_task_loss") is not None:
            losses.append(f"passkey answers {s['final_task_loss']:.3f} nats")
        share = s["config"].get("passkey_share") or 0.0
        if share:
            trained += f"; passkey tasks in {share:.0%} of windows" + (
                "" if s["mode"] == "warmup" else f", answers weighted {s['config'].get('answer_weight', 1.0):g}")
        lines.append(
            f"| {s['name']} | {att} | {trained} | {s['steps']} | {s['config']['batch']} x {s['config']['seq_len']} | "
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
    gates = metrics.get("gates")
    if gates:
        lines += [
            "## Long-context gates (dense attention, held-out text)",
            "",
            f"`{gates.get('command', 'dsaindex reference gates')}`: needle retrieval (teacher-forced exact value), "
            "loss on the last tokens after the true vs a block-shuffled prefix (nats per token; positive gain: far "
            "context used), bits per byte:",
            "",
            "| context | needle accuracy | loss, true prefix | loss, shuffled prefix | gain | bits per byte |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for ctx, g in gates["results"].items():
            sp = g["shuffled_prefix"]
            lines.append(f"| {ctx} | {g['needle_accuracy_dense']:.2f} | {sp['true']:.4f} | {sp['shuffled']:.4f} | "
                         f"{sp['gain']:+.4f} | {g['bits_per_byte_dense']:.4f} |")
        lines.append("")
        if gates.get("structure_command"):
            lines += [f"Top-k structure: `{gates['structure_command']}`.", ""]
        for ctx, g in gates.get("topk_structure", {}).items():
            per = ", ".join(f"{layer['keys_per_block']:.1f}" for layer in g["layers"])
            far = ", ".join(f"{layer['far_share']:.0%}" for layer in g["layers"])
            routed = ""
            if "routed_keys_per_block" in g:
                per_routed = ", ".join(f"{layer['routed_keys_per_block']:.1f}" for layer in g["layers"])
                routed = (f"; beyond the last {g['open_window']} keys (what IVF routes) "
                          f"{g['routed_keys_per_block']:.2f} (per layer {per_routed}); a top-{g['topk']} scattered "
                          f"at random would give {g['random_keys_per_block']:.2f}")
            lines += [f"Where each layer's indexer top-{g['topk']} lies at {ctx} (last {g['queries']} queries of held-out "
                      f"windows): {g['keys_per_block']:.2f} keys per touched {g['block']}-key block (per layer {per})"
                      f"{routed}; "
                      f"{g['far_share']:.1%} more than {g['far']} positions back (per layer {far}); main-attention "
                      f"coverage {g['coverage']:.4f} (oracle {g['oracle']:.4f}, recent window {g['window']:.4f}).", ""]
        for ctx, g in gates["results"].items():
            if "needle_accuracy_sparse" in g:
                lines += [f"With top-{g['topk']} sparse attention at {ctx}: needle accuracy {g['needle_accuracy_sparse']:.2f}, "
                          f"bits per byte {g['bits_per_byte_sparse']:.4f} "
                          f"({g['bits_per_byte_sparse'] / g['bits_per_byte_dense']:.4f} x dense).", ""]
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
        "`dsaindex reference eval --model DIR --json` (add `--corpus CORPUS` for a checkpoint with its own",
        "tokenizer). Training time is budgeted by wall",
        "clock, so step counts on another machine differ; pass `--dense-steps/--warmup-steps/--sparse-steps`",
        "(and a large `--minutes`) to fix them.",
        "",
    ]
    return "\n".join(lines)


def _source_lines(d: dict[str, Any]) -> list[str]:
    """The data section of a checkpoint trained on Python sources as bytes (v1)."""
    return [
        f"- sources: {'; '.join(d['roots'])} (all `.py` files up to 400 kB; raw bytes, files joined with EOS)",
        f"- {d['files_available']:,} files available; training read {d['train_files']:,} files "
        f"({d['train_tokens'] / 1e6:.1f}M tokens), held-out {d['heldout_files']:,} files ({d['heldout_tokens'] / 1e6:.2f}M tokens)",
        f"- split: {d['split']} (heldout_percent = {d['heldout_percent']})",
    ]


def _corpus_lines(d: dict[str, Any], corpus: dict[str, Any] | None) -> list[str]:
    """The data section of a checkpoint trained on a ``dsaindex reference corpus`` folder (v2): its
    sources table (``corpus.json``) with versions, licenses and sizes."""
    lines = [
        f"- corpus: `{d['corpus']}`, {d['train_documents']:,} training documents ({d['train_tokens'] / 1e6:.1f}M tokens), "
        f"{d['heldout_documents']:,} held-out documents ({d['heldout_tokens'] / 1e6:.2f}M tokens); {d['tokenizer']}",
        f"- split: {d['split']}",
    ]
    if corpus and corpus.get("sources"):
        lines += ["", "| source | origin | license | documents | MB | held-out documents | held-out MB |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in corpus["sources"]:
            lines.append(f"| {r['name']} | {r['origin']} | {r['license']} | {r['documents']} | {r['bytes'] / 1e6:.1f} | "
                         f"{r['heldout_documents']} | {r['heldout_bytes'] / 1e6:.1f} |")
    return lines
