"""``dsaindex reference ...``: the project's reference DSA checkpoint (training and evaluation).

``train`` runs the three-stage recipe of :mod:`dsaindex.pipelines.reference_train` (dense pre-training,
dense indexer warm-up, sparse training), saves the checkpoint, evaluates it on held-out files
(:mod:`dsaindex.pipelines.reference_eval`) and writes ``metrics.json``, ``loss_curve.png`` and
``MODEL_CARD.md`` beside it. ``eval`` evaluates an existing checkpoint. Heavy libraries are imported
inside the commands. The module also runs as ``python -m dsaindex.pipelines.reference_cli`` on
machines where only this sub-app's dependencies are installed.
"""

from __future__ import annotations

import json
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import typer

reference_app = typer.Typer(no_args_is_help=True)


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def _machine(device: str) -> str:
    import torch
    import transformers

    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(0)}, {versions}"
    return f"CPU ({platform.processor() or platform.machine()}), {versions}"


def _echo(msg: str) -> None:
    typer.echo(msg)
    sys.stdout.flush()


@reference_app.command("train")
def train_cmd(
    out: Path = typer.Option(
        Path("reference_model"), help="Output folder for the checkpoint and its reports."
    ),
    minutes: float = typer.Option(8.0, help="Wall-clock budget of the three training stages together."),
    dense_frac: float = typer.Option(0.55, help="Share of the budget for dense pre-training."),
    warmup_frac: float = typer.Option(0.10, help="Share of the budget for the dense indexer warm-up."),
    sparse_frac: float = typer.Option(0.35, help="Share of the budget for sparse training."),
    dense_steps: int | None = typer.Option(
        None, help="Step limit of dense pre-training (with the time limit)."
    ),
    warmup_steps: int | None = typer.Option(None, help="Step limit of the warm-up."),
    sparse_steps: int | None = typer.Option(None, help="Step limit of sparse training."),
    seq_len: int = typer.Option(4096, help="Training context (tokens per window)."),
    topk: int = typer.Option(256, help="index_topk of sparse training and of the saved config."),
    dense_batch: int = typer.Option(16, help="Windows per step, dense pre-training."),
    warmup_batch: int = typer.Option(8, help="Windows per step, warm-up."),
    sparse_batch: int = typer.Option(8, help="Windows per step, sparse training."),
    dense_lr: float = typer.Option(2e-3),
    warmup_lr: float = typer.Option(1e-3),
    sparse_lr: float = typer.Option(5e-4, help="Main-model learning rate in sparse training."),
    sparse_indexer_lr: float = typer.Option(5e-4, help="Indexer learning rate in sparse training."),
    query_chunk: int = typer.Option(256, help="Queries per indexer-score chunk."),
    max_train_mb: float = typer.Option(160.0, help="Training text budget (MB of source bytes)."),
    max_heldout_mb: float = typer.Option(4.0, help="Held-out text budget (MB)."),
    heldout_percent: float = typer.Option(2.0, help="Percent of files held out (by path hash)."),
    eval_windows: int = typer.Option(32, help="Held-out windows for bits per byte."),
    coverage_windows: int = typer.Option(8, help="Held-out windows per context length for coverage."),
    tiny: bool = typer.Option(False, help="Use the tiny test geometry (CPU smoke runs)."),
    log_every: int = typer.Option(25, help="Steps between loss read-backs (each one synchronizes the GPU)."),
    seed: int = typer.Option(0),
    device: str = typer.Option("auto", help="cuda, cpu or auto."),
    evaluate_after: bool = typer.Option(True, "--eval/--no-eval", help="Evaluate the saved checkpoint."),
    init_from: Path = typer.Option(
        None, help="Continue from a saved checkpoint folder instead of a fresh model (longer trainings "
        "spread over several runs; optimizer state starts afresh)."
    ),
    stages: str = typer.Option("dense,warmup,sparse", help="Stages to run, in order (comma-separated)."),
) -> None:
    """Train the reference checkpoint with the DSA recipe and write it with its reports to OUT."""
    import torch

    from dsaindex.pipelines import reference_train as rt

    command = "python -m dsaindex.pipelines.reference_cli " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    dev = _device(device)
    cuda = dev.startswith("cuda")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    t0 = time.perf_counter()
    streams = rt.build_token_streams(
        int(max_train_mb * 1e6), int(max_heldout_mb * 1e6), heldout_percent=heldout_percent
    )
    _echo(f"data: {json.dumps(streams.info)} ({time.perf_counter() - t0:.1f}s)")
    train_stream = torch.from_numpy(streams.train).to(dev)
    heldout_stream = torch.from_numpy(streams.heldout).to(dev)

    base = rt.TINY_CONFIG if tiny else rt.REFERENCE_CONFIG
    config = rt.make_config(
        base, index_topk=topk, max_position_embeddings=max(base["max_position_embeddings"], seq_len)
    )
    run_stages = [x.strip() for x in stages.split(",") if x.strip()]
    unknown = sorted(set(run_stages) - {"dense", "warmup", "sparse"})
    if unknown or not run_stages:
        from dsaindex.errors import DsaIndexError

        raise DsaIndexError(f"Unknown stages {unknown or stages!r}.", "pass --stages with dense, warmup and/or sparse.")
    if init_from is not None:
        from dsaindex.pipelines.reference_eval import load_checkpoint

        model = load_checkpoint(init_from, dev).train()
        rt.set_index_topk(model, topk)
        earlier = init_from / "metrics.json"
        if earlier.is_file():  # keep the lineage: the card lists every stage the weights went through
            prior = json.loads(earlier.read_text())
            prior_training = prior.get("training", {})
            prior_stages = prior_training.get("earlier_stages", []) + prior_training.get("stages", [])
            prior_runs = prior.get("earlier_runs", []) + [prior.get("command", "")]
        _echo(f"continuing from {init_from}")
    else:
        model = rt.build_model(config, seed=seed, device=dev)
    if init_from is None or not (init_from / "metrics.json").is_file():
        prior_stages, prior_runs = [], []
    n_params = sum(p.numel() for p in model.parameters())
    n_index = sum(p.numel() for p in rt.indexer_parameters(model))
    _echo(f"model: {n_params / 1e6:.2f}M parameters ({n_index / 1e6:.2f}M in indexers), device {dev}")

    budget = minutes * 60.0
    stage_configs = [
        rt.StageConfig(
            "dense",
            "dense",
            dense_batch,
            seq_len,
            dense_lr,
            dense_steps,
            budget * dense_frac,
            warmup_steps=50,
            query_chunk=query_chunk,
        ),
        rt.StageConfig(
            "warmup",
            "warmup",
            warmup_batch,
            seq_len,
            warmup_lr,
            warmup_steps,
            budget * warmup_frac,
            warmup_steps=10,
            min_lr_ratio=0.5,
            query_chunk=query_chunk,
        ),
        rt.StageConfig(
            "sparse",
            "sparse",
            sparse_batch,
            seq_len,
            sparse_lr,
            sparse_steps,
            budget * sparse_frac,
            warmup_steps=10,
            indexer_lr=sparse_indexer_lr,
            topk=topk,
            query_chunk=query_chunk,
        ),
    ]
    generator = torch.Generator(device=dev)
    generator.manual_seed(seed)
    history: list[dict[str, Any]] = []
    results = []
    offset = 0
    for cfg in [c for c in stage_configs if c.name in run_stages]:
        res = rt.run_stage(
            model,
            train_stream,
            cfg,
            generator,
            history,
            offset,
            autocast=cuda,
            log=_echo,
            log_every=log_every,
        )
        offset += res.steps
        results.append(res)
        _echo(
            f"stage {res.name}: {res.steps} steps, {res.tokens / 1e6:.1f}M tokens, {res.seconds:.0f}s, "
            f"peak memory {res.peak_memory_gb or 0:.1f} GiB"
        )

    out.mkdir(parents=True, exist_ok=True)
    saved = rt.save_checkpoint(model, out, index_topk=topk)
    rt.plot_loss_curve(history, out / "loss_curve.png")
    metrics: dict[str, Any] = {
        "model": {
            "class": "DeepseekV32ForCausalLM",
            "parameters": n_params,
            "indexer_parameters": n_index,
            "safetensors_bytes": saved["safetensors_bytes"],
            "config": {k: v for k, v in base.items() if k != "rope_theta"} | {"index_topk": topk},
        },
        "data": streams.info,
        "training": {
            "seq_len": seq_len,
            "seed": seed,
            "stages": [vars(r) for r in results],
            "earlier_stages": prior_stages,
            "tokens_total": sum(r.tokens for r in results) + sum(x["tokens"] for x in prior_stages),
            "history_every": 10,
            "history": [r for j, r in enumerate(history) if j % 10 == 0 or j == len(history) - 1],
        },
        "machine": _machine(dev),
        "command": command,
        "earlier_runs": prior_runs,
    }
    if evaluate_after:
        from dsaindex.pipelines.reference_eval import evaluate, load_checkpoint

        del model
        if cuda:
            torch.cuda.empty_cache()
        t1 = time.perf_counter()
        reloaded = load_checkpoint(out, dev)
        metrics["eval"] = evaluate(
            reloaded,
            heldout_stream,
            seq_len=seq_len,
            topk=topk,
            bpb_windows=eval_windows,
            coverage_windows=coverage_windows,
            contexts=[c for c in (1024, 2048, 4096) if c <= seq_len] or [seq_len],
        )
        metrics["eval"]["seconds"] = time.perf_counter() - t1
        _echo("eval: " + json.dumps({k: v for k, v in metrics["eval"].items() if k != "coverage"}))
        for ctx, cov in metrics["eval"]["coverage"].items():
            _echo(
                f"coverage@{ctx}: {cov['coverage']:.4f} (oracle {cov['oracle']:.4f}, window {cov['window']:.4f})"
            )
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    (out / "MODEL_CARD.md").write_text(model_card(metrics))
    _echo(f"wrote {out} ({time.perf_counter() - t0:.0f}s in all)")


