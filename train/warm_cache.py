"""Steady-state decode recall: the captured decode windows replayed through the runtime's own cache.

The recall of :mod:`dsaindex.train.recall` scores each held-out query alone, so its miss filter sees a
cold cache: every candidate is a miss, and the filter drops the weakest of them. A decode server runs
step after step over the same request, and LeanSparse's filter runs on a warm cache: candidates the
cache holds are always kept, only misses can be dropped, and only misses are fetched from host.

A capture records, besides scattered queries, windows of consecutive positions (decode-like steps,
``--windows`` / ``--window-len`` of ``dsaindex capture``). :func:`warm_window_recall` replays each
held-out window through a :class:`dsaindex.runtime.pq_batch.PQDecodeGroup` built from the layer's codec,
the same object a server runs: the request's keys up to the window's first position, then one key
and one selection per step, its set-associative cache carried from step to step. Per step it compares
the selection with the exact top-k of the FP8 keys the step sees, with the miss filter and without it
(every candidate rescored), and records the share of the candidates read from host (the fetches) and
the share the cache held (the hits). The first step of a window runs on a cold cache; later steps are
the steady state.

The filter's margin (``filter_widths``, standard deviations below the k-th coarse score) trades host
reads for recall; each width is a replay of its own, its cache filled by its own fetches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from dsaindex.coarse import FILTER_WIDTH, PREFILTER
from dsaindex.geometry import visible_key_count
from dsaindex.train.recall import sequence_key_offsets

if TYPE_CHECKING:
    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.pq import PQCodec


def decode_windows(store: CaptureStore, sequences: list[int]) -> list[tuple[int, np.ndarray]]:
    """(sequence, row indices of its recorded queries in position order) per decode window of
    ``sequences``."""
    seq_of = store.array("query_sequence").astype(np.int64)
    window = store.array("query_window").astype(np.int64)
    position = store.array("query_position").astype(np.int64)
    out = []
    for seq in sequences:
        for w in sorted(set(window[(seq_of == seq) & (window >= 0)].tolist())):
            rows = np.nonzero((seq_of == seq) & (window == w))[0]
            out.append((seq, rows[np.argsort(position[rows], kind="stable")]))
    return out


def _replay(codec: PQCodec, keys: torch.Tensor, visible: list[int], queries: torch.Tensor, weights: torch.Tensor,
            topk: int, candidates: int, prefilter: int, cache: int, filter_width: float | None, device: str,
            use_triton: bool | None, grow_band: int = 0) -> list[dict[str, float]]:
    """One window's steps through a fresh one-request group: per step the selection's recall of the exact
    top-k, and the shares of the candidates fetched from host and held by the cache. ``filter_width``
    None: no miss filter. ``grow_band``: C grown past it (:meth:`PQDecodeGroup.grow_past`)."""
    from dsaindex.kernels.fp8_score import fp8_topk_reference
    from dsaindex.quant import fp8_quantize
    from dsaindex.runtime.host_store import HostKeyStore
    from dsaindex.runtime.pq_batch import PQDecodeGroup

    n = visible[-1]
    group = PQDecodeGroup(codec, HostKeyStore(-(-n // 64) + 1, keys.shape[1]), 1, n, topk, candidates=candidates,
                          prefilter=prefilter, cache_capacity=cache, miss_filter=filter_width is not None,
                          filter_width=FILTER_WIDTH if filter_width is None else filter_width, device=device,
                          use_triton=use_triton)
    if grow_band:
        group.grow_past(grow_band)
    group.admit(0)
    fp8, scales = fp8_quantize(keys[:n].to(device).float())
    fp8 = fp8.view(torch.uint8)[None]
    scales = scales.reshape(1, -1)
    steps, seen = [], 0
    for i, upto in enumerate(visible):
        group.append(0, keys[seen:upto].to(device))
        seen = upto
        q, w = queries[i : i + 1].to(device), weights[i : i + 1].to(device)
        picked, stats = group.select(q, w)
        lengths = torch.tensor([upto], device=device)
        _, want = fp8_topk_reference(fp8[:, :upto], scales[:, :upto], lengths, q, w, min(topk, upto))
        truth = set(want[0].tolist())
        cand = max(1.0, float(stats.candidates.sum()))
        steps.append({"recall": len(truth & set(picked[0].tolist())) / max(1, len(truth)),
                      "fetch": float(stats.fetched.sum()) / cand, "hit": float(stats.hits.sum()) / cand,
                      "prefix": upto})
    return steps


def warm_window_recall(store: CaptureStore, codecs: dict[int, PQCodec], sequences: list[int], topk: int,
                       candidates: int = 2048, prefilter: int = PREFILTER, cache: int = 4096, min_prefix: int = 0,
                       max_windows: int | None = None, device: str = "cpu", use_triton: bool | None = None,
                       progress: Callable[[int, int, str], None] | None = None,
                       filter_widths: tuple[float, ...] | None = None, grow_band: int = 0) -> dict:
    """Replay the decode windows of held-out ``sequences`` through each layer's runtime group (module
    docstring). Windows whose first step sees fewer than ``min_prefix`` keys are skipped.

    Returns {"per_layer": {layer: metrics}, "mean": metrics, "windows", "steps_per_window"}, metrics:
    ``warm_recall_filter`` / ``warm_recall_rerank`` (steps after a window's first, with the miss filter /
    every candidate rescored), ``warm_filter_loss`` (their difference, in points), ``warm_fetch_share``
    and ``warm_hit_share`` (shares of the candidates per step), ``cold_recall_filter`` and
    ``cold_fetch_share`` (the first steps), ``fetch_share_by_step`` (mean per step index), all for the
    first of ``filter_widths`` (default: :data:`dsaindex.coarse.FILTER_WIDTH` alone); ``by_width``
    {width: the filter's metrics} for each of them. ``grow_band``: C grows with each doubling of the prefix past
    it, as servers grow it (a grown step keeps every candidate: its filter and no-filter runs select alike), the
    device cache sized for the growth."""
    widths = tuple(float(w) for w in filter_widths) if filter_widths else (FILTER_WIDTH,)
    key_format = store.manifest.model.geometry.key_format
    position = store.array("query_position").astype(np.int64)
    offsets = sequence_key_offsets(store)
    windows = []
    for seq, rows in decode_windows(store, sequences):
        visible = [int(v) for v in visible_key_count(position[rows])]
        if rows.size and visible[0] >= min_prefix and visible[0] > topk:
            windows.append((seq, rows, visible))
    windows = windows[:max_windows] if max_windows else windows
    per_layer: dict[int, dict] = {}
    total = len(codecs) * len(windows)
    done = 0
    for layer, codec in codecs.items():
        raw = store.keys(layer)
        runs: dict[float | None, list[list[dict]]] = {w: [] for w in (*widths, None)}
        for seq, rows, visible in windows:
            keys = store.engine_keys(raw[offsets[seq] : offsets[seq + 1]], key_format)
            queries = store.as_float(store.queries(layer)[rows])
            weights = torch.from_numpy(store.head_weights(layer)[rows])
            for width in runs:
                runs[width].append(_replay(codec, keys, visible, queries, weights, topk, candidates, prefilter,
                                           cache, width, device, use_triton, grow_band))
            done += 1
            if progress:
                progress(done, total, f"layer {layer}")
        if windows:
            per_layer[layer] = _summarize(runs, widths)
    names = [k for k in next(iter(per_layer.values()), {}) if k not in ("fetch_share_by_step", "by_width")]
    mean = {k: round(float(np.mean([m[k] for m in per_layer.values()])), 5) for k in names}
    if per_layer:
        mean["by_width"] = {w: {k: round(float(np.mean([m["by_width"][w][k] for m in per_layer.values()])), 5)
                                for k in _WIDTH_KEYS} for w in next(iter(per_layer.values()))["by_width"]}
        by_step = [m["fetch_share_by_step"] for m in per_layer.values()]
        mean["fetch_share_by_step"] = [round(float(np.mean(col)), 4) for col in zip(*by_step, strict=False)]
    return {"per_layer": per_layer, "mean": mean, "windows": len(windows),
            "steps_per_window": len(windows[0][2]) if windows else 0,
            "topk": topk, "candidates": candidates, "prefilter": prefilter, "cache": cache,
            "filter_width": widths[0], "grow_band": grow_band}


_WIDTH_KEYS = ("warm_recall_filter", "warm_filter_loss", "warm_fetch_share", "warm_hit_share", "cold_recall_filter",
               "cold_fetch_share")


def _summarize(runs: dict[float | None, list[list[dict]]], widths: tuple[float, ...]) -> dict:
    def mean(values: list[float]) -> float:
        return round(float(np.mean(values)), 5) if values else float("nan")

    def filtered(width: float) -> dict:
        warm = [s for steps in runs[width] for s in steps[1:]]
        first = [steps[0] for steps in runs[width]]
        out = {"warm_recall_filter": mean([s["recall"] for s in warm]),
               "warm_fetch_share": mean([s["fetch"] for s in warm]),
               "warm_hit_share": mean([s["hit"] for s in warm]),
               "cold_recall_filter": mean([s["recall"] for s in first]),
               "cold_fetch_share": mean([s["fetch"] for s in first])}
        out["warm_filter_loss"] = round(100 * (rerank - out["warm_recall_filter"]), 3)
        return out

    rerank = mean([s["recall"] for steps in runs[None] for s in steps[1:]])
    main = widths[0]
    steps_per_window = max(len(steps) for steps in runs[main])
    out = filtered(main) | {"warm_recall_rerank": rerank,
                            "mean_prefix": mean([s["prefix"] for steps in runs[main] for s in steps])}
    out["fetch_share_by_step"] = [mean([steps[i]["fetch"] for steps in runs[main] if i < len(steps)])
                                  for i in range(steps_per_window)]
    out["by_width"] = {f"{w:g}": filtered(w) for w in widths}
    return out
