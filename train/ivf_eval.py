"""Held-out recall of routed selection (causal IVF, contiguous blocks) against the exact top-k.

For each held-out sequence of a capture store, each routing index is fed the sequence's keys; each
held-out query at position ``p`` asks it for a candidate budget (the index uses only what keys
``<= p`` built), and recall is the share of the exact top-k over ``[0, p]`` inside the candidates
(the exact refine then returns exactly those). Queries whose prefix is not larger than a budget are
left out of that budget's mean: there the budget holds every key.
"""

from __future__ import annotations

from functools import partial

import torch

from dsaindex.runtime.causal_ivf import BlockIndex, CausalIVF
from dsaindex.score import indexer_scores
from dsaindex.train.recall import queries_by_sequence, split_sequences

METHODS = ("blocks", "ivf-seal-only", "ivf")
LEARNED = "ivf-learned"


def _cached_reps(encoder: dict, keys: torch.Tensor, cache: dict, version) -> torch.Tensor:
    """Learned representatives of a version, computed once per version."""
    from dsaindex.train.ivf import representatives

    if id(version) not in cache:
        cache[id(version)] = representatives(encoder, keys, version)
    return cache[id(version)]


def make_index(method: str, dim: int, window: int, cluster_size: int, refit_every: int, sinks: int, device):
    if method == "blocks":
        return BlockIndex(dim, window, cluster_size, sinks, device=device)
    if method == "ivf-seal-only":
        return CausalIVF(dim, window, cluster_size, refit_every=0, sinks=sinks, device=device)
    if method in ("ivf", LEARNED):
        return CausalIVF(dim, window, cluster_size, refit_every=refit_every, sinks=sinks, device=device)
    raise ValueError(f"unknown routing method {method!r}; known: {', '.join(METHODS)}")


def evaluate_routing(store, layer: int, budgets: list[int], topk: int, methods=METHODS, window: int = 1024,
                     cluster_size: int = 128, refit_every: int = 16384, sinks: int = 4, max_queries: int = 64,
                     device: str = "cpu", encoder: dict | None = None) -> dict:
    """Mean recall per (method, budget) over held-out queries of one layer, plus the query count.

    ``encoder`` (parameters of :mod:`dsaindex.train.ivf`) adds the method ``ivf-learned``: the ``ivf``
    index routed with learned representatives."""
    methods = tuple(methods) + ((LEARNED,) if encoder is not None and LEARNED not in methods else ())
    _, eval_seqs = split_sequences(len(store.array("sequence_keys")))
    sums = {(m, b): 0.0 for m in methods for b in budgets}
    counts = dict.fromkeys(budgets, 0)
    for part in queries_by_sequence(store, layer, eval_seqs, min(budgets), max_queries, device):
        keys = part.keys
        indexes = {m: make_index(m, keys.shape[1], window, cluster_size, refit_every, sinks, device) for m in methods}
        for index in indexes.values():
            index.append(keys)
        learned_cache: dict[int, torch.Tensor] = {}
        for p, q, w in zip(part.positions, part.queries, part.head_weights, strict=True):
            exact = indexer_scores(q.unsqueeze(0), keys[: p + 1], w.unsqueeze(0))[0]
            truth = set(exact.topk(min(topk, p + 1)).indices.tolist())
            for b in budgets:
                if p + 1 <= b:
                    continue
                counts[b] += 1
                for m, index in indexes.items():
                    reps = partial(_cached_reps, encoder, index.keys, learned_cache) if m == LEARNED else None
                    cand = set(index.candidates(q, w, p, b, representatives=reps).tolist())
                    sums[(m, b)] += len(truth & cand) / len(truth)
    recall = {m: {str(b): round(sums[(m, b)] / counts[b], 5) if counts[b] else None for b in budgets}
              for m in methods}
    return {"layer": layer, "topk": topk, "queries": {str(b): counts[b] for b in budgets}, "recall": recall}
