"""Learned routing representatives for the causal IVF index (AttentionIndex §4), trained offline.

Cluster membership is geometric (cheap to maintain), but routing should predict the native indexer
score of a cluster's members. One small encoder per layer, shared by all its clusters, predicts a
correction to the cluster mean from permutation-invariant summaries of the members:

    r_c = mean_c + out([mean_c, log n_c, meanpool phi(k), maxpool phi(k)]),   phi(k) = gelu(W k + b)

Training (capture store, training sequences only): every training sequence is indexed causally
(:class:`dsaindex.runtime.causal_ivf.CausalIVF`); for each sampled query at position ``p`` the
version it would use gives the clusters; the target over clusters is proportional to the count of
the query's exact top-k keys in the cluster per visible member; the loss is the cross-entropy
between that target and the softmax over clusters of ``beta * score(q, r_c)``.

The parameters are plain float32 arrays (:data:`dsaindex.artifacts.kinds.ENCODER_ARRAYS`), stored in the artifact bundle with the
layer kind ``ivf``; the forward both training and the runtime use is
:func:`dsaindex.runtime.causal_ivf.representatives`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from dsaindex.artifacts.kinds import IVFIndexSettings
from dsaindex.runtime.causal_ivf import CausalIVF, Version, representatives
from dsaindex.score import indexer_scores

if TYPE_CHECKING:
    from dsaindex.artifacts.capture_store import CaptureStore


@dataclass
class IVFOptions:
    """Training hyperparameters of a routing encoder, and the index settings (:class:`IVFIndexSettings`,
    shared with the bundle and the runtime) it is trained for."""

    index: IVFIndexSettings = field(default_factory=IVFIndexSettings)
    features: int = 64
    hidden: int = 256
    steps: int = 300
    groups_per_step: int = 32
    eval_every: int = 20
    val_budget: int | None = None  # None: :func:`validation_budget` of the budgets evaluated
    lr: float = 2e-3
    max_queries: int = 256
    seed: int = 0
    device: str = "cpu"

    def params(self) -> dict:
        """The flat parameter record an ``ivf`` bundle layer stores (:class:`dsaindex.artifacts.kinds.IVFParams`)."""
        d = {k: v for k, v in asdict(self).items() if k not in ("index", "device")}
        return self.index.model_dump() | d

    def make_index(self, dim: int) -> CausalIVF:
        return CausalIVF(dim, **self.index.model_dump(), device=self.device)


def init_encoder(dim: int, features: int, hidden: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Fresh parameters; the output layer starts at zero, so the encoder starts as the plain means."""
    g = torch.Generator().manual_seed(seed)
    return {
        "phi_weight": torch.randn(features, dim, generator=g) / math.sqrt(dim),
        "phi_bias": torch.zeros(features),
        "hidden_weight": torch.randn(hidden, dim + 1 + 2 * features, generator=g) / math.sqrt(dim + 1 + 2 * features),
        "hidden_bias": torch.zeros(hidden),
        "out_weight": torch.zeros(dim, hidden),
        "out_bias": torch.zeros(dim),
    }


@dataclass
class _Group:
    """Queries of one sequence that use the same index version, with their routing targets."""

    keys: torch.Tensor
    version: Version
    queries: torch.Tensor  # [Q, H, D]
    weights: torch.Tensor  # [Q, H]
    target: torch.Tensor  # [Q, C] rows sum to 1
    hits: torch.Tensor  # [Q, C] the query's exact top-k keys in each cluster


def routing_groups(store: CaptureStore, layer: int, sequences: list[int], topk: int, opts: IVFOptions) -> list[_Group]:
    """Training (or evaluation) material of one layer: per sequence and version, the queries routed with
    it and their targets (reference top-k keys per visible member, normalized)."""
    from dsaindex.train.recall import queries_by_sequence

    groups = []
    for part in queries_by_sequence(store, layer, sequences, opts.index.window + opts.index.sinks, opts.max_queries, opts.device):
        groups += sequence_groups(part.keys, part.positions, part.queries, part.head_weights, topk, opts)
    return groups


def sequence_groups(keys: torch.Tensor, positions: list[int], queries: torch.Tensor, head_weights: torch.Tensor,
                    topk: int, opts: IVFOptions) -> list[_Group]:
    """The groups of one sequence: its keys [N, D] indexed causally, its queries [Q, H, D] at
    ``positions`` grouped by the version each uses, with their targets and hit counts."""
    index = opts.make_index(keys.shape[1])
    index.append(keys)
    by_version: dict[int, tuple[Version, list[int]]] = {}
    for i, p in enumerate(positions):
        v = index.version_for(p)
        if v is not None:
            by_version.setdefault(id(v), (v, []))[1].append(i)
    groups = []
    for version, members in by_version.values():
        cluster_of = version.cluster_of(keys.shape[0])
        sizes = version.starts.diff().clamp_min(1).float()
        targets, hit_rows = [], []
        for i in members:
            p = positions[i]
            exact = indexer_scores(queries[i : i + 1], keys[: p + 1], head_weights[i : i + 1])[0]
            hits = cluster_of[exact.topk(min(topk, p + 1)).indices]
            hit_rows.append(torch.bincount(hits[hits >= 0], minlength=version.clusters).float())
            per_member = hit_rows[-1] / sizes
            targets.append(per_member / per_member.sum().clamp_min(1e-9))
        groups.append(_Group(keys, version, queries[members], head_weights[members],
                             torch.stack(targets), torch.stack(hit_rows)))
    return groups


