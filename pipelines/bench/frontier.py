"""``dsaindex bench frontier``: decode operating points of PQ/RQ bundles, speed against served recall.

A decode operating point is a code (a bundle), C (candidates rescored exactly), the stage-1 factor P
(stage 1 keeps P x C keys by a folded score) and the miss filter's width. For every bundle and every
(C, P) the command measures, in one run:

* the served recall of the exact top-k: held-out queries of a capture store
  (:func:`dsaindex.train.recall.held_out`; the bundles' held-out sequences where the store is the one
  they were trained on, every sequence of another store), each one request holding its causal prefix,
  one step of the runtime's own :class:`~dsaindex.runtime.pq_batch.PQDecodeGroup`
  (:func:`dsaindex.pipelines.bench.decode.served_step`) against the exact FP8 top-k. Two steps, as the
  server runs them: with more than ``direct_upto`` requests the cached step with the miss filter (on a cold
  cache: every candidate a miss, so the filter drops all it can, a lower bound of a warm step's recall),
  with fewer the direct step (candidates read straight from the host). The mean over every query, and
  the mean in the longest prefix band (:func:`~dsaindex.train.recall.prefix_band`) holding at least
  :data:`~dsaindex.runtime.operating_points.MIN_BAND_QUERIES` queries;
* per batch size B x keys per request N, the step's median time on synthetic keys with the bundle's code
  (warm cache, as ``bench decode``'s ``pq_warm`` / ``pq_direct``: :func:`~dsaindex.pipelines.bench.decode.pq_step_ms`)
  beside the exact baseline of the same run: DeepGEMM's logits + the faster top-k
  (:func:`~dsaindex.pipelines.bench.decode.deepgemm_ms`); on a GPU where DeepGEMM does not run, Triton's FP8
  logits + the threshold top-k; on the CPU (``--timing``), the kernels' torch references against the torch
  exact step.

Per B x N it reports the Pareto front of (recall, speedup), a point's recall being the lower of its mean
and its longest band's, and the fastest point whose mean and band both reach ``--recall-target``. Beside the
grid it measures what a server takes with no decode flags (each layer's point chosen from the bundle's
recorded recall): its served recall, and its step per B x N, each layer at its own point. The timed step is
the host-store group ``serve`` runs; the engine plugins' paged step is ``bench paged``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from dsaindex.console import at_least
from dsaindex.runtime.settings import DecodeSettings

DECODE = DecodeSettings()  # the served step's defaults: the miss filter, the direct path, the recall target
STEPS = ("filter", "direct")  # the served steps whose recall is measured (decode.served_step's modes)
QUERY_BATCH = 8  # held-out queries stepped together, each its own request
PAPER_K = 512


@dataclass
class Bundle:
    """A bundle under measurement: where it is, its manifest, its codecs by layer (on the device)."""

    ref: str
    manifest: Any
    codecs: dict[int, Any]

    @property
    def label(self) -> str:
        return next(iter(self.codecs.values())).label


def case_key(batch: int, keys: int) -> str:
    return f"{batch}x{keys}"


def step_for(batch: int, direct_upto: int, keys: int = 0, grow_band: int = 0) -> str:
    """Whose recall the step a server runs for ``batch`` live requests of ``keys`` keys serves: ``direct`` (every
    candidate rescored) up to ``direct_upto``, or where C grows (``keys`` past a ``grow_band`` > 0: the cached
    step keeps every grown candidate, no miss filter), else ``filter`` (the cached step's miss filter)."""
    return "direct" if batch <= direct_upto or 0 < grow_band < keys else "filter"


def cache_for(candidates: int) -> int:
    """The server's default device cache of a request: 2 x C rows, a multiple of 4 (its set size)."""
    return -(-2 * candidates // 4) * 4


# ---- inputs --------------------------------------------------------------------------------------------
def parse_topk(text: str, model_topk: int) -> int:
    """``--topk``: a positive count, or ``model`` (the model's own top-k)."""
    from dsaindex.errors import DsaIndexError

    value = str(text).strip().lower()
    if value == "model":
        return model_topk
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise DsaIndexError(f"--topk {text!r} is neither a positive count nor `model`.",
                        f"pass --topk {PAPER_K} (the recall the bundles record) or --topk model ({model_topk}).")


def load_bundles(refs: list[str], store, store_ref: str, layers: list[int] | None, device: str) -> list[Bundle]:
    """Each bundle (a folder, ``s3://`` or ``models:/`` URI) read, verified, checked against the store's model
    and basis, with its PQ/RQ codecs of ``layers`` (default: every code layer of the first bundle) placed
    on ``device``."""
    from dsaindex.artifacts.bundle import read_bundle
    from dsaindex.artifacts.compat import check_store_for_bundle
    from dsaindex.artifacts.registry import load_uri
    from dsaindex.errors import DsaIndexError
    from dsaindex.runtime.loader import place_layers

    out = []
    for ref in refs:
        manifest, arrays = read_bundle(load_uri(ref))
        check_store_for_bundle(store.manifest, manifest, store_ref, ref)
        coded = sorted(int(layer) for layer, art in manifest.layers.items() if art.kind == "pq")
        if not coded:
            kinds = ", ".join(sorted({art.kind for art in manifest.layers.values()}))
            raise DsaIndexError(f"{ref} holds {kinds} artifacts; the decode frontier needs PQ or RQ codes.",
                                "pass --artifacts a bundle written by `dsaindex train pq` on a store of this model.")
        layers = coded if layers is None else layers  # the first bundle's, for every bundle
        missing = sorted(set(layers) - set(coded))
        if missing:
            raise DsaIndexError(f"{ref} has no code for layer(s) {missing}; its code layers are {coded}.",
                                f"pass --layers among {','.join(map(str, coded))} (codes of every bundle).")
        placed = place_layers(manifest, arrays, device)
        out.append(Bundle(ref, manifest, {layer: placed[layer] for layer in layers}))
    return out


def check_points(bundles: list[Bundle], candidates: list[int], prefilters: list[int], topk: int,
                 key_counts: list[int] | None, device: str) -> None:
    """Refuse a (C, P) the served step cannot run, before any work: C below the top-k, C not below every
    timed length (stage 2 would keep every key), and whatever the runtime's group refuses for a bundle's
    code (one small group built per point)."""
    from dsaindex.errors import DsaIndexError
    from dsaindex.runtime.host_store import HostKeyStore
    from dsaindex.runtime.pq_batch import PQDecodeGroup

    low = [c for c in candidates if c < topk]
    if low:
        raise DsaIndexError(f"--candidates {low[0]} is below the top-k {topk}: the exact rerank picks {topk} keys "
                            "among the C candidates.", f"pass --candidates of at least {topk}.")
    if key_counts:
        bad = [n for n in key_counts if n % 64]
        if bad:
            raise DsaIndexError(f"--keys {bad[0]} is not a whole number of 64-key pages.",
                                "pass multiples of 64 (e.g. 262144,1048576).")
        if max(candidates) >= min(key_counts):
            raise DsaIndexError(f"C = {max(candidates)} is not below N = {min(key_counts)} keys: the step would "
                                "rescore every key (exhaustive, not coarse-to-fine).",
                                "pass --keys longer than the largest --candidates, or smaller --candidates.")
    for b in bundles:
        codec = next(iter(b.codecs.values()))
        for c in candidates:
            for p in prefilters:
                try:
                    PQDecodeGroup(codec, HostKeyStore(1, codec.dim, pin=False), 1, 64, topk, candidates=c,
                                  prefilter=p, cache_capacity=cache_for(c), device=device, use_triton=False)
                except DsaIndexError as err:
                    raise DsaIndexError(f"{b.ref} ({b.label}) cannot serve C = {c}, P = {p}: {err.problem}",
                                        err.fix) from None


# ---- recall --------------------------------------------------------------------------------------------
def measure_recall(store, bundles: list[Bundle], sequences: list[int], topk: int, candidates: list[int],
                   prefilters: list[int], steps: list[str], filter_width: float, min_prefix: int, max_queries: int,
                   device: str, use_triton: bool | None, progress=None, grow_band: int = 0,
                   stage2: str = "auto", stage1: str = "codes",
                   chosen: list[dict[int, tuple[int, int, str]] | None] | None = None) -> tuple[dict, int]:
    """Per (bundle index, C, P, step) the held-out queries' results: a list of (layer, prefix keys, share of
    the exact top-k selected, share of the candidates read from host). Returns it and the query count per
    layer measured (the same queries for every point). ``grow_band``: C grows with each query's prefix past
    this many keys (the default past a bundle's measured band); a step past it rescores every candidate (the
    cached step without its miss filter, or the direct step), as servers run it. ``chosen``: per bundle, a
    layer -> (C, P, stage 1) choice (a server's defaults, :func:`server_defaults`) measured too, under the key
    (bundle index, "defaults", 0, step)."""
    import torch

    from dsaindex.pipelines.bench.decode import exact_topk_of_prefixes, served_step, shares_found
    from dsaindex.quant import fp8_quantize
    from dsaindex.runtime.host_store import HostKeyStore
    from dsaindex.runtime.pq_batch import PQDecodeGroup
    from dsaindex.train.recall import held_out

    key_format = store.manifest.model.geometry.key_format
    layers = list(bundles[0].codecs)
    results: dict[tuple[int, int, int, str], list[tuple[int, int, float, float]]] = {}
    counts = {}
    for done, layer in enumerate(layers):
        data = held_out(store, layer, sequences, min_prefix, key_format, max_queries=max_queries)
        nq = int(data.queries.shape[0])
        counts[layer] = nq
        if nq == 0:
            continue
        # the keys as the engines store them, and each code's pages encoded once as the server encodes
        # completed pages (the runtime's own encoder: its kernels on a GPU)
        fp8_all, scales_all = fp8_quantize(data.keys.to(device))
        fp8_all, scales_all = fp8_all.view(torch.uint8), scales_all.reshape(-1)
        exact_all = fp8_all.view(torch.float8_e4m3fn).float() * scales_all[:, None]
        codes_of = []
        for b in bundles:
            encoder = PQDecodeGroup(b.codecs[layer], HostKeyStore(1, exact_all.shape[1], pin=False), 1, 64, 1,
                                    candidates=1, cache_capacity=4, device=device, use_triton=use_triton)
            codes_of.append(encoder.encode_keys(exact_all))
        for start in range(0, nq, QUERY_BATCH):
            if progress:
                progress(done, len(layers), f"layer {layer}: queries {start}/{nq}")
            rows = list(range(start, min(nq, start + QUERY_BATCH)))
            spans = [(int(data.key_start[i]), int(data.visible[i])) for i in rows]
            prefixes = [data.keys[s0 : s0 + n].to(device) for s0, n in spans]
            q, w = data.queries[rows].to(device), data.head_weights[rows].to(device)
            truth = exact_topk_of_prefixes(prefixes, q, w, topk, device)
            host = HostKeyStore(sum(-(-n // 64) for _, n in spans) + len(spans), exact_all.shape[1])
            for bi, b in enumerate(bundles):
                encoded = [(codes_of[bi][s0 : s0 + n // 64 * 64], fp8_all[s0 : s0 + n // 64 * 64],
                            scales_all[s0 : s0 + n // 64 * 64]) for s0, n in spans]
                points = [(c, p, stage1, (bi, c, p)) for c in candidates for p in prefilters]
                if chosen and chosen[bi] and layer in chosen[bi]:
                    c, p, kind = chosen[bi][layer]
                    points.append((c, p, kind, (bi, "defaults", 0)))
                for c, p, kind, key in points:
                    for step in steps:
                        picked, stats = served_step(b.codecs[layer], prefixes, q, w, topk, c, p, cache_for(c),
                                                    step, device, use_triton, encoded=encoded, host=host,
                                                    filter_width=filter_width, grow_band=grow_band,
                                                    stage2=stage2, stage1=kind)
                        fetched = (stats.fetched.float() / stats.candidates.clamp_min(1).float()).tolist()
                        results.setdefault((*key, step), []).extend(
                            (layer, n, share, f)
                            for (_, n), share, f in zip(spans, shares_found(picked, truth), fetched, strict=True))
    if progress:
        progress(len(layers), len(layers), "done")
    return results, counts


def summarize(entries: list[tuple[int, int, float, float]], topk: int) -> dict:
    """A point's recall from its queries' results: ``mean`` over all, ``band_mean`` in the longest prefix band
    holding at least MIN_BAND_QUERIES queries (else the longest band), ``per_layer`` means, ``fetch_share``
    (the mean share of candidates read from host; the direct step reads every candidate it rescores)."""
    from dsaindex.runtime.operating_points import MIN_BAND_QUERIES
    from dsaindex.train.recall import band_rows, prefix_band

    name = f"k{topk}/served"
    sums: dict[str, list[float]] = {}
    for _, prefix, share, _ in entries:
        sums.setdefault(f"k{topk}@{prefix_band(prefix)}/served", []).append(share)
    metrics = {name: sum(e[2] for e in entries) / len(entries)}
    for key, values in sums.items():
        metrics[key] = sum(values) / len(values)
        metrics[key.replace("/served", "/queries")] = float(len(values))
    bands = [(label.split(", ", 1)[1], m) for label, m in band_rows([("all", metrics)], topk)]
    enough = [(band, m) for band, m in bands if m[f"k{topk}/queries"] >= MIN_BAND_QUERIES]
    band, in_band = (enough or bands)[-1]
    per_layer: dict[str, list[float]] = {}
    for layer, _, share, _ in entries:
        per_layer.setdefault(str(layer), []).append(share)
    return {"mean": round(metrics[name], 6), "band": band, "band_mean": round(in_band[name], 6),
            "queries": len(entries), "band_queries": int(in_band[f"k{topk}/queries"]),
            "per_layer": {k: round(sum(v) / len(v), 6) for k, v in per_layer.items()},
            "fetch_share": round(sum(e[3] for e in entries) / len(entries), 4)}


def recorded_recall(manifest, layers: list[int], topk: int, prefilter: int, candidates: int,
                    stage1: str = "codes") -> float | None:
    """The mean over ``layers`` of the served recall the bundle recorded at training for (C, P) with ``stage1``
    (every held-out query; the rerank of stage 1's keys without the miss filter), or None where it recorded
    none."""
    from dsaindex.runtime.operating_points import OperatingPoints

    table = OperatingPoints.from_metrics(manifest.metrics)
    found = [p.overall for layer in layers for p in table.of(layer, topk, prefilter, stage1=stage1)
             if p.candidates == candidates]
    return round(sum(found) / len(found), 6) if found and len(found) == len(layers) else None


def server_defaults(bundle: Bundle, topk: int, target: float, device: str) -> dict[int, tuple[int, int, str]] | str:
    """What a server with no decode flags takes for ``bundle`` on ``device`` at ``target``: layer -> (C, P,
    stage 1), as ``dsaindex serve`` and the plugins choose it from the bundle's recorded recall
    (:func:`dsaindex.runtime.loader.decode_settings`, the model's top-k ``topk``), or the refusal a server
    would stop with."""
    from dsaindex.errors import DsaIndexError
    from dsaindex.runtime.loader import LoadedArtifacts, decode_settings
    from dsaindex.runtime.paged_select import fold_scan_unavailable

    loaded = LoadedArtifacts(manifest=bundle.manifest, path=bundle.ref, layers=dict(bundle.codecs))
    try:
        c, p, kind = decode_settings(DecodeSettings(recall_target=target), loaded, topk,
                                     folds=fold_scan_unavailable(device))
    except DsaIndexError as err:
        return str(err)
    return {layer: (c[layer], p[layer], kind[layer]) for layer in c}


# ---- timing --------------------------------------------------------------------------------------------
def time_cases(cases: list[tuple[int, int]], bundles: list[Bundle], candidates: list[int], prefilters: list[int],
               heads: int, topk: int, direct_upto: int, filter_width: float, graphs: bool, device: str,
               progress=None, grow_band: int = 0, stage2: str = "auto", stage1: str = "codes",
               chosen: list[dict[int, tuple[int, int, str]] | None] | None = None) -> dict[str, dict]:
    """Per B x N (:func:`case_key`): {"baseline": the exact step's timing, "steps": {(bundle index, C, P):
    (median ms, timing mode)}}, every step over the same synthetic keys and queries as its baseline.
    ``grow_band``: C grown past it as the server grows it (a step past it rescores every candidate).
    ``chosen``: per bundle, a server's defaults (layer -> (C, P, stage 1)); each distinct point of them is timed
    too, under (bundle index, "defaults", C, P, stage 1)."""
    import torch

    from dsaindex.pipelines.bench.decode import pq_group_over, pq_step_ms, synthetic_state
    from dsaindex.runtime.host_store import HostKeyStore

    cuda = device.startswith("cuda")
    use_triton = None if cuda else False  # on the CPU the kernels' torch references, as a CPU server runs
    extra = [sorted(set(x.values())) if x else [] for x in (chosen or [None] * len(bundles))]
    total = len(cases) * (len(bundles) * len(candidates) * len(prefilters) + sum(map(len, extra)))
    done = 0
    out = {}
    for batch, keys in cases:
        if progress:
            progress(done, total, f"B={batch} N={keys:,}: exact baseline")
        fp8, scales, _, _, q, w = synthetic_state(batch, keys, heads, 1, device=device)
        lengths = torch.full((batch,), keys, dtype=torch.int32, device=device)
        baseline = exact_baseline(fp8, scales, lengths, q, w, topk, heads, graphs, device)
        steps = {}
        host = HostKeyStore(batch * keys // 64, fp8.shape[2])  # shared by the points, pages given back after each
        g = torch.Generator(device=device).manual_seed(1)
        for bi, b in enumerate(bundles):
            codec = next(iter(b.codecs.values()))
            m, k = codec.codebooks.shape[:2]
            codes = torch.randint(0, k, (batch, keys, m), device=device, generator=g, dtype=torch.int32).to(torch.uint8)
            points = [(c, p, stage1, (bi, c, p)) for c in candidates for p in prefilters]
            points += [(c, p, kind, (bi, "defaults", c, p, kind)) for c, p, kind in extra[bi]]
            for c, p, kind, key in points:
                if progress:
                    progress(done, total, f"B={batch} N={keys:,}: {b.label} C={c} P={p} {kind}")
                group = pq_group_over(fp8, scales, codes, codec.codebooks, topk, c, p, cache_for(c), codec=codec,
                                      device=device, host=host, direct_upto=direct_upto,
                                      filter_width=filter_width, use_triton=use_triton, grow_band=grow_band,
                                      stage2=stage2, stage1=kind)
                ms, _, mode = pq_step_ms(group, q, w, graphs, device)
                steps[key] = (ms, mode)
                group.free_all()
                group = None
                done += 1
            codes = None
        out[case_key(batch, keys)] = {"baseline": baseline, "steps": steps}
        fp8 = scales = q = w = host = None
        if cuda:
            torch.cuda.empty_cache()
    if progress:
        progress(total, total, "done")
    return out


def defaults_timing(bundle_index: int, points: dict[int, tuple[int, int, str]], timings: dict) -> dict:
    """The defaults' step per B x N as a server runs it, each layer at its own point: {"median_ms": the mean over
    layers of their points' medians (a layer's share of a decode step), "speedup": the baseline's median over
    that, "point_ms": each distinct point's median ("C=4096 P=2 folds")}."""
    out: dict[str, dict] = {"median_ms": {}, "speedup": {}, "point_ms": {}}
    for key, t in timings.items():
        ms = {point: t["steps"][(bundle_index, "defaults", *point)][0] for point in set(points.values())}
        mean = sum(ms[point] for point in points.values()) / len(points)
        out["median_ms"][key] = round(mean, 4)
        out["speedup"][key] = round(t["baseline"]["median_ms"] / max(mean, 1e-9), 3)
        out["point_ms"][key] = {f"C={c} P={p} {kind}": round(v, 4) for (c, p, kind), v in sorted(ms.items())}
    return out


def exact_baseline(fp8, scales, lengths, q, w, topk: int, heads: int, graphs: bool, device: str) -> dict:
    """The exact step every point of a B x N is compared with, over the same keys ``fp8`` [B, N, D] uint8 +
    ``scales`` [B, N] and queries: DeepGEMM's logits + the faster top-k where it runs (and takes ``heads``
    on this GPU), Triton's FP8 logits + the threshold top-k on another GPU, the torch exact step on the
    CPU. Returns its name, what it is, median ms and timing mode."""
    from dsaindex.kernels import deepgemm
    from dsaindex.pipelines.bench.decode import deepgemm_ms, timed, torch_exact_step, triton_exact_ms

    if not device.startswith("cuda"):
        ms, mode = timed(torch_exact_step(fp8, scales, q, w, topk), graphs, device)
        return {"name": "torch_exact", "what": "torch exact (bf16 keys, matmul, ReLU, weighted head sum, torch.topk)",
                "median_ms": round(ms, 4), "timing": mode}
    note = deepgemm.unavailable()
    if note is None and not deepgemm.supports_heads(heads):
        note = f"DeepGEMM's paged logits take no {heads}-head queries on this GPU"
    if note is None:
        dg = deepgemm_ms(fp8, scales, lengths, q, w, topk, graphs)
        ms = dg["ms"]
        fast = ms["deepgemm_logits_fast_topk"] <= ms["deepgemm_logits_topk"]
        return {"name": "deepgemm_best",
                "what": "DeepGEMM fp8_paged_mqa_logits + " + ("the threshold top-k" if fast else "torch.topk"),
                "median_ms": round(ms["deepgemm_best"], 4), "deepgemm_logits_ms": round(ms["deepgemm_logits"], 4),
                "timing": dg["modes"]["deepgemm_logits_fast_topk" if fast else "deepgemm_logits_topk"]}
    ms, modes, _, _ = triton_exact_ms(fp8, scales, lengths, q, w, topk, graphs)
    return {"name": "exact_fp8_triton", "what": "Triton FP8 logits + the threshold top-k (no DeepGEMM: " + note + ")",
            "median_ms": round(ms["exact_fp8_triton"], 4), "triton_fp8_logits_ms": round(ms["triton_fp8_logits"], 4),
            "timing": modes["exact_fp8_triton"]}


# ---- the frontier ----------------------------------------------------------------------------------------
def point_recall(row: dict, step: str) -> float:
    """What a point's recall is ranked by for ``step``: the lower of its mean and its longest band's."""
    r = row["recall"][step]
    return min(r["mean"], r["band_mean"])


def reaches(row: dict, step: str, target: float) -> bool:
    r = row["recall"][step]
    return r["mean"] >= target and r["band_mean"] >= target


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the (recall, speedup) pairs no other pair beats in both (at least as good in both and
    better in one), by rising recall."""
    front = [i for i, (r, s) in enumerate(points)
             if not any(r2 >= r and s2 >= s and (r2 > r or s2 > s) for r2, s2 in points)]
    return sorted(front, key=lambda i: (points[i][0], -points[i][1]))


def choose(rows: list[dict], case: str, step: str, target: float, timed_run: bool) -> int | None:
    """Index of the fastest row of ``case`` whose recall for ``step`` reaches ``target`` in its mean and its
    longest band (ties: less stage-2 work, then the first); without timing the least stage-2 work
    (P x C, what the choosers of :mod:`dsaindex.runtime.operating_points` rank by). None: no row reaches it."""
    good = [i for i, row in enumerate(rows) if reaches(row, step, target)]
    if not good:
        return None
    if timed_run:
        return min(good, key=lambda i: (rows[i]["median_ms"][case], rows[i]["stage2_keys"], i))
    return min(good, key=lambda i: (rows[i]["stage2_keys"], rows[i]["candidates"], i))


def frontier_cases(rows: list[dict], cases: list[tuple[int, int]], timings: dict | None, direct_upto: int,
                   target: float, grow_band: int = 0) -> list[dict]:
    """Per B x N: its step, baseline, Pareto front (row indices; with timing) and chosen row."""
    out = []
    for batch, keys in cases:
        key, step = case_key(batch, keys), step_for(batch, direct_upto, keys, grow_band)
        entry = {"batch": batch, "keys": keys, "step": step,
                 "baseline": timings[key]["baseline"] if timings else None,
                 "chosen_by": "median_ms" if timings else "stage2_keys (no timing in this run)"}
        if timings:
            entry["front"] = pareto_front([(point_recall(r, step), r["speedup"][key]) for r in rows])
        chosen = choose(rows, key, step, target, timings is not None)
        entry["chosen"] = chosen
        if chosen is not None:
            r = rows[chosen]
            entry["chosen_point"] = {"bundle": r["bundle"], "code": r["code"], "candidates": r["candidates"],
                                     "prefilter": r["prefilter"], "recall": r["recall"][step]["mean"],
                                     "band": r["recall"][step]["band"], "band_recall": r["recall"][step]["band_mean"],
                                     "median_ms": r["median_ms"].get(key) if timings else None,
                                     "speedup": r["speedup"].get(key) if timings else None}
        else:
            best = max(range(len(rows)), key=lambda i: point_recall(rows[i], step))
            entry["best_recall"] = {"bundle": rows[best]["bundle"], "candidates": rows[best]["candidates"],
                                    "prefilter": rows[best]["prefilter"], "recall": point_recall(rows[best], step)}
        out.append(entry)
    return out


def summary_lines(report: dict) -> list[str]:
    """One line per B x N: the point chosen for the recall target, or that none reaches it; then one per bundle:
    what a server takes with no decode flags and the recall it serves."""
    target = report["recall_target"]
    lines = []
    for d in report.get("defaults", []):
        if "refused" in d:
            lines.append(f"serve's defaults for {d['bundle']}: a server refuses to start: {d['refused']}")
            continue
        kinds: dict[str, list[str]] = {}
        for layer, x in d["points"].items():
            kinds.setdefault(f"C={x['candidates']} P={x['prefilter']} {x['stage1']}", []).append(layer)
        said = "; ".join(f"{p} (layers {', '.join(layers)})" for p, layers in kinds.items())
        served = ", ".join(f"{s} step {100 * r['mean']:.2f}% ({r['band']}: {100 * r['band_mean']:.2f}%)"
                           for s, r in d["recall"].items())
        line = f"serve's defaults for {d['bundle']}: {said}; served recall {served}"
        if d.get("speedup"):
            line += "; a layer's step " + ", ".join(
                f"{case.replace('x', ' x ', 1)}: {d['median_ms'][case]:.4f} ms ({x:.2f}x)" for case, x in d["speedup"].items())
        lines.append(line)
    for case in report["cases"]:
        head = f"B={case['batch']} N={case['keys']:,} ({case['step']} step)"
        if case["chosen"] is None:
            b = case["best_recall"]
            lines.append(f"{head}: no point reaches {100 * target:.2f}% in the mean and the longest band (best: "
                         f"{100 * b['recall']:.2f}% at C={b['candidates']} P={b['prefilter']} of {b['bundle']}).")
            continue
        p = case["chosen_point"]
        speed = (f"{p['median_ms']:.4f} ms, {p['speedup']:.2f}x {case['baseline']['name']}" if p["median_ms"] is not None
                 else "least stage-2 work (no timing)")
        lines.append(f"{head}: {p['code']} C={p['candidates']} P={p['prefilter']} of {p['bundle']}: {speed}; recall "
                     f"{100 * p['recall']:.2f}% ({p['band']}: {100 * p['band_recall']:.2f}%)")
    return lines


def markdown_table(report: dict) -> str:
    """The recall of every point, the choice per B x N, and (with timing) every point's time and speedup."""
    from dsaindex.console import markdown_rows

    steps = report["steps"]

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.2f}%"

    headers = ["bundle", "code", "C", "P", "P x C"]
    for step in steps:
        headers += [f"{step} step: mean", f"{step} step: longest band"]
    headers += ["recorded at training"]
    body = []
    for r in report["rows"]:
        cells = [r["bundle"], r["code"], str(r["candidates"]), str(r["prefilter"]), f"{r['stage2_keys']:,}"]
        for step in steps:
            rec = r["recall"][step]
            cells += [pct(rec["mean"]), f"{pct(rec['band_mean'])} ({rec['band']})"]
        cells.append(pct(r["recorded_recall"]))
        body.append(cells)
    parts = [f"Served recall of the exact top-{report['topk']} ({report['queries']} held-out queries, "
             f"{report['selection']}):", "", markdown_rows(headers, body)]
    chosen = []
    for case in report["cases"]:
        p = case.get("chosen_point")
        base = case["baseline"]
        cells = [str(case["batch"]), f"{case['keys']:,}", case["step"],
                 f"{base['median_ms']:.4f} ({base['name']})" if base else "-"]
        if p is None:
            cells += ["none reaches the target", "-", "-", "-"]
        else:
            cells += [f"{p['code']} C={p['candidates']} P={p['prefilter']} ({p['bundle']})",
                      "-" if p["median_ms"] is None else f"{p['median_ms']:.4f}",
                      "-" if p["speedup"] is None else f"{p['speedup']:.2f}x",
                      f"{pct(p['recall'])} / {pct(p['band_recall'])}"]
        chosen.append(cells)
    parts += ["", f"Fastest point reaching {pct(report['recall_target'])} in the mean and the longest band "
                  f"(chosen by {report['cases'][0]['chosen_by'] if report['cases'] else '-'}):", "",
              markdown_rows(["B", "N", "step", "exact baseline (ms)", "point", "ms", "speedup", "recall mean / band"],
                            chosen)]
    if report["timing"]["skipped"] is None:
        keys = [case_key(c["batch"], c["keys"]) for c in report["cases"]]
        rows = [[r["bundle"], str(r["candidates"]), str(r["prefilter"])]
                + [f"{r['median_ms'][k]:.4f} ({r['speedup'][k]:.2f}x)" for k in keys] for r in report["rows"]]
        parts += ["", "Step time in ms (speedup against the exact baseline of the same B x N):", "",
                  markdown_rows(["bundle", "C", "P", *[f"B={c['batch']} N={c['keys']:,}" for c in report["cases"]]],
                                rows)]
    return "\n".join(parts) + "\n"


def frontier_plot(report: dict, path: Path) -> Path:
    """PNG: speedup against recall, one panel per B x N, each bundle's points, the Pareto front as a line and
    the chosen point ringed; the recall target as a vertical line."""
    from dsaindex.errors import DsaIndexError

    try:
        import matplotlib
    except ImportError:
        raise DsaIndexError("--plot needs matplotlib, which is not installed here.",
                            "pip install matplotlib (or drop --plot).") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({c["batch"] for c in report["cases"]})
    lengths = sorted({c["keys"] for c in report["cases"]})
    fig, axes = plt.subplots(len(lengths), len(batches), figsize=(3.6 * len(batches), 3.2 * len(lengths)),
                             squeeze=False)
    rows = report["rows"]
    bundles = list(dict.fromkeys(r["bundle"] for r in rows))
    markers = "osD^v<>P*X"
    for case in report["cases"]:
        ax = axes[lengths.index(case["keys"])][batches.index(case["batch"])]
        key, step = case_key(case["batch"], case["keys"]), case["step"]
        for bi, bundle in enumerate(bundles):
            mine = [r for r in rows if r["bundle"] == bundle]
            ax.scatter([point_recall(r, step) for r in mine], [r["speedup"][key] for r in mine],
                       marker=markers[bi % len(markers)], s=26, label=f"{mine[0]['code']}: {Path(bundle).name}")
        front = case["front"]
        ax.plot([point_recall(rows[i], step) for i in front], [rows[i]["speedup"][key] for i in front],
                color="black", lw=1, ls="--", label="Pareto front")
        for i in front:
            ax.annotate(f"C{rows[i]['candidates']}/P{rows[i]['prefilter']}",
                        (point_recall(rows[i], step), rows[i]["speedup"][key]), fontsize=6,
                        textcoords="offset points", xytext=(3, 3))
        if case["chosen"] is not None:
            r = rows[case["chosen"]]
            ax.scatter([point_recall(r, step)], [r["speedup"][key]], s=160, facecolors="none", edgecolors="red",
                       label="fastest at the target")
        ax.axvline(report["recall_target"], color="red", lw=0.8, alpha=0.5)
        ax.axhline(1.0, color="gray", lw=0.6, alpha=0.5)
        ax.set_title(f"B={case['batch']}, N={case['keys']:,} ({step} step)", fontsize=9)
        ax.set_xlabel(f"served recall of the exact top-{report['topk']}", fontsize=8)
        ax.set_ylabel(f"speedup vs {case['baseline']['name']}", fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(f"decode operating points: speedup against served recall\n(recall: the lower of the mean and the "
                 f"longest prefix band; red line: the target {100 * report['recall_target']:.2f}%)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- the command -----------------------------------------------------------------------------------------
def bench_frontier(
    more: list[str] = typer.Argument(None, metavar="BUNDLE", show_default=False,
                                     help="Further bundles (so --artifacts A B C lists three)."),
    store: str = typer.Option(..., "--store", "-s", help="Capture store of the bundles' model whose held-out queries "
                                                         "measure recall (a folder or s3://bucket/prefix): a store the "
                                                         "bundles were not trained on, or their training store (then "
                                                         "only its held-out sequences)."),
    artifacts: list[str] = typer.Option(None, "--artifacts", "-a", help="PQ or RQ bundle: a folder, s3://bucket/prefix "
                                                                        "or models:/<name>@<alias> (repeatable)."),
    candidates: str = typer.Option("2048,4096", help="Comma-separated C: candidates rescored exactly."),
    prefilter: str = typer.Option("4,8,16", help="Comma-separated P: stage 1 keeps P x C keys by the folded score."),
    batches: str = typer.Option("1,2,8,32,64", help="Comma-separated request counts B to time."),
    keys: str = typer.Option("262144,1048576", help="Comma-separated keys per request N to time (multiples of 64)."),
    layers: str = typer.Option(None, help="Comma-separated layers whose held-out queries measure recall "
                                          "(default: every code layer)."),
    topk: str = typer.Option(str(PAPER_K), help="k of the exact top-k the recall is of: a count, or `model` (the "
                                                "model's own top-k, which the server selects)."),
    recall_target: float = typer.Option(DECODE.recall_target, help="The recall the chosen point must reach in the "
                                                                   "mean and in the longest prefix band."),
    filter_width: float = typer.Option(DECODE.filter_width, help="The miss filter's margin below the k-th coarse "
                                                                 "score, in standard deviations."),
    direct_upto: int = typer.Option(DECODE.direct_upto, callback=at_least(0),
                                    help="Steps of at most this many requests read their candidates straight from "
                                         "the host (the direct step, no miss filter), as the server runs them."),
    queries: int = typer.Option(64, callback=at_least(1), help="Held-out queries per layer."),
    grow_band: int = typer.Option(0, "--grow-band", callback=at_least(0),
                                  help="C grows with each doubling of a query's prefix past this "
                                       "many keys, as servers grow it past the band a bundle measured (e.g. 131072 "
                                       "for bundles measured at 128K): the recall of that rule on a longer store, "
                                       "and its steps' time. 0: C fixed. A step past the band rescores every "
                                       "candidate (no miss filter), whatever the batch, as servers run it."),
    min_prefix: int = typer.Option(None, callback=at_least(1),
                                   help="Only queries with at least this many keys before them (default: 4 x k, and "
                                        "above the largest C: shorter prefixes would be rescored whole)."),
    timing: bool = typer.Option(None, "--timing/--no-timing",
                                help="Time the steps (default: where --device is CUDA). --timing on the CPU times "
                                     "the kernels' torch references against the torch exact step (small --keys)."),
    graphs: bool = typer.Option(True, "--graphs/--eager", help="Time steps replayed from CUDA graphs (as servers "
                                                               "run decode)."),
    device: str = typer.Option("auto", help="Where recall is measured and steps are timed: cpu, cuda or auto."),
    stage2: str = typer.Option("auto", "--stage2", help="Stage 2's kernel on a GPU: auto (the default), cuda, int8 "
                                                       "(8-bit operands) or triton; the CPU runs the torch reference."),
    stage1: str = typer.Option("codes", "--stage1", help="What stage 1 scores: codes (the default), groups (the "
                                                         "keys' group codes, half the bytes, kept beside the codes) "
                                                         "or folds (the codes by 16 folded queries)."),
    out: Path = typer.Option(None, help="Also write the JSON result to this file."),
    markdown: Path = typer.Option(None, help="Also write the tables as markdown to this file."),
    plot: Path = typer.Option(None, help="Also draw speedup against recall (one panel per B x N, the Pareto front "
                                         "marked) into this PNG file."),
    show_progress: bool = typer.Option(True, "--progress/--no-progress", help="Show progress bars on stderr."),
) -> None:
    """Speed against served recall of decode operating points (C, stage-1 factor P, miss filter) of PQ/RQ
    bundles: recall of the exact top-k on a held-out store through the server's own step, step time per
    batch x length against DeepGEMM logits + the best top-k in the same run, the Pareto front, and the
    fastest point reaching the recall target."""
    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.artifacts.storage import display, location
    from dsaindex.coarse import check_filter_width
    from dsaindex.console import emit_report, parse_ints, progress_bar, resolve_device
    from dsaindex.errors import DsaIndexError
    from dsaindex.runtime.settings import parse_fraction
    from dsaindex.train.recall import measured_sequences

    # every input is checked before the first measurement (recall and timing take minutes)
    refs = list(artifacts or []) + list(more or [])
    if not refs:
        raise DsaIndexError("No bundle to measure.", "pass --artifacts BUNDLE [BUNDLE ...] (PQ/RQ bundles of the "
                                                     "store's model).")
    cs = sorted(set(parse_ints(candidates, "--candidates", minimum=1)))
    ps = sorted(set(parse_ints(prefilter, "--prefilter", minimum=1)))
    batch_sizes = sorted(set(parse_ints(batches, "--batches", minimum=1)))
    key_counts = sorted(set(parse_ints(keys, "--keys", minimum=64)))
    layer_ids = sorted(set(parse_ints(layers, "--layers", minimum=0))) if layers else None
    target = parse_fraction(recall_target, "--recall-target")
    try:
        width = check_filter_width(filter_width)
    except ValueError as err:
        raise DsaIndexError(f"--filter-width {filter_width}: {err}.", "pass a width of at least 0.") from None
    from dsaindex.kernels.pq_stage2_cuda import STAGE2S

    if stage2 not in STAGE2S:
        raise DsaIndexError(f"--stage2 {stage2!r} is not a stage-2 kernel.", f"pass one of {', '.join(STAGE2S)}.")
    from dsaindex.runtime.paged_select import STAGE1S

    if stage1 not in STAGE1S:
        raise DsaIndexError(f"--stage1 {stage1!r} is not a stage-1 code.", f"pass one of {', '.join(STAGE1S)}.")
    device = resolve_device(device)
    cuda = device.startswith("cuda")
    timed_run = cuda if timing is None else timing
    if plot is not None and not timed_run:
        raise DsaIndexError("--plot draws speedup against recall, and this run times nothing "
                            f"({'--no-timing' if timing is False else 'no CUDA device'}).",
                            "run with timing (on a CUDA device, or --timing on the CPU at small --keys), or drop --plot.")
    store_ref = location(store)
    cstore = CaptureStore.open(store_ref)
    geometry = cstore.manifest.model.geometry
    k = parse_topk(topk, geometry.topk)
    bundles = load_bundles(refs, cstore, display(store_ref), layer_ids, device)
    if stage1 == "groups":
        from dsaindex.pq import check_groups

        for b in bundles:
            for codec in b.codecs.values():
                check_groups(codec.subspaces, codec.codebooks.shape[1], codec.residual)
    if stage1 == "folds":
        from dsaindex.kernels.pq_fold_cuda import takes as fold_takes

        for b in bundles:
            for codec in b.codecs.values():
                why = fold_takes(2, codec.dim, codec.subspaces, codec.codebooks.shape[1], codec.residual)
                if why is not None:
                    raise DsaIndexError(f"--stage1 folds: {why}.", "pass --stage1 codes.")
    check_points(bundles, cs, ps, k, key_counts if timed_run else None, device)
    if min_prefix is None:
        min_prefix = max(4 * k, max(cs) + 1)
    elif min_prefix <= max(cs):
        raise DsaIndexError(f"--min-prefix {min_prefix} is not above the largest C ({max(cs)}): a query with at most "
                            "C keys before it has every key rescored (exhaustive, not coarse-to-fine).",
                            f"pass --min-prefix {max(cs) + 1} or more, or leave it out.")
    sequences, held_how = measured_sequences(cstore, [b.manifest for b in bundles])
    steps = [s for s in STEPS if any(step_for(b, direct_upto, n, grow_band) == s for b in batch_sizes
                                     for n in key_counts)]
    if not timed_run:
        reason = "--no-timing" if timing is False else "no CUDA device"
        typer.echo(f"note: the timing part is skipped ({reason}); pass --timing to time the kernels' torch "
                   "references on the CPU (at small --keys), or run on a CUDA device. The recall is measured.",
                   err=True)
    elif not cuda:
        typer.echo("note: timing the kernels' torch references on the CPU against the torch exact step (not the "
                   "GPU kernels, not DeepGEMM).", err=True)

    use_triton = None if cuda else False  # on the CPU the kernels' torch references (a CPU server runs them)
    # what a server takes with no decode flags, per bundle: measured beside the grid
    chosen = [server_defaults(b, geometry.topk, target, device) for b in bundles]
    with progress_bar("served recall", enabled=show_progress, unit="layers") as update:
        results, counts = measure_recall(cstore, bundles, sequences, k, cs, ps, steps, width, min_prefix, queries,
                                         device, use_triton, update, grow_band, stage2, stage1,
                                         [None if isinstance(x, str) else x for x in chosen])
    if not any(counts.values()):
        raise DsaIndexError(f"No held-out query of {display(store_ref)} (sequences {sequences}) has {min_prefix} keys "
                            "or more before it.",
                            "capture longer sequences (--seq-len) or lower --min-prefix (it must stay above the "
                            "largest C).")
    cases = [(b, n) for n in key_counts for b in batch_sizes]
    timings = None
    if timed_run:
        with progress_bar("decode steps", enabled=show_progress, unit="steps") as update:
            timings = time_cases(cases, bundles, cs, ps, geometry.n_heads, k, direct_upto, width, graphs, device,
                                 update, grow_band, stage2, stage1,
                                 [None if isinstance(x, str) else x for x in chosen])
    rows = []
    for bi, b in enumerate(bundles):
        for c in cs:
            for p in ps:
                row = {"bundle": b.ref, "bundle_id": b.manifest.bundle_id, "code": b.label, "candidates": c,
                       "prefilter": p, "stage2_keys": p * c, "cache_capacity": cache_for(c),
                       "recall": {s: summarize(results[(bi, c, p, s)], k) for s in steps},
                       "recorded_recall": recorded_recall(b.manifest, list(b.codecs), k, p, c,
                                                          "folds" if stage1 == "folds" else "codes")}
                if timings:
                    row["median_ms"] = {key: round(t["steps"][(bi, c, p)][0], 4) for key, t in timings.items()}
                    row["timing"] = {key: t["steps"][(bi, c, p)][1] for key, t in timings.items()}
                    row["speedup"] = {key: round(t["baseline"]["median_ms"] / max(row["median_ms"][key], 1e-9), 3)
                                      for key, t in timings.items()}
                rows.append(row)
    import torch

    report = {
        "store": display(store_ref), "store_id": cstore.manifest.store_id, "sequences": sequences,
        "held_out": held_how, "layers": list(bundles[0].codecs), "topk": k, "min_prefix": min_prefix,
        "queries_per_layer": queries, "queries": sum(counts.values()),
        "queries_by_layer": {str(layer): n for layer, n in counts.items()},
        "recall_target": target, "filter_width": width, "direct_upto": direct_upto, "steps": steps,
        "grow_band": grow_band, "stage2": stage2, "stage1": stage1,
        "selection": "the runtime's Triton kernels" if cuda else "the kernels' torch references (CPU)",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "timing": {"skipped": None if timed_run else ("--no-timing" if timing is False else "no CUDA device"),
                   "graphs": graphs if cuda else False, "heads": geometry.n_heads,
                   "cache": "warm (a step after one that filled the device cache; the direct step has none)"},
        "bundles": [{"bundle": b.ref, "bundle_id": b.manifest.bundle_id, "code": b.label,
                     "trained_on": b.manifest.lineage.capture_store_id} for b in bundles],
        "rows": rows,
        "cases": frontier_cases(rows, cases, timings, direct_upto, target, grow_band),
        "defaults": [{"bundle": b.ref, "refused": x} if isinstance(x, str) else
                     {"bundle": b.ref, "points": {str(layer): {"candidates": c, "prefilter": p, "stage1": kind}
                                                  for layer, (c, p, kind) in x.items()},
                      "recall": {s: summarize(results[(bi, "defaults", 0, s)], k) for s in steps
                                 if (bi, "defaults", 0, s) in results},
                      **(defaults_timing(bi, x, timings) if timings else {})}
                     for bi, (b, x) in enumerate(zip(bundles, chosen, strict=True))],
    }
    if plot is not None:
        report["plot"] = str(frontier_plot(report, plot))
    for line in summary_lines(report):
        typer.echo(line, err=True)
    emit_report(report, out, markdown, markdown_table(report))

