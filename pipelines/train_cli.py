"""``dsaindex train pq|ivf`` and ``dsaindex eval pq|pq-compare|ivf``: option parsing over the jobs of
:mod:`dsaindex.train.pq_job` and :mod:`dsaindex.train.ivf_job`.

These commands live with the pipelines because ``--model`` loads the target model to compare its
fingerprint with the store's; the training code itself never loads a model.
"""

from __future__ import annotations

from pathlib import Path

import typer

train_app = typer.Typer(no_args_is_help=True)
eval_app = typer.Typer(no_args_is_help=True)

_URI_HELP = "MLflow tracking URI (default: $MLFLOW_TRACKING_URI or ./runs/mlflow)."
_CANDIDATES = "1024,2048,4096"


def _pq_options(subspaces: int, trainer: str, iterations: int, score_aware: bool, max_train_keys: int,
                eval_queries: int, device: str, candidates: str = _CANDIDATES):
    from dsaindex.console import parse_ints, resolve_device
    from dsaindex.train.pq_job import PQOptions

    return PQOptions(subspaces=subspaces, trainer=trainer, iterations=iterations, score_aware=score_aware,
                     max_train_keys=max_train_keys, max_eval_queries=eval_queries, device=resolve_device(device),
                     candidates=tuple(sorted(set(parse_ints(candidates, "--candidates")))))


