"""``dsaindex train pq`` and ``dsaindex eval pq`` / ``dsaindex eval pq-compare``."""

from __future__ import annotations

from pathlib import Path

import typer

train_app = typer.Typer(no_args_is_help=True)
eval_app = typer.Typer(no_args_is_help=True)


def _options(subspaces, trainer, iterations, score_aware, max_train_keys, eval_queries, device, candidates="1024,2048,4096"):
    from dsaindex.errors import DsaIndexError
    from dsaindex.train.pq_job import PQOptions

    try:
        cands = tuple(sorted({int(c) for c in str(candidates).split(",") if c.strip()}))
    except ValueError:
        raise DsaIndexError(f"--candidates {candidates!r} is not a list of integers.", "pass e.g. --candidates 1024,2048,4096.") from None

    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return PQOptions(subspaces=subspaces, trainer=trainer, iterations=iterations, score_aware=score_aware,
                     max_train_keys=max_train_keys, max_eval_queries=eval_queries, device=device, candidates=cands)


def recall_table(rows: list[tuple[str, dict]], k: int, candidates=(1024, 2048, 4096), title: str = ""):
    from rich.table import Table

    fc = 2048 if 2048 in candidates else max(candidates)  # C of the miss-filter columns
    table = Table(title=title or f"recall of the exact top-{k} (held-out queries)", title_justify="left")
    for col in ["", "direct PQ", *[f"rerank C={c}" for c in candidates], f"+filter C={fc}", f"fetch C={fc}", "rel. MSE"]:
        table.add_column(col, justify="right" if col else "left")
    rows = [(name, m) for name, m in rows if f"k{k}/direct" in m]
    if not rows:
        return f"[dim]recall of the exact top-{k}: no held-out query has a causal prefix of 4 x {k} keys " \
               f"(capture longer sequences)[/dim]"
    for name, m in rows:
        table.add_row(
            name,
            f"{m[f'k{k}/direct']:.2%}",
            *[f"{m[f'k{k}/rerank@{c}']:.2%}" if f"k{k}/rerank@{c}" in m else "-" for c in candidates],
            f"{m[f'k{k}/filter@{fc}']:.2%}" if f"k{k}/filter@{fc}" in m else "-",
            f"{m[f'k{k}/fetch@{fc}']:.1%}" if f"k{k}/fetch@{fc}" in m else "-",
            f"{m.get('relative_mse', float('nan')):.4f}",
        )
    return table


def check_store_model(store: Path, model_ref: str) -> None:
    """Refuse a store captured from another model than ``model_ref`` (names both fingerprints)."""
    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.errors import StoreMismatchError
    from dsaindex.pipelines.capture import fingerprint
    from dsaindex.pipelines.models import load_model

    have = CaptureStore.open(store).manifest.model
    want = fingerprint(load_model(model_ref))
    if (have.family, have.config_digest, have.weights_digest) != (want.family, want.config_digest, want.weights_digest):
        raise StoreMismatchError(
            f"{store} was captured from {have.name} ({have.family}, weights {have.weights_digest}), not from "
            f"{model_ref} ({want.family}, weights {want.weights_digest}).",
            f"capture from {model_ref} first (`dsaindex capture NEW_STORE --model {model_ref}`), or train for "
            f"the store's own model.",
        )


