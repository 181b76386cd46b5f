"""``dsaindex bench paged``: the engine plugins' decode step against the engines' own exact indexer, side by
side in one run, and the GPU bytes each keeps per key.

Per batch size B and request length N (synthetic keys, every request at N; medians of steps replayed from
CUDA graphs, as the engines run decode):

* ``deepgemm_best``: DeepGEMM's ``fp8_paged_mqa_logits`` over the engines' paged index-K cache and the
  faster of ``torch.topk`` and the runtime's threshold top-k, what SGLang and vLLM run without the plugin;
* ``plugin_device``: :class:`dsaindex.runtime.paged_select.PagedCacheSelector` over that cache in HBM (the
  plugins' default, ``DSAINDEX_KEYS=device``), with its exact path: a step with B x (N - 14 x the stage-1
  width) at most ``--exact-below`` keys is scored as the engine scores it, chosen on the device by a
  conditional graph node;
  ``plugin_device_pq``: the same selector with the exact path off (every step through the codes), timed where
  the row's step takes the exact path, so each row shows both sides of the bound;
* ``plugin_host``: the same step with the cache in pinned host memory the GPU reads in place
  (:func:`dsaindex.runtime.mapped.host_mapped_zeros`, ``DSAINDEX_KEYS=host``): the C candidates, the tail
  page and the signatures of each request's last 2 completed pages are read over the host link.

GPU bytes per key and layer: the exact keys' 132 B; with the plugin, the codes, signatures and flags
(:func:`dsaindex.runtime.paged_select.device_bytes_per_key`) beside the keys (device) or alone (host).

With ``--artifacts BUNDLE``: the step the plugins serve that bundle with when no ``DSAINDEX_*`` variable is
set (:func:`plugin_points`: each decode layer's C, stage 1 and its factor from the bundle's recorded recall
at the default target, C grown past the layer's measured band, the exact-path rule on, keys on the device),
each distinct point timed over the same cache beside one DeepGEMM baseline; a decode step's time a layer is
the mean over the bundle's decode layers (``plugin_defaults``; with the keys in host memory too,
``plugin_defaults_host``).
"""

from __future__ import annotations

from pathlib import Path

import typer

from dsaindex.coarse import PAGED_EXACT_BELOW, PAGED_EXACT_OFFSET, PAGED_FOLDS_EXTRA_BELOW, PREFILTER
from dsaindex.console import at_least

KEY_BYTES = 132


