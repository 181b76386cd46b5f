"""Train per-layer PQ codebooks on a capture store, evaluate them on held-out sequences, write a bundle.

Keys are trained in the store's basis and in the precision the engine stores (FP8 e4m3 + ue8m0,
dequantized). The last fifth of the store's sequences is held out: neither codebooks nor score-aware
metrics see them; every reported recall comes from them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from dsaindex.coarse import PREFILTER
from dsaindex.pq import PQCodec, PQSpec, rotate
from dsaindex.train.additive import QUANTIZERS, AdditiveCodec, check_codebook_size, full_spec, train_additive
from dsaindex.train.codebooks import score_gradient_metric, train_codebooks, train_rotation
from dsaindex.train.recall import (
    CANDIDATES,
    PAPER_K,
    evaluate_selection,
    held_out,
    layer_keys,
    sequence_key_offsets,
    split_sequences,
)

if TYPE_CHECKING:
    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.train.cluster import RaySettings

# OPQ's Procrustes rounds after the balanced-PCA start (:func:`dsaindex.train.codebooks.train_rotation`), by
# where their k-means runs. GPU (the torch trainer on CUDA): 6, the rounds every recorded OPQ recall was measured
# with (docs/results.md), under 2 s a layer at 262K keys. CPU: each round retrains the codebooks (4 k-means
# iterations) and encodes the keys, about 2 s a layer at 13K keys on 2 cores, so 6 rounds tripled a layer's
# training (4.5 -> 13-16 s on the demo's store); they lowered the held-out reconstruction error by only 0-3%
# beyond the start (reference checkpoint, PQ16 and PQ32) and left recall unchanged. So the CPU runs the start
# alone, OPQ's parametric form (Ge et al. 2013: eigenvalue allocation), at plain PQ's cost.
GPU_ROTATION_ROUNDS = 6
CPU_ROTATION_ROUNDS = 0


def default_rotation_rounds(trainer: str, device: str) -> int:
    """Procrustes rounds of an OPQ rotation where none were asked for: :data:`GPU_ROTATION_ROUNDS` when the
    rounds' k-means runs on a GPU (``trainer`` torch on a CUDA ``device``), else :data:`CPU_ROTATION_ROUNDS`."""
    return GPU_ROTATION_ROUNDS if trainer == "torch" and str(device).startswith("cuda") else CPU_ROTATION_ROUNDS


Progress = Callable[[int, int, str], None]
"""``progress(layers done, layers in all, the step running now)``, e.g. :func:`dsaindex.console.progress_bar`'s
``update``."""


@dataclass
class PQOptions:
    subspaces: int = 32
    centroids: int = 256
    trainer: str = "faiss"
    iterations: int = 20
    score_aware: bool = True
    # OPQ: a learned orthogonal rotation before PQ, stored in the bundle beside the codebooks. Off here (library
    # callers keep plain PQ); `dsaindex train pq` turns it on for product codes unless --no-rotate.
    rotate: bool = False
    rotation_rounds: int | None = None  # OPQ: Procrustes rounds; None: default_rotation_rounds(trainer, device)
    quantizer: str = "pq"  # or "rq" / "lsq": ``subspaces`` whole-key codebooks (train.additive; LSQ compared only)
    beam: int = 5  # rq: beam width of the residual search, in training and in the served codec's page encoding
    max_train_keys: int = 262144
    metric_queries: int = 256
    eval_fraction: float = 0.2
    max_eval_queries: int = 128
    candidates: tuple[int, ...] = CANDIDATES
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.rotate and self.rotation_rounds is None:  # resolved once, so Ray tasks on other devices agree
            self.rotation_rounds = default_rotation_rounds(self.trainer, self.device)

    def params(self) -> dict:
        d = asdict(self)
        d["candidates"] = list(self.candidates)
        d.pop("device")
        return d


@dataclass
class LayerResult:
    layer: int
    codebooks: torch.Tensor
    metric: torch.Tensor | None
    train_keys: int
    train_seconds: float
    metrics: dict[str, float] = field(default_factory=dict)
    rotation: torch.Tensor | None = None  # [D, D] orthogonal: codes are of keys @ rotation.T
    additive: AdditiveCodec | None = None  # an RQ / LSQ code instead of PQ codebooks
    residual: PQCodec | None = None  # an RQ code as the runtime serves it (AdditiveCodec.served)
    worker: dict = field(default_factory=dict)  # trained on Ray: host, pid, device, threads, seconds

    @property
    def codec(self) -> PQCodec | AdditiveCodec:
        """The layer's codec, as a bundle stores it and the runtime serves it (RQ: the residual codec; LSQ: as
        trained, compared only)."""
        if self.residual is not None:
            return self.residual
        return self.additive if self.additive is not None else PQCodec(self.codebooks, self.metric, self.rotation)


