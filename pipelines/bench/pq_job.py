"""``dsaindex bench pq-job``: the whole ``train pq`` job on a production-size model, timed end to end.

The question it answers: how long does ``dsaindex train pq`` take for a whole model on one device? By
default the model is shaped like DeepSeek-V3.2's indexer (:data:`dsaindex.runtime.planner.MODEL_SHAPES`: 61
layers, 64 heads x 128 dims, top-2048, keys trained in the engines' FP8 e4m3 + ue8m0 form) with 1,048,576
keys per layer, 8 sequences of 131,072.

Two stages, timed apart:

1. **Store build** (not part of the job's time): a real capture store is written with
   :class:`~dsaindex.artifacts.capture_store.CaptureStore` under a synthetic fingerprint, one sequence
   at a time across all layers (one append per sequence: 61 x 131,072 x 128 bf16 keys, about 2 GB). Keys are
   synthetic (clustered around a per-layer mean, anisotropic: a decaying variance spectrum in a random
   per-layer basis; queries random in the same basis, head weights random and positive) or, with
   ``--store``, a real store's first layer (keys, queries, head weights) tiled with a little noise.
2. **The job**: :func:`dsaindex.train.pq_job.run_pq_job` exactly as ``train pq --no-register`` runs it:
   every layer's keys read, the score-aware metric, k-means (or RQ), the held-out recall, then the
   plots and the bundle. Each step's share comes from the job's own progress callback: the device is
   synchronized at every step boundary, so queued GPU work is counted in the step that queued it.

The job's time hardly depends on the keys (fixed k-means iterations, fixed query counts), so synthetic
keys time it as real ones would; their held-out recall checks the path and is no quality figure (``dsaindex
train pq`` on a real capture measures that).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from dsaindex.console import at_least

if TYPE_CHECKING:
    import numpy as np
    import torch

    from dsaindex.artifacts.capture_store import CaptureSettings, SequenceBatch
    from dsaindex.artifacts.fingerprint import ModelFingerprint
    from dsaindex.geometry import IndexerGeometry
    from dsaindex.train.pq_job import PQOptions

MODEL = "deepseek-v3.2"  # the planner's preset whose indexer dims the synthetic model takes
TARGET_SECONDS = 300.0
CENTERS = 4096  # clusters per synthetic layer
SPECTRUM_DECAY = 0.75  # key std along the i-th principal direction ~ i ** -0.75


def synthetic_geometry(layers: int) -> IndexerGeometry:
    """The indexer geometry of a ``layers``-layer model with DeepSeek-V3.2's indexer (every layer runs
    one), read the way a checkpoint's ``config.json`` is read."""
    from dsaindex.geometry import geometry_from_config
    from dsaindex.runtime.planner import MODEL_SHAPES

    dims = MODEL_SHAPES[MODEL]
    return geometry_from_config({"model_type": dims.family, "num_hidden_layers": layers,
                                 "index_n_heads": dims.index_n_heads, "index_head_dim": dims.index_head_dim,
                                 "index_topk": dims.index_topk, "qk_rope_head_dim": dims.qk_rope_head_dim})


def synthetic_fingerprint(geometry: IndexerGeometry, source: str) -> ModelFingerprint:
    """A fingerprint for the synthetic model: its digests are of its geometry and of where its keys come
    from, so two benchmark stores of one shape and source belong to one model."""
    from dsaindex.artifacts.fingerprint import ModelFingerprint

    config = json.dumps(geometry.to_dict(), sort_keys=True)
    return ModelFingerprint(
        name=f"synthetic/{MODEL}-{geometry.num_layers}L", family=geometry.family, geometry=geometry,
        config_digest=hashlib.sha256(config.encode()).hexdigest()[:16],
        weights_digest=hashlib.sha256(f"{config}\n{source}".encode()).hexdigest()[:16], dtype="bfloat16",
    )


def query_sampling(queries_per_seq: int):
    """:class:`~dsaindex.artifacts.capture_store.QuerySampling` of about ``queries_per_seq`` positions per
    sequence: half in two decode-like windows of consecutive positions, the rest scattered (as a capture
    samples them; overlapping draws make a few fewer)."""
    from dsaindex.artifacts.capture_store import QuerySampling

    windows = 2 if queries_per_seq >= 4 else 0
    window_len = queries_per_seq // 2 // windows if windows else 0
    return QuerySampling(scattered=queries_per_seq - windows * window_len, windows=windows, window_len=window_len)