@train_app.command("pq")
def train_pq_cmd(
    store: Path = typer.Argument(..., help="Capture store to train on."),
    model: str = typer.Option(None, "--model", "-m", help="Target model; refuses a store captured from another."),
    out: Path = typer.Option(None, "--out", "-o", help="Bundle folder to write (default: runs/bundles/<store>-pq<M>)."),
    subspaces: int = typer.Option(32, help="PQ subspaces (bytes per key): 16, 32 or 64 for 128-d keys."),
    trainer: str = typer.Option("faiss", help="faiss (CPU) or torch (GPU-capable batched Lloyd)."),
    iterations: int = typer.Option(20, help="k-means iterations."),
    score_aware: bool = typer.Option(
        True, "--score-aware/--plain",
        help="Score-aware codebooks (k-means under the score-gradient metric; default: it lifts held-out recall "
        "at equal bytes) or plain k-means on keys."),
    max_train_keys: int = typer.Option(262144, help="Keys per layer to train on (deterministic subsample)."),
    eval_queries: int = typer.Option(128, help="Held-out queries per layer for the recall evaluation."),
    candidates: str = typer.Option("1024,2048,4096", help="Candidate counts C of the coarse stage to evaluate."),
    device: str = typer.Option("auto", help="Device of the torch trainer and the evaluation."),
    register: bool = typer.Option(True, "--register/--no-register", help="Log an MLflow run and register the bundle."),
    tracking_uri: str = typer.Option(None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or ./runs/mlflow)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Train per-layer PQ codebooks, evaluate recall on held-out sequences, write and register a bundle."""
    from rich.console import Console

    from dsaindex.console import print_json
    from dsaindex.train.pq_job import recall_plot, train_pq, write_pq_bundle

    opts = _options(subspaces, trainer, iterations, score_aware, max_train_keys, eval_queries, device, candidates)
    if model is not None:
        check_store_model(store, model)
    console = Console(stderr=True, quiet=as_json)
    with console.status("training") as status:
        report = train_pq(store, opts, progress=lambda msg: status.update(f"training PQ{subspaces}: {msg}"))
    name = f"{Path(store).name}-pq{subspaces}{'-sa' if score_aware else ''}"
    out = out or Path("runs/bundles") / name
    out.parent.mkdir(parents=True, exist_ok=True)
    topk = int(report["store"].manifest.model.geometry["topk"])
    plots = []
    for k in sorted({512, topk}):
        p = recall_plot(report["per_layer"], out.parent / f"{out.name}-recall-k{k}.png",
                        f"PQ{subspaces}{' score-aware' if score_aware else ''} on {Path(store).name}", k)
        if p:
            plots.append(p)
    manifest = write_pq_bundle(report, opts, out, plots)
    registered = None
    if register:
        from dsaindex.artifacts.registry import register_bundle

        params = opts.params() | {"store": str(store), "layers": len(report["per_layer"])}
        registered = register_bundle(out, params, manifest.metrics, plots, tracking_uri=tracking_uri)
    result = {
        "bundle": str(out),
        "registered": registered,
        "plots": [str(p) for p in plots],
        "train_seconds": {str(layer): round(r.train_seconds, 3) for layer, r in report["results"].items()},
        "mean": report["mean"],
        "per_layer": {str(k): v for k, v in report["per_layer"].items()},
    }
    if as_json:
        print_json(result)
        return
    out_console = Console()
    for k in sorted({512, topk}):
        rows = [(f"layer {layer}", m) for layer, m in sorted(report["per_layer"].items())] + [("mean", report["mean"])]
        out_console.print(recall_table(rows, k, opts.candidates, f"PQ{subspaces} recall of the exact top-{k}"))
    out_console.print(f"bundle: {out}" + (f"  registered: {registered['name']} v{registered['version']} "
                                          f"@{registered.get('alias', 'candidate')}" if registered else ""))
    for p in plots:
        out_console.print(f"plot: {p}")


@eval_app.command("pq")
def eval_pq_cmd(
    bundle: str = typer.Argument(..., help="Bundle path or models:/<name>@<alias>."),
    store: Path = typer.Option(..., "--store", "-s", help="Capture store whose held-out sequences to evaluate on."),
    eval_queries: int = typer.Option(128, help="Held-out queries per layer."),
    candidates: str = typer.Option("1024,2048,4096", help="Candidate counts C of the coarse stage to evaluate."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Recall of a trained PQ bundle on a store's held-out sequences (the store must match its model)."""
    import torch
    from rich.console import Console

    from dsaindex.artifacts.bundle import read_bundle
    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.artifacts.registry import load_uri
    from dsaindex.console import print_json
    from dsaindex.errors import DsaIndexError
    from dsaindex.train.pq_job import evaluate_layer, mean_metrics
    from dsaindex.train.recall import split_sequences

    manifest, arrays = read_bundle(load_uri(bundle))
    cs = CaptureStore.open(store)
    if cs.manifest.model.model_dump() != manifest.model.model_dump() or cs.manifest.settings.basis != manifest.basis:
        raise DsaIndexError(
            f"The bundle was trained for {manifest.model.name} ({manifest.basis} basis) but the store holds "
            f"{cs.manifest.model.name} ({cs.manifest.settings.basis} basis).",
            "evaluate on a store captured from the bundle's model with the same basis.",
        )
    opts = _options(32, "faiss", 1, True, 1, eval_queries, "cpu", candidates)
    _, eval_seq = split_sequences(cs.committed.sequences)
    topk = int(manifest.model.geometry["topk"])
    per_layer = {}
    for layer_id in manifest.layers:
        layer = int(layer_id)
        metric = arrays[layer].get("metric")
        per_layer[layer] = evaluate_layer(cs, layer, eval_seq, torch.from_numpy(arrays[layer]["codebooks"]),
                                          None if metric is None else torch.from_numpy(metric), opts,
                                          manifest.key_format, topk)
    mean = mean_metrics(per_layer)
    if as_json:
        print_json({"per_layer": {str(k): v for k, v in per_layer.items()}, "mean": mean})
        return
    console = Console()
    for k in sorted({512, topk}):
        rows = [(f"layer {layer}", m) for layer, m in sorted(per_layer.items())] + [("mean", mean)]
        console.print(recall_table(rows, k, opts.candidates))


@eval_app.command("pq-compare")
def eval_pq_compare_cmd(
    store: Path = typer.Argument(..., help="Capture store."),
    subspaces: str = typer.Option("16,32,64", help="Comma-separated subspace counts."),
    variants: str = typer.Option("plain,score-aware", help="plain and/or score-aware."),
    trainer: str = typer.Option("faiss", help="faiss or torch."),
    iterations: int = typer.Option(20),
    max_train_keys: int = typer.Option(262144),
    eval_queries: int = typer.Option(128),
    device: str = typer.Option("auto"),
    out: Path = typer.Option(None, help="Write the JSON result here too."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Train PQ variants side by side on the same split (nothing registered) and print one recall table."""
    import json

    from rich.console import Console

    from dsaindex.train.pq_job import train_pq

    results = {}
    for m in [int(s) for s in subspaces.split(",") if s]:
        for variant in [v.strip() for v in variants.split(",") if v.strip()]:
            opts = _options(m, trainer, iterations, variant == "score-aware", max_train_keys, eval_queries, device)
            report = train_pq(store, opts)
            results[f"PQ{m} {variant}"] = report["mean"] | {
                "train_seconds_per_layer": float(sum(r.train_seconds for r in report["results"].values())
                                                 / len(report["results"]))}
    text = json.dumps(results, indent=2)
    if out:
        out.write_text(text)
    if as_json:
        print(text)
        return
    from dsaindex.artifacts.capture_store import CaptureStore

    topk = int(CaptureStore.open(store).manifest.model.geometry["topk"])
    console = Console()
    for k in sorted({512, topk}):
        console.print(recall_table(list(results.items()), k, title=f"mean recall of the exact top-{k}"))


def _ivf_table(mean: dict, budgets: list[int], title: str):
    from rich.table import Table

    table = Table(title=title)
    table.add_column("routing")
    for b in budgets:
        table.add_column(f"budget {b:,}", justify="right")
    for method, by in mean.items():
        table.add_row(method, *[("-" if by[str(b)] is None else f"{by[str(b)] * 100:.2f}%") for b in budgets])
    return table


@train_app.command("ivf")
def train_ivf_cmd(
    store: Path = typer.Argument(..., help="Capture store to train on."),
    model: str = typer.Option(None, "--model", "-m", help="Target model; refuses a store captured from another."),
    out: Path = typer.Option(None, "--out", "-o", help="Bundle folder to write (default: runs/bundles/<store>-ivf)."),
    window: int = typer.Option(1024, help="Keys per seal (the open window's size)."),
    cluster_size: int = typer.Option(128, help="Keys per cluster (the cap of the size-capped k-means)."),
    refit_every: int = typer.Option(16384, help="Keys between refits of the whole prefix (0: never)."),
    budgets: str = typer.Option("4096,8192,16384,24576", help="Candidate budgets to evaluate (keys)."),
    steps: int = typer.Option(300, help="Encoder training steps."),
    groups_per_step: int = typer.Option(32, help="Query groups (sequence x index version) per training step."),
    layers: str = typer.Option(None, help="Comma-separated layers to train (default: all; a partial bundle "
                                          "is for study: the runtime wants every indexer layer)."),
    train_queries: int = typer.Option(256, help="Training queries per layer."),
    eval_queries: int = typer.Option(64, help="Held-out queries per layer."),
    device: str = typer.Option("auto", help="cpu, cuda or auto."),
    register: bool = typer.Option(True, "--register/--no-register", help="Log an MLflow run and register the bundle."),
    tracking_uri: str = typer.Option(None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or ./runs/mlflow)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Train per-layer routing encoders (learned IVF representatives), compare routing methods on
    held-out sequences (recall vs candidate budget), write and register an ``ivf`` bundle."""
    from rich.console import Console

    from dsaindex.console import print_json
    from dsaindex.pipelines.cli import _device
    from dsaindex.train.ivf import IVFOptions
    from dsaindex.train.ivf_job import ivf_plot, mean_recall, train_ivf, write_ivf_bundle

    if model is not None:
        check_store_model(store, model)
    opts = IVFOptions(window=window, cluster_size=cluster_size, refit_every=refit_every, steps=steps,
                      groups_per_step=groups_per_step, max_queries=train_queries, device=_device(device))
    budget_list = [int(b) for b in budgets.split(",") if b]
    console = Console(stderr=True, quiet=as_json)
    with console.status("training") as status:
        report = train_ivf(store, opts, budget_list, eval_queries, progress=lambda m: status.update(f"ivf: {m}"),
                           layers=[int(x) for x in layers.split(",") if x] if layers else None)
    out = out or Path("runs/bundles") / f"{Path(store).name}-ivf"
    out.parent.mkdir(parents=True, exist_ok=True)
    mean = mean_recall(report)
    plot = ivf_plot(mean, budget_list, out.parent / f"{out.name}-recall.png",
                    f"routing recall of the exact top-{report['topk']} ({Path(store).name})")
    manifest = write_ivf_bundle(report, opts, out)
    registered = None
    if register:
        from dsaindex.artifacts.registry import register_bundle

        registered = register_bundle(out, opts.params() | {"store": str(store)}, manifest.metrics, [plot],
                                     tracking_uri=tracking_uri)
    result = {"bundle": str(out), "registered": registered, "plot": str(plot), "topk": report["topk"],
              "mean": mean, "per_layer": {str(k): {"train": r["train"], "recall": r["eval"]["recall"],
                                                   "queries": r["eval"]["queries"],
                                                   "truth_profile": r["eval"]["truth_profile"]}
                                          for k, r in report["results"].items()}}
    if as_json:
        print_json(result)
        return
    Console().print(_ivf_table(mean, budget_list, f"held-out recall of the exact top-{report['topk']}, mean of layers"))
    Console().print(f"bundle: {out}  plot: {plot}" + (f"  registered: {registered['name']} v{registered['version']}"
                                                      if registered else ""))


@eval_app.command("ivf")
def eval_ivf_cmd(
    bundle: Path = typer.Argument(..., help="An ivf bundle (`dsaindex train ivf`)."),
    store: Path = typer.Option(..., "--store", "-s", help="Capture store whose held-out sequences to route."),
    budgets: str = typer.Option("4096,8192,16384,24576", help="Candidate budgets (keys)."),
    eval_queries: int = typer.Option(64, help="Held-out queries per layer."),
    device: str = typer.Option("auto", help="cpu, cuda or auto."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Held-out routing recall of a trained ivf bundle beside contiguous blocks and plain IVF."""
    from rich.console import Console

    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.console import print_json
    from dsaindex.pipelines.cli import _device
    from dsaindex.train.ivf import IVFOptions
    from dsaindex.train.ivf_eval import METHODS, evaluate_routing
    from dsaindex.train.ivf_job import load_encoders, mean_recall

    dev = _device(device)
    manifest, encoders = load_encoders(bundle, dev)
    cs = CaptureStore.open(store)
    if cs.manifest.model.weights_digest != manifest.model.weights_digest:
        from dsaindex.errors import DsaIndexError

        raise DsaIndexError(f"{bundle} was trained for another model than the one {store} was captured from.",
                            "evaluate on a store of the bundle's model.")
    opts = IVFOptions(**{k: v for k, v in manifest.params.items() if k in IVFOptions.__dataclass_fields__})
    topk = int(cs.manifest.model.geometry["topk"])
    budget_list = [int(b) for b in budgets.split(",") if b]
    results = {layer: {"eval": evaluate_routing(cs, layer, budget_list, topk, METHODS, opts.window, opts.cluster_size,
                                                opts.refit_every, opts.sinks, eval_queries, dev, encoder=enc)}
               for layer, enc in encoders.items()}
    mean = mean_recall({"results": results, "budgets": budget_list})
    if as_json:
        print_json({"bundle": str(bundle), "store": str(store), "topk": topk, "mean": mean,
                    "per_layer": {str(k): r["eval"] for k, r in results.items()}})
        return
    Console().print(_ivf_table(mean, budget_list, f"held-out recall of the exact top-{topk}, mean of layers"))
