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

The parameters are plain float32 arrays (``ENCODER_ARRAYS``), stored in the artifact bundle with the
layer kind ``ivf``; :func:`representatives` is the forward both training and the runtime use.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from dsaindex.runtime.causal_ivf import CausalIVF, Version
from dsaindex.score import indexer_scores

ENCODER_ARRAYS = ("phi_weight", "phi_bias", "hidden_weight", "hidden_bias", "out_weight", "out_bias")


@dataclass
class IVFOptions:
    window: int = 1024
    cluster_size: int = 128
    refit_every: int = 16384
    sinks: int = 4
    features: int = 64
    hidden: int = 256
    steps: int = 300
    lr: float = 2e-3
    max_queries: int = 256
    seed: int = 0
    device: str = "cpu"

    def params(self) -> dict:
        d = asdict(self)
        d.pop("device")
        return d

    def index(self, dim: int) -> CausalIVF:
        return CausalIVF(dim, self.window, self.cluster_size, self.refit_every, self.sinks, device=self.device)


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


def representatives(params: dict[str, torch.Tensor], keys: torch.Tensor, version: Version) -> torch.Tensor:
    """Learned representatives [C, D] of a version's clusters; ``keys`` [N, D] hold its members."""
    members = keys[version.order]  # [M, D], grouped by cluster
    sizes = (version.starts[1:] - version.starts[:-1]).clamp_min(1)
    cluster = torch.repeat_interleave(torch.arange(version.clusters, device=keys.device), version.starts.diff())
    c = version.clusters
    mean = torch.zeros(c, keys.shape[1], device=keys.device).index_add_(0, cluster, members) / sizes[:, None]
    feats = torch.nn.functional.gelu(members @ params["phi_weight"].t() + params["phi_bias"])
    f_mean = torch.zeros(c, feats.shape[1], device=keys.device).index_add_(0, cluster, feats) / sizes[:, None]
    f_max = torch.full((c, feats.shape[1]), -1e4, device=keys.device).scatter_reduce(
        0, cluster[:, None].expand_as(feats), feats, "amax")
    summary = torch.cat([mean, sizes.float().log()[:, None], f_mean, f_max], dim=1)
    hidden = torch.nn.functional.gelu(summary @ params["hidden_weight"].t() + params["hidden_bias"])
    return mean + hidden @ params["out_weight"].t() + params["out_bias"]


@dataclass
class _Group:
    """Queries of one sequence that use the same index version, with their routing targets."""

    keys: torch.Tensor
    version: Version
    queries: torch.Tensor  # [Q, H, D]
    weights: torch.Tensor  # [Q, H]
    target: torch.Tensor  # [Q, C] rows sum to 1


def routing_groups(store, layer: int, sequences: list[int], topk: int, opts: IVFOptions) -> list[_Group]:
    """Training (or evaluation) material of one layer: per sequence and version, the queries routed with
    it and their targets (reference top-k keys per visible member, normalized)."""
    from dsaindex.train.recall import queries_by_sequence

    dev = opts.device
    groups = []
    for part in queries_by_sequence(store, layer, sequences, opts.window + opts.sinks, opts.max_queries, dev):
        keys = part.keys
        index = opts.index(keys.shape[1])
        index.append(keys)
        by_version: dict[int, tuple[Version, list[int]]] = {}
        for i, p in enumerate(part.positions):
            v = index.version_for(p)
            if v is not None:
                by_version.setdefault(id(v), (v, []))[1].append(i)
        for version, members in by_version.values():
            cluster_of = torch.full((keys.shape[0],), -1, dtype=torch.long, device=dev)
            cluster_of[version.order] = torch.repeat_interleave(torch.arange(version.clusters, device=dev),
                                                                version.starts.diff())
            sizes = version.starts.diff().clamp_min(1).float()
            targets = []
            for i in members:
                p = part.positions[i]
                exact = indexer_scores(part.queries[i : i + 1], keys[: p + 1], part.head_weights[i : i + 1])[0]
                hits = cluster_of[exact.topk(min(topk, p + 1)).indices]
                counts = torch.bincount(hits[hits >= 0], minlength=version.clusters).float() / sizes
                targets.append(counts / counts.sum().clamp_min(1e-9))
            groups.append(_Group(keys, version, part.queries[members], part.head_weights[members],
                                 torch.stack(targets)))
    return groups


def routing_loss(params, group: _Group, log_beta: torch.Tensor) -> torch.Tensor:
    reps = representatives(params, group.keys, group.version)
    scores = indexer_scores(group.queries, reps, group.weights)  # [Q, C]
    logp = torch.log_softmax(log_beta.exp() * scores, dim=1)
    return -(group.target * logp).sum(1).mean()


def train_encoder(groups: list[_Group], dim: int, opts: IVFOptions, progress=None) -> tuple[dict, dict]:
    """Adam on the routing cross-entropy over all groups; returns (parameters, training summary)."""
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
    for step in range(opts.steps):
        optimizer.zero_grad()
        loss = sum(routing_loss(params, g, log_beta) for g in groups) / len(groups)
        loss.backward()
        optimizer.step()
        if progress and step % 50 == 0:
            progress(f"step {step}: loss {loss.item():.4f}")
    with torch.no_grad():
        last = float(sum(routing_loss(params, g, log_beta) for g in groups) / len(groups))
    trained = {k: v.detach() for k, v in params.items()}
    return trained, {"loss_start": round(first, 5), "loss_end": round(last, 5), "groups": len(groups),
                     "queries": sum(int(g.queries.shape[0]) for g in groups), "rep_spread": round(float(spread), 4)}