def _generator(device: str, *seed: int) -> torch.Generator:
    """A torch generator on ``device`` seeded from the integers ``seed`` (the same in every process)."""
    import numpy as np
    import torch

    return torch.Generator(device=device).manual_seed(int(np.random.SeedSequence(seed).generate_state(1)[0]))


class SyntheticKeys:
    """Clustered, anisotropic keys per layer: ``mean + center + noise``, centers and noise drawn along a
    per-layer random orthogonal basis with std ``i ** -SPECTRUM_DECAY`` on its i-th direction (normalized
    to unit mean variance), so a few directions dominate, as in real indexer keys. Queries [Q, H, D] are
    drawn with the same spectrum; head weights [Q, H] are positive, of the effective scale
    ``H^-0.5 * D^-0.5``. Deterministic in (layer, sequence)."""

    description = "synthetic clustered anisotropic keys"

    def __init__(self, geometry: IndexerGeometry, device: str):
        self.heads, self.dim, self.device = geometry.n_heads, geometry.head_dim, device

    def _layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        import torch

        g = _generator(self.device, 1, layer)
        d = self.dim
        spectrum = torch.arange(1, d + 1, device=self.device, dtype=torch.float32) ** -SPECTRUM_DECAY
        spectrum = spectrum / spectrum.square().mean().sqrt()
        basis = torch.linalg.qr(torch.randn(d, d, generator=g, device=self.device))[0]
        mean = 0.5 * torch.randn(d, generator=g, device=self.device)
        centers = (torch.randn(CENTERS, d, generator=g, device=self.device) * spectrum) @ basis.T
        return spectrum, basis, mean, centers

    def sequence(self, layer: int, seq: int, keys: int, queries: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys [keys, D], queries [queries, H, D], head weights [queries, H]), float32 on the device."""
        import torch

        spectrum, basis, mean, centers = self._layer(layer)
        g = _generator(self.device, 2, layer, seq)
        dev, d = self.device, self.dim
        assign = torch.randint(0, CENTERS, (keys,), generator=g, device=dev)
        noise = (0.5 * torch.randn(keys, d, generator=g, device=dev) * spectrum) @ basis.T
        k = mean + centers[assign] + noise
        q = (torch.randn(queries, self.heads, d, generator=g, device=dev) * spectrum) @ basis.T
        w = torch.rand(queries, self.heads, generator=g, device=dev) * (self.heads * d) ** -0.5
        return k, q, w


class TiledStoreKeys:
    """A real store's first layer tiled into every layer: each (layer, sequence) reads its keys from a
    random offset into that layer's keys (wrapping around), its queries and head weights likewise, plus
    noise of 1% of their std so tiled copies differ. A store with fewer heads than the synthetic model
    (a divisor of it) has its heads repeated and the weights scaled down alike: every score is kept."""

    def __init__(self, path: Path, geometry: IndexerGeometry, max_keys: int, device: str):
        import torch

        from dsaindex.artifacts.capture_store import CaptureStore
        from dsaindex.errors import DsaIndexError

        store = CaptureStore.open(path)
        g = store.manifest.model.geometry
        if not store.committed.sequences or not store.committed.queries:
            raise DsaIndexError(f"{path} holds no committed sequence with sampled queries.",
                                "capture into it first, or leave out --store for synthetic keys.")
        if g.head_dim != geometry.head_dim or geometry.n_heads % g.n_heads:
            raise DsaIndexError(
                f"{path} holds keys of {g.n_heads} heads x {g.head_dim} dims; the benchmark's model has "
                f"{geometry.n_heads} x {geometry.head_dim} (tiling needs the same dims and a head count dividing "
                f"{geometry.n_heads}).",
                "pass a store of a V3.2- or GLM-5-shaped indexer, or leave out --store for synthetic keys.")
        layer = store.layers[0]
        self.basis = store.manifest.settings.basis
        self.description = f"{path} layer {layer} tiled with 1% noise"
        self.device = device
        keys = store.keys(layer)[:max_keys]
        self.keys = store.as_float(keys).to(device)
        repeat = torch.arange(geometry.n_heads) % g.n_heads
        self.queries = store.as_float(store.queries(layer))[:, repeat].to(device)
        self.weights = (torch.from_numpy(store.head_weights(layer)).float()[:, repeat]
                        * (g.n_heads / geometry.n_heads)).to(device)
        self.key_std = float(self.keys.std())
        self.query_std = float(self.queries.std())
        self.source_weights = store.manifest.model.weights_digest

    def sequence(self, layer: int, seq: int, keys: int, queries: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys [keys, D], queries [queries, H, D], head weights [queries, H]), float32 on the device."""
        import torch

        g = _generator(self.device, 3, layer, seq)
        dev = self.device
        offset = int(torch.randint(0, self.keys.shape[0], (1,), generator=g, device=dev))
        rows = (offset + torch.arange(keys, device=dev)) % self.keys.shape[0]
        k = self.keys[rows] + 0.01 * self.key_std * torch.randn(keys, self.keys.shape[1], generator=g, device=dev)
        offset = int(torch.randint(0, self.queries.shape[0], (1,), generator=g, device=dev))
        rows = (offset + torch.arange(queries, device=dev)) % self.queries.shape[0]
        q = self.queries[rows]
        q = q + 0.01 * self.query_std * torch.randn(q.shape, generator=g, device=dev)
        return k, q, self.weights[rows]