def _options(value: str, flag: str, what: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """The distinct names of a comma list ``value`` of ``flag``, in order; each one of ``allowed``."""
    from dsaindex.errors import DsaIndexError

    names = tuple(dict.fromkeys(m.strip() for m in value.split(",") if m.strip()))
    if not names or any(m not in allowed for m in names):
        raise DsaIndexError(f"{flag} {value!r} names no {what} or an unknown one.", f"pass {', '.join(allowed)}.")
    return names


def _paged_state(batch: int, keys: int, heads: int, subspaces: int) -> tuple:
    """(the engines' paged FP8 cache, its page table, the lengths, random codes, codebooks, queries, weights)
    for ``batch`` requests of ``keys`` synthetic keys each, on the GPU."""
    import torch

    from dsaindex.kernels import deepgemm
    from dsaindex.pipelines.bench.decode import synthetic_state

    fp8, scales, codes, codebooks, q, w = synthetic_state(batch, keys, heads, subspaces)
    lengths = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
    cache, table = deepgemm.paged_cache(fp8, scales)
    fp8 = scales = None
    torch.cuda.empty_cache()
    return cache, table, lengths, codes, codebooks, q, w


def _time_deepgemm(state: tuple, keys: int, topk: int, graphs: bool, profile: bool = False) -> tuple:
    """DeepGEMM's paged logits + ``torch.topk`` and + the runtime's threshold top-k over ``state``
    (:func:`_paged_state`): (median ms by name, with ``deepgemm_best`` the faster, timing modes, profiles,
    DeepGEMM's schedule to share, None or why DeepGEMM did not run)."""
    from dsaindex.kernels import deepgemm
    from dsaindex.kernels.topk import rows_topk
    from dsaindex.pipelines.bench.decode import timed
    from dsaindex.pipelines.bench.timing import kernel_profile

    cache, table, lengths, _, _, q, w = state
    ms: dict[str, float] = {}
    modes: dict[str, str] = {}
    profiles: dict[str, dict] = {}
    note = deepgemm.unavailable()
    schedule = None
    if note is None:
        schedule = deepgemm.paged_schedule(lengths)

        def logits(masked: bool = False):
            return deepgemm.paged_logits(cache, table, lengths, q, w, keys, schedule, masked=masked)

        logits()
        ms["deepgemm_topk"], modes["deepgemm_topk"] = timed(lambda: logits(masked=True).topk(topk, dim=1), graphs)
        ms["deepgemm_fast_topk"], modes["deepgemm_fast_topk"] = timed(lambda: rows_topk(logits(), lengths, topk),
                                                                      graphs)
        ms["deepgemm_best"] = min(ms["deepgemm_topk"], ms["deepgemm_fast_topk"])
        if profile:
            profiles["deepgemm_fast_topk"] = kernel_profile(lambda: rows_topk(logits(), lengths, topk))
    return ms, modes, profiles, schedule, note


def _time_selector(state: tuple, rows, codec, schedule, graphs: bool, profile: bool, topk: int,
                   **settings) -> tuple[float, str, dict | None]:
    """(median ms, timing mode, kernel profile or None) of the plugins' step: a
    :class:`~dsaindex.runtime.paged_select.PagedCacheSelector` of ``codec`` and ``settings`` over ``rows``
    (the cache of ``state``, or a host copy of it) with ``state``'s codes adopted, sharing DeepGEMM's
    ``schedule`` as an engine computes it once a step for every layer."""
    import torch

    from dsaindex.pipelines.bench.decode import timed
    from dsaindex.pipelines.bench.timing import kernel_profile
    from dsaindex.runtime.paged_select import PagedCacheSelector

    _, table, lengths, codes, _, q, w = state
    selector = PagedCacheSelector(codec, rows.shape[0], topk, device="cuda", **settings)
    selector.adopt(rows, table.reshape(-1), codes.reshape(-1, 64, codes.shape[2]))
    step = lambda: selector.select(rows, table, lengths, q, w, eager_refresh=False, schedule=schedule)  # noqa: E731
    step()
    ms, mode = timed(step, graphs)
    if int(selector.stats.stale.sum()) or int(selector.stats.encoded.sum()):
        raise RuntimeError("the paged selector found stale pages in the benchmark's adopted codes")
    kernels = kernel_profile(step) if profile else None
    selector = step = None
    torch.cuda.empty_cache()
    return ms, mode, kernels


def _expected_path(batch: int, keys: int, candidates: int, prefilter: int, stage1: str, grow_band: int,
                   exact_below: int) -> str:
    """``exact`` or ``pq``: the path the plugins' rule sends a step of ``batch`` requests of ``keys`` keys down
    (:func:`~dsaindex.runtime.paged_select.takes_exact_path` with the selector's default offsets, the fold
    scan's bound holding its fixed part too, as the selector's does)."""
    from dsaindex.runtime.paged_select import exact_shares, growth_limit, takes_exact_path

    offset, extra = exact_shares(prefilter * candidates, grows=grow_band > 0)
    grow = (grow_band, growth_limit(candidates)) if grow_band else (0, 1)  # the offset grows with C
    bound = exact_below + (PAGED_FOLDS_EXTRA_BELOW if exact_below and stage1 == "folds" else 0)
    return "exact" if takes_exact_path(batch, keys, bound, offset, grow, extra) else "pq"


def time_paged_case(batch: int, keys: int, heads: int, topk: int, candidates: int, prefilter: int,
                    subspaces: int, places: tuple[str, ...], graphs: bool, profile: bool = False,
                    exact_below: int = PAGED_EXACT_BELOW, top_cs: tuple[str, ...] = ("auto",),
                    scans: tuple[str, ...] = ("triton",), grow_band: int = 0,
                    stage2s: tuple[str, ...] = ("auto",), stage1s: tuple[str, ...] = ("codes",)) -> dict:
    import torch

    from dsaindex.pq import PQCodec
    from dsaindex.runtime.mapped import host_mapped_zeros
    from dsaindex.runtime.paged_select import device_bytes_per_key

    state = _paged_state(batch, keys, heads, subspaces)
    cache, codebooks = state[0], state[4]
    ms, modes, profiles, schedule, note = _time_deepgemm(state, keys, topk, graphs, profile)
    codec = PQCodec(codebooks.float().cpu())
    first = (top_cs[0], scans[0], stage2s[0], stage1s[0])
    path = _expected_path(batch, keys, candidates, prefilter, first[3], grow_band, exact_below)
    runs = [(p, p, exact_below, *first) for p in places]
    if path == "exact" and "device" in places:
        runs.append(("device_pq", "device", 0, *first))
    if "device" in places:  # the other ways to keep stage 2's candidates, or to run stage 1 or 2, on the codes' path
        codes_bound = exact_below if path == "pq" else 0
        runs += [(f"device_{mode}", "device", codes_bound, mode, *first[1:]) for mode in top_cs[1:]]
        runs += [(f"device_scan_{scan}", "device", codes_bound, first[0], scan, *first[2:]) for scan in scans[1:]]
        runs += [(f"device_stage2_{kernel}", "device", codes_bound, *first[:2], kernel, first[3])
                 for kernel in stage2s[1:]]
        runs += [(f"device_stage1_{code}", "device", codes_bound, *first[:3], code) for code in stage1s[1:]]
    for name, place, bound, top_c, scan, stage2, stage1 in runs:
        rows = cache
        if place == "host":
            rows = host_mapped_zeros(tuple(cache.shape), torch.uint8, "cuda")
            rows.copy_(cache)
        got = _time_selector(state, rows, codec, schedule, graphs, profile, topk, candidates=candidates,
                             prefilter=prefilter, keys_on_host=place == "host", exact_below=bound, top_c=top_c,
                             scan=scan, grow_band=grow_band, stage2=stage2, stage1=stage1)
        ms[f"plugin_{name}"], modes[f"plugin_{name}"] = got[:2]
        if profile:
            profiles[f"plugin_{name}"] = got[2]
        rows = None
        torch.cuda.empty_cache()
    code_bytes = device_bytes_per_key(subspaces)
    gpu_bytes = {"exact": KEY_BYTES, "plugin_device": KEY_BYTES + code_bytes, "plugin_host": code_bytes}
    timed_plugins = [k for k in ms if k.startswith("plugin_")]
    return {
        "batch": batch, "keys": keys, "path": path,
        "median_ms": {k: round(v, 4) for k, v in ms.items()},
        "timing": modes,
        "speedup_vs_deepgemm": ({k: round(ms["deepgemm_best"] / ms[k], 3) for k in timed_plugins}
                                if note is None else None),
        "deepgemm": note or "sgl-deep-gemm fp8_paged_mqa_logits + the faster of torch.topk and the threshold top-k",
        "gpu_bytes_per_key_and_layer": {k: round(v, 3) for k, v in gpu_bytes.items()
                                        if k == "exact" or k.removeprefix("plugin_") in places},
        "profile": profiles or None,
    }


def plugin_points(artifacts: str, model: str, tracking_uri: str | None = None,
                  environ: dict[str, str] | None = None, device: str = "cuda") -> dict:
    """What the engine plugins serve ``artifacts`` with for ``model`` on ``device`` under ``environ`` (default:
    no ``DSAINDEX_*`` variable set, their defaults): {"bundle", "topk" (the model's, which the points' recall
    is of), "recall_target", "exact_below", "points": {layer: (C, P, stage 1, grow band)}, "codecs": {layer:
    codec}, "recall": {layer: the recall the bundle records there}}, chosen by
    :func:`dsaindex.runtime.loader.decode_settings` and :func:`~dsaindex.runtime.loader.growth_bands` as the
    plugins choose; raises :class:`DsaIndexError` where a plugin would refuse to start (no point reaches the
    target, codes the paged step does not serve)."""
    from dsaindex.artifacts.bundle import read_manifest
    from dsaindex.artifacts.registry import load_uri
    from dsaindex.geometry import geometry_from_config
    from dsaindex.pipelines.capture.models import model_config
    from dsaindex.runtime.loader import decode_settings, growth_bands, load_bundle
    from dsaindex.runtime.operating_points import OperatingPoints
    from dsaindex.runtime.paged_select import check_paged_codes, fold_scan_unavailable
    from dsaindex.runtime.settings import engine_settings

    settings = engine_settings("vllm", environ or {})
    config = model_config(model)
    # the bundle's own key basis: the step's cost does not depend on it (a plugin serves the one it is set to)
    basis = read_manifest(load_uri(artifacts, tracking_uri=tracking_uri)).basis
    loaded = load_bundle(artifacts, config, device="cpu", basis=basis, tracking_uri=tracking_uri,
                         allow_other_weights=True)
    topk = geometry_from_config(config).topk
    decode = {layer: codec for layer, codec in loaded.layers.items() if loaded.kind_of(layer).role == "decode"}
    check_paged_codes(decode)
    candidates, factors, stages = decode_settings(settings.decode(topk), loaded, topk,
                                                  folds=fold_scan_unavailable(device))
    bands = (growth_bands(loaded.manifest.metrics, candidates, factors, topk, stages)
             if settings.long_prefix == "grow" else {})
    table = OperatingPoints.from_metrics(loaded.manifest.metrics)
    recall = {layer: table.recall(layer, topk, factors[layer], stages[layer]).get(candidates[layer])
              for layer in candidates}
    return {"bundle": loaded.manifest.bundle_id, "topk": topk, "recall_target": settings.recall_target,
            "exact_below": settings.exact_below,
            "points": {layer: (candidates[layer], factors[layer], stages[layer], bands.get(layer, 0))
                       for layer in sorted(candidates)},
            "codecs": {layer: decode[layer] for layer in candidates}, "recall": recall}


def point_label(point: tuple[int, int, str, int]) -> str:
    """``C=4096 P=2 folds grow>131072`` (C grows past that many keys) or ``... fixed`` (a fixed C)."""
    c, p, kind, band = point
    return f"C={c} P={p} {kind} " + (f"grow>{band}" if band else "fixed")


def time_defaults_case(batch: int, keys: int, heads: int, topk: int, chosen: dict, graphs: bool,
                       profile: bool = False, places: tuple[str, ...] = ("device",)) -> dict:
    """The plugins' default step for ``chosen`` (:func:`plugin_points`) at ``batch`` x ``keys``: each distinct
    layer point timed over one synthetic cache (that layer's codec) beside one DeepGEMM baseline, with the keys
    in each of ``places`` (``device``: HBM, the default; ``host``: pinned host memory read in place,
    ``DSAINDEX_KEYS=host``, where the exact path is off); a step's time a layer is the mean over the layers
    (``plugin_defaults``, and ``plugin_defaults_host``)."""
    import torch

    from dsaindex.errors import DsaIndexError
    from dsaindex.runtime.mapped import host_mapped_zeros
    from dsaindex.runtime.paged_select import device_bytes_per_key

    points, codecs = chosen["points"], chosen["codecs"]
    widths = {int(codecs[layer].codebooks.shape[0]) for layer in points}
    if len(widths) != 1:
        raise DsaIndexError(f"the bundle's decode layers hold codes of {sorted(widths)} bytes a key; the benchmark "
                            "times one cache of codes.", "pass a bundle whose decode layers share one code.")
    subspaces = widths.pop()
    state = _paged_state(batch, keys, heads, subspaces)
    ms, modes, profiles, schedule, note = _time_deepgemm(state, keys, topk, graphs, profile)
    by_point: dict[tuple, dict] = {}
    for place in places:
        rows = state[0]
        if place == "host":
            rows = host_mapped_zeros(tuple(rows.shape), torch.uint8, "cuda")
            rows.copy_(state[0])
        suffix = "" if place == "device" else f"_{place}"
        for layer, point in points.items():
            entry = by_point.get(point)
            if entry is not None and f"median_ms{suffix}" in entry:
                if place == places[0]:
                    entry["layers"].append(layer)
                continue
            c, p, kind, band = point
            c = max(c, topk)  # as the plugins build it: C is at least the top-k they return
            below = chosen["exact_below"] if place == "device" else 0  # host keys: never exact
            path = _expected_path(batch, keys, c, p, kind, band, below)
            t, mode, kernels = _time_selector(state, rows, codecs[layer], schedule, graphs, profile, topk,
                                              candidates=c, prefilter=p, stage1=kind, grow_band=band,
                                              exact_below=below, keys_on_host=place == "host")
            entry = by_point.setdefault(point, {"point": point_label(point), "layers": [layer]})
            entry.update({f"path{suffix}": path, f"median_ms{suffix}": round(t, 4), f"timing{suffix}": mode,
                          **({f"profile{suffix}": kernels} if kernels else {})})
        rows = None
        torch.cuda.empty_cache()
    means, layer_ms = {}, {}
    for place in places:
        suffix = "" if place == "device" else f"_{place}"
        per_layer = {layer: by_point[point][f"median_ms{suffix}"] for layer, point in points.items()}
        layer_ms[f"layer_ms{suffix}"] = {str(layer): t for layer, t in per_layer.items()}
        means[f"plugin_defaults{suffix}"] = sum(per_layer.values()) / len(per_layer)
    code_bytes = device_bytes_per_key(subspaces)
    gpu_bytes = {"plugin_defaults": KEY_BYTES + code_bytes, "plugin_defaults_host": code_bytes}
    return {
        "batch": batch, "keys": keys,
        "points": list(by_point.values()),
        **layer_ms,
        "median_ms": {**{k: round(v, 4) for k, v in ms.items()}, **{k: round(v, 4) for k, v in means.items()}},
        "timing": modes,
        "speedup_vs_deepgemm": None if note else {k: round(ms["deepgemm_best"] / v, 3) for k, v in means.items()},
        "deepgemm": note or "sgl-deep-gemm fp8_paged_mqa_logits + the faster of torch.topk and the threshold top-k",
        "gpu_bytes_per_key_and_layer": {"exact": KEY_BYTES,
                                        **{k: round(gpu_bytes[k], 3) for k in means}},
        "profile": profiles or None,
    }


def markdown_table(report: dict) -> str:
    places = report["places"]
    head = ["B", "N", "path", "DeepGEMM + best top-k (ms)", *[f"plugin, keys on {p} (ms)" for p in places],
            *[f"vs DeepGEMM ({p})" for p in places], "codes only (ms)"]
    from dsaindex.console import markdown_rows

    cells_of = []
    for r in report["rows"]:
        m, s = r["median_ms"], r["speedup_vs_deepgemm"] or {}
        pq_only = m.get("plugin_device_pq", m.get("plugin_device") if r.get("path") == "pq" else None)
        cells = [str(r["batch"]), f"{r['keys']:,}", r.get("path", "pq"), f"{m.get('deepgemm_best', float('nan')):.3f}",
                 *[f"{m[f'plugin_{p}']:.3f}" for p in places],
                 *[f"{s[f'plugin_{p}']:.2f}x" if s else "n/a" for p in places],
                 "n/a" if pq_only is None else f"{pq_only:.3f}"]
        cells_of.append(cells)
    return markdown_rows(head, cells_of)


def bench_paged(
    batches: str = typer.Option("1,8,32,64", help="Comma-separated request counts B."),
    keys: str = typer.Option("65536,262144,1048576", help="Comma-separated keys per request and layer."),
    heads: int = typer.Option(64, callback=at_least(1), help="Indexer heads (V3.2: 64)."),
    topk: int = typer.Option(2048, callback=at_least(1), help="Keys selected per step (V3.2: 2048)."),
    candidates: int = typer.Option(4096, callback=at_least(1), help="C: candidates rescored exactly (the plugins' "
                                                                     "default: 2 x top-k)."),
    prefilter: int = typer.Option(PREFILTER, callback=at_least(1), help="Stage 1 keeps prefilter x C keys."),
    subspaces: int = typer.Option(32, callback=at_least(1), help="Bytes of PQ code per key."),
    places: str = typer.Option("device,host", "--keys-on", help="Where the exact keys live in the plugin's "
                                                                 "step: device, host, or both."),
    exact_below: int = typer.Option(PAGED_EXACT_BELOW, callback=at_least(0),
                                    help=f"The plugins' exact path: steps with B x (N - {PAGED_EXACT_OFFSET} x the "
                                         "stage-1 width) at most this many keys are scored as the engine scores them "
                                         "(DSAINDEX_EXACT_BELOW; 0: never)."),
    top_c: str = typer.Option("auto", "--top-c", help="How stage 2's candidates become the C rescored: topk (the "
                              "exact top C), bins (score bins, no top-C kernel) or auto (the plugins' default: bins "
                              "while B x P x C is at most 256K or where the CUDA stage 2 scores, topk above); a comma "
                              "list times the others too "
                              "(plugin_device_<mode>, on the codes' path)."),
    scan: str = typer.Option("auto", "--scan", help="Stage 1's selecting kernel: auto (the default: cuda where it "
                             "runs), cuda (tables in shared memory) or triton; a comma list times the others too "
                             "(plugin_device_scan_<s>, on the codes' path)."),
    stage2: str = typer.Option("auto", "--stage2", help="Stage 2's kernel: auto (the default: int8 where it runs), "
                               "cuda (codebooks and score bins in shared memory), int8 (the same on 8-bit operands) or "
                               "triton; a comma list times the "
                               "others too (plugin_device_stage2_<s>, on the codes' path)."),
    stage1: str = typer.Option("codes", "--stage1", help="What stage 1 scores: codes (the default: the keys' codes) "
                               "or groups (their group codes, 16 bytes a PQ32 key, kept beside the codes) or folds "
                               "(the codes by 16 folded queries, the heads grouped by sign and direction); a comma "
                               "list times the others too (plugin_device_stage1_<s>, on the codes' path)."),
    grow_band: int = typer.Option(0, "--grow-band", callback=at_least(0),
                                  help="C grows with each doubling of a request's keys past this many (what the "
                                       "plugins do past the end of the prefix band a bundle measured its recall in, "
                                       "DSAINDEX_LONG_PREFIX=grow; 131072 for bundles measured at 128K). 0: C fixed, "
                                       "the point the frontier's recall was measured at."),
    graphs: bool = typer.Option(True, "--graphs/--eager", help="Time steps replayed from CUDA graphs."),
    profile: bool = typer.Option(False, "--profile", help="Add each step's per-kernel device time (torch.profiler, "
                                                           "eager) to the JSON."),
    artifacts: str = typer.Option(None, "--artifacts", "-a",
                                  help="Time the step the plugins serve this PQ bundle with by default (folder, "
                                       "s3://bucket/prefix or models:/<name>@<alias>): each decode layer at the "
                                       "point chosen from its recorded recall, C grown past its measured band, "
                                       "keys on the device (and with --keys-on device,host, the default, in host "
                                       "memory too: DSAINDEX_KEYS=host); --candidates, --prefilter, --stage1 and "
                                       "--grow-band are then the bundle's, not flags."),
    model: str = typer.Option("reference", "--model", "-m",
                              help="With --artifacts: the served model whose top-k the points are chosen for."),
    tracking_uri: str = typer.Option(None, help="With --artifacts models:/...: the MLflow tracking URI."),
    out: Path = typer.Option(None, help="Also write the JSON result to this file."),
    markdown: Path = typer.Option(None, help="Also write the table as markdown to this file."),
) -> None:
    """The engine plugins' decode step (keys in HBM, or in host memory read in place) against DeepGEMM's
    paged logits + the best top-k, per batch size and length, with GPU bytes per key. With --artifacts, the
    step the plugins serve a bundle with by default, each layer at its own point. Needs a CUDA device."""
    import json

    import torch

    from dsaindex.console import emit_report, parse_ints
    from dsaindex.errors import DsaIndexError
    from dsaindex.kernels import deepgemm

    key_counts = parse_ints(keys, "--keys", minimum=64)
    batch_sizes = parse_ints(batches, "--batches", minimum=1)
    from dsaindex.kernels.pq_scan_cuda import SCANS
    from dsaindex.kernels.pq_stage2_cuda import STAGE2S
    from dsaindex.runtime.paged_select import STAGE1S, TOP_C

    chosen = _options(places, "--keys-on", "place", ("device", "host"))
    top_cs = _options(top_c, "--top-c", "way", TOP_C)
    scans = _options(scan, "--scan", "stage-1 kernel", SCANS)
    stage2s = _options(stage2, "--stage2", "stage-2 kernel", STAGE2S)
    stage1s = _options(stage1, "--stage1", "stage-1 code", STAGE1S)
    if any(n % 64 for n in key_counts):
        raise DsaIndexError("--keys must be multiples of the 64-key page.", "pass e.g. 65536,262144,1048576.")
    if candidates < topk:
        raise DsaIndexError(f"--candidates {candidates} is below --topk {topk}.", f"pass --candidates {topk} or more.")
    if grow_band and "topk" in top_cs:
        raise DsaIndexError("--top-c topk keeps one C for every request of a step; --grow-band needs bins or auto.",
                            "drop topk from --top-c, or pass --grow-band 0.")
    if not torch.cuda.is_available():
        raise DsaIndexError("bench paged needs a CUDA device (the engines' step runs from CUDA graphs).",
                            "run it on a GPU machine.")
    if deepgemm.unavailable():
        typer.echo(f"note: no DeepGEMM baseline in this run: {deepgemm.unavailable()}", err=True)
    if artifacts is not None:
        if "device" not in chosen:
            raise DsaIndexError("--artifacts times the plugins' default step, with the keys on the device.",
                                "pass --keys-on device, or device,host to time DSAINDEX_KEYS=host beside it.")
        _bench_defaults(artifacts, model, tracking_uri, key_counts, batch_sizes, heads, topk, graphs, profile, out,
                        markdown, chosen)
        return
    rows = []
    for n in key_counts:
        for b in batch_sizes:
            row = time_paged_case(b, n, heads, topk, candidates, prefilter, subspaces, chosen, graphs, profile,
                                  exact_below, top_cs, scans, grow_band, stage2s, stage1s)
            rows.append(row)
            typer.echo(json.dumps({k: row[k] for k in ("batch", "keys", "path", "median_ms", "speedup_vs_deepgemm")}),
                       err=True)
            torch.cuda.empty_cache()
    report = {"device": torch.cuda.get_device_name(), "heads": heads, "topk": topk, "candidates": candidates,
              "prefilter": prefilter, "subspaces": subspaces, "exact_below": exact_below, "places": list(chosen),
              "top_c": list(top_cs), "scan": list(scans), "stage2": list(stage2s), "stage1": list(stage1s),
              "grow_band": grow_band,
              "rows": rows}
    emit_report(report, out, markdown, markdown_table(report))


def defaults_markdown(report: dict) -> str:
    from dsaindex.console import markdown_rows

    layers = list(report["points"])
    host = "host" in report.get("keys_on", ["device"])
    head = ["B", "N", "DeepGEMM + best top-k (ms)", "defaults, mean a layer (ms)", "vs DeepGEMM",
            *[f"layer {layer} (ms, path)" for layer in layers],
            *(["keys on the host (ms)", "vs DeepGEMM (host)"] if host else [])]
    cells_of = []
    for r in report["rows"]:
        m, s = r["median_ms"], r["speedup_vs_deepgemm"]
        paths = {str(layer): x["path"] for x in r["points"] for layer in x["layers"]}
        cells_of.append([str(r["batch"]), f"{r['keys']:,}", f"{m.get('deepgemm_best', float('nan')):.3f}",
                         f"{m['plugin_defaults']:.3f}", f"{s['plugin_defaults']:.2f}x" if s else "n/a",
                         *[f"{r['layer_ms'][layer]:.3f} {paths[layer]}" for layer in layers],
                         *([f"{m['plugin_defaults_host']:.3f}", f"{s['plugin_defaults_host']:.2f}x" if s else "n/a"]
                           if host else [])])
    return markdown_rows(head, cells_of)


def _bench_defaults(artifacts: str, model: str, tracking_uri: str | None, key_counts: list[int],
                    batch_sizes: list[int], heads: int, topk: int, graphs: bool, profile: bool, out: Path | None,
                    markdown: Path | None, places: tuple[str, ...] = ("device",)) -> None:
    """``bench paged --artifacts``: the plugins' default step for a bundle, per B x N."""
    import json

    import torch

    from dsaindex.console import emit_report

    chosen = plugin_points(artifacts, model, tracking_uri)
    points = chosen["points"]
    typer.echo("the plugins' defaults for " + chosen["bundle"] + ": " + "; ".join(
        f"layer {layer}: {point_label(point)}" + (f" (recorded recall {100 * chosen['recall'][layer]:.2f}%)"
                                                  if chosen["recall"][layer] is not None else "")
        for layer, point in points.items()), err=True)
    rows = []
    for n in key_counts:
        for b in batch_sizes:
            row = time_defaults_case(b, n, heads, topk, chosen, graphs, profile, places)
            rows.append(row)
            typer.echo(json.dumps({k: row[k] for k in ("batch", "keys", "layer_ms", "median_ms",
                                                       "speedup_vs_deepgemm")}), err=True)
            torch.cuda.empty_cache()
    report = {"device": torch.cuda.get_device_name(), "artifacts": artifacts, "bundle": chosen["bundle"],
              "model": model, "model_topk": chosen["topk"], "recall_target": chosen["recall_target"],
              "heads": heads, "topk": topk, "exact_below": chosen["exact_below"], "keys_on": list(places),
              "points": {str(layer): {"point": point_label(point), "recorded_recall": chosen["recall"][layer]}
                         for layer, point in points.items()},
              "rows": rows}
    emit_report(report, out, markdown, defaults_markdown(report))

