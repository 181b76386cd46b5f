"""Training of the reference DSA checkpoint: a small ``DeepseekV32ForCausalLM`` trained from scratch
with DeepSeek-V3.2's indexer recipe.

Data: the token streams of :mod:`dsaindex.pipelines.capture.tokens` (Python sources as bytes, or a
``dsaindex reference corpus`` folder with its BPE).

Recipe (three stages; the loop is :mod:`dsaindex.pipelines.reference.stages`)
--------------------------------------------
1. ``dense``: ordinary language-model pre-training with dense causal attention (index_topk >= context,
   so the indexer selects every key; its parameters are not trained).
2. ``warmup``: everything but the indexers is frozen. Per layer, the indexer's distribution
   ``softmax_t(score[s, t])`` over the causal prefix is fitted to the main attention distribution
   (attention probabilities summed over heads, L1-normalized per query) with KL divergence. The
   indexer's inputs are detached from the main model's graph.
3. ``sparse``: the main model trains with top-k sparse attention (the indexer's top ``index_topk``
   keys per query, causal prefix only); the indexer keeps its KL loss, restricted to the selected set
   (target and indexer distributions both renormalized over the set). The top-k is not
   differentiable and the indexer inputs are detached, so the LM loss reaches only the main model
   and the KL loss only the indexers.

The training forward (:mod:`dsaindex.pipelines.reference.forward`) runs the model's own submodules
with fused attention kernels and a chunked, differentiable indexer score.

A run (:func:`train_reference` with :class:`ReferenceTrainOptions`) chains the stages, saves the
checkpoint and writes its reports. The configs (reference geometry and its tiny CPU variant) are in
:mod:`dsaindex.pipelines.capture.presets`.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsaindex.pipelines.capture.presets import REFERENCE_CONFIG, TINY_REFERENCE_CONFIG, reference_config

if TYPE_CHECKING:
    from dsaindex.pipelines.reference.stages import StageConfig


@dataclass
class ReferenceTrainOptions:
    """Settings of one run of the recipe (``dsaindex reference train``; its ``--help`` describes each one,
    and takes its defaults from here).

    Stage limits: ``*_steps`` (``None``: none) and the wall-clock budget ``minutes`` split by ``*_frac``;
    the first limit reached ends a stage. ``stages`` lists the stages to run, comma-separated; with
    ``init_from`` the run continues the checkpoint saved there and keeps the lineage of its runs.
    ``command`` is recorded in ``metrics.json`` and the model card as the way to reproduce the run.
    ``corpus`` trains on a ``dsaindex reference corpus`` folder with its BPE tokenizer (the v2 data;
    ``max_train_mb`` / ``max_heldout_mb`` then count millions of tokens) instead of Python sources as bytes;
    ``rope_theta`` and ``max_position`` set a fresh model's RoPE base and position limit (a continued
    checkpoint keeps its own); ``layers`` sets a fresh model's depth (every layer a dense MLP and an indexer,
    as in the reference geometry; more layers give cross-layer reuse plans more to choose from).
    ``passkey_share`` of the windows (a corpus run only) carry fresh passkey
    tasks (:class:`~dsaindex.pipelines.reference.tasks.PasskeyTasks`, up to ``passkey_questions`` questions
    each) whose answer tokens weigh ``passkey_weight`` in the loss.
    """

    out: Path = Path("reference_model")
    minutes: float = 8.0
    dense_frac: float = 0.55
    warmup_frac: float = 0.10
    sparse_frac: float = 0.35
    dense_steps: int | None = None
    warmup_steps: int | None = None
    sparse_steps: int | None = None
    seq_len: int = 4096
    topk: int = 256
    dense_batch: int = 16
    warmup_batch: int = 8
    sparse_batch: int = 8
    dense_lr: float = 2e-3
    warmup_lr: float = 1e-3
    sparse_lr: float = 5e-4
    sparse_indexer_lr: float = 5e-4
    query_chunk: int = 256
    max_train_mb: float = 160.0
    max_heldout_mb: float = 4.0
    heldout_percent: float = 2.0
    eval_windows: int = 32
    coverage_windows: int = 8
    tiny: bool = False
    log_every: int = 25
    seed: int = 0
    device: str = "auto"
    init_from: Path | None = None
    stages: str = "dense,warmup,sparse"
    command: str = ""
    corpus: Path | None = None
    rope_theta: float = 10000.0
    max_position: int | None = None
    kl_queries: int | None = None
    attn_chunk: int | None = None
    passkey_share: float = 0.0
    passkey_weight: float = 1.0
    passkey_questions: int = 4
    layers: int | None = None


STAGES = ("dense", "warmup", "sparse")


def parse_stages(stages: str) -> list[str]:
    """The stages of a comma-separated list, in order; refuses unknown names and an empty list."""
    names = [x.strip() for x in stages.split(",") if x.strip()]
    unknown = sorted(set(names) - set(STAGES))
    if unknown or not names:
        from dsaindex.errors import DsaIndexError

        raise DsaIndexError(f"Unknown stages {unknown or stages!r}.", "pass --stages with dense, warmup and/or sparse.")
    return names


def stage_configs(options: ReferenceTrainOptions) -> list[StageConfig]:
    """The recipe's three stages with the run's batch shapes, learning rates and limits."""
    from dsaindex.pipelines.reference.stages import StageConfig  # torch, as the rest of a run: not at import

    budget = options.minutes * 60.0
    common = dict(seq_len=options.seq_len, query_chunk=options.query_chunk, kl_queries=options.kl_queries,
                  attn_chunk=options.attn_chunk, passkey_share=options.passkey_share,
                  answer_weight=options.passkey_weight)
    return [
        StageConfig("dense", "dense", options.dense_batch, lr=options.dense_lr, max_steps=options.dense_steps,
                    seconds=budget * options.dense_frac, warmup_steps=50, **common),
        StageConfig("warmup", "warmup", options.warmup_batch, lr=options.warmup_lr, max_steps=options.warmup_steps,
                    seconds=budget * options.warmup_frac, warmup_steps=10, min_lr_ratio=0.5, **common),
        StageConfig("sparse", "sparse", options.sparse_batch, lr=options.sparse_lr, max_steps=options.sparse_steps,
                    seconds=budget * options.sparse_frac, warmup_steps=10, indexer_lr=options.sparse_indexer_lr,
                    topk=options.topk, **common),
    ]


def earlier_lineage(init_from: Path | None) -> tuple[list[dict], list[str]]:
    """``(stages, commands)`` of the runs that produced the checkpoint at ``init_from``, from its
    ``metrics.json`` (empty without one), so the card lists every stage the weights went through."""
    earlier = None if init_from is None else init_from / "metrics.json"
    if earlier is None or not earlier.is_file():
        return [], []
    prior = json.loads(earlier.read_text())
    training = prior.get("training", {})
    return (training.get("earlier_stages", []) + training.get("stages", []),
            prior.get("earlier_runs", []) + [prior.get("command", "")])


def machine_description(device: str) -> str:
    """The accelerator (or CPU) and library versions, for the card's reproduction note."""
    import torch
    import transformers

    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(0)}, {versions}"
    return f"CPU ({platform.processor() or platform.machine()}), {versions}"