def _subsample(keys: torch.Tensor, limit: int, seed: int) -> torch.Tensor:
    if keys.shape[0] <= limit:
        return keys
    g = torch.Generator().manual_seed(seed)
    return keys[torch.randperm(keys.shape[0], generator=g)[:limit].sort().values]


def metric_for_layer(store: CaptureStore, layer: int, train_sequences: list[int], key_format: str, spec: PQSpec,
                     max_queries: int, topk: int, rotation: torch.Tensor | None = None,
                     device: str | torch.device = "cpu", raw: np.ndarray | None = None,
                     query_block: int = 32) -> torch.Tensor:
    """Score-aware metric from the training sequences' sampled queries and their exact top-(2 topk) keys
    (in the rotated space when ``rotation`` is given: queries and keys rotated alike).

    Each sequence's keys are put in engine form once, up to its longest sampled prefix, and scored on
    ``device`` ``query_block`` queries at a time (causal prefixes masked); the metric is accumulated there
    too. ``raw``: the layer's stored keys when already read (``store.keys(layer)``)."""
    from dsaindex.geometry import visible_key_count
    from dsaindex.score import indexer_scores

    positions = store.array("query_position").astype(np.int64)
    seq_of = store.array("query_sequence").astype(np.int64)
    stride = store.manifest.model.geometry.key_stride
    offsets = sequence_key_offsets(store)
    rows = metric_rows(store, train_sequences, max_queries)
    dev = torch.device(device)
    queries = store.as_float(store.queries(layer)[rows]).to(dev)
    weights = torch.from_numpy(store.head_weights(layer)[rows]).to(dev)
    raw = store.keys(layer) if raw is None else raw
    chosen = [torch.zeros(0, spec.dim, device=dev)] * len(rows)
    for seq in np.unique(seq_of[rows]):
        mine = np.nonzero(seq_of[rows] == seq)[0]
        start, length = int(offsets[seq]), int(offsets[seq + 1] - offsets[seq])
        visible = np.minimum(visible_key_count(positions[rows[mine]], stride), length)
        mine, visible = mine[visible > 0], visible[visible > 0]
        if not len(mine):
            continue
        keys = store.engine_keys(raw[start : start + int(visible.max())], key_format).to(dev)
        for lo in range(0, len(mine), query_block):
            block, counts = mine[lo : lo + query_block], visible[lo : lo + query_block]
            width = int(counts.max())
            outside = torch.arange(width, device=dev)[None, :] >= torch.from_numpy(counts).to(dev)[:, None]
            scores = indexer_scores(queries[block], keys[:width], weights[block]).masked_fill(outside, float("-inf"))
            top = scores.topk(min(2 * topk, width)).indices  # sorted: a row's in-prefix keys come first
            for j, (i, count) in enumerate(zip(block, counts, strict=True)):
                chosen[i] = keys[top[j, : min(2 * topk, int(count))]]
    return score_gradient_metric(rotate(queries, rotation), weights, [rotate(c, rotation) for c in chosen],
                                 spec).cpu()


def metric_rows(store: CaptureStore, train_sequences: list[int], max_queries: int) -> np.ndarray:
    """The store rows of the queries the score-aware metric samples: at most ``max_queries``, evenly spread
    over the training sequences' queries."""
    seq_of = store.array("query_sequence").astype(np.int64)
    rows = np.nonzero(np.isin(seq_of, train_sequences))[0]
    if len(rows) > max_queries:
        rows = rows[np.linspace(0, len(rows) - 1, max_queries).round().astype(np.int64)]
    return rows


