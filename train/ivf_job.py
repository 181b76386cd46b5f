"""``dsaindex train ivf``: routing encoders per layer, held-out routing recall, an artifact bundle.

The last fifth of the store's sequences is held out (as for PQ): encoders train on the others (with
three or more of them, the last one only picks the training step to keep, see ``train_encoder``); the
recall of every routing method (contiguous blocks, IVF sealed only, IVF with refits, IVF with the
learned representatives) is measured on the held-out ones at each candidate budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dsaindex.artifacts.kinds import ENCODER_ARRAYS, IVFLayer
from dsaindex.train.ivf import IVFOptions, routing_groups, train_encoder
from dsaindex.train.ivf_eval import LEARNED, METHODS, evaluate_routing
from dsaindex.train.recall import measured_sequences, split_sequences

if TYPE_CHECKING:
    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.train.cluster import RaySettings

Progress = Callable[[int, int, str], None]
"""``progress(layers done, layers in all, the step running now)``, e.g. :func:`dsaindex.console.progress_bar`'s
``update``."""


def check_options(opts: IVFOptions, budgets: list[int], eval_queries: int) -> None:
    """Refuse counts no training can use, before any work (named by their command-line options)."""
    from dsaindex.errors import DsaIndexError

    for option, value in (("--steps", opts.steps), ("--groups-per-step", opts.groups_per_step),
                          ("--train-queries", opts.max_queries), ("--eval-queries", eval_queries),
                          ("--budgets", min(budgets) if budgets else 0)):
        if value < 1:
            raise DsaIndexError(f"{option} {value} is below 1.", f"pass {option} 1 or more.")
    if opts.val_budget is not None and opts.val_budget < opts.index.cluster_size:
        raise DsaIndexError(f"--val-budget {opts.val_budget} holds no cluster of {opts.index.cluster_size} keys.",
                            "pass --val-budget of at least --cluster-size, or leave it out.")


def train_ivf(store_path: str | Path, opts: IVFOptions, budgets: list[int], eval_queries: int = 64,
              progress: Progress | None = None, layers: list[int] | None = None,
              ray: str | RaySettings | None = None) -> dict:
    """Train and evaluate the encoder of every layer (or of ``layers``). ``progress(layers done, layers in
    all, step)`` as each step starts (on Ray: as each layer's result arrives). ``ray``: None trains here,
    one layer after another; an address (``"auto"``: a local cluster) or
    :class:`~dsaindex.train.cluster.RaySettings` trains each layer as a Ray task reading its layer from the
    store (:mod:`dsaindex.train.cluster`), with results equal to the serial ones on the same device at the
    same thread count."""
    from dsaindex.artifacts.capture_store import CaptureStore

    check_options(opts, budgets, eval_queries)
    store = CaptureStore.open(store_path)
    store.check_chunks(layers)  # the layers' chunks are there before the first one trains
    topk = store.manifest.model.geometry.topk
    split = split_sequences(store.committed.sequences)
    if layers is not None and not set(layers) <= set(store.layers):
        from dsaindex.errors import DsaIndexError

        raise DsaIndexError(f"{store_path} holds layers {store.layers}, not {sorted(set(layers) - set(store.layers))}.",
                            "pass --layers from the store's own (`dsaindex store info` lists them).")
    chosen = store.layers if layers is None else sorted(set(layers))
    if ray is not None:
        from dsaindex.train.cluster import location, run_layers

        done = run_layers(_train_layer_task, chosen, (location(store_path), split, topk, opts, budgets, eval_queries),
                          ray, opts.device, progress)
        results = {layer: _layer_from_record(d["result"], d["worker"]) for layer, d in done.items()}
    else:
        results = {}
        for done_count, layer in enumerate(chosen):
            def step(text: str, done: int = done_count, layer: int = layer) -> None:
                if progress:
                    progress(done, len(chosen), f"layer {layer}: {text}")

            results[layer] = train_layer(store, layer, split, topk, opts, budgets, eval_queries, step)
    if progress:
        progress(len(chosen), len(chosen), "done")
    return {"store": store, "split": split, "topk": topk, "budgets": budgets, "results": results}


def train_layer(store: CaptureStore, layer: int, split: tuple[list[int], list[int]], topk: int, opts: IVFOptions,
                budgets: list[int], eval_queries: int, step: Callable[[str], None] | None = None) -> dict:
    """One layer's encoder and its held-out routing recall: ``{encoder: {name: tensor}, train: summary,
    eval: recall}``. ``step(text)`` is told each step as it starts."""
    step = step or (lambda text: None)
    t0 = time.perf_counter()
    step("routing targets")
    fit, val = split[0], []
    if len(split[0]) >= 3:  # the last training sequence picks the training step (never the held-out ones)
        fit, val = split[0][:-1], split[0][-1:]
    groups = routing_groups(store, layer, fit, topk, opts)
    val_groups = routing_groups(store, layer, val, topk, opts) if val else None
    if not groups:
        from dsaindex.errors import DsaIndexError

        raise DsaIndexError(
            f"No training query of layer {layer} has more than {opts.index.window + opts.index.sinks} keys before it.",
            "capture longer sequences (--seq-len), or train with a smaller --window.")
    dim = int(groups[0].keys.shape[1])
    encoder, summary = train_encoder(groups, dim, opts, progress=step, val_groups=val_groups, budgets=budgets)
    seconds = time.perf_counter() - t0
    step("held-out recall")
    recall = evaluate_routing(store, layer, budgets, topk, opts.index, METHODS, eval_queries, opts.device,
                              encoder=encoder)
    return {"encoder": encoder, "train": summary | {"seconds": round(seconds, 2)}, "eval": recall}


def _train_layer_task(layer: int, device: str, location: str, split: tuple[list[int], list[int]], topk: int,
                      opts: IVFOptions, budgets: list[int], eval_queries: int) -> dict:
    """One layer of :func:`train_ivf` on a Ray worker (the store opened at ``location``, trained on
    ``device``): its result with the encoder as plain numpy arrays."""
    from dsaindex.artifacts.capture_store import CaptureStore

    result = train_layer(CaptureStore.open(location), layer, split, topk, replace(opts, device=device), budgets,
                         eval_queries)
    return result | {"encoder": {name: t.detach().cpu().numpy() for name, t in result["encoder"].items()}}


def _layer_from_record(record: dict, worker: dict) -> dict:
    """A layer's result as :func:`train_layer` returns it (encoder tensors on the host), from a task's record."""
    import torch

    encoder = {name: torch.from_numpy(np.array(a)) for name, a in record["encoder"].items()}
    return record | {"encoder": encoder, "worker": worker}


def mean_recall(report: dict) -> dict[str, dict[str, float | None]]:
    """Recall per method and budget, averaged over layers."""
    out: dict[str, dict[str, float | None]] = {}
    for method in (*METHODS, LEARNED):
        out[method] = {}
        for b in report["budgets"]:
            vals = [r["eval"]["recall"][method][str(b)] for r in report["results"].values()]
            vals = [v for v in vals if v is not None]
            out[method][str(b)] = round(sum(vals) / len(vals), 5) if vals else None
    return out


def ivf_plot(mean: dict, budgets: list[int], path: Path, title: str) -> Path:
    """Recall vs candidate budget, one line per routing method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, by in mean.items():
        xs = [b for b in budgets if by[str(b)] is not None]
        ax.plot(xs, [by[str(b)] for b in xs], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("candidate budget (keys)")
    ax.set_ylabel("recall of the exact top-k")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_ivf_bundle(report: dict, opts: IVFOptions, out: Path) -> object:
    from dsaindex.artifacts.bundle import LayerArtifact, new_bundle_manifest, store_lineage, write_bundle

    store = report["store"]
    layers, arrays = {}, {}
    for layer, r in report["results"].items():
        params = opts.params() | {"train": r["train"]}
        layers[str(layer)] = LayerArtifact(kind="ivf", params=params)
        arrays[layer] = {name: r["encoder"][name].float().cpu().numpy().astype(np.float32) for name in ENCODER_ARRAYS}
    metrics = {f"mean/{m}/recall@{b}": float(v) for m, by in mean_recall(report).items()
               for b, v in by.items() if v is not None}
    manifest = new_bundle_manifest(
        model=store.manifest.model, basis=store.manifest.settings.basis,
        key_format=store.manifest.model.geometry.key_format, layers=layers,
        lineage=store_lineage(store, report["split"]), metrics=metrics, params=opts.params())
    return write_bundle(out, manifest, arrays)


def load_encoders(path: str | Path, device: str = "cpu") -> tuple[object, dict[int, IVFLayer]]:
    """(manifest, {layer: :class:`IVFLayer`}: encoder parameters and index settings) of an ``ivf``
    bundle, checksums verified."""
    from dsaindex.artifacts.bundle import read_bundle
    from dsaindex.errors import DsaIndexError
    from dsaindex.runtime.loader import place_layers

    manifest, arrays = read_bundle(path, verify=True)
    kinds = {art.kind for art in manifest.layers.values()}
    if kinds != {"ivf"}:
        raise DsaIndexError(f"{path} holds {sorted(kinds)} artifacts, not ivf routing encoders.",
                            "pass a bundle written by `dsaindex train ivf`.")
    return manifest, place_layers(manifest, arrays, device)


def default_bundle_path(store_path: str | Path) -> Path:
    """``runs/bundles/<store name>-ivf``, or with ``-2``, ``-3``, ... where that is taken."""
    from dsaindex.artifacts.bundle import fresh_bundle_path

    return fresh_bundle_path(Path("runs/bundles") / f"{Path(store_path).name}-ivf")


def run_ivf_job(store_path: str | Path, opts: IVFOptions, budgets: list[int], eval_queries: int = 64,
                out: Path | None = None, register: bool = True, tracking_uri: str | None = None,
                progress: Progress | None = None, layers: list[int] | None = None,
                ray: str | RaySettings | None = None) -> dict:
    """The whole IVF training: encoders per layer, held-out routing recall, the recall plot, the bundle
    and (``register``) its registration. ``out`` (default :func:`default_bundle_path`, a fresh name) is
    checked before any training (not empty, or not writable: refused). ``ray``: see :func:`train_ivf`.
    Returns a JSON-ready result (bundle, registered, plot, topk, mean, per_layer)."""
    from dsaindex.artifacts.bundle import check_bundle_destination

    out = check_bundle_destination(out if out is not None else default_bundle_path(store_path))
    if register:  # an unreachable tracking server fails now, not after the training
        from dsaindex.artifacts.registry import ensure_reachable

        ensure_reachable(tracking_uri)
    report = train_ivf(store_path, opts, budgets, eval_queries, progress=progress, layers=layers, ray=ray)
    out.parent.mkdir(parents=True, exist_ok=True)
    mean = mean_recall(report)
    plot = ivf_plot(mean, budgets, out.parent / f"{out.name}-recall.png",
                    f"routing recall of the exact top-{report['topk']} ({Path(store_path).name})")
    manifest = write_ivf_bundle(report, opts, out)
    registered = None
    if register:
        from dsaindex.artifacts.registry import register_bundle

        registered = register_bundle(out, opts.params() | {"store": str(store_path)}, manifest.metrics, [plot],
                                     tracking_uri=tracking_uri)
    return {"bundle": str(out), "registered": registered, "plot": str(plot), "topk": report["topk"],
            "mean": mean, "per_layer": {str(k): {"train": r["train"], "recall": r["eval"]["recall"],
                                                 "queries": r["eval"]["queries"],
                                                 "truth_profile": r["eval"]["truth_profile"]}
                                             | ({"worker": r["worker"]} if "worker" in r else {})
                                        for k, r in report["results"].items()}}


def evaluate_bundle(bundle: str | Path, store_path: str | Path, budgets: list[int], eval_queries: int = 64,
                    device: str = "cpu", progress: Progress | None = None,
                    ray: str | RaySettings | None = None, min_prefix: int = 0,
                    refit_fraction: float | None = None) -> dict:
    """Held-out routing recall of a trained ``ivf`` bundle on a store of its model, beside contiguous
    blocks and plain IVF: on the bundle's held-out sequences of its training store, on every sequence of
    another store. Returns ``{bundle, store, topk, sequences, held_out, min_prefix, mean, per_layer}``.
    ``min_prefix``: only queries with more keys before them (the longest prefixes of a long capture);
    ``refit_fraction``: route with this refit schedule instead of the bundle's (0: a fixed interval), to
    compare schedules on one capture.
    ``progress(layers done, layers in all, text)`` as each layer is evaluated; ``ray`` as in
    :func:`train_ivf` (the encoders travel to the tasks, each task reads its layer's queries from the store)."""
    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.artifacts.compat import check_store_for_bundle

    manifest, encoders = load_encoders(bundle, "cpu" if ray is not None else device)
    if refit_fraction is not None:
        import dataclasses

        from dsaindex.artifacts.kinds import IVFIndexSettings

        encoders = {layer: dataclasses.replace(enc, settings=IVFIndexSettings(
            **{**enc.settings.model_dump(), "refit_fraction": refit_fraction})) for layer, enc in encoders.items()}
    store = CaptureStore.open(store_path)
    check_store_for_bundle(store.manifest, manifest, str(store_path), str(bundle))
    sequences, held_how = measured_sequences(store, [manifest])
    topk = store.manifest.model.geometry.topk
    layers = list(encoders)
    if ray is not None:
        from dsaindex.train.cluster import location, run_layers

        done = run_layers(_evaluate_layer_task, layers,
                          (location(store_path), budgets, topk, encoders, eval_queries, sequences, min_prefix), ray, device,
                          progress)
        results = {layer: {"eval": d["result"]} for layer, d in done.items()}
    else:
        results = {}
        for layer in layers:
            if progress:
                progress(len(results), len(layers), f"layer {layer}: held-out recall")
            enc = encoders[layer]
            results[layer] = {"eval": evaluate_routing(store, layer, budgets, topk, enc.settings, METHODS,
                                                       eval_queries, device, encoder=enc.params, sequences=sequences,
                                                       min_prefix=min_prefix)}
    if progress:
        progress(len(layers), len(layers), "done")
    mean = mean_recall({"results": results, "budgets": budgets})
    return {"bundle": str(bundle), "store": str(store_path), "topk": topk, "sequences": sequences,
            "held_out": held_how, "min_prefix": min_prefix,
            "refit_fraction": next(iter(encoders.values())).settings.refit_fraction, "mean": mean,
            "per_layer": {str(k): r["eval"] for k, r in results.items()}}


def _evaluate_layer_task(layer: int, device: str, location: str, budgets: list[int], topk: int, encoders: dict,
                         eval_queries: int, sequences: list[int], min_prefix: int) -> dict:
    """One layer of :func:`evaluate_bundle` on a Ray worker: its routing recall (a plain dict)."""
    from dsaindex.artifacts.capture_store import CaptureStore

    enc = encoders[layer]
    params = {name: t.to(device) for name, t in enc.params.items()}
    return evaluate_routing(CaptureStore.open(location), layer, budgets, topk, enc.settings, METHODS, eval_queries,
                            device, encoder=params, sequences=sequences, min_prefix=min_prefix)
