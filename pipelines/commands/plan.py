"""``dsaindex plan memory``: HBM, streamed-prefill timing and admission for serving a DSA model.

The numbers come from :mod:`dsaindex.runtime.planner` (leansparse §4, Eq. 1-5): per layer, the prefix
state to load for the last chunk of a ``--context``-token prefill, its load time over the host link, the
layer's compute time that hides it, the wait, and the smallest chunk that hides it; the peak GPU bytes of
prefix state streamed (two layers) and resident (all layers); and how many requests of each context fit
one GPU's HBM for exact, PQ32 and PQ16 index keys, with the MLA KV resident or offloaded to the host.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import typer

from dsaindex.console import at_least

plan_app = typer.Typer(no_args_is_help=True, help="Plan GPU memory and admission for serving DSA models.")


@plan_app.callback()
def _plan() -> None:
    """Plan GPU memory and admission for serving DSA models."""


def model_dims(ref: str, kv_dtype: str) -> Any:
    """:class:`~dsaindex.runtime.planner.ModelDims` of a preset name, a ``config.json`` or a checkpoint
    folder holding one."""
    from dataclasses import replace

    from dsaindex.errors import DsaIndexError
    from dsaindex.runtime.planner import MODEL_SHAPES, model_from_config

    if ref in MODEL_SHAPES:
        return replace(MODEL_SHAPES[ref], kv_dtype=kv_dtype)
    path = Path(ref)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise DsaIndexError(
            f"--model {ref!r} is neither a preset ({', '.join(MODEL_SHAPES)}) nor a config.json file.",
            "pass a preset name, or the path of a DSA model's config.json (or of its folder).")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise DsaIndexError(f"--model {path} is not a readable JSON file ({type(err).__name__}: {err}).",
                            "point at the config.json of a DeepSeek-V3.2 or GLM-5 checkpoint.") from None
    if not isinstance(config, dict):
        raise DsaIndexError(f"--model {path} holds JSON but not a config object.",
                            "point at the config.json of a DeepSeek-V3.2 or GLM-5 checkpoint.")
    return model_from_config(config, name=path.parent.name or path.stem, kv_dtype=kv_dtype)


def bundle_code_bytes(artifacts: str | Path) -> float:
    """Bytes per key of a PQ bundle's codes (subspaces x bits per code / 8; the widest layer), read from
    its manifest only."""
    from dsaindex.artifacts.bundle import read_manifest
    from dsaindex.errors import DsaIndexError

    manifest = read_manifest(artifacts)
    kinds = sorted({layer.kind for layer in manifest.layers.values()})
    if kinds != ["pq"]:
        raise DsaIndexError(
            f"{artifacts} holds {', '.join(kinds) or 'no'} artifacts; the planner sizes PQ codes.",
            "pass --artifacts a bundle written by `dsaindex train pq`, or --code-bytes N.")
    return max(layer.params["subspaces"] * math.ceil(math.log2(layer.params.get("centroids", 256))) / 8
               for layer in manifest.layers.values())


def positive(value: float | None, option: str, upper: float | None = None) -> None:
    """Refuse a float option at or below zero (or above ``upper``) with a one-line error."""
    from dsaindex.errors import DsaIndexError

    if value is not None and (not value > 0 or (upper is not None and value > upper)):
        bound = f" and at most {upper:g}" if upper is not None else ""
        raise DsaIndexError(f"{option} {value:g} is out of range.", f"pass {option} above 0{bound}.")


PAYLOADS = {"index_keys": "keys", "index_keys+mla_kv": "keys+KV"}  # what each layer's load carries


def size(n: float) -> str:
    """Bytes to three significant digits in binary units: ``132 MiB``, ``1.54 GiB``."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            value = n / (1 << shift)
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"
    return f"{int(n)} B"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def render(report: dict[str, Any]) -> tuple[list[Any], str]:
    """The report as rich tables (to print) and as markdown (to write)."""
    from rich import box
    from rich.table import Table

    plan, adm = report["streaming"], report["admission"]
    stream_head = ["payload", "load\nbytes", "load\nms", "compute\nms", "wait\nms", "break-even\n(tokens)",
                   "peak\nstreamed", "peak\nresident"]
    stream_rows = []
    for label in ("index_keys", "index_keys+mla_kv"):
        p = plan[label]
        stream_rows.append([PAYLOADS[label], size(p["load_bytes"]),
                            ms(p["load_s"]), ms(p["compute_s"]), ms(p["wait_s"]),
                            "none" if p["break_even_chunk"] is None else f"{p['break_even_chunk']:,}",
                            size(p["peak_bytes"]["streaming"]), size(p["peak_bytes"]["resident"])])
    columns = list(adm["rows"][0]["requests"]) if adm["rows"] else []
    adm_head = ["context", *[c.replace("/", "\n") for c in columns]]
    adm_rows = [[f"{row['context']:,}", *[str(row["requests"][c]) for c in columns]] for row in adm["rows"]]
    m, mc = report["model"], report["machine"]
    title = (f"{m['name']}: a {report['chunk']:,}-token chunk on a {report['prefix']:,}-token prefix; "
             f"one layer on one GPU of {mc['gpus']} (eta {report['efficiency']:g}, "
             f"host {mc['host_bps'] / 1e9:g} GB/s)")
    adm_title = (f"requests that fit ({size(report['budget']['usable_bytes'])} usable per GPU, weights "
                 f"{size(report['budget']['weights_bytes'])} per GPU; KV {m['kv_dtype']}; prefill "
                 f"{adm.get('prefill', 'exact')})")
    tables, md = [], []
    for head, rows, name in ((stream_head, stream_rows, title), (adm_head, adm_rows, adm_title)):
        table = Table(title=name, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
        for i, col in enumerate(head):
            table.add_column(col, justify="left" if i == 0 else "right", no_wrap=True)
        for row in rows:
            table.add_row(*row)
        tables.append(table)
        md += [f"**{name}**", "", "| " + " | ".join(h.replace("\n", " ") for h in head) + " |",
               "|" + " --- |" * len(head), *["| " + " | ".join(row) + " |" for row in rows], ""]
    return tables, "\n".join(md)


def plugin_report(dims: Any, machine: Any, lengths: list[int], chunk: int, artifacts: str | Path | None,
                  code_bytes: float | None, weights: float | None, as_json: bool, out: Path | None,
                  markdown: Path | None) -> None:
    """``plan memory --mode plugin``: :func:`dsaindex.runtime.planner.engine_pool` as a table (or JSON)."""
    from dataclasses import asdict

    from dsaindex.console import emit_report, markdown_rows, save_report
    from dsaindex.runtime import planner
    from dsaindex.runtime.paged_select import device_bytes_per_key

    subspaces = bundle_code_bytes(artifacts) if artifacts is not None else (code_bytes or 32)
    per_key = device_bytes_per_key(int(round(subspaces)), dims.index_head_dim)
    pool = planner.engine_pool(dims, machine, lengths, per_key, chunk, weights)
    report = {"model": dims.to_dict(), "machine": asdict(machine), "mode": "plugin", "chunk": chunk, **pool}
    names = {"engine": "engine alone", "plugin_device": "plugin, keys on GPU", "plugin_host": "plugin, keys on host"}
    head = ["", *names.values()]
    rows = [["index bytes per token (all layers)", *[size(pool["index_bytes_per_token"][k]) for k in names]],
            ["pool bytes per token", *[size(pool["bytes_per_token"][k]) for k in names]],
            ["tokens per GPU", *[f"{pool['tokens'][k]:,}" for k in names]],
            *[[f"requests of {r['context']:,} tokens", *[f"{r[k]:,}" for k in names]] for r in pool["requests"]],
            ["vs the engine alone", "", *["n/a" if pool["gain"][k] is None else f"{pool['gain'][k]:+.1%}"
                                          for k in ("plugin_device", "plugin_host")]]]
    title = (f"{dims.name} on {machine.gpus} x {machine.name} (per GPU: {size(pool['budget_bytes'])} for the KV pool "
             f"after {size(pool['weights_bytes'])} of weights and {size(pool['reservation_bytes'])} of prefill "
             f"reservation; KV {dims.kv_dtype}; codes {per_key:.2f} B per key and indexer layer)")
    md = f"**{title}**\n\n" + markdown_rows(head, rows) + "\n"
    if as_json:
        emit_report(report, out, markdown, md)
        return
    save_report(report, out, markdown, md)
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for i, col in enumerate(head):
        table.add_column(col, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in rows:
        table.add_row(*row)
    console = Console()
    console.print(table)
    console.print("[dim]plugin, keys on GPU: DSAINDEX_KEYS=device (the default): the codes come on top of the "
                  "engine's keys. plugin, keys on host: DSAINDEX_KEYS=host (SGLang and vLLM): the served layers' "
                  "keys live in pinned host memory and the pool counts the codes instead.[/dim]")


@plan_app.command("memory")
def plan_memory(
    model: str = typer.Option("deepseek-v3.2", "--model", "-m",
                              help="Preset (deepseek-v3.2, glm-5) or path of a DSA model's config.json."),
    context: int = typer.Option(1048576, callback=at_least(1), help="Tokens of the prefill the chunk ends."),
    chunk: int = typer.Option(4096, callback=at_least(1), help="Prefill chunk (tokens)."),
    artifacts: str = typer.Option(None, help="PQ bundle (a folder or s3://bucket/prefix): its codes' size adds an "
                                            "admission column."),
    code_bytes: float = typer.Option(None, help="Bytes per key of another code size (instead of "
                                                "--artifacts)."),
    hbm_gb: float = typer.Option(None, help="HBM per GPU in GB (default: H200, 141)."),
    host_gbps: float = typer.Option(None, help="Effective host-to-device GB/s per GPU under load "
                                               "(default 50; measure it on the serving node)."),
    efficiency: float = typer.Option(None, help="eta: share of the compute ceilings reached (default 0.6)."),
    gpus: int = typer.Option(None, callback=at_least(1),
                             help="GPUs one model instance spans, tensor parallel (default 8)."),
    delay_us: float = typer.Option(None, help="delta: buffer-reuse and startup delay per load "
                                              "(microseconds; default 0)."),
    weights_gb: float = typer.Option(None, help="Weights of the whole model in GB (default: counted, FP8)."),
    kv_dtype: str = typer.Option("fp8", help="MLA KV cache format: fp8 (656 B/token/layer on V3.2) or bf16."),
    cache_rows: int = typer.Option(4096, callback=at_least(0), help="Exact keys cached per request and layer "
                                                                    "by PQ decode."),
    score_rows: int = typer.Option(None, callback=at_least(1),
                                   help="Queries whose indexer logits are held at once (default: the "
                                        "whole chunk)."),
    ivf_budget: int = typer.Option(None, callback=at_least(1),
                                   help="Prefill through the runtime's causal IVF with this many candidates "
                                        "per query (default: the exact indexer scores every key)."),
    contexts: str = typer.Option("131072,524288,1048576", help="Comma-separated request lengths for the "
                                                               "admission table."),
    mode: str = typer.Option("runtime", "--mode",
                             help="runtime: the runtime's streamed prefill and admission; plugin: the tokens an "
                                  "engine's KV pool (SGLang, vLLM) admits per GPU with and without the "
                                  "engine plugins."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON instead of tables."),
    out: Path = typer.Option(None, help="Also write the JSON result to this file."),
    markdown: Path = typer.Option(None, help="Also write the tables as markdown to this file."),
) -> None:
    """Per-layer load, compute and wait of streamed prefill, the break-even chunk, the peak prefix-state
    bytes streamed vs resident, and the requests that fit per context, index mode and KV placement
    (``--mode plugin``: the tokens and requests an engine's pool admits with and without the plugins)."""
    from dataclasses import asdict

    from dsaindex.console import parse_ints
    from dsaindex.errors import DsaIndexError
    from dsaindex.runtime import planner

    for value, option in ((hbm_gb, "--hbm-gb"), (host_gbps, "--host-gbps"), (weights_gb, "--weights-gb"),
                          (code_bytes, "--code-bytes")):
        positive(value, option)
    positive(efficiency, "--efficiency", upper=1.0)
    if delay_us is not None and delay_us < 0:
        raise DsaIndexError(f"--delay-us {delay_us:g} is negative.", "pass --delay-us 0 or more.")
    if kv_dtype not in ("fp8", "bf16"):
        raise DsaIndexError(f"--kv-dtype {kv_dtype!r} is not a format the planner knows.",
                            "pass fp8 or bf16.")
    if chunk > context:
        raise DsaIndexError(f"--chunk {chunk:,} is longer than --context {context:,}.",
                            "pass a chunk of at most the context.")
    if artifacts is not None and code_bytes is not None:
        raise DsaIndexError("--artifacts and --code-bytes both set the code size.", "pass one of them.")
    if mode not in ("runtime", "plugin"):
        raise DsaIndexError(f"--mode {mode!r} is not a planner mode.", "pass --mode runtime or --mode plugin.")
    lengths = parse_ints(contexts, "--contexts", minimum=1)
    dims = model_dims(model, kv_dtype)
    machine = planner.with_overrides(
        planner.Machine(), hbm_bytes=None if hbm_gb is None else hbm_gb * 1e9, gpus=gpus,
        host_bps=None if host_gbps is None else host_gbps * 1e9,
        delay_s=None if delay_us is None else delay_us * 1e-6)
    eta = planner.DEFAULT_EFFICIENCY if efficiency is None else efficiency
    if mode == "plugin":
        plugin_report(dims, machine, lengths, chunk, artifacts, code_bytes,
                      None if weights_gb is None else weights_gb * 1e9, as_json, out, markdown)
        return
    modes = dict(planner.INDEX_MODES)
    if artifacts is not None:
        modes["artifacts"] = bundle_code_bytes(artifacts)
    elif code_bytes is not None:
        modes["codes"] = code_bytes
    weights = None if weights_gb is None else weights_gb * 1e9
    prefix = context - chunk
    reservation = {f"{mode}/{kv}": planner.prefill_reservation(dims, machine, chunk, prefix, code,
                                                               kv == "offloaded", score_rows, ivf_budget)
                   for mode, code in modes.items() for kv in planner.KV_MODES}
    weights_per_gpu = (planner.weight_bytes(dims) if weights is None else weights) / machine.gpus
    report = {
        "model": dims.to_dict(), "machine": asdict(machine), "context": context, "chunk": chunk,
        "prefix": prefix, "efficiency": eta,
        "streaming": planner.streaming_plan(dims, machine, chunk, prefix, eta),
        "prefill_reservation": reservation,
        "budget": {"usable_bytes": machine.hbm_bytes * machine.usable_fraction,
                   "weights_bytes": weights_per_gpu},
        "admission": {"code_bytes": modes, "cache_rows": cache_rows, "score_rows": score_rows or chunk,
                      "prefill": "exact" if ivf_budget is None else f"ivf, {ivf_budget} candidates",
                      "rows": planner.admission_table(dims, machine, lengths, chunk, modes, weights,
                                                      cache_rows, score_rows, ivf_budget)},
    }
    tables, md = render(report)
    from dsaindex.console import emit_report, save_report

    if as_json:
        emit_report(report, out, markdown, md)
        return
    save_report(report, out, markdown, md)
    from rich.console import Console

    console = Console()
    for table in tables:
        console.print(table)
    console.print(f"[dim]Per GPU of a tensor-parallel instance of {machine.gpus} GPUs; prefix state is "
                  "replicated, so a GPU's request count is the instance's. keys: exact index keys streamed "
                  "from the host (PQ modes), MLA KV resident; keys+KV: both streamed, only the top-k KV "
                  "working set stays on the GPU.[/dim]")