def metric_for_layer_reference(store: CaptureStore, layer: int, train_sequences: list[int], key_format: str,
                               spec: PQSpec, max_queries: int, topk: int) -> torch.Tensor:
    """The spec of :func:`metric_for_layer` (no rotation, on the host): each sampled query's causal prefix
    read from the store and put in engine form on its own, then scored."""
    from dsaindex.geometry import visible_key_count
    from dsaindex.score import indexer_scores

    positions = store.array("query_position").astype(np.int64)
    seq_of = store.array("query_sequence").astype(np.int64)
    offsets = sequence_key_offsets(store)
    rows = metric_rows(store, train_sequences, max_queries)
    queries = store.as_float(store.queries(layer)[rows])
    weights = torch.from_numpy(store.head_weights(layer)[rows])
    chosen = []
    for i, r in enumerate(rows):
        start = offsets[seq_of[r]]
        count = min(int(visible_key_count(positions[r], store.manifest.model.geometry.key_stride)),
                    int(offsets[seq_of[r] + 1] - start))
        keys = store.engine_keys(store.keys(layer)[start : start + count], key_format)
        scores = indexer_scores(queries[i : i + 1], keys, weights[i : i + 1])[0]
        chosen.append(keys[scores.topk(min(2 * topk, count)).indices])
    return score_gradient_metric(queries, weights, chosen, spec)


def train_layer(store: CaptureStore, layer: int, split: tuple[list[int], list[int]], opts: PQOptions, key_format: str,
                topk: int, step: Callable[[str], None] | None = None, raw: np.ndarray | None = None) -> LayerResult:
    """Train and evaluate one layer; ``step(text)`` is told each step as it starts. ``raw``: the layer's
    stored keys (``store.keys(layer)``) when already read; the layer is read once either way."""
    step = step or (lambda text: None)
    train_seq, eval_seq = split
    geometry = store.manifest.model.geometry
    step("reading keys")
    raw = store.keys(layer) if raw is None else raw
    keys = _subsample(layer_keys(store, layer, train_seq, key_format, raw), opts.max_train_keys, opts.seed + layer)
    if opts.quantizer != "pq":
        return _train_additive_layer(store, layer, split, opts, key_format, topk, keys, step, raw)
    spec = PQSpec(dim=geometry.head_dim, subspaces=opts.subspaces, centroids=opts.centroids)
    t0 = time.perf_counter()
    rotation = None
    if opts.rotate:
        step(f"OPQ rotation (balanced PCA, {_rounds(opts.rotation_rounds)})")
        rotation = train_rotation(keys, spec, opts.trainer, rounds=opts.rotation_rounds, seed=opts.seed + layer,
                                  device=opts.device)
        keys = rotate(keys, rotation)  # the codebooks are trained in the rotated space
    rotate_seconds = time.perf_counter() - t0
    metric = None
    t0 = time.perf_counter()
    if opts.score_aware:
        step("score-aware metric")
        metric = metric_for_layer(store, layer, train_seq, key_format, spec, opts.metric_queries, topk, rotation,
                                  opts.device, raw)
    step(f"k-means ({opts.trainer}, {keys.shape[0]:,} keys, {opts.iterations} iterations)")
    codebooks = train_codebooks(keys, spec, opts.trainer, opts.iterations, opts.seed + layer, metric, opts.device)
    seconds = time.perf_counter() - t0 + rotate_seconds  # rotation, metric and codebooks
    result = LayerResult(layer, codebooks, metric, keys.shape[0], seconds, rotation=rotation)
    step("held-out recall")
    result.metrics = evaluate_layer(store, layer, eval_seq, result.codec, opts, key_format, topk, raw)
    return result


def _train_additive_layer(store: CaptureStore, layer: int, split: tuple[list[int], list[int]], opts: PQOptions,
                          key_format: str, topk: int, keys: torch.Tensor, step: Callable[[str], None],
                          raw: np.ndarray | None = None) -> LayerResult:
    """:func:`train_layer` for an RQ / LSQ code (``opts.quantizer``): ``opts.subspaces`` whole-key codebooks,
    score-aware under the full D x D metric."""
    metric = None
    t0 = time.perf_counter()
    if opts.score_aware:
        step("score-aware metric (full)")
        metric = metric_for_layer(store, layer, split[0], key_format, full_spec(keys.shape[1], opts.centroids),
                                  opts.metric_queries, topk, device=opts.device, raw=raw)
    step(f"{opts.quantizer.upper()} ({opts.trainer if opts.quantizer == 'rq' else 'faiss'}, {keys.shape[0]:,} keys)")
    codec = train_additive(keys, opts.quantizer, opts.subspaces, opts.centroids, metric, seed=opts.seed + layer,
                           beam=opts.beam, trainer=opts.trainer, device=opts.device, iterations=opts.iterations)
    result = LayerResult(layer, torch.empty(0), metric, keys.shape[0], time.perf_counter() - t0, additive=codec,
                         residual=codec.served(metric) if opts.quantizer == "rq" else None)
    step("held-out recall")
    result.metrics = evaluate_layer(store, layer, split[1], codec, opts, key_format, topk, raw)
    return result


