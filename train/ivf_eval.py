"""Held-out recall of routed selection (causal IVF, contiguous blocks) against the exact top-k.

For each held-out sequence of a capture store, each routing index is fed the sequence's keys; each
held-out query at position ``p`` asks it for a candidate budget (the index uses only what keys
``<= p`` built), and recall is the share of the exact top-k over ``[0, p]`` inside the candidates
(the exact refine then returns exactly those). Queries whose prefix is not larger than a budget are
left out of that budget's mean: there the budget holds every key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dsaindex.artifacts.kinds import IVFIndexSettings
from dsaindex.runtime.causal_ivf import BlockIndex, CausalIVF, LearnedRepresentatives
from dsaindex.score import indexer_scores
from dsaindex.train.recall import queries_by_sequence, split_sequences

if TYPE_CHECKING:
    from dsaindex.artifacts.capture_store import CaptureStore

METHODS = ("blocks", "ivf-seal-only", "ivf")
LEARNED = "ivf-learned"


def make_index(method: str, dim: int, settings: IVFIndexSettings, device: str | torch.device) -> CausalIVF:
    s = settings
    if method == "blocks":
        return BlockIndex(dim, s.window, s.cluster_size, s.sinks, device=device)
    if method == "ivf-seal-only":
        return CausalIVF(dim, **s.model_dump(exclude={"refit_every"}), refit_every=0, device=device)
    if method in ("ivf", LEARNED):
        return CausalIVF(dim, **s.model_dump(), device=device)
    raise ValueError(f"unknown routing method {method!r}; known: {', '.join(METHODS)}")


def evaluate_routing(store: CaptureStore, layer: int, budgets: list[int], topk: int, settings: IVFIndexSettings,
                     methods: tuple[str, ...] = METHODS, max_queries: int = 64, device: str = "cpu", encoder: dict | None = None,
                     sequences: list[int] | None = None, min_prefix: int = 0) -> dict:
    """Mean recall per (method, budget) over held-out queries of one layer, plus the query count.

    ``encoder`` (parameters of :mod:`dsaindex.train.ivf`) adds the method ``ivf-learned``: the ``ivf``
    index routed with learned representatives. ``sequences``: the store's sequences whose queries are
    measured (None: the held-out split of :func:`split_sequences`); ``min_prefix``: only queries with more
    keys before them than this (and than the smallest budget)."""
    methods = tuple(methods) + ((LEARNED,) if encoder is not None and LEARNED not in methods else ())
    eval_seqs = sequences if sequences is not None else split_sequences(len(store.array("sequence_keys")))[1]
    sums = {(m, b): 0.0 for m in methods for b in budgets}
    counts = dict.fromkeys(budgets, 0)
    profile = {"window_share": 0.0, "keys_per_block": 0.0, "keys_per_cluster": 0.0, "queries": 0, "far": 0,
               "clustered": 0}
    for part in queries_by_sequence(store, layer, eval_seqs, max(min(budgets), min_prefix), max_queries, device):
        keys = part.keys
        indexes = {m: make_index(m, keys.shape[1], settings, device) for m in methods}
        for index in indexes.values():
            index.append(keys)
        learned = LearnedRepresentatives(encoder, indexes[LEARNED]) if LEARNED in indexes else None
        cluster_maps: dict[int, torch.Tensor] = {}
        for p, q, w in zip(part.positions, part.queries, part.head_weights, strict=True):
            exact = indexer_scores(q.unsqueeze(0), keys[: p + 1], w.unsqueeze(0))[0]
            top = exact.topk(min(topk, p + 1)).indices
            truth = set(top.tolist())
            _profile(profile, top, p, settings.window, settings.cluster_size, indexes.get("ivf"), cluster_maps)
            for b in budgets:
                if p + 1 <= b:
                    continue
                counts[b] += 1
                for m, index in indexes.items():
                    reps = learned if m == LEARNED else None
                    cand = set(index.candidates(q, w, p, b, representatives=reps).tolist())
                    sums[(m, b)] += len(truth & cand) / len(truth)
    recall = {m: {str(b): round(sums[(m, b)] / counts[b], 5) if counts[b] else None for b in budgets}
              for m in methods}
    truth_profile = {"window_share": round(profile["window_share"] / max(1, profile["queries"]), 4),
                     "keys_per_block": round(profile["keys_per_block"] / max(1, profile["far"]), 3),
                     "keys_per_cluster": round(profile["keys_per_cluster"] / max(1, profile["clustered"]), 3)}
    return {"layer": layer, "topk": topk, "queries": {str(b): counts[b] for b in budgets}, "recall": recall,
            "truth_profile": truth_profile}


def _profile(acc: dict, top: torch.Tensor, p: int, window: int, cluster_size: int, ivf, cluster_maps: dict) -> None:
    """Where a query's exact top-k lies: the share in its last ``window`` keys, and how concentrated the
    rest is: keys per touched contiguous block of ``cluster_size`` (what block routing can exploit)
    and per touched cluster of the IVF version the query uses (what cluster routing can exploit)."""
    far = top[top <= p - window]
    acc["queries"] += 1
    acc["window_share"] += 1 - far.numel() / max(1, top.numel())
    if not far.numel():
        return
    acc["far"] += 1
    acc["keys_per_block"] += far.numel() / torch.unique(far // cluster_size).numel()
    version = ivf.version_for(p) if ivf is not None else None
    if version is None:
        return
    if id(version) not in cluster_maps:
        cluster_maps[id(version)] = version.cluster_of(ivf.length)
    ids = cluster_maps[id(version)][far]
    ids = ids[ids >= 0]
    if ids.numel():
        acc["clustered"] += 1
        acc["keys_per_cluster"] += ids.numel() / torch.unique(ids).numel()
