"""The staged training loop of the reference recipe: one optimizer step (:func:`train_step`) and one
stage run to its step or time limit (:func:`run_stage`), with the stage settings (:class:`StageConfig`).

Stages: ``dense`` (ordinary language-model pre-training with dense causal attention), ``warmup``
(everything but the indexers frozen; each indexer fitted to its layer's main attention with KL) and
``sparse`` (the main model trains with top-k sparse attention while the indexers keep their KL loss,
restricted to the selected set). :mod:`dsaindex.pipelines.reference.forward` computes the losses.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from dsaindex.pipelines.capture.presets import BOS_ID
from dsaindex.pipelines.capture.tokens import sample_windows
from dsaindex.pipelines.reference.forward import (
    ForwardResult,
    indexer_parameters,
    is_indexer_param,
    main_parameters,
    sampled_rows,
    training_forward,
)


@dataclass
class StageConfig:
    """One stage: ``mode`` (dense / warmup / sparse), its limits (``max_steps`` and/or ``seconds``;
    the first reached ends it; the learning-rate schedule follows whichever is closer to its end),
    batch shape and optimizer settings."""

    name: str
    mode: str
    batch: int
    seq_len: int
    lr: float
    max_steps: int | None = None
    seconds: float | None = None
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    indexer_lr: float | None = None  # sparse stage: learning rate of the indexer parameters
    topk: int | None = None
    query_chunk: int = 256
    kl_queries: int | None = None  # indexer KL on this many sampled queries per window (None: every query)
    attn_chunk: int | None = None  # sparse main attention over query chunks of this many rows
    passkey_share: float = 0.0  # share of windows rewritten into passkey tasks (reference_tasks)
    answer_weight: float = 1.0  # loss weight of passkey answer tokens, against 1 per token


@dataclass
class StageResult:
    name: str
    mode: str
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    final_lm_loss: float | None = None
    final_kl: float | None = None
    final_task_loss: float | None = None  # passkey answers, mean over the last logged steps (nats)
    peak_memory_gb: float | None = None
    config: dict = field(default_factory=dict)


def configure_trainable(model, mode: str) -> tuple[list, list]:
    """Set ``requires_grad`` for a stage; returns ``(main params trained, indexer params trained)``.

    dense: main only; warmup: indexers only (main frozen); sparse: both (their losses are separate).
    """
    train_main = mode in ("dense", "sparse")
    train_idx = mode in ("warmup", "sparse")
    for n, p in model.named_parameters():
        p.requires_grad_(train_idx if is_indexer_param(n) else train_main)
    return (main_parameters(model) if train_main else []), (indexer_parameters(model) if train_idx else [])


def make_optimizer(model, cfg: StageConfig):
    """AdamW over the stage's trainable parameters (fused on CUDA); norms and 1-D params get no decay."""
    import torch

    main, idx = configure_trainable(model, cfg.mode)
    groups = []
    for params, lr in ((main, cfg.lr), (idx, cfg.indexer_lr if cfg.indexer_lr is not None else cfg.lr)):
        if not params:
            continue
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups.append({"params": decay, "weight_decay": cfg.weight_decay, "lr": lr, "base_lr": lr})
        groups.append({"params": no_decay, "weight_decay": 0.0, "lr": lr, "base_lr": lr})
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def lr_factor(cfg: StageConfig, step: int, elapsed: float) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` over the stage."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = 0.0
    if cfg.max_steps:
        progress = max(progress, step / cfg.max_steps)
    if cfg.seconds:
        progress = max(progress, elapsed / cfg.seconds)
    progress = min(1.0, progress)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def train_step(
    model, optimizer, input_ids, labels, cfg: StageConfig, autocast: bool = False, generator=None,
    answer=None, focus=None,
) -> ForwardResult:
    """One optimizer step of a stage; returns the (detached) losses. ``answer`` and ``focus`` come from
    :class:`~dsaindex.pipelines.reference.tasks.PasskeyTasks`: the answer labels (weighted by
    ``cfg.answer_weight``) and the positions always added to the indexer KL's sampled queries."""
    import torch

    device_type = input_ids.device.type
    rows = None
    if cfg.kl_queries and cfg.mode in ("warmup", "sparse"):
        rows = sampled_rows(input_ids.shape[1], cfg.kl_queries, generator, input_ids.device)
        if focus is not None and focus.numel():
            rows = torch.unique(torch.cat([rows, focus.to(rows.device)]))  # sorted, the last position kept
    with torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=autocast):
        res = training_forward(model, input_ids, labels, cfg.mode, cfg.topk, cfg.query_chunk, rows, cfg.attn_chunk,
                               answer, cfg.answer_weight)
    loss = sum(x for x in (res.objective, res.kl) if x is not None)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    return ForwardResult(*(None if x is None else x.detach() for x in (res.lm, res.kl, res.task)))


def run_stage(
    model,
    stream,
    cfg: StageConfig,
    generator,
    history: list[dict],
    step_offset: int = 0,
    autocast: bool = False,
    log: Callable[[str], None] | None = None,
    log_every: int = 25,
    bos: int = BOS_ID,
    tasks: Any = None,
) -> StageResult:
    """Train one stage until ``max_steps`` or ``seconds``; appends ``{step, stage, lm, kl, task, time}`` rows
    to ``history`` (losses synchronized every ``log_every`` steps, to keep the GPU busy in between).
    ``tasks`` (a :class:`~dsaindex.pipelines.reference.tasks.PasskeyTasks`) rewrites a share of the
    sampled windows into passkey tasks; ``task`` is then the answer tokens' loss."""
    import torch

    optimizer = make_optimizer(model, cfg)
    model.train()
    if stream.is_cuda:
        torch.cuda.reset_peak_memory_stats()
    result = StageResult(cfg.name, cfg.mode, config=asdict(cfg))
    start = time.perf_counter()
    step = 0
    pending: list[tuple[int, ForwardResult, float]] = []

    def flush():
        for st, res, el in pending:
            row = {"step": step_offset + st, "stage": cfg.name, "time": el}
            row["lm"] = None if res.lm is None else float(res.lm)
            row["kl"] = None if res.kl is None else float(res.kl)
            row["task"] = None if res.task is None else float(res.task)
            history.append(row)
            result.final_lm_loss, result.final_kl = row["lm"], row["kl"]
        tasks_seen = [r["task"] for r in history[len(history) - len(pending):] if r["task"] is not None]
        if tasks_seen:
            result.final_task_loss = sum(tasks_seen) / len(tasks_seen)
        if pending and log:
            r = history[-1]
            lm = "-" if r["lm"] is None else f"{r['lm'] / math.log(2):.4f} bits"
            kl = "-" if r["kl"] is None else f"{r['kl']:.4f}"
            task = "" if not tasks_seen else f" answers={sum(tasks_seen) / len(tasks_seen):.3f} nats"
            log(f"[{cfg.name}] step {r['step'] - step_offset} t={r['time']:.0f}s lm={lm} kl={kl}{task}")
        pending.clear()

    while True:
        elapsed = time.perf_counter() - start
        if cfg.max_steps is not None and step >= cfg.max_steps:
            break
        if cfg.seconds is not None and elapsed >= cfg.seconds:
            break
        factor = lr_factor(cfg, step, elapsed)
        for g in optimizer.param_groups:
            g["lr"] = g["base_lr"] * factor
        input_ids, labels = sample_windows(stream, cfg.batch, cfg.seq_len, generator, bos)
        answer = focus = None
        if tasks is not None:
            batch = tasks.apply(input_ids, labels)
            input_ids, labels, answer, focus = batch.input_ids, batch.labels, batch.answer, batch.focus
        res = train_step(model, optimizer, input_ids, labels, cfg, autocast, generator, answer, focus)
        pending.append((step, res, elapsed))
        step += 1
        if step % log_every == 0:
            flush()
    flush()
    if stream.is_cuda:
        torch.cuda.synchronize()
        result.peak_memory_gb = torch.cuda.max_memory_allocated() / 2**30
    result.steps = step
    result.tokens = step * cfg.batch * cfg.seq_len
    result.seconds = time.perf_counter() - start
    for p in model.parameters():
        p.requires_grad_(True)
    return result
