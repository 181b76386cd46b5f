"""Held-out recall of PQ coarse-to-fine selection against the exact indexer top-k.

For each held-out query whose causal prefix holds at least ``4 * k`` keys:

* exact scores use the keys as the engine stores them (FP8 e4m3 + ue8m0 scale, dequantized), the
  reference every selection is judged against;
* (a) ``direct``: top-k straight from the PQ coarse scores;
* (b) ``rerank@C``: top-C by coarse score, exact rescoring of those C, top-k;
* (c) ``filter@C``: (b) after LeanSparse's miss filter with a cold cache: candidates whose coarse
  score is below (the k-th largest candidate coarse score - one sample std of the candidates' coarse
  scores) are dropped before the exact rescore; ``fetch@C`` is the share of candidates kept (what a
  cold cache would read from host);
* (d) ``prefilter{P}@C``: (b) as the served decode step selects: its stage 1, aiming at ``P * C`` keys,
  keeps what the kernels keep in expectation (:func:`~dsaindex.coarse.stage1_kept`: 1.5 x ``P * C``, every key
  of a prefix up to twice that) by the folded score (the head-weighted sum of the queries against the coded
  key, no ReLU), and the top C by coarse score are taken among those. The folded score ranks worst where heads
  disagree, so at long prefixes a small ``P`` can lose what (b) keeps; a server's ``--candidates auto`` reads
  this metric at its own prefilter.
* (e) ``folds{P}@C``: (d) with the fold scan's stage 1 (``stage1="folds"``,
  :mod:`dsaindex.kernels.pq_fold_cuda`): the heads grouped by sign and direction, each group's folded query
  against the coded key through its own ReLU with a leak (:func:`grouped_fold_scores`, in float).

Each metric is also reported per prefix band (``k512@32K-64K/rerank@2048``: queries whose causal prefix
holds 32K to 64K keys, see :func:`prefix_band`), since recall falls as prefixes grow and an average over
short and long prefixes hides that.

``rerank@C``, ``filter@C`` and ``fetch@C`` are left out where ``C <= k`` (the top-C then is the direct
top-k, so reranking it changes nothing) and for queries whose prefix is not longer than ``C`` (reranking
would score every key: exhaustive, not coarse-to-fine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from dsaindex.coarse import miss_filter_keep, stage1_kept
from dsaindex.geometry import visible_key_count
from dsaindex.score import indexer_scores

if TYPE_CHECKING:
    from dsaindex.artifacts.capture_store import CaptureStore

CANDIDATES = (1024, 2048, 4096)
PREFILTERS = (1, 2, 4, 8, 16)  # stage-1 factors whose served recall (d) is recorded beside rerank@C
FOLD_PREFILTERS = (1, 2)  # stage-1 factors of the grouped folds (e)
PAPER_K = 512
BAND_EDGES = (16384, 32768, 65536, 131072, 262144, 524288, 1048576)  # prefix lengths (keys) where bands meet


def _kilo(n: int) -> str:
    return f"{n // 1048576}M" if n >= 1048576 else f"{n // 1024}K"


def prefix_band(n: int) -> str:
    """The band of a causal prefix of ``n`` keys: ``0-16K``, ``16K-32K``, ..., ``512K-1M``, ``1M-max``
    (lower edge included; names MLflow takes as they are)."""
    lower = [e for e in BAND_EDGES if e <= n]
    if not lower:
        return f"0-{_kilo(BAND_EDGES[0])}"
    if lower[-1] == BAND_EDGES[-1]:
        return f"{_kilo(BAND_EDGES[-1])}-max"
    return f"{_kilo(lower[-1])}-{_kilo(BAND_EDGES[len(lower)])}"


def band_rows(rows: list[tuple[str, dict]], k: int) -> list[tuple[str, dict]]:
    """Per prefix band, shortest first, the rows of named :func:`evaluate_selection` results renamed
    ``"<name>, <band>"`` with that band's metrics under the overall names (``k512@32K-64K/direct`` ->
    ``k512/direct``), for a recall table by band."""
    order = [prefix_band(0), *(prefix_band(e) for e in BAND_EDGES)]
    out = []
    for band in order:
        tag = f"k{k}@{band}/"
        for name, metrics in rows:
            picked = {f"k{k}/" + key[len(tag):]: v for key, v in metrics.items() if key.startswith(tag)}
            if picked:
                out.append((f"{name}, {band}", picked))
    return out


@dataclass
class HeldOut:
    """Held-out queries of one layer with what is needed to score them.

    queries [Q, H, D], head_weights [Q, H], visible [Q] (prefix length in keys), key_start [Q] (row of the
    query's sequence start in ``keys``), keys [N, D] float32 engine keys of the held-out sequences.
    """

    queries: torch.Tensor
    head_weights: torch.Tensor
    visible: torch.Tensor
    key_start: torch.Tensor
    keys: torch.Tensor


def split_sequences(num_sequences: int, eval_fraction: float = 0.2) -> tuple[list[int], list[int]]:
    """Deterministic split: the last ``eval_fraction`` of sequences (at least one) are held out."""
    if num_sequences < 2:
        from dsaindex.errors import DsaIndexError

        raise DsaIndexError(
            f"The store holds {num_sequences} sequence(s); training needs at least 2 (one is held out).",
            "capture more sequences (`dsaindex capture STORE --sequences N` extends the store).",
        )
    n_eval = max(1, int(round(num_sequences * eval_fraction)))
    return list(range(num_sequences - n_eval)), list(range(num_sequences - n_eval, num_sequences))


def measured_sequences(store: CaptureStore, manifests: list) -> tuple[list[int], str]:
    """The store's sequences that no bundle (``manifests``: their :class:`BundleManifest`) trained on, and how
    they were chosen: a bundle trained on this very store (same store id) leaves its recorded held-out
    sequences; the store of another capture is held out whole."""
    from dsaindex.errors import DsaIndexError

    keep = set(range(store.committed.sequences))
    trained_here = [m for m in manifests if m.lineage.capture_store_id == store.manifest.store_id]
    for m in trained_here:
        keep &= set(m.lineage.eval_sequences)
    if not keep:
        raise DsaIndexError(f"Every sequence of store {store.manifest.store_id} trained one of the bundles; none is "
                            "held out for all of them.",
                            "pass --store a capture the bundles were not trained on (`dsaindex capture` with "
                            "another corpus or seed).")
    how = ("the held-out sequences of the bundles' training store" if trained_here
           else "every sequence (no bundle was trained on this store)")
    return sorted(keep), how


def sequence_key_offsets(store: CaptureStore) -> np.ndarray:
    counts = store.array("sequence_keys").astype(np.int64)
    return np.concatenate([[0], np.cumsum(counts)])


def layer_keys(store: CaptureStore, layer: int, sequences: list[int], key_format: str,
               raw: np.ndarray | None = None) -> torch.Tensor:
    """Engine-form keys [N, D] of the given sequences of one layer, concatenated in order; ``raw``: the
    layer's stored keys (``store.keys(layer)``) when already read."""
    offsets = sequence_key_offsets(store)
    raw = store.keys(layer) if raw is None else raw
    parts = [raw[offsets[s] : offsets[s + 1]] for s in sequences]
    return store.engine_keys(np.concatenate(parts), key_format)


def held_out(store: CaptureStore, layer: int, eval_sequences: list[int], min_prefix: int, key_format: str,
             max_queries: int = 256, raw: np.ndarray | None = None) -> HeldOut:
    """Held-out queries with a causal prefix of at least ``min_prefix`` keys (at most ``max_queries``);
    ``raw``: as for :func:`layer_keys`."""
    stride = store.manifest.model.geometry.key_stride
    positions = store.array("query_position").astype(np.int64)
    seq_of = store.array("query_sequence").astype(np.int64)
    visible = visible_key_count(positions, stride)
    seq_keys = store.array("sequence_keys").astype(np.int64)
    visible = np.minimum(visible, seq_keys[seq_of])
    rows = np.nonzero(np.isin(seq_of, eval_sequences) & (visible >= min_prefix))[0]
    if len(rows) > max_queries:
        rows = rows[np.linspace(0, len(rows) - 1, max_queries).round().astype(np.int64)]
    local_start = np.zeros(len(sequence_key_offsets(store)) - 1, dtype=np.int64)
    acc = 0
    for s in eval_sequences:
        local_start[s] = acc
        acc += seq_keys[s]
    return HeldOut(
        queries=store.as_float(store.queries(layer)[rows]) if len(rows) else torch.zeros(0),
        head_weights=torch.from_numpy(store.head_weights(layer)[rows]) if len(rows) else torch.zeros(0),
        visible=torch.from_numpy(visible[rows]),
        key_start=torch.from_numpy(local_start[seq_of[rows]]),
        keys=layer_keys(store, layer, eval_sequences, key_format, raw),
    )


def _hits(truth_mask: torch.Tensor, chosen: torch.Tensor, k: int) -> list[float]:
    """Per row, the share of the row's exact top-``k`` (``truth_mask`` [Q, N] bool) among ``chosen`` [Q, k]
    distinct key indices."""
    return (truth_mask.gather(1, chosen).sum(1).float() / k).tolist()


def evaluate_selection(
    data: HeldOut,
    coarse_keys: torch.Tensor,
    ks: tuple[int, ...],
    candidates: tuple[int, ...] = CANDIDATES,
    device: str = "cpu",
    query_block: int = 64,
    prefilters: tuple[int, ...] = PREFILTERS,
    fold_prefilters: tuple[int, ...] = FOLD_PREFILTERS,
) -> dict[str, float]:
    """Recall of coarse-to-fine selection for each k in ``ks``.

    Parameters
    ----------
    data : held-out queries and engine keys; coarse_keys : [N, D] the keys the coarse stage sees (PQ
        decoded), row-aligned with ``data.keys``
    query_block : queries of one sequence scored together (their [block, prefix] score rows are held
        at once, causal prefixes masked)
    prefilters : the stage-1 factors P of (d); where ``P * C`` covers a query's prefix, (d) is (b)
    fold_prefilters : the stage-1 factors P of (e), likewise

    Returns
    -------
    {"k512/direct": r, "k512/rerank@2048": r, "k512/filter@2048": r, "k512/fetch@2048": share,
     "k512/prefilter4@2048": r, "k512/queries": n, ...} (means over queries whose prefix holds at least 4k
     keys), and the same per
    prefix band: {"k512@32K-64K/direct": r, ..., "k512@32K-64K/queries": n}
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}

    def add(name: str, values: list[float], bands: list[str]) -> None:  # overall, and in each query's band
        for value, band in zip(values, bands, strict=True):
            for key in (name, name.replace("/", f"@{band}/", 1)):
                sums[key] = sums.get(key, 0.0) + value
                counts[key] = counts.get(key, 0) + 1

    keys, coarse_all = data.keys.to(device), coarse_keys.to(device)
    starts, visible = data.key_start.long(), data.visible.long()
    for start in sorted(set(starts.tolist())):  # queries of one sequence share its keys
        rows = torch.nonzero(starts == start).flatten()
        for block in rows.split(query_block):
            n_rows = visible[block]
            width = int(n_rows.max())
            q, w = data.queries[block].to(device), data.head_weights[block].to(device)
            outside = torch.arange(width, device=device)[None, :] >= n_rows.to(device)[:, None]  # past the prefix
            exact = indexer_scores(q, keys[start : start + width], w).masked_fill(outside, float("-inf"))
            coarse = indexer_scores(q, coarse_all[start : start + width], w).masked_fill(outside, float("-inf"))
            folded = None
            if prefilters:  # stage 1's score: the head-weighted query against the coded key, no ReLU
                fold = torch.einsum("bh,bhd->bd", w.float(), q.float())
                folded = (fold @ coarse_all[start : start + width].float().T).masked_fill(outside, float("-inf"))
            grouped = None
            if fold_prefilters:  # the fold scan's score
                grouped = grouped_fold_scores(q, w, coarse_all[start : start + width]).masked_fill(outside,
                                                                                                   float("-inf"))
            for k in ks:
                live = torch.nonzero(n_rows >= 4 * k).flatten()
                if live.numel() == 0:
                    continue
                ex, co, n_live = exact[live.to(device)], coarse[live.to(device)], n_rows[live].tolist()
                bands = [prefix_band(n) for n in n_live]
                truth = torch.zeros_like(ex, dtype=torch.bool).scatter_(1, ex.topk(k).indices, True)
                tag = f"k{k}"
                add(f"{tag}/direct", _hits(truth, co.topk(k).indices, k), bands)
                for c in candidates:
                    # C at or above the prefix is exhaustive, C at or below k the direct top-k again
                    use = [i for i, n in enumerate(n_live) if k < c < n]
                    if not use:
                        continue
                    pick = torch.tensor(use, device=device)
                    cand_scores, cand = co[pick].topk(c)  # sorted descending
                    cand_exact = ex[pick].gather(1, cand)
                    hits = truth[pick]
                    rerank = cand.gather(1, cand_exact.topk(k).indices)
                    kept = miss_filter_keep(cand_scores, torch.ones_like(cand_scores, dtype=torch.bool), k)
                    # the filter keeps at least the top k candidates, so the exact top-k of the kept ones
                    # never reaches a dropped one
                    filtered = cand.gather(1, cand_exact.masked_fill(~kept, float("-inf")).topk(k).indices)
                    picked_bands = [bands[i] for i in use]
                    rerank_hits = _hits(hits, rerank, k)
                    add(f"{tag}/rerank@{c}", rerank_hits, picked_bands)
                    add(f"{tag}/filter@{c}", _hits(hits, filtered, k), picked_bands)
                    add(f"{tag}/fetch@{c}", (kept.sum(1).float() / c).tolist(), picked_bands)
                    prefixes = [n_live[i] for i in use]
                    for name, stage1, factors in (("prefilter", folded, prefilters), ("folds", grouped, fold_prefilters)):
                        scored = stage1[live.to(device)][pick] if factors else None
                        for p in factors:  # (d) and (e)
                            kept = _staged_hits(scored, co[pick], ex[pick], hits, prefixes, p * c, c, k, rerank_hits)
                            add(f"{tag}/{name}{p}@{c}", kept, picked_bands)
    out = {name: sums[name] / counts[name] for name in sums}
    for name in [n for n in counts if n.endswith("/direct")]:
        out[name.replace("/direct", "/queries")] = float(counts[name])
    for k in ks:
        out.setdefault(f"k{k}/queries", 0.0)
    return out


def grouped_fold_scores(queries: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[Q, N] the fold scan's stage-1 score of ``keys`` [N, D] for ``queries`` [Q, H, D] with ``head_weights``
    [Q, H], in float: the heads in the scan's groups (:func:`~dsaindex.kernels.pq_fold_cuda.head_groups`), group
    ``g`` folded into ``Q_g = sum_{h in g} w_h q_h``, a key scored ``sum_g leak x_g + relu(x_g)`` over the positive
    side's groups and ``leak x_g + min(x_g, 0)`` over the other's, ``x_g = Q_g . k`` (the kernel's slopes, before
    its int8 rounding)."""
    from dsaindex.kernels.pq_fold_cuda import FOLDS, LEAK, head_groups

    groups = head_groups(queries, head_weights)  # [Q, H]
    weighted = queries.float() * head_weights.float()[:, :, None]
    out = torch.zeros(queries.shape[0], keys.shape[0], device=keys.device)
    for g in range(FOLDS):
        x = (weighted * (groups == g)[:, :, None]).sum(1) @ keys.float().T
        out += LEAK * x + (x.clamp_min(0) if g < FOLDS // 2 else x.clamp_max(0))
    return out


def _staged_hits(folded: torch.Tensor, coarse: torch.Tensor, exact: torch.Tensor, truth: torch.Tensor,
                 prefixes: list[int], target: int, c: int, k: int, unstaged: list[float]) -> list[float]:
    """Per row, recall of the exact top-``k`` when stage 1, aiming at ``target`` (P x C) keys, keeps the
    :func:`~dsaindex.coarse.stage1_kept` keys of the highest ``folded`` score (what the kernels keep in
    expectation), the top ``c`` of those by ``coarse`` score are rescored exactly and the top ``k`` taken. Rows
    whose prefix stage 1 keeps whole pass every key to stage 2: their ``unstaged`` value (rerank@c)."""
    out = list(unstaged)
    rows = [i for i, n in enumerate(prefixes) if stage1_kept(target, n) < n]
    if not rows:
        return out
    kept = stage1_kept(target, max(prefixes[i] for i in rows))  # the same for every row stage 1 thins
    r = torch.tensor(rows, device=folded.device)
    stage1 = folded[r].topk(kept).indices
    cand = stage1.gather(1, coarse[r].gather(1, stage1).topk(c).indices)
    picked = cand.gather(1, exact[r].gather(1, cand).topk(k).indices)
    for i, v in zip(rows, _hits(truth[r], picked, k), strict=True):
        out[i] = v
    return out


@dataclass
class SequenceQueries:
    """One sequence's engine keys [n, D] and some of its sampled queries: positions [Q] (int list),
    queries [Q, H, D], head weights [Q, H]."""

    sequence: int
    keys: torch.Tensor
    positions: list[int]
    queries: torch.Tensor
    head_weights: torch.Tensor


def queries_by_sequence(store: CaptureStore, layer: int, sequences: list[int], min_visible: int, max_queries: int,
                        device: str = "cpu") -> list[SequenceQueries]:
    """Sampled queries of ``sequences`` that see more than ``min_visible`` keys (at most ``max_queries``,
    evenly spread), grouped by sequence with that sequence's engine keys (key stride 1)."""
    key_format = store.manifest.model.geometry.key_format
    offsets = sequence_key_offsets(store)
    positions = store.array("query_position").astype(np.int64)
    seq_of = store.array("query_sequence").astype(np.int64)
    rows = np.nonzero(np.isin(seq_of, sequences) & (visible_key_count(positions) > min_visible))[0]
    if len(rows) > max_queries:
        rows = rows[np.linspace(0, len(rows) - 1, max_queries).round().astype(np.int64)]
    queries = store.as_float(store.queries(layer)[rows]).to(device)
    weights = torch.from_numpy(store.head_weights(layer)[rows]).to(device)
    raw = store.keys(layer)
    out = []
    for seq in sorted(set(seq_of[rows].tolist())):
        mine = np.nonzero(seq_of[rows] == seq)[0]
        keys = store.engine_keys(raw[offsets[seq] : offsets[seq + 1]], key_format).to(device)
        out.append(SequenceQueries(seq, keys, positions[rows[mine]].tolist(), queries[mine], weights[mine]))
    return out