def _bits(x: torch.Tensor) -> np.ndarray:
    """float [..., D] -> numpy uint16 bf16 bits on the host (the store's key storage form)."""
    import numpy as np

    from dsaindex.quant import bf16_to_bits

    return bf16_to_bits(x).cpu().numpy().view(np.uint16)


def _sequence_batch(source: SyntheticKeys | TiledStoreKeys, geometry: IndexerGeometry, settings: CaptureSettings,
                    seq: int) -> SequenceBatch:
    """Sequence ``seq`` of every layer of ``geometry`` from ``source``, as one capture-store append."""
    import numpy as np

    from dsaindex.artifacts.capture_store import SequenceBatch  # noqa: F811  (the runtime import of the type)
    from dsaindex.pipelines.capture.run import sample_query_positions

    seq_len = settings.seq_len
    positions, windows = sample_query_positions(seq_len, seq, settings.sampling)
    batch = SequenceBatch(
        sequence_tokens=[seq_len], sequence_keys=[seq_len], sequence_queries=[len(positions)],
        tokens=[np.zeros(seq_len, dtype=np.int32)], query_position=[positions.astype(np.int32)],
        query_sequence=[np.full(len(positions), seq, dtype=np.int32)], query_window=[windows])
    for layer in geometry.indexer_layers:
        k, q, w = source.sequence(layer, seq, seq_len, len(positions))
        batch.keys[layer] = [_bits(k)]
        batch.queries[layer] = [_bits(q)]
        batch.head_weights[layer] = [w.float().cpu().numpy()]
    return batch


def build_store(path: Path, geometry: IndexerGeometry, source: SyntheticKeys | TiledStoreKeys, sequences: int,
                seq_len: int, queries_per_seq: int, progress: Callable[..., None]) -> dict:
    """Write a capture store of ``sequences`` sequences of ``seq_len`` keys in every layer of ``geometry``,
    one append per sequence across all layers (bf16 keys as uint16 bits, Hadamard basis or the tiled
    store's). Returns ``{seconds, generate_seconds, write_seconds, bytes, key_bytes}``;
    ``progress(keys done, keys in all)`` counts keys per layer."""
    from dsaindex.artifacts.capture_store import CaptureSettings, CaptureStore, new_manifest
    from dsaindex.pipelines.bench.timing import time_call

    settings = CaptureSettings(seq_len=seq_len, chunk_len=seq_len, basis=getattr(source, "basis", "hadamard"),
                               key_dtype="bfloat16", sampling=query_sampling(queries_per_seq))
    weights = getattr(source, "source_weights", "")
    fingerprint = synthetic_fingerprint(geometry, f"{source.description} {weights}".strip())
    corpus = {"sources": [source.description], "text_field": None, "files": 0, "bytes": 0, "digest": ""}
    manifest = new_manifest(fingerprint, settings, corpus, "none (synthetic keys)")
    t0 = time.perf_counter()
    generate = write = 0.0
    CaptureStore.create(path, manifest)
    with CaptureStore.open_for_append(path, manifest) as store:
        progress(0, sequences * seq_len)
        for seq in range(sequences):
            batch, seconds = time_call(lambda seq=seq: _sequence_batch(source, geometry, settings, seq), source.device)
            generate += seconds
            _, seconds = time_call(lambda batch=batch: store.append(batch), "cpu")  # host work: no device sync
            write += seconds
            progress((seq + 1) * seq_len, sequences * seq_len)
        info = store.info()
    return {"seconds": time.perf_counter() - t0, "generate_seconds": generate, "write_seconds": write,
            "bytes": info["bytes_on_disk"], "key_bytes": info["key_bytes_on_disk"],
            "keys_per_layer": info["keys_per_layer"], "queries_per_layer": info["queries_per_layer"],
            "sequences": info["committed"]["sequences"]}