@reference_app.command("eval")
def eval_cmd(
    model: str = typer.Option("reference", help="`reference` or a checkpoint folder."),
    seq_len: int = typer.Option(
        4096, help="Context of the bits-per-byte windows (and the longest coverage context)."
    ),
    topk: int = typer.Option(None, help="index_topk of the sparse measurement and of coverage (default: the checkpoint's)."),
    windows: int = typer.Option(8, help="Held-out windows for bits per byte."),
    coverage_windows: int = typer.Option(2, help="Held-out windows per context length for coverage."),
    max_heldout_mb: float = typer.Option(2.0, help="Held-out text to read (MB)."),
    heldout_percent: float = typer.Option(
        2.0, help="Percent of files held out (by path hash); as in training."
    ),
    batch: int = typer.Option(1, help="Windows per forward."),
    device: str = typer.Option("auto", help="cuda, cpu or auto."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Held-out bits per byte (dense vs sparse) and indexer coverage of the main attention at 1K/2K/4K."""
    import torch

    from dsaindex.pipelines.models import resolve_model_dir
    from dsaindex.pipelines.reference_eval import evaluate, load_checkpoint
    from dsaindex.pipelines.reference_train import build_token_streams

    dev = _device(device)
    path = resolve_model_dir(model)
    streams = build_token_streams(0, int(max_heldout_mb * 1e6), heldout_percent=heldout_percent)
    heldout = torch.from_numpy(streams.heldout).to(dev)
    net = load_checkpoint(path, dev)
    topk = int(net.config.index_topk) if topk is None else topk
    contexts = [c for c in (1024, 2048, 4096) if c <= seq_len] or [seq_len]
    result = evaluate(
        net,
        heldout,
        seq_len=seq_len,
        topk=topk,
        bpb_windows=windows,
        coverage_windows=coverage_windows,
        contexts=contexts,
        batch=batch,
    )
    result["model"] = str(path)
    result["heldout_files"] = streams.info["heldout_files"]
    if as_json:
        typer.echo(json.dumps(result, indent=1))
        return
    b = result["bits_per_byte"]
    typer.echo(
        f"held-out bits per byte ({result['tokens']} tokens, context {seq_len}): "
        f"dense {b['dense']:.4f}, sparse(top-{topk}) {b['sparse']:.4f} ({b['sparse_over_dense']:.3f}x)"
    )
    for ctx, cov in result["coverage"].items():
        typer.echo(
            f"coverage of main-attention mass by indexer top-{topk} at {ctx}: {cov['coverage']:.4f} "
            f"(oracle top-{topk} {cov['oracle']:.4f}, recent-{topk} window {cov['window']:.4f})"
        )


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


if __name__ == "__main__":
    reference_app()
