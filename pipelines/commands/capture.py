"""``dsaindex capture`` and ``dsaindex demo``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from dsaindex.pipelines.capture.presets import PRESETS
from dsaindex.pipelines.commands import serving_options

if TYPE_CHECKING:
    from dsaindex.artifacts.capture_store import CaptureSettings
    from dsaindex.pipelines.capture.corpus import CorpusSpec
    from dsaindex.pipelines.capture.run import PrefillRequest


_MODEL_HELP = (
    "Checkpoint directory, `reference`, or a built-in preset: "
    + ", ".join(f"`preset:{name}`" for name in PRESETS)
    + ". Default: the reference checkpoint if installed, else preset:tiny-v32."
)


def capture_cmd(
    store: str = typer.Argument(..., help="Capture store to create, or to resume if it exists: a local folder or "
                                          "s3://bucket/prefix."),
    model: str = typer.Option(None, "--model", "-m", help=_MODEL_HELP),
    corpus: list[str] = typer.Option(
        None, "--corpus", "-c", help="Text/JSONL files or folders (repeatable). Default: the Python stdlib sources."
    ),
    text_field: str = typer.Option("text", help="Field holding the text in JSONL corpus files."),
    sequences: int = typer.Option(8, "--sequences", "-n", min=1, help="Sequences the store should hold when done."),
    seq_len: int = typer.Option(4096, min=1, help="Tokens per sequence."),
    chunk_len: int = typer.Option(2048, min=1, help="Tokens per forward call (bounds the indexer's [S,H,T] scores, "
                                                    "and the attention's [heads,S,T] ones)."),
    basis: str = typer.Option("hadamard", help="Key basis to store: hadamard (as engines rotate keys) or raw."),
    key_dtype: str = typer.Option("bfloat16", help="Storage dtype of keys and queries: bfloat16 or float32."),
    queries: int = typer.Option(32, min=0, help="Scattered query positions sampled per sequence."),
    windows: int = typer.Option(2, min=0, help="Decode-like windows of consecutive query positions per sequence."),
    window_len: int = typer.Option(16, min=0, help="Positions per decode-like window."),
    seed: int = typer.Option(0, min=0, help="Seed of the query sampling."),
    device: str = typer.Option("auto", help="cpu, cuda, cuda:N or auto."),
    dtype: str = typer.Option("auto", help="Model dtype: auto (bf16 on GPU, fp32 on CPU), float32, bfloat16."),
    flush_tokens: int = typer.Option(
        0, min=0, help="Commit after every sequence (0), or once this many tokens are buffered (fewer, larger "
        "commits; a kill loses what is buffered)."),
    ivf_artifacts: str = typer.Option(
        None, "--ivf-artifacts",
        help="Prefill the model through the runtime's IVF selection from this ivf bundle (path, s3:// or "
             "models:/), as `dsaindex serve` does, instead of its own exact indexer: each chunk then costs the "
             "budget, not the prefix, which makes 512K-1M-token sequences affordable. Recorded in the store."),
    ivf_budget: int = serving_options.IVF_BUDGET,
    ivf_recall_target: float = serving_options.IVF_RECALL_TARGET,
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
) -> None:
    """Run a DSA model over a corpus and record its indexer keys, sampled queries and head weights."""
    from dsaindex.artifacts.capture_store import CaptureSettings, QuerySampling
    from dsaindex.artifacts.storage import location
    from dsaindex.console import resolve_device
    from dsaindex.errors import DsaIndexError
    from dsaindex.pipelines.capture.corpus import CorpusSpec
    from dsaindex.pipelines.capture.models import default_model_ref
    from dsaindex.pipelines.capture.run import PrefillRequest

    # every option is checked before a model loads or a store is created
    where = location(store)  # a local folder or s3://; another scheme is refused, never taken for a folder
    if basis not in ("hadamard", "raw"):
        raise DsaIndexError(f"Unknown basis {basis!r}.", "use --basis hadamard or --basis raw.")
    if key_dtype not in ("bfloat16", "float32"):
        raise DsaIndexError(f"Unknown key dtype {key_dtype!r}.", "use --key-dtype bfloat16 or float32.")
    if dtype not in ("auto", "float32", "bfloat16"):
        raise DsaIndexError(f"Unknown model dtype {dtype!r}.", "use --dtype auto, float32 or bfloat16.")
    settings = CaptureSettings(
        seq_len=seq_len,
        chunk_len=chunk_len,
        basis=basis,
        key_dtype=key_dtype,
        sampling=QuerySampling(scattered=queries, windows=windows, window_len=window_len, seed=seed),
    )
    if ivf_artifacts is None and ivf_budget is not None:
        raise DsaIndexError("--ivf-budget sizes the runtime's IVF prefill, which needs --ivf-artifacts.",
                            "pass --ivf-artifacts IVF_BUNDLE too, or leave --ivf-budget out.")
    prefill = None if ivf_artifacts is None else PrefillRequest(ivf_artifacts, ivf_budget, ivf_recall_target)
    spec = CorpusSpec(sources=tuple(corpus) if corpus else ("stdlib",), text_field=text_field)
    run_capture_and_report(where, model or default_model_ref(), spec, settings, sequences, resolve_device(device), dtype,
                           flush_tokens, as_json, progress, prefill)


def run_capture_and_report(store: str | Path, model: str, spec: CorpusSpec, settings: CaptureSettings, sequences: int,
                           device: str, dtype: str, flush_tokens: int, as_json: bool, progress: bool,
                           prefill: PrefillRequest | None = None) -> None:
    """Capture (see :func:`dsaindex.pipelines.capture.run.capture`) and print the run and the store. A Ctrl-C
    ends it with :class:`typer.Abort` carrying what the store kept (the CLI prints it and exits 130)."""
    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.console import print_json, print_store_summary, progress_bar
    from dsaindex.pipelines.capture.run import capture

    def notice(message: str) -> None:
        typer.echo(f"note: {message}", err=True)

    try:
        with progress_bar(f"capture {model}", enabled=progress and not as_json) as update:
            result = capture(store, model, spec, settings, sequences, device=device, dtype=dtype,
                             flush_tokens=flush_tokens, progress=update, notice=notice, prefill=prefill)
    except KeyboardInterrupt:
        raise typer.Abort(_interrupted_message(store, sequences)) from None
    summary = CaptureStore.open(store).info()
    run = {
        "sequences_added": result.sequences_added,
        "resumed_from": result.resumed_from,
        "tokens_added": result.tokens_added,
        "seconds": round(result.seconds, 3),
        "tokens_per_s": round(result.tokens_per_second, 1),
        "keys_per_s_all_layers": round(result.keys_added * len(summary["layers"]) / max(result.seconds, 1e-9), 1),
        "device": device,
    }
    if as_json:
        print_json({"capture": run, "store": summary})
        return
    if result.resumed_from:
        typer.echo(f"resumed after {result.resumed_from} committed sequences")
    typer.echo(
        f"captured {result.sequences_added} sequences, {result.tokens_added:,} tokens in {result.seconds:.1f} s "
        f"({run['tokens_per_s']:,.0f} tokens/s, {run['keys_per_s_all_layers']:,.0f} keys/s written) on {device}"
    )
    print_store_summary(summary)


def _interrupted_message(store: str | Path, sequences: int) -> str:
    """What a Ctrl-C left: the committed sequences of the store, and how to go on."""
    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.errors import DsaIndexError

    if not CaptureStore.exists(store):
        return "interrupted (Ctrl-C) before the capture store was created; nothing was written."
    try:
        committed = CaptureStore.open(store).committed.sequences
    except DsaIndexError:
        return f"interrupted (Ctrl-C); {store} could not be read back."
    return (f"interrupted (Ctrl-C): {committed} of {sequences} sequences are committed in {store}; "
            "run the same command again to resume from there.")


def demo_cmd(
    out: Path = typer.Option(Path("runs/demo"), help="Folder for the demo's outputs."),
    model: str = typer.Option(None, "--model", "-m", help="Model reference (default: reference or tiny preset)."),
    sequences: int = typer.Option(4, help="Sequences to capture (the last one is held out for evaluation)."),
    seq_len: int = typer.Option(4096, help="Tokens per sequence (the recall of the top-512 needs 2048+ keys of prefix)."),
    subspaces: int = typer.Option(32, help="PQ subspaces."),
    device: str = typer.Option("auto", help="cpu, cuda or auto."),
    tracking_uri: str = typer.Option(None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or ./runs/mlflow)."),
) -> None:
    """The main job on embedded defaults: capture, train PQ codebooks, register them, print the recall table."""
    import time

    from rich.console import Console

    from dsaindex.artifacts.capture_store import CaptureSettings
    from dsaindex.console import print_pq_job, progress_bar, resolve_device
    from dsaindex.pipelines.capture.corpus import CorpusSpec
    from dsaindex.pipelines.capture.models import default_model_ref
    from dsaindex.train.pq_job import PQOptions, describe_code, pq_label, run_pq_job

    console = Console()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    store = out / f"capture-{stamp}"
    ref = model or default_model_ref()
    device = resolve_device(device)
    console.rule(f"1/2 capture: {ref} on the Python stdlib sources -> {store}")
    settings = CaptureSettings(seq_len=seq_len, chunk_len=min(1024, seq_len))
    run_capture_and_report(store, ref, CorpusSpec(), settings, sequences, device, "auto", 0, False, True)  # commit per sequence

    # C below the held-out prefixes (2K-4K keys) so the coarse stage prunes, and above the top-k (a C
    # at or below it reranks the direct top-k: evaluation leaves such C out); OPQ, `train pq`'s default
    opts = PQOptions(subspaces=subspaces, iterations=15, max_eval_queries=64, candidates=(1024, 2048), rotate=True)
    label = pq_label(opts)
    console.rule(f"2/2 train {label} codebooks per layer (faiss), evaluate on the held-out sequence, "
                 "register in the MLflow model registry")
    with progress_bar(label, unit="layers") as update:
        result = run_pq_job(store, opts, out / f"{label.lower()}-{stamp}", tracking_uri=tracking_uri,
                            progress=update, title=f"{label} on {ref}")
    print_pq_job(result, f"{label} (held out)", console)
    console.print(f"code: {describe_code(opts)}", markup=False, highlight=False)
    console.print(f"[dim]What the recall means here: the held-out queries have {seq_len // 2:,}-{seq_len:,} keys before "
                  f"them, so C = 1,024 reranks a quarter to a half of each prefix and C = 2,048 half of it or all of "
                  "it; recall near 100% at these lengths says little about long contexts. At 128K-token prefixes the "
                  "same codes need C of 4,096 or more for 99.5% (docs/results.md); measure yours with "
                  "`dsaindex eval pq` on a long capture.[/dim]")
    console.print(f"browse: dsaindex registry list; dsaindex registry show {result.registered['name']} @candidate")


def register(app: typer.Typer) -> None:
    app.command("capture")(capture_cmd)
    app.command("demo")(demo_cmd)