Evaluator = Callable[..., dict[str, Any]]


def train_reference(
    options: ReferenceTrainOptions, log: Callable[[str], None] = print, evaluator: Evaluator | None = None
) -> dict[str, Any]:
    """Train the reference checkpoint and write it with its reports to ``options.out``.

    Builds the token streams, a fresh model (or the one at ``init_from``), runs the chosen stages, saves
    the checkpoint and ``loss_curve.png``, then writes ``metrics.json`` and ``MODEL_CARD.md``.
    ``evaluator`` (:func:`dsaindex.pipelines.reference.eval.evaluate`, passed in because that module
    builds on this one) measures the saved checkpoint on the held-out stream; ``None`` skips evaluation.
    Returns the metrics dictionary.
    """
    import torch

    from dsaindex.console import resolve_device
    from dsaindex.indexer import set_index_topk
    from dsaindex.pipelines.capture.tokens import BYTE_VOCABULARY, build_token_streams, corpus_token_streams
    from dsaindex.pipelines.reference.card import model_card
    from dsaindex.pipelines.reference.checkpoint import plot_loss_curve, save_checkpoint, save_tokenizer
    from dsaindex.pipelines.reference.forward import build_model, indexer_parameters, load_checkpoint
    from dsaindex.pipelines.reference.stages import run_stage

    run_stages = parse_stages(options.stages)
    if options.passkey_share and options.corpus is None:
        from dsaindex.errors import DsaIndexError

        raise DsaIndexError("Passkey tasks need a corpus run: they are tokenized with the corpus's tokenizer.",
                            "pass --corpus, or leave --passkey-share at 0.")
    dev = resolve_device(options.device)
    cuda = dev.startswith("cuda")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    t0 = time.perf_counter()
    if options.corpus is not None:
        streams, vocab = corpus_token_streams(options.corpus, int(options.max_train_mb * 1e6),
                                              int(options.max_heldout_mb * 1e6))
    else:
        streams = build_token_streams(
            int(options.max_train_mb * 1e6), int(options.max_heldout_mb * 1e6), heldout_percent=options.heldout_percent
        )
        vocab = BYTE_VOCABULARY
    log(f"data: {json.dumps(streams.info)} ({time.perf_counter() - t0:.1f}s)")
    train_stream = torch.from_numpy(streams.train).to(dev)
    heldout_stream = torch.from_numpy(streams.heldout).to(dev)

    seq_len, topk = options.seq_len, options.topk
    base = TINY_REFERENCE_CONFIG if options.tiny else REFERENCE_CONFIG
    if options.layers is not None:
        base = {**base, "num_hidden_layers": options.layers, "first_k_dense_replace": options.layers}
    if options.init_from is not None and options.layers is not None:
        from dsaindex.errors import DsaIndexError

        raise DsaIndexError("--layers sets a fresh model's depth; a continued checkpoint keeps its own.",
                            "drop --layers, or drop --init-from to train a fresh model of that depth.")
    if options.init_from is not None:
        model = load_checkpoint(options.init_from, dev).train()
        set_index_topk(model, topk)
        log(f"continuing from {options.init_from}")
    else:
        limit = options.max_position or max(base["max_position_embeddings"], seq_len)
        config = reference_config(
            base, index_topk=topk, max_position_embeddings=limit, rope_theta=options.rope_theta,
            vocab_size=vocab.size, bos_token_id=vocab.bos, eos_token_id=vocab.eos, pad_token_id=vocab.pad,
        )
        model = build_model(config, seed=options.seed, device=dev)
    if model.config.vocab_size != vocab.size:
        from dsaindex.errors import DsaIndexError

        raise DsaIndexError(f"The checkpoint has {model.config.vocab_size} token entries; this run's data has "
                            f"{vocab.size}.", "continue a checkpoint on the data (and tokenizer) it was trained on.")
    prior_stages, prior_runs = earlier_lineage(options.init_from)
    n_params = sum(p.numel() for p in model.parameters())
    n_index = sum(p.numel() for p in indexer_parameters(model))
    log(f"model: {n_params / 1e6:.2f}M parameters ({n_index / 1e6:.2f}M in indexers), device {dev}")

    generator = torch.Generator(device=dev)
    generator.manual_seed(options.seed)
    tasks = None
    if options.passkey_share:
        from dsaindex.pipelines.reference.tasks import PasskeyTasks

        tasks = PasskeyTasks(vocab.tokenizer, options.passkey_share, seed=options.seed,
                             max_questions=options.passkey_questions)
    history: list[dict[str, Any]] = []
    results = []
    offset = 0
    for cfg in [c for c in stage_configs(options) if c.name in run_stages]:
        res = run_stage(model, train_stream, cfg, generator, history, offset, autocast=cuda, log=log,
                        log_every=options.log_every, bos=vocab.bos, tasks=tasks)
        offset += res.steps
        results.append(res)
        log(
            f"stage {res.name}: {res.steps} steps, {res.tokens / 1e6:.1f}M tokens, {res.seconds:.0f}s, "
            f"peak memory {res.peak_memory_gb or 0:.1f} GiB"
        )

    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    saved = save_checkpoint(model, out, index_topk=topk)
    if vocab.tokenizer is not None:  # shipped beside the weights, with the corpus's sources table
        import shutil

        save_tokenizer(vocab, out)
        if (vocab.tokenizer.parent / "corpus.json").is_file():
            shutil.copyfile(vocab.tokenizer.parent / "corpus.json", out / "corpus.json")
    plot_loss_curve(history, out / "loss_curve.png")
    metrics: dict[str, Any] = {
        "model": {
            "class": "DeepseekV32ForCausalLM",
            "parameters": n_params,
            "indexer_parameters": n_index,
            "safetensors_bytes": saved["safetensors_bytes"],
            "config": {k: v for k, v in base.items() if k != "rope_theta"} | {
                "index_topk": topk, "vocab_size": int(model.config.vocab_size),
                "max_position_embeddings": int(model.config.max_position_embeddings),
                "rope_parameters": dict(getattr(model.config, "rope_parameters", None) or {})},
            "vocabulary": {"entries": vocab.size, "bos": vocab.bos, "eos": vocab.eos, "pad": vocab.pad,
                           "tokenizer": None if vocab.tokenizer is None else "tokenizer.json",
                           "heldout_bytes_per_token": vocab.bytes_per_token},
        },
        "data": streams.info,
        "training": {
            "seq_len": seq_len,
            "seed": options.seed,
            "stages": [vars(r) for r in results],
            "earlier_stages": prior_stages,
            "tokens_total": sum(r.tokens for r in results) + sum(x["tokens"] for x in prior_stages),
            "history_every": 10,
            "history": [r for j, r in enumerate(history) if j % 10 == 0 or j == len(history) - 1],
        },
        "machine": machine_description(dev),
        "corpus": (json.loads((out / "corpus.json").read_text()) if (out / "corpus.json").is_file() else None),
        "command": options.command,
        "earlier_runs": prior_runs,
    }
    if evaluator is not None:
        del model
        if cuda:
            torch.cuda.empty_cache()
        t1 = time.perf_counter()
        metrics["eval"] = evaluator(
            load_checkpoint(out, dev),
            heldout_stream,
            seq_len=seq_len,
            topk=topk,
            bpb_windows=options.eval_windows,
            coverage_windows=options.coverage_windows,
            bos=vocab.bos,
            bytes_per_token=vocab.bytes_per_token,
        )
        metrics["eval"]["seconds"] = time.perf_counter() - t1
        log("eval: " + json.dumps({k: v for k, v in metrics["eval"].items() if k != "coverage"}))
        for ctx, cov in metrics["eval"]["coverage"].items():
            log(f"coverage@{ctx}: {cov['coverage']:.4f} (oracle {cov['oracle']:.4f}, window {cov['window']:.4f})")
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    (out / "MODEL_CARD.md").write_text(model_card(metrics))
    log(f"wrote {out} ({time.perf_counter() - t0:.0f}s in all)")
    return metrics
