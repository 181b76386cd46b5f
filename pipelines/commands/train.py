"""``dsaindex train pq|ivf|reuse|indexer-distill`` and ``dsaindex eval pq|pq-compare|ivf|reuse``: option
parsing over the jobs of :mod:`dsaindex.train.pq_job`, :mod:`dsaindex.train.ivf_job`,
:mod:`dsaindex.train.reuse` and :mod:`dsaindex.pipelines.capture.indexer_distill`.

These commands live with the pipelines because ``--model`` loads the target model to compare its
fingerprint with the store's; the training code itself never loads a model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import typer

from dsaindex.coarse import PREFILTER
from dsaindex.console import at_least
from dsaindex.runtime.settings import DecodeSettings

DECODE = DecodeSettings()  # the served step's defaults, which --warm replays

train_app = typer.Typer(no_args_is_help=True)
eval_app = typer.Typer(no_args_is_help=True)

_URI_HELP = "MLflow tracking URI (default: $MLFLOW_TRACKING_URI or ./runs/mlflow)."
_CANDIDATES = "1024,2048,4096"
_CANDIDATES_HELP = ("Candidate counts C of the coarse stage to evaluate (comma-separated; a C not above the "
                    "top-k is left out: its top-C is the direct top-k).")
_BUDGETS = "4096,8192,16384,24576"
_BUDGETS_HELP = "Candidate budgets to evaluate (comma-separated, keys per query)."
_WHERE = " (a folder or s3://bucket/prefix)"
_RAY_HELP = ("Run each layer as a Ray task: `auto` starts a local cluster on this machine; host:port or "
             "ray://host:10001 joins a running one (dsaindex installed on every node). Tasks read their layers "
             "from the store and take a GPU where the cluster has them. Default: one layer after another here.")


def _pq_options(subspaces: int, trainer: str, iterations: int, score_aware: bool, max_train_keys: int,
                eval_queries: int, device: str, candidates: str = _CANDIDATES, rotate: bool = False,
                centroids: int = 256, quantizer: str = "pq", beam: int = 5, rotation_rounds: int | None = None):
    from dsaindex.console import parse_ints, resolve_device
    from dsaindex.train.pq_job import PQOptions

    return PQOptions(subspaces=subspaces, centroids=centroids, trainer=trainer, iterations=iterations,
                     score_aware=score_aware, rotate=rotate, rotation_rounds=rotation_rounds, quantizer=quantizer,
                     beam=beam, max_train_keys=max_train_keys, max_eval_queries=eval_queries, device=resolve_device(device),
                     candidates=tuple(sorted(set(parse_ints(candidates, "--candidates", minimum=1)))))


def _location(value: str | None):
    """A store or bundle argument as the jobs take it: a local Path, or an s3:// location; another scheme
    (or a mistyped ``s3:/x``) is refused with the fix, before anything loads."""
    from dsaindex.artifacts.storage import location

    return None if value is None else location(value)


@contextlib.contextmanager
def _bundle_out(out: str | None, keep_plots: bool = False) -> Iterator[tuple[Path | None, object]]:
    """(the ``out`` a training job writes its bundle to, ``publish(bundle, plots) -> (bundle, plots)``).

    A local ``--out`` (or none: the job's default name) is passed through and ``publish`` returns what it
    gets. For ``s3://bucket/prefix``, checked at once (empty, writable), the job writes into a local staging
    folder and ``publish`` puts the bundle there, its manifest last, and its plots beside it
    (``<prefix>-recall.png``; not a ``--plot`` file the user named, with ``keep_plots``)."""
    import tempfile

    from dsaindex.artifacts.bundle import check_bundle_destination, publish_bundle
    from dsaindex.artifacts.storage import ObjectLocation, put_file

    where = _location(out)
    if not isinstance(where, ObjectLocation):
        yield where, lambda bundle, plots: (bundle, plots)
        return
    dest = check_bundle_destination(where)
    with tempfile.TemporaryDirectory(prefix="dsaindex-train-") as staging:

        def publish(bundle, plots):
            publish_bundle(bundle, dest)
            if keep_plots:
                return dest, plots
            return dest, [put_file(Path(p), dest.sibling(Path(p).name.replace(Path(bundle).name, dest.name, 1)))
                          for p in plots]

        yield Path(staging) / dest.name, publish


def _check_target_model(store: str | Path, model_ref: str | None) -> None:
    """With ``--model``: refuse a store captured from another model than the target."""
    if model_ref is None:
        return
    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.artifacts.compat import check_store_for_model
    from dsaindex.pipelines.capture.models import load_model

    captured = CaptureStore.open(store).manifest.model
    # in the dtype the store was captured in: random preset weights round differently in bf16 and fp32
    dtype = captured.dtype if captured.dtype in ("float32", "bfloat16") else "auto"
    check_store_for_model(captured, load_model(model_ref, dtype=dtype).fingerprint, str(store), model_ref)


@train_app.command("pq")
def train_pq_cmd(
    store: str = typer.Argument(..., help="Capture store to train on" + _WHERE + "."),
    model: str = typer.Option(None, "--model", "-m", help="Target model; refuses a store captured from another."),
    out: str = typer.Option(None, "--out", "-o", help="Bundle folder to write, or an s3://bucket/prefix; must be new "
                                                       "or empty (default: runs/bundles/<store>-opq<M>[-sa], "
                                                       "-pq<M>[-sa] with --no-rotate, -rq<M>[-sa] with --quantizer "
                                                       "rq, with -2, -3, ... if taken)."),
    subspaces: int = typer.Option(32, callback=at_least(1),
                                  help="PQ subspaces (bytes per key): 16, 32 or 64 for 128-d keys."),
    trainer: str = typer.Option("faiss", help="faiss (CPU) or torch (GPU-capable batched Lloyd)."),
    iterations: int = typer.Option(20, callback=at_least(1), help="k-means iterations."),
    score_aware: bool = typer.Option(
        True, "--score-aware/--plain",
        help="Score-aware codebooks (k-means under the score-gradient metric; default: it lifts held-out recall "
        "at equal bytes) or plain k-means on keys."),
    rotate: bool | None = typer.Option(
        None, "--rotate/--no-rotate", "--opq", show_default="rotate for --quantizer pq",
        help="OPQ, the default for product codes: learn an orthogonal rotation of the keys before PQ (stored in the "
             "bundle; the runtime rotates new keys and each step's queries with it). Same bytes per key, lower "
             "quantization error (on the H200 at 128K prefixes, OPQ32 met the 99.5% served-recall target at "
             "C = 4,096 with stage 1 at 4 x C; plain PQ32 needed 8 x C). --no-rotate trains plain PQ; residual "
             "codes (--quantizer rq) take no rotation."),
    rotation_rounds: int | None = typer.Option(
        None, callback=at_least(0), show_default="6 with --trainer torch on a GPU, else 0",
        help="OPQ: Procrustes rounds after the balanced-PCA start, each retraining the codebooks. 6 cost under "
             "2 s a layer on a GPU; on the CPU each costs over a third of a layer's codebook training, for 0-3% "
             "less reconstruction error in all, so the CPU runs the start alone (OPQ's parametric form)."),
    quantizer: str = typer.Option(
        "pq", help="pq: product codes (each byte codes a slice of the key); rq: residual codes (each byte picks "
                   "one of 256 whole-key codewords, summed; found by beam search). Same bytes per key; RQ "
                   "ranks better at long prefixes and encodes new pages more slowly."),
    beam: int = typer.Option(5, help="--quantizer rq: beam width of the residual search, in training and when the "
                                     "server encodes new pages (16 lifts RQ16's recall at C=2048 by about 0.2 "
                                     "points at 128K and triples the page encoding)."),
    max_train_keys: int = typer.Option(262144, callback=at_least(1024),
                                       help="Keys per layer to train on (deterministic subsample; at least "
                                            "4 per centroid, 1024)."),
    eval_queries: int = typer.Option(128, callback=at_least(1), help="Held-out queries per layer for the recall "
                                                                      "evaluation."),
    candidates: str = typer.Option(_CANDIDATES, help=_CANDIDATES_HELP),
    device: str = typer.Option("auto", help="Device of the torch trainer and the evaluation."),
    register: bool = typer.Option(True, "--register/--no-register", help="Log an MLflow run and register the bundle."),
    tracking_uri: str = typer.Option(None, help=_URI_HELP),
    ray: str = typer.Option(None, "--ray", help=_RAY_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON (and no progress bar)."),
) -> None:
    """Train per-layer PQ codebooks (OPQ by default: a learned rotation first; --no-rotate for plain PQ),
    evaluate recall on held-out sequences, write and register a bundle."""
    from rich.console import Console

    from dsaindex.console import print_json, print_pq_job, progress_bar
    from dsaindex.train.pq_job import check_rotation, describe_code, pq_label, run_pq_job

    if quantizer not in ("pq", "rq"):
        from dsaindex.errors import DsaIndexError

        raise DsaIndexError(f"--quantizer {quantizer!r} is not a code the runtime serves.",
                            "pass --quantizer pq or rq (compare LSQ with `dsaindex eval pq-compare`).")
    if rotate is None:  # the default: OPQ for product codes; residual codes span the whole key, no rotation
        rotate = quantizer == "pq"
    opts = _pq_options(subspaces, trainer, iterations, score_aware, max_train_keys, eval_queries, device, candidates,
                       rotate=rotate, quantizer=quantizer, beam=beam, rotation_rounds=rotation_rounds)
    check_rotation(opts)  # before the store is opened
    store = _location(store)
    _check_target_model(store, model)
    with _bundle_out(out) as (job_out, publish), \
            progress_bar(pq_label(opts), enabled=not as_json, unit="layers") as update:
        result = run_pq_job(store, opts, job_out, register, tracking_uri, progress=update, ray=ray)
        result.bundle, result.plots = publish(result.bundle, result.plots)
    if as_json:
        print_json(result.as_dict())
        return
    console = Console()
    print_pq_job(result, pq_label(opts), console)
    console.print(f"code: {describe_code(opts)}" + ("; --no-rotate trains plain PQ" if opts.rotate else ""),
                  markup=False, highlight=False)


@eval_app.command("pq")
def eval_pq_cmd(
    bundle: str = typer.Argument(..., help="Bundle path or models:/<name>@<alias>."),
    store: str = typer.Option(..., "--store", "-s", help="Capture store whose held-out sequences to evaluate on"
                                                        + _WHERE + "."),
    eval_queries: int = typer.Option(128, callback=at_least(1), help="Held-out queries per layer."),
    candidates: str = typer.Option(_CANDIDATES, help=_CANDIDATES_HELP),
    warm: bool = typer.Option(False, "--warm", help="Also replay the held-out decode windows (consecutive "
                                                    "positions) through the runtime's group and cache: recall "
                                                    "with the miss filter on a warm cache, and the host fetches."),
    warm_candidates: int = typer.Option(2048, callback=at_least(1), help="--warm: C, candidates per step."),
    prefilter: int = typer.Option(PREFILTER, callback=at_least(1), help="--warm: stage 1 keeps prefilter x C keys."),
    cache: int = typer.Option(4096, callback=at_least(4), help="--warm: exact keys cached per request (a "
                                                               "multiple of 4, at least C)."),
    min_prefix: int = typer.Option(0, callback=at_least(0), help="--warm: skip windows starting before this many "
                                                                 "keys."),
    grow_band: int = typer.Option(0, "--grow-band", callback=at_least(0),
                                  help="--warm: C grows with each doubling of the prefix past this many keys, as "
                                       "servers grow it (every candidate rescored, the device cache sized for the "
                                       "growth): the steady state's host fetches of that step. 0: C fixed."),
    device: str = typer.Option("auto", help="Where the held-out keys are coded and scored, and --warm replays: "
                                            "cpu, cuda or auto."),
    filter_width: str = typer.Option(f"{DECODE.filter_width:g}", help="--warm: the miss filter's margin below the k-th coarse score, "
                                                 "in standard deviations (comma-separated: one replay each; "
                                                 "the first is the headline; LeanSparse's is 1)."),
    ray: str = typer.Option(None, "--ray", help=_RAY_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Recall of a trained PQ bundle on a store's held-out sequences (the store must match its model)."""
    from rich.console import Console

    from dsaindex.console import (
        parse_floats,
        print_json,
        print_recall_tables,
        print_tables,
        progress_bar,
        recall_table,
        resolve_device,
    )
    from dsaindex.train.pq_job import PAPER_K, evaluate_bundle, evaluate_bundle_warm
    from dsaindex.train.recall import band_rows

    # only the evaluation's fields count; the held-out keys are coded and scored on --device (an RQ code's
    # beam search over a 128K-key sequence takes minutes on a CPU, a second on a GPU)
    opts = _pq_options(32, "faiss", 1, True, 1, eval_queries, device, candidates)
    widths = tuple(parse_floats(filter_width, "--filter-width", minimum=0.0))
    store = _location(store)
    result = evaluate_bundle(bundle, store, opts, ray=ray)
    steady = None
    if warm:
        with progress_bar("decode windows", enabled=not as_json, unit="windows") as update:
            steady = evaluate_bundle_warm(bundle, store, warm_candidates, prefilter, cache, min_prefix,
                                          resolve_device(device), progress=update, filter_widths=widths,
                                          grow_band=grow_band)
    if as_json:
        print_json({"per_layer": {str(k): v for k, v in result["per_layer"].items()}, "mean": result["mean"]}
                   | ({"warm": steady | {"per_layer": {str(k): v for k, v in steady["per_layer"].items()}}}
                      if steady else {}))
        return
    print_recall_tables(result["per_layer"], result["mean"], result["ks"], opts.candidates)
    by_band = band_rows([("mean", result["mean"])], PAPER_K)
    if len(by_band) > 1:
        print_tables([recall_table(by_band, PAPER_K, opts.candidates,
                                   f"mean recall of the exact top-{PAPER_K} by prefix band (keys)", caption=False)],
                     Console())
    if steady is not None:
        Console().print(_warm_table(steady))


def _warm_table(steady: dict):
    """The steady-state decode table of ``eval pq --warm``: a row per layer, then the mean."""
    from rich.console import Group
    from rich.table import Table

    if not steady["per_layer"]:
        return "[dim]no held-out decode window (capture with --windows, --window-len)[/dim]"
    table = Table(title=f"decode windows through the runtime's cache: {steady['windows']} windows x "
                        f"{steady['steps_per_window']} steps, top-{steady['topk']}, C={steady['candidates']}, "
                        f"cache {steady['cache']}", title_justify="left")
    cols = [("warm_recall_rerank", "recall, no filter", ".2%"), ("warm_recall_filter", "recall, filter", ".2%"),
            ("warm_filter_loss", "loss (pts)", ".2f"), ("warm_fetch_share", "fetched", ".1%"),
            ("warm_hit_share", "hits", ".1%"), ("cold_recall_filter", "first step: recall", ".2%"),
            ("cold_fetch_share", "first step: fetched", ".1%")]
    table.add_column("")
    for _, name, _ in cols:
        table.add_column(name, justify="right")
    rows = [(f"layer {layer}", m) for layer, m in sorted(steady["per_layer"].items())] + [("mean", steady["mean"])]
    for label, m in rows:
        table.add_row(label, *[format(m[key], fmt) for key, _, fmt in cols])
    widths = steady["mean"].get("by_width", {})
    if len(widths) < 2:
        return table
    by_width = Table(title="the miss filter's width (standard deviations below the k-th coarse score), mean "
                           "over layers", title_justify="left")
    keep = [c for c in cols if c[0] != "warm_recall_rerank"]
    by_width.add_column("width")
    for _, name, _ in keep:
        by_width.add_column(name, justify="right")
    for w, m in widths.items():
        by_width.add_row(w, *[format(m[key], fmt) for key, _, fmt in keep])
    return Group(table, by_width)


@eval_app.command("pq-compare")
def eval_pq_compare_cmd(
    store: str = typer.Argument(..., help="Capture store to train and evaluate on (its own held-out split)"
                                         + _WHERE + "."),
    subspaces: str = typer.Option("16,32,64", help="PQ subspace counts to compare (comma-separated; bytes per "
                                                   "key at 256 centroids; each must divide the key dim), also "
                                                   "the codebook counts of RQ / LSQ codes (any count)."),
    centroids: str = typer.Option("256", help="Centroids per subspace to compare (comma-separated powers of two "
                                              "up to 256): 16 is a 4-bit code, half a byte per subspace."),
    variants: str = typer.Option("plain,score-aware", help="Codebook variants to compare: plain (k-means on keys), "
                                                           "score-aware (k-means under the score-gradient metric), "
                                                           "opq and opq-score-aware (the same after a learned "
                                                           "rotation of the keys, OPQ), rq, rq-score-aware, lsq "
                                                           "and lsq-score-aware (residual / additive codes of "
                                                           "--subspaces whole-key codebooks, faiss; for "
                                                           "comparison: the runtime serves PQ)."),
    trainer: str = typer.Option("faiss", help="faiss (CPU) or torch (GPU-capable batched Lloyd)."),
    iterations: int = typer.Option(20, callback=at_least(1), help="k-means iterations."),
    max_train_keys: int = typer.Option(262144, callback=at_least(1024),
                                       help="Keys per layer to train on (deterministic subsample; at least "
                                            "4 per centroid, 1024)."),
    eval_queries: int = typer.Option(128, callback=at_least(1), help="Held-out queries per layer."),
    candidates: str = typer.Option(_CANDIDATES, help=_CANDIDATES_HELP),
    device: str = typer.Option("auto", help="Device of the torch trainer and the evaluation."),
    out: Path = typer.Option(None, help="Also write the JSON result to this file."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Train PQ variants side by side on the same split (nothing registered) and print one recall table."""
    import json

    from rich.console import Console

    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.console import parse_ints, print_tables, progress_bar, recall_table
    from dsaindex.errors import DsaIndexError
    from dsaindex.train.pq_job import PAPER_K, check_options, pq_label, train_pq
    from dsaindex.train.recall import band_rows

    known = ("plain", "score-aware", "opq", "opq-score-aware", "rq", "rq-score-aware", "lsq", "lsq-score-aware")
    chosen = [v.strip() for v in variants.split(",") if v.strip()]
    unknown = sorted(set(chosen) - set(known))
    if unknown or not chosen:
        raise DsaIndexError(f"--variants {variants!r} names no known variant. Unknown: {', '.join(unknown) or 'none'}.",
                            f"pass some of {', '.join(known)}.")
    sizes = parse_ints(centroids, "--centroids", minimum=2)
    store = _location(store)
    odd = [k for k in sizes if k > 256 or k & (k - 1)]
    if odd:
        raise DsaIndexError(f"--centroids {centroids!r}: {odd} are not powers of two up to 256.",
                            "pass centroid counts such as 256 (8-bit codes) or 16 (4-bit codes).")
    cases = []
    for m in parse_ints(subspaces, "--subspaces", minimum=1):
        for k in sizes:
            for variant in chosen:
                quantizer = variant.split("-")[0] if variant.startswith(("rq", "lsq")) else "pq"
                cases.append(_pq_options(m, trainer, iterations, variant.endswith("score-aware"), max_train_keys,
                                         eval_queries, device, candidates, rotate=variant.startswith("opq"),
                                         centroids=k, quantizer=quantizer))
    geometry = CaptureStore.open(store).manifest.model.geometry
    for opts in cases:  # every case's options before the first one trains
        check_options(opts, geometry.head_dim)
    results = {}
    for opts in cases:
        bits = opts.centroids.bit_length() - 1
        name = f"{pq_label(opts)}{'' if bits == 8 else f'x{bits}'} {'score-aware' if opts.score_aware else 'plain'}"
        with progress_bar(name, enabled=not as_json, unit="layers") as update:
            report = train_pq(store, opts, progress=update)
        results[name] = report["mean"] | {
            "bytes_per_key": opts.subspaces * bits / 8, "train_seconds_per_layer": float(sum(r.train_seconds for r in report["results"].values())
                                             / len(report["results"]))}
    text = json.dumps(results, indent=2)
    if out:
        out.write_text(text)
    if as_json:
        print(text)
        return
    tables = [recall_table(list(results.items()), k, cases[0].candidates, f"mean recall of the exact top-{k}",
                           caption=False) for k in sorted({PAPER_K, geometry.topk})]
    by_band = band_rows(list(results.items()), PAPER_K)
    if len({name.rsplit(", ", 1)[1] for name, _ in by_band}) > 1:
        tables.append(recall_table(by_band, PAPER_K, cases[0].candidates,
                                   f"mean recall of the exact top-{PAPER_K} by prefix band (keys)", caption=False))
    print_tables(tables, Console())


@train_app.command("ivf")
def train_ivf_cmd(
    store: str = typer.Argument(..., help="Capture store to train on" + _WHERE + "."),
    model: str = typer.Option(None, "--model", "-m", help="Target model; refuses a store captured from another."),
    out: str = typer.Option(None, "--out", "-o", help="Bundle folder to write, or an s3://bucket/prefix; must be new "
                                                       "or empty (default: runs/bundles/<store>-ivf, with -2, -3, "
                                                       "... if taken)."),
    window: int = typer.Option(1024, callback=at_least(1), help="Keys per seal (the open window's size)."),
    cluster_size: int = typer.Option(128, callback=at_least(1),
                                     help="Keys per cluster (the cap of the size-capped k-means)."),
    refit_every: int = typer.Option(16384, callback=at_least(0), help="Keys between refits of the whole prefix "
                                                                      "(0: never)."),
    refit_fraction: float = typer.Option(None, help="Past refit_every / this many keys, a refit waits for this "
                                                    "share of the prefix (0: every refit_every keys; default: "
                                                    "1/16)."),
    budgets: str = typer.Option(_BUDGETS, help=_BUDGETS_HELP),
    steps: int = typer.Option(300, callback=at_least(1), help="Encoder training steps."),
    groups_per_step: int = typer.Option(32, callback=at_least(1),
                                        help="Query groups (sequence x index version) per training step."),
    val_budget: int = typer.Option(None, callback=at_least(1),
                                   help="Candidate budget (keys) at which the validation sequence picks the "
                                        "training step to keep (default: the smallest of --budgets, where that "
                                        "holds fewer clusters than most validation queries see)."),
    layers: str = typer.Option(None, help="Comma-separated layers to train (default: all; a partial bundle "
                                          "is for study: the runtime wants every indexer layer)."),
    train_queries: int = typer.Option(256, callback=at_least(1), help="Training queries per layer."),
    eval_queries: int = typer.Option(64, callback=at_least(1), help="Held-out queries per layer."),
    device: str = typer.Option("auto", help="cpu, cuda or auto."),
    register: bool = typer.Option(True, "--register/--no-register", help="Log an MLflow run and register the bundle."),
    tracking_uri: str = typer.Option(None, help=_URI_HELP),
    ray: str = typer.Option(None, "--ray", help=_RAY_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON (and no progress bar)."),
) -> None:
    """Train per-layer routing encoders (learned IVF representatives), compare routing methods on
    held-out sequences (recall vs candidate budget), write and register an ``ivf`` bundle."""
    from pydantic import ValidationError
    from rich.console import Console

    from dsaindex.artifacts.kinds import IVFIndexSettings
    from dsaindex.console import parse_ints, print_json, progress_bar, resolve_device, routing_table
    from dsaindex.errors import DsaIndexError
    from dsaindex.train.ivf import IVFOptions
    from dsaindex.train.ivf_job import run_ivf_job

    try:
        grows = {} if refit_fraction is None else {"refit_fraction": refit_fraction}
        settings = IVFIndexSettings(window=window, cluster_size=cluster_size, refit_every=refit_every, **grows)
    except ValidationError as err:
        raise DsaIndexError(f"Invalid index settings: {err.errors()[0]['msg']}.",
                            "pass --window as a multiple of --cluster-size (1024 and 128, say), and "
                            "--refit-fraction in [0, 1).") from None
    budget_list = parse_ints(budgets, "--budgets", minimum=1)
    layer_list = parse_ints(layers, "--layers", minimum=0) if layers else None
    store = _location(store)
    _check_target_model(store, model)
    opts = IVFOptions(settings, steps=steps, groups_per_step=groups_per_step, max_queries=train_queries,
                      val_budget=val_budget, device=resolve_device(device))
    with _bundle_out(out) as (job_out, publish), \
            progress_bar("IVF encoders", enabled=not as_json, unit="layers") as update:
        result = run_ivf_job(store, opts, budget_list, eval_queries, job_out, register, tracking_uri,
                             progress=update, layers=layer_list, ray=ray)
        bundle, plots = publish(result["bundle"], [result["plot"]])
        result |= {"bundle": str(bundle), "plot": str(plots[0])}
    if as_json:
        print_json(result)
        return
    Console().print(routing_table(result["mean"], budget_list,
                                  f"held-out recall of the exact top-{result['topk']}, mean of layers"))
    _print_outputs(result)


def _print_outputs(result: dict) -> None:
    """The line a training job ends on: its bundle, its plot, its registration."""
    from rich.console import Console

    registered = result["registered"]
    Console().print(f"bundle: {result['bundle']}  plot: {result['plot']}"
                    + (f"  registered: {registered['name']} v{registered['version']}" if registered else ""))


@eval_app.command("ivf")
def eval_ivf_cmd(
    bundle: str = typer.Argument(..., help="An ivf bundle (`dsaindex train ivf`)" + _WHERE + "."),
    store: str = typer.Option(..., "--store", "-s", help="Capture store whose held-out sequences to route" + _WHERE
                                                        + "."),
    budgets: str = typer.Option(_BUDGETS, help=_BUDGETS_HELP),
    eval_queries: int = typer.Option(64, callback=at_least(1), help="Held-out queries per layer."),
    min_prefix: int = typer.Option(0, callback=at_least(0),
                                   help="Only queries with more keys before them than this (e.g. 524288: the "
                                        "512K-1M prefixes of a long capture)."),
    refit_fraction: float = typer.Option(None, min=0.0, max=0.999,
                                         help="Route with this refit schedule instead of the bundle's (0: refit every "
                                              "refit_every keys at any length), to compare schedules on one capture."),
    device: str = typer.Option("auto", help="cpu, cuda or auto."),
    ray: str = typer.Option(None, "--ray", help=_RAY_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Held-out routing recall of a trained ivf bundle beside contiguous blocks and plain IVF: on the bundle's
    held-out sequences of its training store, or on every sequence of another capture of the same model."""
    from rich.console import Console

    from dsaindex.console import parse_ints, print_json, resolve_device, routing_table
    from dsaindex.train.ivf_job import evaluate_bundle

    budget_list = parse_ints(budgets, "--budgets", minimum=1)
    result = evaluate_bundle(_location(bundle), _location(store), budget_list, eval_queries, resolve_device(device),
                             ray=ray, min_prefix=min_prefix, refit_fraction=refit_fraction)
    if as_json:
        print_json(result)
        return
    longer = (f", prefixes over {min_prefix:,} keys" if min_prefix else "") + (
        f", refit fraction {refit_fraction:g}" if refit_fraction is not None else "")
    Console().print(routing_table(result["mean"], budget_list,
                                  f"held-out recall of the exact top-{result['topk']}, mean of layers "
                                  f"({result['held_out']}{longer})"))


def _reuse_rows(plans: dict) -> object:
    from rich.table import Table

    table = Table(title="retained recall of the exact top-k (held-out queries, mean of layers)")
    for col in ("retention", "kept layers (optimal)", "optimal", "evenly spaced", "gain"):
        table.add_column(col, justify="left" if col.startswith("kept") else "right")
    for retention, p in plans.items():
        table.add_row(retention, ",".join(map(str, p["kept"])), f"{p['recall']:.4f}", f"{p['even_recall']:.4f}",
                      f"{p['recall'] - p['even_recall']:+.4f}")
    return table


@train_app.command("reuse")
def train_reuse_cmd(
    store: str = typer.Argument(..., help="Capture store to analyze" + _WHERE + "."),
    model: str = typer.Option(None, "--model", "-m", help="Target model; refuses a store captured from another."),
    topk: int = typer.Option(None, "--topk", callback=at_least(1),
                             help="Keys each layer selects (default: the model's index_topk)."),
    queries: int = typer.Option(256, "--queries", callback=at_least(1),
                                help="Sampled queries per split (training, held-out) whose top-k sets are compared."),
    out: str = typer.Option(None, "--out", "-o", help="Bundle folder to write, or an s3://bucket/prefix; must be new "
                                                       "or empty (default: runs/bundles/<store>-reuse, with -2, -3, "
                                                       "... if taken)."),
    plot: Path = typer.Option(None, "--plot", help="Heat map of the overlap matrix (PNG; default: "
                                                   "<bundle>-overlap.png beside the bundle)."),
    device: str = typer.Option("auto", help="cpu, cuda or auto."),
    register: bool = typer.Option(True, "--register/--no-register", help="Log an MLflow run and register the bundle."),
    tracking_uri: str = typer.Option(None, help=_URI_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON (and no progress bar)."),
) -> None:
    """Measure how much of each layer's exact top-k another layer's holds, choose which layers keep their
    indexer at retentions 1/2 ... 1/32 (the rest reuse the nearest kept layer before them), compare with
    evenly spaced layers on held-out sequences, write and register a ``reuse`` bundle."""
    from rich.console import Console

    from dsaindex.console import print_json, progress_bar, resolve_device
    from dsaindex.train.reuse import run_reuse_job

    store = _location(store)
    _check_target_model(store, model)
    with _bundle_out(out, keep_plots=plot is not None) as (job_out, publish), \
            progress_bar("reuse overlap", enabled=not as_json, unit="steps") as update:
        result = run_reuse_job(store, topk, queries, job_out, register, tracking_uri, plot, resolve_device(device),
                               progress=update)
        bundle, plots = publish(result["bundle"], [result["plot"]])
        result |= {"bundle": str(bundle), "plot": str(plots[0])}
    if as_json:
        print_json(result)
        return
    Console().print(_reuse_rows(result["plans"]))
    _print_outputs(result)


@eval_app.command("reuse")
def eval_reuse_cmd(
    bundle: str = typer.Argument(..., help="A reuse bundle (`dsaindex train reuse`)" + _WHERE + "."),
    store: str = typer.Option(..., "--store", "-s", help="Capture store whose held-out sequences to measure on"
                                                        + _WHERE + "."),
    queries: int = typer.Option(256, "--queries", callback=at_least(1), help="Held-out queries compared."),
    device: str = typer.Option("auto", help="cpu, cuda or auto."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON (and no progress bar)."),
) -> None:
    """Held-out retained recall of each plan of a reuse bundle beside the evenly spaced pattern."""
    from rich.console import Console

    from dsaindex.console import print_json, progress_bar, resolve_device
    from dsaindex.train.reuse import evaluate_bundle

    with progress_bar("reuse eval", enabled=not as_json, unit="steps") as update:
        result = evaluate_bundle(_location(bundle), _location(store), queries, resolve_device(device),
                                 progress=update)
    if as_json:
        print_json(result)
        return
    Console().print(_reuse_rows(result["plans"]))


def _distill_streams(model_ref: str, loaded, corpus: Path | None):
    """(token streams, vocabulary) that ``indexer-distill`` trains and evaluates on
    (:func:`~dsaindex.pipelines.reference.train.checkpoint_streams`: ``corpus``'s own tokens, or the
    byte-token Python sources for a byte-token checkpoint)."""
    from dsaindex.pipelines.capture.models import ByteTokenizer
    from dsaindex.pipelines.capture.tokens import checkpoint_streams

    own = None if isinstance(loaded.tokenizer, ByteTokenizer) else loaded.tokenizer.name
    return checkpoint_streams(model_ref, own, corpus, int(loaded.model.config.vocab_size), 8_000_000, 2_000_000)


@train_app.command("indexer-distill")
def train_indexer_distill_cmd(
    plan: str = typer.Option(..., "--plan", help="A reuse bundle (`dsaindex train reuse`): path or models:/NAME@ALIAS."),
    retention: str = typer.Option("1/4", help="Which of the bundle's plans, e.g. 1/4."),
    method: str = typer.Option("optimal", help="optimal (the learned plan) or even (every N-th layer)."),
    model: str = typer.Option("reference", "--model", "-m", help="`reference` or a checkpoint directory."),
    out: Path = typer.Option(..., "--out", "-o", help="Overlay folder to write (new or empty)."),
    steps: int = typer.Option(200, callback=at_least(1), help="Optimizer steps."),
    batch: int = typer.Option(2, callback=at_least(1), help="Training windows per step."),
    seq_len: int = typer.Option(1024, callback=at_least(16), help="Tokens per training and held-out window."),
    lr: float = typer.Option(1e-3, help="Peak learning rate (AdamW, linear decay to 10%)."),
    eval_windows: int = typer.Option(16, callback=at_least(1), help="Held-out windows for bits per byte and recall."),
    eval_seq_len: int = typer.Option(None, callback=at_least(16),
                                     help="Tokens per held-out window (default: --seq-len)."),
    topk: int = typer.Option(None, "--topk", callback=at_least(1),
                             help="Keys each layer attends (default: the model's index_topk)."),
    objective: str = typer.Option("dense", help="dense: match the served layers' whole attention; selected: "
                                                "that attention on the union of their own top-k keys."),
    lag: bool = typer.Option(False, "--lag", help="The Multi-layer Indexer's schedule: every layer attends the "
                                                  "nearest kept layer before it (a kept layer too), so each "
                                                  "kept indexer serves the layers after it."),
    corpus: Path = typer.Option(None, "--corpus", help="The corpus a checkpoint with its own tokenizer was trained "
                                                       "on (the folder `dsaindex reference corpus` wrote, or its "
                                                       "tokenizer.json and tokens.npz); default: the byte-token "
                                                       "Python sources the v1 reference was trained on."),
    device: str = typer.Option("auto", help="cpu, cuda or auto."),
    tracking_uri: str = typer.Option(None, help=_URI_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON (and no progress bar)."),
) -> None:
    """Retrain only the indexers a reuse plan keeps, the model frozen, so each predicts the attention of
    every layer that uses its selection; write them as a checkpoint overlay with lineage to the plan and
    the base checkpoint, and report held-out bits per byte and retained recall: unmodified, plan, plan
    distilled."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from dsaindex.artifacts.kinds import ReusePlans, lagged_sources
    from dsaindex.console import print_json, progress_bar, resolve_device
    from dsaindex.errors import DsaIndexError
    from dsaindex.pipelines.capture.indexer_distill import distill, plan_quality, write_overlay
    from dsaindex.pipelines.capture.models import load_model
    from dsaindex.pipelines.capture.tokens import heldout_windows
    from dsaindex.runtime.loader import load_bundle

    if objective not in ("dense", "selected"):
        raise DsaIndexError(f"--objective {objective!r} is not dense or selected.", "pass --objective dense or selected.")
    dev = resolve_device(device)
    loaded = load_model(model, device=dev, dtype="float32")
    net = loaded.model
    bundle = load_bundle(plan, net.config, device=dev, served=loaded.fingerprint, tracking_uri=tracking_uri)
    plans = next((obj for obj in bundle.layers.values() if isinstance(obj, ReusePlans)), None)
    if plans is None:
        raise DsaIndexError(f"{plan} holds no reuse plans.", "pass a bundle written by `dsaindex train reuse`.")
    chosen = plans.plan(retention, method)
    by_layer = dict(zip(plans.layers, chosen.sources, strict=True))
    sources = [by_layer.get(i, i) for i in range(len(net.model.layers))]
    if lag:
        sources = lagged_sources(list(range(len(sources))), chosen.kept)
    topk = int(net.config.index_topk) if topk is None else topk
    streams, vocab = _distill_streams(model, loaded, corpus)
    train = torch.from_numpy(streams.train).to(dev)
    ids, labels = heldout_windows(torch.from_numpy(streams.heldout).to(dev), eval_seq_len or seq_len, eval_windows,
                                  vocab.bos)
    own = list(range(len(sources)))
    per_byte = vocab.bytes_per_token
    with progress_bar("indexer-distill", enabled=not as_json, unit="steps") as update:
        update(0, steps, "held-out quality before")
        before = {"unmodified": plan_quality(net, ids, labels, own, topk, bytes_per_token=per_byte),
                  "plan": plan_quality(net, ids, labels, sources, topk, bytes_per_token=per_byte)}
        history = distill(net, sources, train, steps, batch, seq_len, lr,
                          progress=lambda done, total, kl: update(done, total, f"KL {kl:.4f}"),
                          objective=objective, topk=topk, bos=vocab.bos)
        update(steps, steps, "held-out quality after")
        after = plan_quality(net, ids, labels, sources, topk, bytes_per_token=per_byte)
    gap = before["plan"]["bits_per_byte"] - before["unmodified"]["bits_per_byte"]
    closed = (before["plan"]["bits_per_byte"] - after["bits_per_byte"]) / gap if gap > 0 else None
    metrics = {"unmodified": before["unmodified"], "plan": before["plan"], "distilled": after,
               "gap_closed": None if closed is None else round(closed, 4)}
    lineage = {"plan": {"uri": str(plan), "bundle_id": bundle.manifest.bundle_id, "retention": retention,
                        "method": method, "kept": chosen.kept, "sources": sources, "lag": lag},
               "base_checkpoint": loaded.fingerprint.model_dump(),
               "training": {"steps": steps, "batch": batch, "seq_len": seq_len, "lr": lr, "objective": objective,
                            "history": history,
                            "corpus": streams.info}}
    manifest = write_overlay(net, chosen.kept, out, lineage, metrics)
    result = {"overlay": str(out), "kept": chosen.kept, "sources": sources, "lag": lag, "topk": topk,
              "eval_windows": [int(ids.shape[0]), int(ids.shape[1])], **metrics,
              "weights_sha256": manifest["weights_sha256"]}
    if as_json:
        print_json(result)
        return
    table = Table(title=f"held-out quality at retention {retention} ({method}), top-{topk}, "
                        f"{ids.shape[0]} x {ids.shape[1]} tokens")
    for col in ("indexers", "bits per byte", *[f"recall L{i}" for i in range(len(sources))]):
        table.add_column(col, justify="left" if col == "indexers" else "right")
    plan_name = "plan + MLI lag" if lag else "plan"
    for name, row in (("every layer its own", metrics["unmodified"]), (plan_name, metrics["plan"]),
                      (f"{plan_name}, distilled", metrics["distilled"])):
        table.add_row(name, f"{row['bits_per_byte']:.4f}", *[f"{r:.3f}" for r in row["retained_recall"]])
    Console().print(table)
    print(f"gap closed by distillation: {'n/a' if closed is None else f'{100 * closed:.1f}%'}")
    print(f"overlay: {out}")