class StepClock:
    """Wraps a :data:`dsaindex.train.pq_job.Progress` callback and notes when each step starts (after
    synchronizing ``device``, so GPU work queued by a step counts in it)."""

    def __init__(self, inner: Callable[..., None], device: str):
        self.inner, self.device = inner, device
        self.events: list[tuple[float, str]] = []
        self.start = time.perf_counter()

    def __call__(self, done: int, total: int, step: str = "") -> None:
        from dsaindex.pipelines.bench.timing import synchronize

        synchronize(self.device)
        self.events.append((time.perf_counter(), step))
        self.inner(done, total, step)

    def phases(self, end: float) -> tuple[dict[str, float], dict[int, float]]:
        """(seconds per step name, wall seconds per layer) from the start to ``end``. A step's name is its
        text without the ``layer N:`` prefix and the parenthesized details (``k-means (torch, ...)`` ->
        ``k-means``); before the first step is ``opening the store``, after ``done`` is ``plots and bundle``."""
        phases: dict[str, float] = {}
        per_layer: dict[int, float] = {}
        marks = [(self.start, "opening the store"), *self.events, (end, "")]
        for (t, step), (t_next, _) in itertools.pairwise(marks):
            head, _, text = step.partition(": ") if step.startswith("layer ") else ("", "", step)
            name = "plots and bundle" if text == "done" else text.split(" (")[0]
            phases[name] = phases.get(name, 0.0) + (t_next - t)
            if head:
                layer = int(head.split()[1])
                per_layer[layer] = per_layer.get(layer, 0.0) + (t_next - t)
        return phases, per_layer


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": round(statistics.fmean(values), 3), "median": round(statistics.median(values), 3),
            "max": round(max(values), 3)} if values else {}


def check_inputs(keys: int, seq_len: int, opts: PQOptions, head_dim: int) -> int:
    """Refuse, before anything is written, inputs the job cannot train on. Returns the sequence count."""
    from dsaindex.errors import DsaIndexError
    from dsaindex.train.pq_job import check_options
    from dsaindex.train.recall import split_sequences

    if opts.quantizer not in ("pq", "rq"):
        raise DsaIndexError(f"--quantizer {opts.quantizer!r} is not benchmarked here.",
                            "pass --quantizer pq (what the runtime serves) or rq.")
    check_options(opts, head_dim)
    if keys % seq_len:
        raise DsaIndexError(f"--keys {keys:,} is not a multiple of --seq-len {seq_len:,} (keys per layer = "
                            "sequences x sequence length).",
                            f"pass --keys {max(2, keys // seq_len) * seq_len} or another multiple of --seq-len.")
    sequences = keys // seq_len
    if sequences < 2:
        raise DsaIndexError(f"--keys {keys:,} at --seq-len {seq_len:,} makes {sequences} sequence; the job holds the "
                            "last fifth of the sequences out (at least one), so it needs 2 or more.",
                            f"pass --keys {2 * seq_len} or more, or a shorter --seq-len.")
    train_keys = min(len(split_sequences(sequences, opts.eval_fraction)[0]) * seq_len, opts.max_train_keys)
    if train_keys < 4 * opts.centroids:
        raise DsaIndexError(f"{train_keys:,} training keys per layer are too few for {opts.centroids} centroids "
                            f"(4 per centroid: {4 * opts.centroids:,}).",
                            "pass a larger --keys (or --seq-len), or a larger --max-train-keys.")
    return sequences


