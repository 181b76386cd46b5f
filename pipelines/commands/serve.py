"""``dsaindex serve``: transformers' OpenAI-compatible server with the runtime's selection installed.

Startup, in order: the model loads; every artifact bundle is resolved (path or ``models:/...``),
verified and validated against it (:func:`dsaindex.runtime.serving.serve_index`: a mismatch stops here with
the runtime check's message and exit code 2, before any port opens); the runtime is installed; then
transformers' server (:mod:`dsaindex.runtime.server`) listens.
"""

from __future__ import annotations

import typer

from dsaindex.console import at_least
from dsaindex.runtime.settings import DecodeSettings, PrefillSettings, ServeSettings

# the option defaults are the settings' own (one definition: runtime/settings.py)
DECODE, PREFILL, SERVE = DecodeSettings(), PrefillSettings(), ServeSettings()


def serve_cmd(
    model: str = typer.Option("reference", "--model", "-m", help="Checkpoint directory, `reference` or a preset."),
    artifacts: list[str] = typer.Option(..., "--artifacts", "-a",
                                        help="Bundle path, s3://bucket/prefix or models:/<name>@<alias>; repeat for one "
                                             "pq (decode) and one ivf (prefill) bundle."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, callback=at_least(1), help="Port to listen on."),
    model_id: str = typer.Option(None, help="The model's name in the API (default: dsaindex/<model name>)."),
    device: str = typer.Option("auto", help="cuda, cpu or auto."),
    dtype: str = typer.Option("auto", help="auto (bfloat16 on CUDA, float32 on the CPU), float32 or bfloat16."),
    topk: int = typer.Option(None, callback=at_least(1), help="Keys selected per query (default: the model's)."),
    candidates: str = typer.Option(str(DECODE.candidates), help="Decode: C, keys reranked exactly per step, or `auto`: per layer, the "
                                                "smallest C whose held-out recall in the pq bundle reaches "
                                                "--recall-target."),
    recall_target: float = typer.Option(DECODE.recall_target, min=0.0, max=1.0,
                                        help="With --candidates auto: the held-out recall of the exact top-k each "
                                             "decode layer must reach (at the bundle's longest prefixes too)."),
    prefilter: str = typer.Option(DecodeSettings.prefilter, help="Decode: stage 1 keeps prefilter x C keys, or `auto` "
                                                           "(with --candidates auto): per layer, the cheapest stage 1 "
                                                           "and C whose held-out recall reaches --recall-target "
                                                           "(default: auto with --candidates auto, else 4)."),
    ivf_budget: int = typer.Option(PREFILL.ivf_budget, callback=at_least(1),
                                   help="Prefill: candidates per query from the IVF index (default: the smallest the "
                                        "ivf bundle records at --ivf-recall-target; 8 x top-k where it records none)."),
    ivf_recall_target: float = typer.Option(PREFILL.ivf_recall_target, min=0.0, max=1.0,
                                            help="Without --ivf-budget: the held-out prefill recall of the exact "
                                                 "top-k the IVF budget must reach, as the ivf bundle records it."),
    exact_below: int = typer.Option(DECODE.exact_below, callback=at_least(0),
                                    help="Decode: score requests of at most this many keys exactly (0: never)."),
    direct_upto: int = typer.Option(DECODE.direct_upto, callback=at_least(0),
                                    help="Decode: steps with at most this many requests read their candidates "
                                         "straight from pinned host memory (no device cache; 0: never)."),
    filter_width: float = typer.Option(DECODE.filter_width, min=0.0, help="Decode: the miss filter's margin below the k-th coarse "
                                                          "score, in standard deviations (wider: more host "
                                                          "reads, less recall lost)."),
    prefill_chunk: int = typer.Option(PREFILL.chunk, callback=at_least(1),
                                      help="Prompt tokens prefilled at once (default: the largest power of two "
                                           "up to 4,096 whose attention scores at the model's last position fit "
                                           "in 1 GiB)."),
    stream_prefix: bool = typer.Option(PREFILL.stream_prefix, "--stream-prefix",
                                       help="Keep the model's indexer keys in pinned host memory and stream each "
                                            "layer's prefix through two device buffers (LeanSparse's prefill)."),
    retention: str = typer.Option(SERVE.retention, help="With a reuse bundle among --artifacts: the plan to serve ('1/2', "
                                             "'1/4', ...): layers without an indexer in it take their kept "
                                             "layer's selection."),
    lag: bool = typer.Option(SERVE.lag, "--lag", help="The Multi-layer Indexer: every layer attends the nearest kept "
                                                  "layer before it, each kept layer's selection running on a side "
                                                  "stream under its own layer (CUDA)."),
    basis: str = typer.Option(SERVE.basis, help="Key basis the artifacts were trained in."),
    allow_other_weights: bool = typer.Option(SERVE.allow_other_weights, "--allow-other-weights",
                                             help="Serve artifacts trained for another model of the same geometry."),
    tracking_uri: str = typer.Option(SERVE.tracking_uri, help="MLflow tracking URI for models:/ URIs."),
    max_requests: int = typer.Option(16, callback=at_least(1),
                                     help="Generation requests served at once; more are answered 429 (retry)."),
    log_level: str = typer.Option("warning", help="uvicorn's log level."),
) -> None:
    """Serve a DSA model over HTTP (OpenAI-compatible: /v1/completions, /v1/chat/completions, /v1/models)
    with transformers' own server, the runtime selecting every layer's top-k: IVF for prefill, PQ for
    decode, the model's exact selection where a layer has no artifact of a kind."""
    from dsaindex.artifacts.storage import location
    from dsaindex.console import resolve_device
    from dsaindex.indexer import set_index_topk
    from dsaindex.pipelines.capture.models import load_model
    from dsaindex.runtime import server
    from dsaindex.runtime.serving import serve_index

    for uri in artifacts:  # another scheme than s3:// (or a mistyped s3:/x) is refused before the model loads
        if not uri.startswith("models:/"):
            location(uri)
    settings = ServeSettings(
        decode=DecodeSettings(candidates=parse_candidates(candidates), recall_target=recall_target,
                              prefilter=None if prefilter is None else parse_prefilter(prefilter,
                                                                                       parse_candidates(candidates)),
                              exact_below=exact_below, filter_width=filter_width, direct_upto=direct_upto),
        prefill=PrefillSettings(ivf_budget=ivf_budget, ivf_recall_target=ivf_recall_target, stream_prefix=stream_prefix,
                                chunk=prefill_chunk),
        basis=basis, allow_other_weights=allow_other_weights, tracking_uri=tracking_uri, retention=retention, lag=lag)
    dev = resolve_device(device)
    loaded = load_model(model, device=dev, dtype=dtype)
    net = loaded.model
    identity = loaded.fingerprint  # the checkpoint's, before serving settings change the config
    if topk is not None:
        set_index_topk(net, topk)
    index = serve_index(artifacts, net, settings, name=loaded.name, device=dev, served=identity)
    index.attach()
    name = model_id or f"dsaindex/{loaded.name}"
    chunk = server.prefill_chunk(net.config, settings.prefill.chunk)
    typer.echo(f"serving {name} ({loaded.name}, top-{index.topk}) on http://{host}:{port}/v1 with "
               f"{', '.join(map(str, artifacts))}: {index.describe()}; prompts prefilled {chunk:,} tokens at a "
               "time", err=True)
    app = server.build_app(net, loaded.tokenizer.for_transformers(), name, max_in_flight=max_requests, chunk=chunk)
    server.run(app, host=host, port=port, log_level=log_level)


def parse_prefilter(value: str, candidates: int | str) -> int | str:
    """``--prefilter``: a positive factor, or ``auto`` (only with ``--candidates auto``); a
    :class:`DsaIndexError` naming the fix otherwise (:func:`dsaindex.runtime.settings.parse_prefilter`)."""
    from dsaindex.runtime import settings

    return settings.parse_prefilter(value, candidates, empty_ok=False)


def parse_candidates(value: str) -> int | str:
    """``--candidates``: a positive count, or ``auto``; a :class:`DsaIndexError` naming the fix otherwise."""
    from dsaindex.runtime import settings

    return settings.parse_candidates(value, empty_ok=False)