def evaluate_layer(store: CaptureStore, layer: int, eval_seq: list[int], codec: PQCodec | AdditiveCodec, opts: PQOptions,
                   key_format: str, topk: int, raw: np.ndarray | None = None) -> dict[str, float]:
    """Held-out recall of one layer's codec (an OPQ codec codes the keys rotated and decodes them back to the
    original space, where they score against the raw queries). Coding and scoring run on ``opts.device``.
    ``raw``: the layer's stored keys when already read."""
    ks = tuple(sorted({PAPER_K, topk}))
    data = held_out(store, layer, eval_seq, 4 * min(ks), key_format, opts.max_eval_queries, raw)
    keys = data.keys.to(opts.device)
    if isinstance(codec, PQCodec):
        codec = codec.to(opts.device)
    decoded = codec.decode(codec.encode(keys)).to(opts.device)
    # the fold scan's stage 1 is recorded only for codes it serves (product codes of 32 x 256, 128 dims)
    from dsaindex.kernels.pq_fold_cuda import takes as fold_takes
    from dsaindex.train.recall import FOLD_PREFILTERS

    folds = ()  # additive (RQ) codes: none
    if isinstance(codec, PQCodec):
        m, centroids, sub = codec.codebooks.shape
        dim = sub if codec.residual else m * sub
        heads = int(data.queries.shape[1]) if data.queries.dim() == 3 else 2  # no held-out query: nothing scored
        if fold_takes(heads, dim, m, centroids, codec.residual) is None:
            folds = FOLD_PREFILTERS
    metrics = evaluate_selection(data, decoded, ks, opts.candidates, device=opts.device, fold_prefilters=folds)
    keys = keys.float()
    error = ((decoded - keys) ** 2).sum(-1).mean() / (keys**2).sum(-1).mean().clamp_min(1e-30)
    metrics["relative_mse"] = float(error)  # plain (Euclidean) reconstruction error over the mean squared norm
    return metrics


def mean_metrics(per_layer: dict[int, dict[str, float]]) -> dict[str, float]:
    names = sorted({n for m in per_layer.values() for n in m})
    return {n: float(np.mean([m[n] for m in per_layer.values() if n in m])) for n in names}


