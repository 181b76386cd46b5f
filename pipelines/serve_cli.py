"""``dsaindex serve``: transformers' OpenAI-compatible server with the runtime's selection installed.

Startup, in order: the model loads; every artifact bundle is resolved (path or ``models:/...``),
verified and validated against it (:func:`dsaindex.runtime.serving.load`: a mismatch stops here with
the runtime check's message and exit code 2, before any port opens); the runtime is installed; then
transformers' server (:mod:`dsaindex.runtime.server`) listens.
"""

from __future__ import annotations

import typer

from dsaindex.coarse import DIRECT_UPTO, FILTER_WIDTH, PREFILTER, RECALL_TARGET
from dsaindex.console import at_least


def serve_cmd(
    model: str = typer.Option("reference", "--model", "-m", help="Checkpoint directory, `reference` or a preset."),
    artifacts: list[str] = typer.Option(..., "--artifacts", "-a",
                                        help="Bundle path or models:/<name>@<alias>; repeat for one pq (decode) and "
                                             "one ivf (prefill) bundle."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, callback=at_least(1), help="Port to listen on."),
    model_id: str = typer.Option(None, help="The model's name in the API (default: dsaindex/<model name>)."),
    device: str = typer.Option("auto", help="cuda, cpu or auto."),
    dtype: str = typer.Option("auto", help="auto (bfloat16 on CUDA, float32 on the CPU), float32 or bfloat16."),
    topk: int = typer.Option(None, callback=at_least(1), help="Keys selected per query (default: the model's)."),
    candidates: str = typer.Option("1024", help="Decode: C, keys reranked exactly per step, or `auto`: per layer, the "
                                                "smallest C whose held-out recall in the pq bundle reaches "
                                                "--recall-target."),
    recall_target: float = typer.Option(RECALL_TARGET, min=0.0, max=1.0,
                                        help="With --candidates auto: the held-out recall of the exact top-k each "
                                             "decode layer must reach (at the bundle's longest prefixes too)."),
    prefilter: str = typer.Option(str(PREFILTER), help="Decode: stage 1 keeps prefilter x C keys, or `auto` (with "
                                                        "--candidates auto): per layer, the cheapest stage 1 and C "
                                                        "whose held-out recall reaches --recall-target."),
    ivf_budget: int = typer.Option(None, callback=at_least(1),
                                   help="Prefill: candidates per query from the IVF index (default 8 x top-k)."),
    exact_below: int = typer.Option(0, callback=at_least(0),
                                    help="Decode: score requests of at most this many keys exactly (0: never)."),
    direct_upto: int = typer.Option(DIRECT_UPTO, callback=at_least(0),
                                    help="Decode: steps with at most this many requests read their candidates "
                                         "straight from pinned host memory (no device cache; 0: never)."),
    filter_width: float = typer.Option(FILTER_WIDTH, min=0.0, help="Decode: the miss filter's margin below the k-th coarse "
                                                          "score, in standard deviations (wider: more host "
                                                          "reads, less recall lost)."),
    stream_prefix: bool = typer.Option(False, "--stream-prefix",
                                       help="Keep the model's indexer keys in pinned host memory and stream each "
                                            "layer's prefix through two device buffers (LeanSparse's prefill)."),
    retention: str = typer.Option(None, help="With a reuse bundle among --artifacts: the plan to serve ('1/2', "
                                             "'1/4', ...): layers without an indexer in it take their kept "
                                             "layer's selection."),
    lag: bool = typer.Option(False, "--lag", help="The Multi-layer Indexer: every layer attends the nearest kept "
                                                  "layer before it, each kept layer's selection running on a side "
                                                  "stream under its own layer (CUDA)."),
    basis: str = typer.Option("hadamard", help="Key basis the artifacts were trained in."),
    allow_other_weights: bool = typer.Option(False, "--allow-other-weights",
                                             help="Serve artifacts trained for another model of the same geometry."),
    tracking_uri: str = typer.Option(None, help="MLflow tracking URI for models:/ URIs."),
    log_level: str = typer.Option("warning", help="uvicorn's log level."),
) -> None:
    """Serve a DSA model over HTTP (OpenAI-compatible: /v1/completions, /v1/chat/completions, /v1/models)
    with transformers' own server, the runtime selecting every layer's top-k: IVF for prefill, PQ for
    decode, the model's exact selection where a layer has no artifact of a kind."""
    from dsaindex.console import resolve_device
    from dsaindex.pipelines.models import load_model
    from dsaindex.pipelines.reference_train import set_index_topk
    from dsaindex.runtime import server
    from dsaindex.runtime.serving import load

    c_setting = parse_candidates(candidates)
    p_setting = parse_prefilter(prefilter, c_setting)
    dev = resolve_device(device)
    loaded = load_model(model, device=dev, dtype=dtype)
    net = loaded.model
    identity = loaded.fingerprint  # the checkpoint's, before serving settings change the config
    if topk is not None:
        set_index_topk(net, topk)
    index = load(artifacts, net, name=loaded.name, device=dev, basis=basis, allow_other_weights=allow_other_weights,
                 tracking_uri=tracking_uri, served=identity, candidates=c_setting, recall_target=recall_target,
                 prefilter=p_setting,
                 ivf_budget=ivf_budget, exact_below=exact_below, stream_prefix=stream_prefix, retention=retention,
                 lag=lag, filter_width=filter_width, direct_upto=direct_upto)
    index.attach()
    name = model_id or f"dsaindex/{loaded.name}"
    typer.echo(f"serving {name} ({loaded.name}, top-{index.topk}) on http://{host}:{port}/v1 with "
               f"{', '.join(map(str, artifacts))}: {index.describe()}", err=True)
    app = server.build_app(net, loaded.tokenizer.for_transformers(), name)
    server.run(app, host=host, port=port, log_level=log_level)


def parse_prefilter(value: str, candidates: int | str) -> int | str:
    """``--prefilter``: a positive factor, or ``auto`` (only with ``--candidates auto``); a
    :class:`DsaIndexError` naming the fix otherwise."""
    from dsaindex.errors import DsaIndexError

    text = value.strip().lower()
    if text == "auto":
        if candidates != "auto":
            raise DsaIndexError("--prefilter auto chooses each layer's stage 1 together with its C.",
                                "pass --candidates auto too, or a number to --prefilter (e.g. 4).")
        return "auto"
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise DsaIndexError(f"--prefilter {value!r} is neither a positive factor nor `auto`.",
                        f"pass a number (e.g. --prefilter {PREFILTER}) or --prefilter auto.")


def parse_candidates(value: str) -> int | str:
    """``--candidates``: a positive count, or ``auto``; a :class:`DsaIndexError` naming the fix otherwise."""
    from dsaindex.errors import DsaIndexError

    text = value.strip().lower()
    if text == "auto":
        return "auto"
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise DsaIndexError(f"--candidates {value!r} is neither a positive count nor `auto`.",
                        "pass a number of keys (e.g. --candidates 2048) or --candidates auto.")
