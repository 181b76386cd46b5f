"""``dsaindex train reuse`` / ``eval reuse``: which indexer layers to keep when the others reuse a top-k.

For each sampled query position and each indexer layer, the exact top-k over the causal prefix
(:func:`dsaindex.score.indexer_scores` + :func:`dsaindex.score.causal_topk`, keys as the engines store
them); per ordered layer pair ``(i, j)`` the mean overlap ``|S_i & S_j| / |S_j|``: the recall layer ``j``
keeps if it uses layer ``i``'s selection. For a retention ``1/N`` the plan keeps ``ceil(L / N)``
indexers, the first layer's always, and every other layer reuses the nearest kept layer before it
(IndexCache / MLI reuse runs forward). :func:`best_plan` picks the kept set that maximizes the mean
retained recall exactly, by a dynamic program over segments (a segment starts at a kept layer); the
evenly spaced pattern (every N-th layer) is reported beside it.

Overlaps that choose the plans come from the training sequences; the held-out sequences (the last fifth,
as for PQ and IVF) measure the plans' retained recall.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dsaindex.artifacts.kinds import ReusePlan, ReusePlans, kept_count, retention_stride, reuse_sources
from dsaindex.errors import DsaIndexError

if TYPE_CHECKING:
    import torch

    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.geometry import IndexerGeometry

Progress = Callable[[int, int, str], None]
STRIDES = (2, 4, 8, 16, 32)
"""Retentions 1/2 ... 1/32; those above the layer count are left out."""


# ---- plans -----------------------------------------------------------------------------------------
def retentions_for(num_layers: int) -> list[str]:
    """``["1/2", "1/4", ...]``: the retentions 1/N of :data:`STRIDES` with N at most ``num_layers``."""
    return [f"1/{s}" for s in STRIDES if s <= num_layers]


def retained_recall(overlap: np.ndarray, kept: list[int]) -> float:
    """Mean over layers of ``overlap[source, layer]`` for a kept set (indices into ``overlap``, 0 first)."""
    sources = reuse_sources(list(range(len(overlap))), kept)
    return float(np.mean([overlap[s, j] for j, s in enumerate(sources)]))


def best_plan(overlap: np.ndarray, keep: int) -> list[int]:
    """Indices (0 first, ascending) of the ``keep`` layers that maximize :func:`retained_recall`.

    Exact: ``best[c, b]`` is the largest retained-recall sum over layers ``[0, b)`` split into ``c``
    segments, each reusing its first layer; ``best[c, b] = max_a best[c-1, a] + seg(a, b)``.
    O(keep * L^2) with prefix sums of each row of ``overlap`` [L, L].
    """
    n = len(overlap)
    assert 1 <= keep <= n, f"keep {keep} of {n} layers"
    o = np.asarray(overlap, dtype=np.float64)
    prefix = np.concatenate([np.zeros((n, 1)), np.cumsum(o, axis=1)], axis=1)  # prefix[a, b] = sum_{j<b} o[a, j]

    def seg(a: int, b: int) -> float:
        return prefix[a, b] - prefix[a, a]

    best = np.full((keep + 1, n + 1), -np.inf)
    start = np.zeros((keep + 1, n + 1), dtype=np.int64)
    for b in range(1, n + 1):
        best[1, b] = seg(0, b)
    for c in range(2, keep + 1):
        for b in range(c, n + 1):
            for a in range(c - 1, b):
                value = best[c - 1, a] + seg(a, b)
                if value > best[c, b]:
                    best[c, b], start[c, b] = value, a
    kept, b = [], n
    for c in range(keep, 1, -1):
        b = int(start[c, b])
        kept.append(b)
    return [0, *sorted(kept)]


def make_plans(overlap: np.ndarray, layers: list[int]) -> list[ReusePlan]:
    """The optimal and the evenly spaced plan of every retention, in layer ids."""
    plans = []
    for retention in retentions_for(len(layers)):
        stride = retention_stride(retention)
        keep = kept_count(len(layers), stride)
        for method, kept in (("optimal", best_plan(overlap, keep)), ("even", list(range(0, len(layers), stride)))):
            ids = [layers[i] for i in kept]
            plans.append(ReusePlan(retention=retention, method=method, kept=ids, sources=reuse_sources(layers, ids),
                                   recall=round(min(1.0, max(0.0, retained_recall(overlap, kept))), 6)))
    return plans


def plan_recall(overlap: np.ndarray, layers: list[int], plan: ReusePlan) -> float:
    """Retained recall of a plan (layer ids) under an overlap matrix (rows and columns in ``layers`` order)."""
    return retained_recall(overlap, [layers.index(k) for k in plan.kept])


def engine_config(geometry: IndexerGeometry, kept: list[int]) -> dict[str, Any] | None:
    """The config keys SGLang and vLLM read for top-k sharing, for a kept set (layer ids).

    ``index_topk_pattern``: one character per decoder layer, ``F`` where the layer runs its indexer,
    ``S`` where it reuses the top-k of the last ``F`` layer before it (SGLang ``dsa_layer_skips_topk``,
    vLLM ``DeepseekV2MLAAttention``); ``indexer_types``: the same as ``full`` / ``shared`` (the GLM-5
    config field, which SGLang reads before the pattern). Decoder layers without an indexer in the model
    stay ``S``. None for DeepSeek-V4, whose engines read no such key.
    """
    if geometry.family == "deepseek_v4":
        return None
    keep = set(kept)
    types = ["full" if i in keep else "shared" for i in range(geometry.num_layers)]
    return {"index_topk_pattern": "".join("F" if t == "full" else "S" for t in types), "indexer_types": types}


# ---- exact selections and their overlap ------------------------------------------------------------
def sampled_rows(store: CaptureStore, sequences: list[int], topk: int, max_queries: int) -> np.ndarray:
    """Rows of the sampled queries of ``sequences`` whose causal prefix holds more than ``topk`` keys (a
    shorter prefix is selected whole in every layer), at most ``max_queries``, evenly spread."""
    from dsaindex.geometry import visible_key_count

    stride = store.manifest.model.geometry.key_stride
    positions = store.array("query_position").astype(np.int64)
    seq_of = store.array("query_sequence").astype(np.int64)
    visible = np.minimum(visible_key_count(positions, stride), store.array("sequence_keys").astype(np.int64)[seq_of])
    rows = np.nonzero(np.isin(seq_of, sequences) & (visible > topk))[0]
    if len(rows) > max_queries:
        rows = rows[np.linspace(0, len(rows) - 1, max_queries).round().astype(np.int64)]
    return rows


def exact_selections(store: CaptureStore, layer: int, rows: np.ndarray, topk: int, device: str = "cpu") -> torch.Tensor:
    """[Q, topk] int64: the exact top-k key indices (within its sequence) of each query row in one layer."""
    import torch

    from dsaindex.score import causal_topk, indexer_scores
    from dsaindex.train.recall import sequence_key_offsets

    geometry = store.manifest.model.geometry
    offsets = sequence_key_offsets(store)
    positions = store.array("query_position").astype(np.int64)[rows]
    seq_of = store.array("query_sequence").astype(np.int64)[rows]
    queries = store.as_float(store.queries(layer)[rows])
    weights = torch.from_numpy(store.head_weights(layer)[rows])
    raw = store.keys(layer)
    out = torch.full((len(rows), topk), -1, dtype=torch.int64)
    for seq in sorted(set(seq_of.tolist())):
        mine = np.nonzero(seq_of == seq)[0]
        keys = store.engine_keys(raw[offsets[seq] : offsets[seq + 1]], geometry.key_format).to(device)
        scores = indexer_scores(queries[mine].to(device), keys, weights[mine].to(device))
        _, idx = causal_topk(scores, torch.from_numpy(positions[mine]).to(device), topk, geometry.key_stride)
        out[torch.from_numpy(mine), : idx.shape[1]] = idx.cpu()
    return out


def overlap_matrix(selections: list[torch.Tensor]) -> np.ndarray:
    """[L, L] float32: ``overlap[i, j]`` = mean over queries of ``|S_i & S_j| / |S_j|`` for per-layer
    selections [Q, k] (int64 key indices, -1 empty). The diagonal is 1."""
    import torch

    sel = torch.stack(selections, dim=1)  # [Q, L, k]
    num_q, num_l, _ = sel.shape
    width = int(sel.max()) + 2  # one spare column takes the empty slots
    total = torch.zeros(num_l, num_l, dtype=torch.float64)
    block = max(1, (1 << 26) // max(1, num_l * width))
    for start in range(0, num_q, block):
        part = sel[start : start + block]
        member = torch.zeros(part.shape[0], num_l, width, dtype=torch.float32)
        member.scatter_(2, torch.where(part < 0, width - 1, part), 1.0)
        member = member[..., : width - 1]
        shared = torch.bmm(member, member.transpose(1, 2)).double()  # [q, L, L]
        sizes = member.sum(-1).double().clamp_min(1)  # [q, L]
        total += (shared / sizes.unsqueeze(1)).sum(0)
    return (total / max(1, num_q)).float().numpy()


def measure_overlap(store: CaptureStore, sequences: list[int], topk: int, max_queries: int, device: str = "cpu",
                    progress: Callable[[str], None] | None = None) -> tuple[np.ndarray, int]:
    """(overlap [L, L] float32 over the store's indexer layers, queries used) on ``sequences``."""
    rows = sampled_rows(store, sequences, topk, max_queries)
    if not len(rows):
        raise DsaIndexError(f"No sampled query of {store.path} in sequences {sequences[:8]}"
                            f"{'...' if len(sequences) > 8 else ''} sees more than {topk} keys.",
                            "capture longer sequences (--seq-len), or pass a smaller --topk.")
    selections = []
    for layer in store.layers:
        if progress:
            progress(f"top-{topk} of layer {layer}")
        selections.append(exact_selections(store, layer, rows, topk, device))
    if progress:
        progress("overlap")
    return overlap_matrix(selections), len(rows)


# ---- the job ---------------------------------------------------------------------------------------
def check_options(store: CaptureStore, topk: int | None, max_queries: int) -> int:
    """The top-k to use; refuses values no analysis can use and stores with fewer than two indexer layers."""
    if max_queries < 1:
        raise DsaIndexError(f"--queries {max_queries} is below 1.", "pass --queries 1 or more.")
    k = store.manifest.model.geometry.topk if topk is None else topk
    if k < 1:
        raise DsaIndexError(f"--topk {k} is below 1.", "pass --topk 1 or more (default: the model's index_topk).")
    if len(store.layers) < 2:
        raise DsaIndexError(f"{store.path} holds {len(store.layers)} indexer layer(s); reuse needs at least 2.",
                            "capture from a model with several indexer layers.")
    return k


def default_bundle_path(store_path: str | Path) -> Path:
    """``runs/bundles/<store name>-reuse``, or with ``-2``, ``-3``, ... where that is taken."""
    from dsaindex.artifacts.bundle import fresh_bundle_path

    return fresh_bundle_path(Path("runs/bundles") / f"{Path(store_path).name}-reuse")


def overlap_plot(overlap: np.ndarray, layers: list[int], path: Path, title: str) -> Path:
    """Heat map of ``overlap`` (rows: the layer whose top-k is reused; columns: the layer reusing it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    size = min(12.0, 3.0 + 0.15 * len(layers))
    fig, ax = plt.subplots(figsize=(size + 1, size))
    image = ax.imshow(overlap, vmin=0.0, vmax=1.0, cmap="viridis", origin="upper")
    ticks = range(0, len(layers), max(1, len(layers) // 16))
    ax.set_xticks(list(ticks), [str(layers[i]) for i in ticks])
    ax.set_yticks(list(ticks), [str(layers[i]) for i in ticks])
    ax.set_xlabel("layer j (reuses)")
    ax.set_ylabel("layer i (selection reused)")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="|S_i & S_j| / |S_j|")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _table(plans: list[ReusePlan], heldout: np.ndarray, layers: list[int], geometry: IndexerGeometry) -> dict:
    out: dict[str, Any] = {}
    for p in plans:
        entry = out.setdefault(p.retention, {})
        prefix = "" if p.method == "optimal" else "even_"
        entry[f"{prefix}kept"] = p.kept
        entry[f"{prefix}train_recall"] = p.recall
        entry[f"{prefix}recall"] = round(plan_recall(heldout, layers, p), 6)
        entry[f"{prefix}engine_config"] = engine_config(geometry, p.kept)
    return out


def _metrics(table: dict) -> dict[str, float]:
    return {f"keep_1_of_{r.split('/')[1]}/{m}_recall": float(v[key])
            for r, v in table.items() for m, key in (("optimal", "recall"), ("even", "even_recall"))}


def run_reuse_job(store_path: str | Path, topk: int | None = None, max_queries: int = 256, out: Path | None = None,
                  register: bool = True, tracking_uri: str | None = None, plot: Path | None = None,
                  device: str = "cpu", progress: Progress | None = None) -> dict:
    """Overlaps on the training sequences, plans, their held-out recall, the heat map, the bundle and
    (``register``) its registration. Returns a JSON-ready ``{bundle, registered, plot, topk, layers,
    queries, plans}`` where ``plans[retention]`` holds the optimal and ``even_`` plan's kept layers,
    training and held-out recall and engine config keys."""
    from dsaindex.artifacts.bundle import (
        LayerArtifact,
        check_bundle_destination,
        new_bundle_manifest,
        store_lineage,
        write_bundle,
    )
    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.train.recall import split_sequences

    store = CaptureStore.open(store_path)
    store.check_chunks()  # every layer's chunks are there before the analysis reads one
    k = check_options(store, topk, max_queries)
    out = check_bundle_destination(out if out is not None else default_bundle_path(store_path))
    if register:  # an unreachable tracking server fails now, not after the analysis
        from dsaindex.artifacts.registry import ensure_reachable

        ensure_reachable(tracking_uri)
    split = split_sequences(store.committed.sequences)
    layers = list(store.layers)
    total, done = 2 * (len(layers) + 1), 0

    def step(text: str) -> None:
        nonlocal done
        if progress:
            progress(done, total, text)
        done += 1

    overlap, train_queries = measure_overlap(store, split[0], k, max_queries, device, lambda t: step(f"train: {t}"))
    heldout, eval_queries = measure_overlap(store, split[1], k, max_queries, device, lambda t: step(f"held-out: {t}"))
    if progress:
        progress(total, total, "done")
    plans = make_plans(overlap, layers)
    geometry = store.manifest.model.geometry
    table = _table(plans, heldout, layers, geometry)
    params = {"plans_in_layer": layers[0], "layers": layers, "topk": k,
              "plans": [p.model_dump() for p in plans], "train_queries": train_queries}
    artifacts = {str(layers[0]): LayerArtifact(kind="reuse", params=params)}
    artifacts.update({str(layer): LayerArtifact(kind="reuse", params={"plans_in_layer": layers[0]})
                      for layer in layers[1:]})
    metrics = _metrics(table)
    run_params = {"topk": k, "queries": max_queries, "retentions": ",".join(table)}
    manifest = new_bundle_manifest(model=store.manifest.model, basis=store.manifest.settings.basis,
                                   key_format=geometry.key_format, layers=artifacts,
                                   lineage=store_lineage(store, split), metrics=metrics, params=run_params)
    plot = overlap_plot(overlap, layers, plot if plot is not None else out.parent / f"{out.name}-overlap.png",
                        f"top-{k} overlap between layers ({Path(store_path).name})")
    manifest = write_bundle(out, manifest, {layers[0]: {"overlap": overlap.astype(np.float32)}})
    registered = None
    if register:
        from dsaindex.artifacts.registry import register_bundle

        registered = register_bundle(out, run_params | {"store": str(store_path)}, manifest.metrics, [plot],
                                     tracking_uri=tracking_uri)
    return {"bundle": str(out), "registered": registered, "plot": str(plot), "topk": k, "layers": layers,
            "queries": {"train": train_queries, "held_out": eval_queries}, "plans": table}


def load_plans(path: str | Path, device: str = "cpu") -> tuple[Any, ReusePlans]:
    """(manifest, :class:`ReusePlans`) of a ``reuse`` bundle, checksums and plans verified; every other
    layer must refer to the layer holding the plans."""
    from dsaindex.artifacts.bundle import read_bundle
    from dsaindex.artifacts.kinds import ReuseRef
    from dsaindex.errors import CorruptBundleError
    from dsaindex.runtime.loader import place_layers

    manifest, arrays = read_bundle(path, verify=True)
    kinds = {art.kind for art in manifest.layers.values()}
    if kinds != {"reuse"}:
        raise DsaIndexError(f"{path} holds {sorted(kinds)} artifacts, not reuse plans.",
                            "pass a bundle written by `dsaindex train reuse`.")
    placed = place_layers(manifest, arrays, device)
    holders = [served for served in placed.values() if isinstance(served, ReusePlans)]
    if len(holders) != 1:
        raise CorruptBundleError(f"{path} has {len(holders)} layers holding reuse plans; it must have one.",
                                 "train the plans again (`dsaindex train reuse STORE`).")
    plans = holders[0]
    refs = {layer: s.plans_in_layer for layer, s in placed.items() if isinstance(s, ReuseRef)}
    wrong = {layer: at for layer, at in refs.items() if at != plans.layers[0]}
    if wrong or sorted(placed) != plans.layers:
        raise CorruptBundleError(f"{path}: the reuse layers {sorted(placed)} do not all refer to the plans in layer "
                                 f"{plans.layers[0]} covering {plans.layers}"
                                 + (f" (layers {sorted(wrong)} refer elsewhere)" if wrong else "") + ".",
                                 "train the plans again (`dsaindex train reuse STORE`).")
    return manifest, plans


def evaluate_bundle(bundle: str | Path, store_path: str | Path, max_queries: int = 256, device: str = "cpu",
                    progress: Progress | None = None) -> dict:
    """Held-out retained recall of each plan of a ``reuse`` bundle beside the evenly spaced one, on a store
    of its model. Returns ``{bundle, store, topk, queries, plans}`` (``plans`` as :func:`run_reuse_job`)."""
    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.artifacts.compat import check_store_for_bundle
    from dsaindex.train.recall import split_sequences

    if max_queries < 1:
        raise DsaIndexError(f"--queries {max_queries} is below 1.", "pass --queries 1 or more.")
    manifest, plans = load_plans(bundle)
    store = CaptureStore.open(store_path)
    check_store_for_bundle(store.manifest, manifest, str(store_path), str(bundle))
    total = len(plans.layers) + 1
    count = iter(range(total))

    def step(text: str) -> None:
        if progress:
            progress(next(count), total, text)

    heldout, queries = measure_overlap(store, split_sequences(store.committed.sequences)[1], plans.topk,
                                       max_queries, device, step)
    if progress:
        progress(total, total, "done")
    return {"bundle": str(bundle), "store": str(store_path), "topk": plans.topk, "queries": queries,
            "plans": _table(plans.plans, heldout, plans.layers, store.manifest.model.geometry)}