def routing_loss(params: dict[str, torch.Tensor], group: _Group, log_beta: torch.Tensor) -> torch.Tensor:
    reps = representatives(params, group.keys, group.version)
    scores = indexer_scores(group.queries, reps, group.weights)  # [Q, C]
    logp = torch.log_softmax(log_beta.exp() * scores, dim=1)
    return -(group.target * logp).sum(1).mean()


@torch.no_grad()
def routing_hit_rate(params: dict[str, torch.Tensor], groups: list[_Group], budget: int, cluster_size: int) -> float:
    """Share of the queries' exact top-k keys (those in clusters) inside the best-ranked clusters that
    fill ``budget`` keys: the selection criterion of training (independent of the softmax scale)."""
    found = total = 0.0
    for g in groups:
        reps = representatives(params, g.keys, g.version)
        ranked = indexer_scores(g.queries, reps, g.weights).argsort(dim=1, descending=True)
        top = ranked[:, : max(1, budget // cluster_size)]
        found += float(g.hits.gather(1, top).sum())
        total += float(g.hits.sum())
    return found / max(total, 1e-9)


def validation_budget(val_groups: list[_Group], cluster_size: int, budgets: Sequence[int] = ()) -> int:
    """The candidate budget at which training steps are compared on the validation queries.

    The smallest evaluated budget (where routing matters most) when, for most validation queries, it
    holds fewer clusters than their index version has: a budget that holds every cluster gives every
    step a hit rate of 1, so the plain means (step 0) would always be kept. Otherwise (no budget
    given, or validation prefixes too short for it) half the median cluster count of the validation
    queries, in keys."""
    per_query = sorted(int(g.version.clusters) for g in val_groups for _ in range(int(g.queries.shape[0])))
    median = per_query[len(per_query) // 2] if per_query else 0
    if budgets and min(budgets) // cluster_size < median:
        return int(min(budgets))
    return max(1, median // 2) * cluster_size


def train_encoder(groups: list[_Group], dim: int, opts: IVFOptions, progress: Callable[[str], None] | None = None,
                  val_groups: list[_Group] | None = None, budgets: Sequence[int] = ()) -> tuple[dict, dict]:
    """Adam on the routing cross-entropy, ``groups_per_step`` groups a step.

    With ``val_groups`` (queries of sequences not trained on) the parameters kept are those of the
    step, checked every ``eval_every``, with the best :func:`routing_hit_rate` on them at the budget
    ``opts.val_budget`` (default: :func:`validation_budget` of ``budgets``, the budgets evaluated);
    step 0 is the plain means (the output layer starts at zero), kept unless training beats it.
    Returns (parameters, summary: losses over all training groups, the validation budget and hit
    rates, the step kept)."""
    params = {k: v.to(opts.device).requires_grad_(True)
              for k, v in init_encoder(dim, opts.features, opts.hidden, opts.seed).items()}
    with torch.no_grad():  # start beta so that the scores of the means spread over about one unit
        spread = torch.stack([representatives(params, g.keys, g.version).std() for g in groups]).mean()
        scale = torch.stack([indexer_scores(g.queries, representatives(params, g.keys, g.version), g.weights).std()
                             for g in groups]).mean()
    log_beta = torch.tensor(float(-torch.log(scale.clamp_min(1e-6))), device=opts.device, requires_grad=True)
    optimizer = torch.optim.Adam([*params.values(), log_beta], lr=opts.lr)
    with torch.no_grad():
        first = float(sum(routing_loss(params, g, log_beta) for g in groups) / len(groups))
    pick = torch.Generator().manual_seed(opts.seed)

    val_budget = opts.val_budget or (validation_budget(val_groups, opts.index.cluster_size, budgets)
                                     if val_groups else None)

    def hit_rate() -> float:
        return routing_hit_rate(params, val_groups, val_budget, opts.index.cluster_size)

    best = (hit_rate(), 0, {k: v.detach().clone() for k, v in params.items()}) if val_groups else None
    val_start = best[0] if best else None
    for step in range(opts.steps):
        optimizer.zero_grad()
        batch = groups
        if len(groups) > opts.groups_per_step:  # a random subset of (sequence, version) groups per step
            batch = [groups[i] for i in torch.randperm(len(groups), generator=pick)[: opts.groups_per_step].tolist()]
        loss = sum(routing_loss(params, g, log_beta) for g in batch) / len(batch)
        loss.backward()
        optimizer.step()
        if best and ((step + 1) % opts.eval_every == 0 or step + 1 == opts.steps):
            rate = hit_rate()
            if rate > best[0]:
                best = (rate, step + 1, {k: v.detach().clone() for k, v in params.items()})
        if progress and step % 10 == 0:
            progress(f"step {step}/{opts.steps}: loss {loss.item():.4f}"
                     + (f", best validation hit rate {best[0]:.4f}" if best else ""))
    with torch.no_grad():
        last = float(sum(routing_loss(params, g, log_beta) for g in groups) / len(groups))
    trained = best[2] if best else {k: v.detach() for k, v in params.items()}
    summary = {"loss_start": round(first, 5), "loss_end": round(last, 5), "groups": len(groups),
               "queries": sum(int(g.queries.shape[0]) for g in groups), "rep_spread": round(float(spread), 4)}
    if best:
        summary |= {"val_queries": sum(int(g.queries.shape[0]) for g in val_groups), "val_budget": val_budget,
                    f"val_hit_rate@{val_budget}_start": round(val_start, 5),
                    f"val_hit_rate@{val_budget}_kept": round(best[0], 5), "kept_step": best[1]}
    return trained, summary