def _timed_job(run_dir: Path, opts: PQOptions, device: str, target_seconds: float, keep_store: bool,
               threads: int | None = None) -> dict:
    """One ``train pq`` job on the built store, timed by step: its options, timing and mean recall.
    ``threads``: the job runs at that many torch / faiss threads (the Ray tasks' count, so that their
    bundles can be compared with this one bit for bit)."""
    import contextlib

    import torch

    from dsaindex.console import progress_bar
    from dsaindex.train.cluster import pinned_threads
    from dsaindex.train.pq_job import pq_label, run_pq_job

    cuda = device.startswith("cuda")
    label = pq_label(opts)
    pinned = pinned_threads(threads) if threads else contextlib.nullcontext()
    with progress_bar(label, unit="layers") as update, pinned:
        clock = StepClock(update, device)
        result = run_pq_job(run_dir / "store", opts, out=run_dir / f"bundle-{label}", register=False,
                            progress=clock)
        end = time.perf_counter()
    seconds = end - clock.start
    phases, wall = clock.phases(end)
    train_seconds = [r.train_seconds for r in result.report["results"].values()]
    evaluation = sum(s for name, s in phases.items() if "recall" in name)
    outside = phases.get("opening the store", 0.0) + phases.get("plots and bundle", 0.0)
    return {
        "options": opts.params() | {"device": device, "label": label},
        "job": {
            "seconds": round(seconds, 3),
            "target_seconds": target_seconds,
            "target_met": seconds <= target_seconds,
            "train_seconds_per_layer": _spread(train_seconds),
            "wall_seconds_per_layer": _spread(list(wall.values())),
            "training_seconds": round(seconds - evaluation - outside, 3),
            "evaluation_seconds": round(evaluation, 3),
            "phases": {name: round(s, 3) for name, s in phases.items()},
            "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
            "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
            "bundle": str(result.bundle) if keep_store else None,
            "threads": threads or torch.get_num_threads(),
        },
        "recall_mean": {name: round(v, 5) for name, v in result.report["mean"].items()
                        if "@" not in name.split("/")[0]},
    }


def _ray_scaling(run_dir: Path, opts: PQOptions, address: str, workers: list[int], serial: dict | None,
                 keep_store: bool) -> dict:
    """The same job on Ray once per worker count in ``workers``, one after another on the one store (each
    worker a one-thread layer task): wall time (apart from the cluster's start), per-layer time on the
    workers, speedup and scaling efficiency, and whether each bundle equals the serial one (``serial``:
    :func:`_timed_job`'s result, run at one thread) or, with no serial job, the first Ray run's."""
    from dsaindex.console import progress_bar
    from dsaindex.train.cluster import LOCAL, RaySettings, bundle_differences, connect
    from dsaindex.train.pq_job import pq_label, run_pq_job

    label = pq_label(opts)
    runs = []
    for count in workers:
        settings = RaySettings(address=address, threads=1, workers=count, local_cpus=count if address == LOCAL else None)
        out = run_dir / f"bundle-{label}-ray{count}"
        t0 = time.perf_counter()
        with connect(settings) as cluster, progress_bar(f"{label} on Ray, {count} workers", unit="layers") as update:
            started = time.perf_counter()
            result = run_pq_job(run_dir / "store", opts, out=out, register=False, progress=update, ray=settings)
            seconds = time.perf_counter() - started
        layers = [r.worker for r in result.report["results"].values()]
        reference = run_dir / f"bundle-{label}" if serial is not None else run_dir / f"bundle-{label}-ray{workers[0]}"
        differences = bundle_differences(reference, out)
        if serial is None and not runs:  # the first run is the others' reference
            recall = {name: round(v, 5) for name, v in result.report["mean"].items()}
        runs.append({
            "workers": count, "cluster": cluster.describe(), "cluster_start_seconds": round(started - t0, 3),
            "seconds": round(seconds, 3),
            "layer_seconds": _spread([w["seconds"] for w in layers]),
            "train_seconds_per_layer": _spread([r.train_seconds for r in result.report["results"].values()]),
            "processes": len({(w["host"], w["pid"]) for w in layers}), "hosts": len({w["host"] for w in layers}),
            "devices": sorted({w["device"] for w in layers}),
            ("bundle_equals_serial" if serial is not None else "bundle_equals_first"): not differences,
            "differences": differences[:5],
            "bundle": str(out) if keep_store else None,
        })
    base = runs[0]
    for run in runs:
        if serial is not None:
            run["speedup_vs_serial"] = round(serial["job"]["seconds"] / run["seconds"], 3)
        run["speedup_vs_first"] = round(base["seconds"] / run["seconds"], 3)
        run["scaling_efficiency"] = round(base["seconds"] * base["workers"] / (run["seconds"] * run["workers"]), 3)
    out = {"address": address, "threads_per_task": 1,
           "serial_seconds": serial["job"]["seconds"] if serial is not None else None,
           "efficiency_base_workers": base["workers"], "runs": runs}
    if serial is None:
        out["recall_mean"] = recall
    return out


