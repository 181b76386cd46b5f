"""``dsaindex serve``: transformers' OpenAI-compatible server with the runtime's selection installed.

Startup, in order: the model loads; every artifact bundle is resolved (path or ``models:/...``),
verified and validated against it (:func:`dsaindex.runtime.serving.serve_index`: a mismatch stops here with
the runtime check's message and exit code 2, before any port opens); the runtime is installed; then
transformers' server (:mod:`dsaindex.runtime.server`) listens.
"""

from __future__ import annotations

import typer

from dsaindex.console import at_least
from dsaindex.pipelines.commands import serving_options
from dsaindex.pipelines.commands.serving_options import DECODE, PREFILL, SERVE

# the parsers, importable from here too
from dsaindex.pipelines.commands.serving_options import parse_candidates as parse_candidates
from dsaindex.pipelines.commands.serving_options import parse_prefilter as parse_prefilter
from dsaindex.runtime.settings import PrefillSettings, ServeSettings


def serve_cmd(
    model: str = serving_options.MODEL,
    artifacts: list[str] = serving_options.ARTIFACTS,
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, callback=at_least(1), help="Port to listen on."),
    model_id: str = typer.Option(None, help="The model's name in the API (default: dsaindex/<model name>)."),
    device: str = serving_options.DEVICE,
    dtype: str = typer.Option("auto", help="auto (bfloat16 on CUDA, float32 on the CPU), float32 or bfloat16."),
    topk: int = serving_options.TOPK,
    candidates: str = serving_options.CANDIDATES,
    recall_target: float = serving_options.RECALL_TARGET,
    prefilter: str = serving_options.PREFILTER,
    stage1: str = serving_options.STAGE1,
    ivf_budget: int = serving_options.IVF_BUDGET,
    ivf_recall_target: float = serving_options.IVF_RECALL_TARGET,
    exact_below: int = serving_options.EXACT_BELOW,
    direct_upto: int = typer.Option(DECODE.direct_upto, callback=at_least(0),
                                    help="Decode: steps with at most this many requests read their candidates "
                                         "straight from pinned host memory (no device cache; 0: never)."),
    filter_width: float = typer.Option(DECODE.filter_width, min=0.0,
                                       help="Decode: the miss filter's margin below the k-th coarse score, in "
                                            "standard deviations (wider: more host reads, less recall lost)."),
    long_prefix: str = serving_options.LONG_PREFIX,
    prefill_chunk: int = serving_options.PREFILL_CHUNK,
    stream_prefix: bool = typer.Option(PREFILL.stream_prefix, "--stream-prefix",
                                       help="Keep the model's indexer keys in pinned host memory and stream each "
                                            "layer's prefix through two device buffers (LeanSparse's prefill)."),
    retention: str = typer.Option(SERVE.retention,
                                  help="With a reuse bundle among --artifacts: the plan to serve ('1/2', '1/4', "
                                       "...): layers without an indexer in it take their kept layer's selection."),
    lag: bool = typer.Option(SERVE.lag, "--lag",
                             help="The Multi-layer Indexer: every layer attends the nearest kept layer before it, "
                                  "each kept layer's selection running on a side stream under its own layer (CUDA)."),
    basis: str = serving_options.BASIS,
    allow_other_weights: bool = serving_options.ALLOW_OTHER_WEIGHTS,
    tracking_uri: str = serving_options.TRACKING_URI,
    max_requests: int = typer.Option(16, callback=at_least(1),
                                     help="Generation requests served at once; more are answered 429 (retry)."),
    log_level: str = typer.Option("warning", help="uvicorn's log level."),
) -> None:
    """Serve a DSA model over HTTP (OpenAI-compatible: /v1/completions, /v1/chat/completions, /v1/models)
    with transformers' own server, the runtime selecting every layer's top-k: IVF for prefill, PQ for
    decode, the model's exact selection where a layer has no artifact of a kind."""
    from dsaindex.runtime import server
    from dsaindex.runtime.serving import serve_index

    serving_options.check_locations(artifacts)
    settings = ServeSettings(
        decode=serving_options.parse_decode(candidates, prefilter, recall_target, exact_below=exact_below,
                                            filter_width=filter_width, direct_upto=direct_upto,
                                            long_prefix=long_prefix, stage1=stage1),
        prefill=PrefillSettings(ivf_budget=ivf_budget, ivf_recall_target=ivf_recall_target, stream_prefix=stream_prefix,
                                chunk=prefill_chunk),
        basis=basis, allow_other_weights=allow_other_weights, tracking_uri=tracking_uri, retention=retention, lag=lag)
    loaded, dev = serving_options.load_served_model(model, device, topk, dtype=dtype)
    net = loaded.model
    index = serve_index(artifacts, net, settings, name=loaded.name, device=dev, served=loaded.fingerprint)
    index.attach()
    name = model_id or f"dsaindex/{loaded.name}"
    chunk = server.prefill_chunk(net.config, settings.prefill.chunk)
    typer.echo(f"serving {name} ({loaded.name}, top-{index.topk}) on http://{host}:{port}/v1 with "
               f"{', '.join(map(str, artifacts))}: {index.describe()}; prompts prefilled {chunk:,} tokens at a "
               "time", err=True)
    app = server.build_app(net, loaded.tokenizer.for_transformers(), name, max_in_flight=max_requests, chunk=chunk)
    server.run(app, host=host, port=port, log_level=log_level)