def recall_plot(per_layer: dict[int, dict[str, float]], path: Path, title: str, k: int) -> Path | None:
    """PNG: recall of the exact top-k vs candidate count C, one line per layer (rerank, and filter dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    plotted = False
    for layer, m in sorted(per_layer.items()):
        cs = sorted(int(n.split("@")[1]) for n in m if n.startswith(f"k{k}/rerank@"))
        if not cs:
            continue
        line = ax.plot(cs, [m[f"k{k}/rerank@{c}"] for c in cs], marker="o", label=f"layer {layer}")[0]
        ax.plot(cs, [m[f"k{k}/filter@{c}"] for c in cs], ls="--", color=line.get_color(), alpha=0.6)
        ax.axhline(m[f"k{k}/direct"], color=line.get_color(), ls=":", alpha=0.5)
        plotted = True
    if not plotted:
        plt.close(fig)
        return None
    ax.set_xscale("log", base=2)
    ax.set_xlabel("PQ candidates C (then exact rerank)")
    ax.set_ylabel(f"recall of exact top-{k}")
    ax.set_title(title + "\nsolid: rerank, dashed: + miss filter, dotted: direct PQ top-k")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def check_options(opts: PQOptions, head_dim: int) -> None:
    """Refuse options no training can use, before any work (named by their command-line options): the
    trainer, the subspace count (for PQ it must divide the key dim), the quantizer, counts below one."""
    from dsaindex.errors import DsaIndexError
    from dsaindex.train.codebooks import TRAINERS

    if opts.trainer not in TRAINERS:
        raise DsaIndexError(f"Unknown trainer {opts.trainer!r}.", f"pass --trainer {' or '.join(TRAINERS)}.")
    if opts.beam != PQOptions.beam and opts.quantizer != "rq":
        raise DsaIndexError(f"--beam {opts.beam} applies to residual codes only, not {opts.quantizer.upper()}.",
                            "drop --beam, or pass --quantizer rq.")
    if opts.quantizer != "pq" and opts.quantizer not in QUANTIZERS:
        raise DsaIndexError(f"Unknown quantizer {opts.quantizer!r}.", f"pass pq, {', '.join(QUANTIZERS)}.")
    check_rotation(opts)
    if opts.quantizer == "pq":
        PQSpec(dim=head_dim, subspaces=opts.subspaces, centroids=opts.centroids)
    else:
        check_codebook_size(opts.centroids)
    for option, value in (("--iterations", opts.iterations), ("--max-train-keys", opts.max_train_keys),
                          ("--beam", opts.beam),
                          ("--eval-queries", opts.max_eval_queries),
                          ("--candidates", min(opts.candidates) if opts.candidates else 0)):
        if value < 1:
            raise DsaIndexError(f"{option} {value} is below 1.", f"pass {option} 1 or more.")


def check_rotation(opts: PQOptions) -> None:
    """Refuse a rotation the code cannot take (RQ / LSQ codewords span the whole key) and Procrustes rounds
    without a rotation or below zero, named by their command-line options."""
    from dsaindex.errors import DsaIndexError

    if opts.rotate and opts.quantizer != "pq":
        raise DsaIndexError(f"{opts.quantizer.upper()} codes take no OPQ rotation (their codewords span the whole key).",
                            "drop --rotate/--opq (train pq), or compare rq or lsq without the opq prefix "
                            "(eval pq-compare).")
    if opts.rotation_rounds is not None and not opts.rotate:
        raise DsaIndexError(f"--rotation-rounds {opts.rotation_rounds} applies to OPQ codes only, not "
                            f"{pq_label(opts)}.", "drop --rotation-rounds, or train OPQ (leave out --no-rotate).")
    if opts.rotation_rounds is not None and opts.rotation_rounds < 0:
        raise DsaIndexError(f"--rotation-rounds {opts.rotation_rounds} is below 0.",
                            "pass --rotation-rounds 0 (the balanced-PCA start alone) or more.")


def train_pq(store_path: str | Path, opts: PQOptions, progress: Progress | None = None,
             ray: str | RaySettings | None = None) -> dict:
    """Train and evaluate every layer of a store. Returns a report with results per layer.

    ``progress(layers done, layers in all, step)`` is called as each layer's steps start (on Ray: as each
    layer's result arrives). ``ray``: None trains the layers one after another in this process; an address
    (``"auto"``: a local cluster) or :class:`~dsaindex.train.cluster.RaySettings` trains each layer as a
    Ray task (:mod:`dsaindex.train.cluster`) that reads its keys from the store itself; the results equal
    the serial ones on the same device at the same thread count."""
    from dsaindex.artifacts.capture_store import CaptureStore

    store = CaptureStore.open(store_path)
    geometry = store.manifest.model.geometry
    check_options(opts, geometry.head_dim)
    store.check_chunks()  # every layer's chunks are there before the first layer trains
    key_format = geometry.key_format
    split = split_sequences(store.committed.sequences, opts.eval_fraction)
    layers = list(store.layers)
    if ray is not None:
        from dsaindex.train.cluster import location, run_layers

        done = run_layers(_train_layer_task, layers, (location(store_path), split, opts, key_format, geometry.topk),
                          ray, opts.device, progress)
        results = {layer: _layer_from_record(d["result"], d["worker"]) for layer, d in done.items()}
    else:
        results = _train_layers_here(store, layers, split, opts, key_format, geometry.topk, progress)
    if progress:
        progress(len(layers), len(layers), "done")
    per_layer = {layer: r.metrics for layer, r in results.items()}
    return {
        "store": store,
        "split": split,
        "results": results,
        "per_layer": per_layer,
        "mean": mean_metrics(per_layer),
        "key_format": key_format,
    }


def _train_layers_here(store: CaptureStore, layers: list[int], split: tuple[list[int], list[int]], opts: PQOptions,
                       key_format: str, topk: int, progress: Progress | None) -> dict[int, LayerResult]:
    """:func:`train_pq`'s layers one after another in this process; the next layer's keys are read (and
    decompressed) on a thread while this one trains."""
    results = {}
    with ThreadPoolExecutor(max_workers=1) as reader:
        pending = reader.submit(store.keys, layers[0]) if layers else None
        for done, layer in enumerate(layers):
            def step(text: str, done: int = done, layer: int = layer) -> None:
                if progress:
                    progress(done, len(layers), f"layer {layer}: {text}")

            step("reading keys")
            raw = pending.result()
            pending = reader.submit(store.keys, layers[done + 1]) if done + 1 < len(layers) else None
            results[layer] = train_layer(store, layer, split, opts, key_format, topk, step, raw)
    return results


def _train_layer_task(layer: int, device: str, location: str, split: tuple[list[int], list[int]], opts: PQOptions,
                      key_format: str, topk: int) -> dict:
    """One layer of :func:`train_pq` on a Ray worker: the store opened at ``location``, the layer trained on
    ``device``; returns :func:`_layer_record`."""
    from dsaindex.artifacts.capture_store import CaptureStore

    store = CaptureStore.open(location)
    return _layer_record(train_layer(store, layer, split, replace(opts, device=device), key_format, topk))


def _layer_record(r: LayerResult) -> dict:
    """A trained layer as plain numpy arrays, numbers and a metrics dict (what a Ray task sends back): the
    codec as a bundle stores it (PQ / OPQ: codebooks, metric, rotation; RQ: the served residual codebooks
    and beam; LSQ, compared only: the metrics alone)."""
    def array(t: torch.Tensor | None) -> np.ndarray | None:
        return None if t is None else t.detach().cpu().numpy()

    record = {"layer": r.layer, "train_keys": r.train_keys, "train_seconds": r.train_seconds,
              "metrics": dict(r.metrics), "metric": array(r.metric)}
    if r.residual is not None:
        record |= {"residual_codebooks": array(r.residual.codebooks), "beam": r.residual.beam}
    elif r.additive is None:
        record |= {"codebooks": array(r.codebooks), "rotation": array(r.rotation)}
    return record


def _layer_from_record(record: dict, worker: dict) -> LayerResult:
    """The :class:`LayerResult` of a :func:`_layer_record` (an LSQ layer has no codec: its metrics only)."""
    def tensor(a: np.ndarray | None) -> torch.Tensor | None:
        return None if a is None else torch.from_numpy(np.array(a))  # a writable copy of the object store's

    metric = tensor(record["metric"])
    base = {"layer": record["layer"], "metric": metric, "train_keys": record["train_keys"],
            "train_seconds": record["train_seconds"], "metrics": record["metrics"], "worker": worker}
    if "residual_codebooks" in record:
        residual = PQCodec(tensor(record["residual_codebooks"]), None if metric is None else metric.float(),
                           residual=True, beam=record["beam"])
        return LayerResult(codebooks=torch.empty(0), residual=residual, **base)
    codebooks = tensor(record.get("codebooks"))
    return LayerResult(codebooks=torch.empty(0) if codebooks is None else codebooks,
                       rotation=tensor(record.get("rotation")), **base)


def write_pq_bundle(report: dict, opts: PQOptions, out: Path) -> object:
    """Write the trained codebooks (and score-aware metrics, and OPQ rotations) as an artifact bundle;
    returns its manifest. A rotated layer stores ``rotation`` [D, D] float32 and ``params["rotate"]=True``; an
    RQ layer stores whole-key ``codebooks`` [M, K, D], its full ``metric`` [1, D, D] if score-aware, and
    ``params["quantizer"]="rq"`` with the beam width."""
    from dsaindex.artifacts.bundle import LayerArtifact, new_bundle_manifest, store_lineage, write_bundle
    from dsaindex.errors import DsaIndexError

    if opts.quantizer not in ("pq", "rq"):
        raise DsaIndexError(f"{opts.quantizer.upper()} codes are for comparison only: the runtime serves PQ, OPQ "
                            "and RQ codes.", "compare them with `dsaindex eval pq-compare`; train PQ, OPQ or RQ "
                            "bundles to serve.")
    store = report["store"]
    layers, arrays = {}, {}
    for layer, r in report["results"].items():
        codec = r.codec
        params = {"subspaces": opts.subspaces, "centroids": opts.centroids, "score_aware": opts.score_aware,
                  "rotate": codec.rotation is not None, "trainer": opts.trainer, "train_keys": r.train_keys,
                  "train_seconds": round(r.train_seconds, 3)}
        if codec.residual:
            params |= {"quantizer": "rq", "beam": codec.beam}
        if codec.rotation is not None:
            params["rotation_rounds"] = opts.rotation_rounds
        layers[str(layer)] = LayerArtifact(kind="pq", params=params)
        arrays[layer] = {"codebooks": codec.codebooks.float().cpu().numpy()}
        if codec.metric is not None:
            arrays[layer]["metric"] = codec.metric.float().cpu().numpy()
        if codec.rotation is not None:
            arrays[layer]["rotation"] = codec.rotation.float().cpu().numpy()
    metrics = {f"layer{layer}/{name}": float(v) for layer, m in report["per_layer"].items() for name, v in m.items()}
    metrics.update({f"mean/{name}": float(v) for name, v in report["mean"].items()})
    lineage = store_lineage(store, report["split"])
    manifest = new_bundle_manifest(
        model=store.manifest.model,
        basis=store.manifest.settings.basis,
        key_format=report["key_format"],
        layers=layers,
        lineage=lineage,
        metrics=metrics,
        params=opts.params(),
    )
    return write_bundle(out, manifest, arrays)


def pq_label(opts: PQOptions) -> str:
    """``PQ32``, or ``OPQ32`` with a learned rotation (``RQ16`` / ``LSQ16`` for the additive codes): the
    name of the codec the options train."""
    if opts.quantizer != "pq":
        return f"{opts.quantizer.upper()}{opts.subspaces}"
    return f"{'OPQ' if opts.rotate else 'PQ'}{opts.subspaces}"


def describe_code(opts: PQOptions) -> str:
    """One line that says which code the options train and how: ``OPQ32 score-aware (a learned rotation:
    balanced PCA + 6 Procrustes rounds)`` / ``PQ32 plain (no rotation)`` / ``RQ16 score-aware (beam 5)``."""
    name = f"{pq_label(opts)} {'score-aware' if opts.score_aware else 'plain'}"
    if opts.quantizer != "pq":
        return f"{name} (beam {opts.beam})" if opts.quantizer == "rq" else name
    if not opts.rotate:
        return f"{name} (no rotation)"
    return f"{name} (a learned rotation: balanced PCA + {_rounds(opts.rotation_rounds)})"


def _rounds(n: int) -> str:
    return f"{n} Procrustes round{'' if n == 1 else 's'}"


def default_bundle_path(store_path: str | Path, opts: PQOptions) -> Path:
    """``runs/bundles/<store name>-pq<M>[-sa]`` (``-opq<M>[-sa]`` with a rotation), or with ``-2``, ``-3``,
    ... where that is taken (a rerun writes a new bundle beside the earlier one)."""
    from dsaindex.artifacts.bundle import fresh_bundle_path

    name = f"{Path(store_path).name}-{pq_label(opts).lower()}{'-sa' if opts.score_aware else ''}"
    return fresh_bundle_path(Path("runs/bundles") / name)


@dataclass
class PQJobResult:
    """What :func:`run_pq_job` did: its options, the training report (see :func:`train_pq`), the bundle
    written, its manifest, the plots, and the registration (``None`` when not registered)."""

    opts: PQOptions
    report: dict
    bundle: Path
    manifest: object
    plots: list[Path]
    registered: dict | None

    @property
    def topk(self) -> int:
        return self.report["store"].manifest.model.geometry.topk

    @property
    def ks(self) -> list[int]:
        """The top-k sizes recall is reported for: the paper's 512 and the model's own."""
        return sorted({PAPER_K, self.topk})

    def as_dict(self) -> dict:
        return {
            "code": pq_label(self.opts),
            "bundle": str(self.bundle),
            "registered": self.registered,
            "plots": [str(p) for p in self.plots],
            "train_seconds": {str(layer): round(r.train_seconds, 3) for layer, r in self.report["results"].items()},
            "mean": self.report["mean"],
            "per_layer": {str(k): v for k, v in self.report["per_layer"].items()},
        } | ({"workers": {str(layer): r.worker for layer, r in self.report["results"].items()}}
             if any(r.worker for r in self.report["results"].values()) else {})


def run_pq_job(store_path: str | Path, opts: PQOptions, out: Path | None = None, register: bool = True,
               tracking_uri: str | None = None, progress: Progress | None = None,
               title: str | None = None, ray: str | RaySettings | None = None) -> PQJobResult:
    """The whole PQ training: train and evaluate every layer, plot recall vs C, write the bundle and
    (``register``) log the run and register the bundle as ``@candidate``.

    ``out`` (default :func:`default_bundle_path`, a fresh name) is checked before any training: an
    existing non-empty folder, or one that cannot be created and written, is refused at once rather
    than after minutes of work. ``progress`` and ``ray``: see :func:`train_pq`.
    """
    from dsaindex.artifacts.bundle import check_bundle_destination

    out = check_bundle_destination(out if out is not None else default_bundle_path(store_path, opts))
    if register:  # an unreachable tracking server fails now, not after the training
        from dsaindex.artifacts.registry import ensure_reachable

        ensure_reachable(tracking_uri)
    report = train_pq(store_path, opts, progress=progress, ray=ray)
    out.parent.mkdir(parents=True, exist_ok=True)
    title = title or f"{pq_label(opts)}{' score-aware' if opts.score_aware else ''} on {Path(store_path).name}"
    topk = report["store"].manifest.model.geometry.topk
    plots = [p for k in sorted({PAPER_K, topk})
             if (p := recall_plot(report["per_layer"], out.parent / f"{out.name}-recall-k{k}.png", title, k))]
    manifest = write_pq_bundle(report, opts, out)
    registered = None
    if register:
        from dsaindex.artifacts.registry import register_bundle

        params = opts.params() | {"store": str(store_path), "layers": len(report["per_layer"])}
        registered = register_bundle(out, params, manifest.metrics, plots, tracking_uri=tracking_uri)
    return PQJobResult(opts, report, out, manifest, plots, registered)


def _bundle_on_store(bundle: str | Path, store_path: str | Path) -> tuple[object, dict, CaptureStore, list[int]]:
    """A PQ bundle (path or ``models:/`` URI) and a store of its model, checked against each other: (the
    manifest, the placed codecs by layer, the store, its held-out sequences)."""
    from dsaindex.artifacts.bundle import read_bundle
    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.artifacts.compat import check_store_for_bundle
    from dsaindex.artifacts.registry import load_uri
    from dsaindex.runtime.loader import place_layers

    manifest, arrays = read_bundle(load_uri(bundle))
    store = CaptureStore.open(store_path)
    check_store_for_bundle(store.manifest, manifest, str(store_path), str(bundle))
    _, eval_seq = split_sequences(store.committed.sequences)
    return manifest, place_layers(manifest, arrays), store, eval_seq


def evaluate_bundle(bundle: str | Path, store_path: str | Path, opts: PQOptions, progress: Progress | None = None,
                    ray: str | RaySettings | None = None) -> dict:
    """Held-out recall of a trained PQ bundle (path or ``models:/`` URI) on a store of its model, with
    the store's own split. Returns ``{per_layer, mean, ks}``. ``progress(layers done, layers in all,
    text)`` as each layer is evaluated; ``ray`` as in :func:`train_pq` (the codecs travel to the tasks,
    each task reads its layer's held-out keys from the store)."""
    manifest, codecs, store, eval_seq = _bundle_on_store(bundle, store_path)
    topk = manifest.model.geometry.topk
    layers = list(codecs)
    if ray is not None:
        from dsaindex.train.cluster import location, run_layers

        where = location(store_path)
        per_layer = {layer: d["result"] for layer, d in run_layers(
            _evaluate_layer_task, layers, (where, eval_seq, codecs, opts, manifest.key_format, topk), ray,
            opts.device, progress).items()}
    else:
        per_layer = {}
        for layer in layers:
            if progress:
                progress(len(per_layer), len(layers), f"layer {layer}: held-out recall")
            per_layer[layer] = evaluate_layer(store, layer, eval_seq, codecs[layer], opts, manifest.key_format, topk)
    if progress:
        progress(len(layers), len(layers), "done")
    return {"per_layer": per_layer, "mean": mean_metrics(per_layer), "ks": sorted({PAPER_K, topk})}


def _evaluate_layer_task(layer: int, device: str, location: str, eval_seq: list[int], codecs: dict, opts: PQOptions,
                         key_format: str, topk: int) -> dict[str, float]:
    """One layer of :func:`evaluate_bundle` on a Ray worker: its held-out recall (a plain dict)."""
    from dsaindex.artifacts.capture_store import CaptureStore

    store = CaptureStore.open(location)
    return evaluate_layer(store, layer, eval_seq, codecs[layer], replace(opts, device=device), key_format, topk)


def evaluate_bundle_warm(bundle: str | Path, store_path: str | Path, candidates: int = 2048, prefilter: int = PREFILTER,
                         cache: int = 4096, min_prefix: int = 0, device: str = "cpu",
                         progress: Progress | None = None, filter_widths: tuple[float, ...] | None = None,
                         grow_band: int = 0) -> dict:
    """Steady-state decode recall of a PQ bundle on a store's held-out decode windows, replayed through
    the runtime's group and cache (:func:`dsaindex.train.warm_cache.warm_window_recall`), once per miss
    filter width; ``grow_band``: C grown past it."""
    from dsaindex.train.warm_cache import warm_window_recall

    manifest, codecs, store, eval_seq = _bundle_on_store(bundle, store_path)
    return warm_window_recall(store, codecs, eval_seq, manifest.model.geometry.topk, candidates, prefilter, cache,
                              min_prefix, device=device, progress=progress, filter_widths=filter_widths,
                              grow_band=grow_band)