def bench_pq_job(
    layers: int = typer.Option(61, callback=at_least(1), help="Indexer layers of the synthetic model "
                                                                "(DeepSeek-V3.2: 61)."),
    keys: int = typer.Option(1_048_576, callback=at_least(1), help="Keys per layer (sequences x --seq-len)."),
    seq_len: int = typer.Option(131_072, callback=at_least(1), help="Keys per sequence."),
    queries_per_seq: int = typer.Option(64, callback=at_least(1), help="Sampled queries per sequence (half in "
                                                                       "two decode windows)."),
    store: Path = typer.Option(None, "--store", "-s", help="A capture store whose first layer's keys, queries "
                                                           "and head weights fill every layer (tiled, 1% noise); "
                                                           "default: synthetic keys."),
    work_dir: Path = typer.Option(None, help="Where the store and bundle are written (in a new subfolder; "
                                             "default: a temporary folder). Removed after unless --keep-store."),
    keep_store: bool = typer.Option(False, "--keep-store", help="Keep the store, bundle and plots."),
    subspaces: int = typer.Option(32, callback=at_least(1), help="PQ subspaces (RQ: codebooks)."),
    quantizer: str = typer.Option("pq", help="pq (what the runtime serves) or rq (residual codes); a comma list "
                                             "(pq,rq) times each job in turn on the one store."),
    rotate: bool | None = typer.Option(None, "--rotate/--no-rotate", "--opq", show_default="rotate for pq",
                                help="OPQ, `train pq`'s default for product codes: a learned rotation first; "
                                     "--no-rotate for plain PQ (rq takes none)."),
    score_aware: bool = typer.Option(True, "--score-aware/--plain", help="Score-aware codebooks or plain k-means."),
    trainer: str = typer.Option("torch", help="torch (GPU-capable batched Lloyd) or faiss (CPU)."),
    iterations: int = typer.Option(20, callback=at_least(1), help="k-means iterations."),
    max_train_keys: int = typer.Option(262144, callback=at_least(1024), help="Keys per layer to train on."),
    eval_queries: int = typer.Option(128, callback=at_least(1), help="Held-out queries per layer."),
    device: str = typer.Option("auto", help="Device of the job (its PQOptions.device) and of the key generation."),
    target_seconds: float = typer.Option(TARGET_SECONDS, help="The job time to meet (seconds)."),
    out: Path = typer.Option(None, help="Also write the JSON result to this file."),
    ray: str = typer.Option(None, "--ray", help="Also run the job on Ray after the serial one, once per --workers "
                                                "count: auto (a local cluster of that many CPUs each) or a "
                                                "running cluster's address (host:port; that many layer tasks in "
                                                "flight). The serial job then runs at one thread, as each "
                                                "layer task does, and each Ray bundle is compared with its "
                                                "bundle bit for bit."),
    workers: str = typer.Option("1,2", help="--ray: worker counts to time one after another (comma-separated); "
                                            "scaling efficiency is relative to the first."),
    serial: bool = typer.Option(True, "--serial/--no-serial", help="--ray: also run the job without Ray first "
                                "(the bundles' reference); --no-serial compares each Ray bundle with the first "
                                "Ray run's instead, saving one whole job's time."),
) -> None:
    """Time the whole `train pq` job (every layer: keys, score-aware metric, k-means, held-out recall,
    bundle) on a production-size store built first (timed apart); with --ray, also fanned out over Ray
    workers (wall time, per-layer time, scaling efficiency, bundle equality with the serial one)."""
    import os

    import torch

    from dsaindex.console import emit_report, human_bytes, parse_ints, progress_bar, resolve_device
    from dsaindex.errors import DsaIndexError
    from dsaindex.train.pq_job import PQOptions, pq_label

    device = resolve_device(device)
    worker_counts = parse_ints(workers, "--workers", minimum=1) if ray is not None else []
    if ray is not None:
        from dsaindex.train.cluster import check_reachable

        check_reachable(ray)  # before the store is built
    all_opts = [PQOptions(subspaces=subspaces, trainer=trainer, iterations=iterations, score_aware=score_aware,
                          rotate=(q.strip() == "pq") if rotate is None else rotate, quantizer=q.strip(),
                          max_train_keys=max_train_keys,
                          max_eval_queries=eval_queries, device=device) for q in quantizer.split(",")]
    geometry = synthetic_geometry(layers)
    sequences = [check_inputs(keys, seq_len, opts, geometry.head_dim) for opts in all_opts][0]  # every job checked
    parent = Path(work_dir) if work_dir is not None else Path(tempfile.gettempdir())
    if parent.exists() and not parent.is_dir():
        raise DsaIndexError(f"--work-dir {parent} is a file.", "pass a folder (it is created if missing).")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".bench-pq-job-probe-", dir=parent))
    except OSError as err:
        raise DsaIndexError(f"Nothing can be written under {parent} ({err.strerror or err}).",
                            "pass --work-dir on a writable filesystem.") from None
    need = layers * keys * geometry.head_dim * 2 * 1.05  # bf16 keys hardly compress
    free = shutil.disk_usage(parent).free
    if free < need:
        raise DsaIndexError(f"The store needs about {human_bytes(need)}; {parent} has {human_bytes(free)} free.",
                            "pass --work-dir on a filesystem with more space, or fewer --layers or --keys.")
    source = (TiledStoreKeys(store, geometry, keys, device) if store is not None
              else SyntheticKeys(geometry, device))
    run_dir = Path(tempfile.mkdtemp(prefix="bench-pq-job-", dir=parent))
    cuda = device.startswith("cuda")
    try:
        with progress_bar(f"store {layers} layers", unit="keys per layer") as update:
            built = build_store(run_dir / "store", geometry, source, sequences, seq_len, queries_per_seq, update)
        described = source.description
        del source  # a tiled store's keys leave the device before the job
        runs: list[dict] = []
        report = {
            "model": f"{MODEL} indexer shape: {layers} layers, {geometry.n_heads} heads x {geometry.head_dim}, "
                     f"top-{geometry.topk}, keys {geometry.key_format}",
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "cpu_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "source": described,
            "layers": layers,
            "sequences": built["sequences"], "seq_len": seq_len,
            "keys_per_layer": built["keys_per_layer"], "queries_per_layer": built["queries_per_layer"],
            "store": {"seconds": round(built["seconds"], 3), "generate_seconds": round(built["generate_seconds"], 3),
                      "write_seconds": round(built["write_seconds"], 3), "bytes": built["bytes"],
                      "key_bytes": built["key_bytes"],
                      "keys_per_s_all_layers": round(layers * built["keys_per_layer"] / built["seconds"], 1),
                      "path": str(run_dir / "store") if keep_store else None},
            "runs": runs,  # every job; the first one's options, timing and recall also at the top
        }
        for job_opts in all_opts:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            if ray is not None and not serial:
                runs.append({"options": job_opts.params() | {"device": device, "label": pq_label(job_opts)}})
                runs[-1]["ray"] = _ray_scaling(run_dir, job_opts, ray, worker_counts, None, keep_store)
            else:
                runs.append(_timed_job(run_dir, job_opts, device, target_seconds, keep_store,
                                       threads=1 if ray is not None else None))
            if ray is not None and serial:
                runs[-1]["ray"] = _ray_scaling(run_dir, job_opts, ray, worker_counts, runs[-1], keep_store)
            report.update(runs[0])
            if out is not None and len(runs) < len(all_opts):  # the jobs done so far survive a later failure
                out.write_text(json.dumps(report, indent=2))
    finally:
        if not keep_store:
            shutil.rmtree(run_dir, ignore_errors=True)
    emit_report(report, out)