def _check_target_model(store: Path, model_ref: str | None) -> None:
    """With ``--model``: refuse a store captured from another model than the target."""
    if model_ref is None:
        return
    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.artifacts.compat import check_store_for_model
    from dsaindex.pipelines.capture import fingerprint
    from dsaindex.pipelines.models import load_model

    check_store_for_model(CaptureStore.open(store).manifest.model, fingerprint(load_model(model_ref)),
                          str(store), model_ref)


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
    candidates: str = typer.Option(_CANDIDATES, help="Candidate counts C of the coarse stage to evaluate."),
    device: str = typer.Option("auto", help="Device of the torch trainer and the evaluation."),
    register: bool = typer.Option(True, "--register/--no-register", help="Log an MLflow run and register the bundle."),
    tracking_uri: str = typer.Option(None, help=_URI_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Train per-layer PQ codebooks, evaluate recall on held-out sequences, write and register a bundle."""
    from rich.console import Console

    from dsaindex.console import print_json, print_pq_job
    from dsaindex.train.pq_job import run_pq_job

    opts = _pq_options(subspaces, trainer, iterations, score_aware, max_train_keys, eval_queries, device, candidates)
    _check_target_model(store, model)
    with Console(stderr=True, quiet=as_json).status("training") as status:
        result = run_pq_job(store, opts, out, register, tracking_uri,
                            progress=lambda msg: status.update(f"training PQ{subspaces}: {msg}"))
    if as_json:
        print_json(result.as_dict())
        return
    print_pq_job(result, f"PQ{subspaces}")


@eval_app.command("pq")
def eval_pq_cmd(
    bundle: str = typer.Argument(..., help="Bundle path or models:/<name>@<alias>."),
    store: Path = typer.Option(..., "--store", "-s", help="Capture store whose held-out sequences to evaluate on."),
    eval_queries: int = typer.Option(128, help="Held-out queries per layer."),
    candidates: str = typer.Option(_CANDIDATES, help="Candidate counts C of the coarse stage to evaluate."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Recall of a trained PQ bundle on a store's held-out sequences (the store must match its model)."""
    from dsaindex.console import print_json, print_recall_tables
    from dsaindex.train.pq_job import evaluate_bundle

    opts = _pq_options(32, "faiss", 1, True, 1, eval_queries, "cpu", candidates)
    result = evaluate_bundle(bundle, store, opts)
    if as_json:
        print_json({"per_layer": {str(k): v for k, v in result["per_layer"].items()}, "mean": result["mean"]})
        return
    print_recall_tables(result["per_layer"], result["mean"], result["ks"], opts.candidates)


@eval_app.command("pq-compare")
def eval_pq_compare_cmd(
    store: Path = typer.Argument(..., help="Capture store."),
    subspaces: str = typer.Option("16,32,64", help="Comma-separated subspace counts."),
    variants: str = typer.Option("plain,score-aware", help="plain and/or score-aware."),
    trainer: str = typer.Option("faiss", help="faiss or torch."),
    iterations: int = typer.Option(20, help="k-means iterations."),
    max_train_keys: int = typer.Option(262144, help="Keys per layer to train on (deterministic subsample)."),
    eval_queries: int = typer.Option(128, help="Held-out queries per layer."),
    device: str = typer.Option("auto", help="Device of the torch trainer and the evaluation."),
    out: Path = typer.Option(None, help="Write the JSON result here too."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Train PQ variants side by side on the same split (nothing registered) and print one recall table."""
    import json

    from rich.console import Console

    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.console import parse_ints, recall_table
    from dsaindex.errors import DsaIndexError
    from dsaindex.train.pq_job import PAPER_K, train_pq

    chosen = [v.strip() for v in variants.split(",") if v.strip()]
    unknown = sorted(set(chosen) - {"plain", "score-aware"})
    if unknown or not chosen:
        raise DsaIndexError(f"--variants {variants!r} names no known variant.", "pass plain and/or score-aware.")
    results = {}
    for m in parse_ints(subspaces, "--subspaces"):
        for variant in chosen:
            opts = _pq_options(m, trainer, iterations, variant == "score-aware", max_train_keys, eval_queries, device)
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
    topk = CaptureStore.open(store).manifest.model.geometry.topk
    console = Console()
    for k in sorted({PAPER_K, topk}):
        console.print(recall_table(list(results.items()), k, title=f"mean recall of the exact top-{k}"))


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
    tracking_uri: str = typer.Option(None, help=_URI_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Train per-layer routing encoders (learned IVF representatives), compare routing methods on
    held-out sequences (recall vs candidate budget), write and register an ``ivf`` bundle."""
    from pydantic import ValidationError
    from rich.console import Console

    from dsaindex.artifacts.kinds import IVFIndexSettings
    from dsaindex.console import parse_ints, print_json, resolve_device, routing_table
    from dsaindex.errors import DsaIndexError
    from dsaindex.train.ivf import IVFOptions
    from dsaindex.train.ivf_job import run_ivf_job

    try:
        settings = IVFIndexSettings(window=window, cluster_size=cluster_size, refit_every=refit_every)
    except ValidationError as err:
        raise DsaIndexError(f"Invalid index settings: {err.errors()[0]['msg']}.",
                            "pass --window as a multiple of --cluster-size (1024 and 128, say).") from None
    _check_target_model(store, model)
    opts = IVFOptions(settings, steps=steps, groups_per_step=groups_per_step, max_queries=train_queries,
                      device=resolve_device(device))
    budget_list = parse_ints(budgets, "--budgets")
    with Console(stderr=True, quiet=as_json).status("training") as status:
        result = run_ivf_job(store, opts, budget_list, eval_queries, out, register, tracking_uri,
                             progress=lambda m: status.update(f"ivf: {m}"),
                             layers=parse_ints(layers, "--layers") if layers else None)
    if as_json:
        print_json(result)
        return
    registered = result["registered"]
    Console().print(routing_table(result["mean"], budget_list,
                                  f"held-out recall of the exact top-{result['topk']}, mean of layers"))
    Console().print(f"bundle: {result['bundle']}  plot: {result['plot']}"
                    + (f"  registered: {registered['name']} v{registered['version']}" if registered else ""))


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

    from dsaindex.console import parse_ints, print_json, resolve_device, routing_table
    from dsaindex.train.ivf_job import evaluate_bundle

    budget_list = parse_ints(budgets, "--budgets")
    result = evaluate_bundle(bundle, store, budget_list, eval_queries, resolve_device(device))
    if as_json:
        print_json(result)
        return
    Console().print(routing_table(result["mean"], budget_list,
                                  f"held-out recall of the exact top-{result['topk']}, mean of layers"))
