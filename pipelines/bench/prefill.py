"""``dsaindex bench prefill-select``: key selection for one prefill chunk at long prefixes, causal IVF
routing + exact refine against exhaustive scoring, with the index's maintenance timed apart.

One request's index grows chunk by chunk up to the longest prefix (every append timed: seals and
refits are the maintenance). At each measured prefix ``P`` the chunk of keys ``[P, P + chunk)`` is
appended and its ``chunk`` queries select their top-k:

* ``exhaustive``: :func:`dsaindex.runtime.ivf_prefill.exhaustive_chunk`, every key of each query's
  prefix scored by the Triton kernel, then ``torch.topk``;
* ``ivf@B``: :func:`dsaindex.runtime.ivf_prefill.select_chunk` with a candidate budget ``B``.

Times are medians of ``--repeats`` synchronized runs after a warm-up
(:func:`dsaindex.pipelines.bench.timing.median_ms`). Maintenance per chunk is amortized at the prefix: the
seals of the chunk's own append plus the latest refit times ``chunk / interval``, the keys the index waits
for after a refit at that length (:meth:`~dsaindex.runtime.causal_ivf.CausalIVF.refit_interval`);
``maintenance_share`` divides it by the selection time IVF saves (exhaustive - ivf). Keys and
queries come from a capture store (``--store``: its keys tiled with small noise up to the longest
prefix) or are synthetic clustered keys; recall against the exhaustive top-k is reported as a check
of the path, not as a routing-quality figure (``dsaindex eval ivf`` measures that on real prefixes).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from dsaindex.console import at_least
from dsaindex.pipelines.bench.timing import median_ms, time_call

if TYPE_CHECKING:
    import torch


def bench_inputs(total: int, chunk: int, store: Path | None, layer: int | None, heads: int,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """(keys [total, D] float32, queries [chunk, H, D], head weights [chunk, H], source text) on the CPU."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if store is None:
        dim = 128
        centers = torch.randn(total // 256 + 1, dim, generator=g)
        keys = centers[torch.randint(0, centers.shape[0], (total,), generator=g)] + 0.6 * torch.randn(total, dim, generator=g)
        pick = torch.randint(0, total, (chunk, heads), generator=g)
        queries = keys[pick] + 0.3 * torch.randn(chunk, heads, dim, generator=g)
        weights = torch.rand(chunk, heads, generator=g) * heads**-0.5 * dim**-0.5
        return keys, queries, weights, "synthetic clustered keys"
    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.train.recall import queries_by_sequence

    cs = CaptureStore.open(store)
    if not cs.committed.sequences:
        from dsaindex.errors import DsaIndexError

        raise DsaIndexError(f"{store} holds no committed sequence.", "capture into it first, or leave out --store.")
    layer = cs.layers[0] if layer is None else layer
    base = cs.engine_keys(cs.keys(layer))
    reps = -(-total // base.shape[0])
    keys = base.repeat(reps, 1)[:total]
    keys = keys + 0.01 * base.std() * torch.randn(keys.shape, generator=g)  # tiled copies are not identical
    parts = queries_by_sequence(cs, layer, list(range(cs.committed.sequences)), 0, chunk)
    queries = torch.cat([p.queries for p in parts]).float()
    weights = torch.cat([p.head_weights for p in parts]).float()
    take = torch.arange(chunk) % queries.shape[0]
    return keys, queries[take], weights[take], f"{store} layer {layer} ({base.shape[0]} keys tiled)"


def _recall(got, want) -> float:
    hits = total = 0
    for a, b in zip(got.tolist(), want.tolist(), strict=True):
        truth = {x for x in b if x >= 0}
        hits += len(truth & set(a))
        total += len(truth)
    return hits / max(1, total)


def run_bench(prefixes: list[int], chunk: int, budgets: list[int], topk: int, store: Path | None, layer: int | None,
              heads: int, window: int, cluster_size: int, refit_every: int, refit_iterations: int, repeats: int,
              device: str, use_triton: bool, progress: Callable[[str], None] | None = None,
              refit_search: str = "incremental", refit_fraction: float | None = None,
              key_storage: str = "fp8") -> dict:
    import torch

    from dsaindex.runtime.causal_ivf import CausalIVF
    from dsaindex.runtime.ivf_prefill import exhaustive_chunk, select_chunk

    prefixes = sorted(prefixes)
    total = prefixes[-1] + chunk
    keys, queries, weights, source = bench_inputs(total, chunk, store, layer, heads)
    keys = keys.to(device)
    queries, weights = queries.to(device), weights.to(device)
    grows = {} if refit_fraction is None else {"refit_fraction": refit_fraction}
    index = CausalIVF(keys.shape[1], window, cluster_size, refit_every, refit_iterations=refit_iterations,
                      refit_search=refit_search, device=device, key_storage=key_storage, **grows)
    appends: list[dict] = []  # one per chunk appended: seconds, seals, refits
    rows = []

    def append(lo: int, hi: int) -> dict:
        seals, refits = len(index.versions), index.refits
        _, seconds = time_call(lambda: index.append(keys[lo:hi]), device)
        rec = {"at": lo, "seconds": seconds, "refit": index.refits > refits,
               "versions": len(index.versions) - seals,
               "interval": index.refit_interval(index.last_refit)}  # keys the refit's cost spreads over
        appends.append(rec)
        index.forget_before(hi - chunk)
        return rec

    start = 0
    for prefix in prefixes:
        for lo in range(start, prefix, chunk):
            append(lo, min(prefix, lo + chunk))
            if progress:
                progress(f"building the index: {index.length:,} keys")
        this = append(prefix, prefix + chunk)
        start = prefix + chunk
        positions = torch.arange(prefix, prefix + chunk, device=device)
        if progress:
            progress(f"prefix {prefix:,}: exhaustive")
        truth = exhaustive_chunk(index.keys, queries, weights, positions, topk, use_triton)
        t_ex = median_ms(lambda p=positions: exhaustive_chunk(index.keys, queries, weights, p, topk, use_triton),
                         repeats, device) / 1e3
        engines = deepgemm_times(index.keys, queries, weights, positions, topk, repeats, device)
        ivf = {}
        for b in budgets:
            if progress:
                progress(f"prefix {prefix:,}: ivf budget {b:,}")
            got = select_chunk(index, queries, weights, positions, b, topk, use_triton=use_triton)
            t = median_ms(lambda p=positions, b=b: select_chunk(index, queries, weights, p, b, topk,
                                                                use_triton=use_triton), repeats, device) / 1e3
            ivf[str(b)] = {"seconds": round(t, 5), "speedup": round(t_ex / t, 3), "recall_check": round(_recall(got, truth), 4)}
        refits = [a for a in appends if a["refit"]]
        seal_times = [a["seconds"] for a in appends if not a["refit"] and a["versions"] > 0][-8:]
        seal_s = statistics.median(seal_times) if seal_times else 0.0
        refit_s = refits[-1]["seconds"] - seal_s if refits else 0.0  # that append also sealed a chunk
        # the latest refit's cost over the keys until the next (at least the interval at its length)
        maintenance = seal_s + max(0.0, refit_s) * chunk / refits[-1]["interval"] if refits else seal_s
        for r in ivf.values():
            saved = t_ex - r["seconds"]
            r["maintenance_share"] = round(maintenance / saved, 4) if saved > 0 else None
        stats = index.refit_stats[-1] if index.refit_stats else None
        rows.append({
            "prefix": prefix, "clusters": index.versions[-1].clusters if index.versions else 0,
            "exhaustive_seconds": round(t_ex, 5), "ivf": ivf, "deepgemm": engines,
            "maintenance": {"seal_per_chunk_s": round(seal_s, 5), "last_refit_s": round(max(0.0, refit_s), 5),
                            "last_refit_at": refits[-1]["at"] if refits else None,
                            "refit_interval": refits[-1]["interval"] if refits else None,
                            "per_chunk_s": round(maintenance, 5), "this_append_s": round(this["seconds"], 5),
                            "refit_distance_work_saved": round(stats.saved, 4) if stats else None},
        })
    return {
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "source": source, "chunk": chunk, "topk": topk, "heads": heads, "budgets": budgets,
        "index": {"window": window, "cluster_size": cluster_size, "refit_every": refit_every,
                  "refit_fraction": index.refit_fraction, "key_storage": key_storage,
                  "refit_iterations": refit_iterations, "refit_search": refit_search, "refits": index.refits},
        "scoring": "triton" if use_triton else "torch", "repeats": repeats, "rows": rows,
        "build_seconds": round(sum(a["seconds"] for a in appends), 3),
    }


def deepgemm_times(keys, queries, weights, positions, topk: int, repeats: int, device: str) -> dict:
    """The engines' exact prefill selection for one chunk: DeepGEMM's ``fp8_mqa_logits`` over the FP8 keys
    of the prefix, alone and with a top-k (``torch.topk``, and the threshold select of
    :mod:`dsaindex.kernels.topk`; ``logits_topk_seconds`` is the faster); seconds (medians), or why it
    did not run."""
    import torch

    from dsaindex.kernels import deepgemm
    from dsaindex.kernels.topk import rows_topk
    from dsaindex.quant import fp8_quantize

    reason = deepgemm.unavailable() if str(device).startswith("cuda") else "not on a CUDA device"
    if reason:
        return {"skipped": reason}
    n = int(positions.max()) + 1
    codes, scales = fp8_quantize(keys[:n])
    codes, scales = codes.view(torch.uint8), scales.reshape(-1)
    lengths = (positions + 1).to(torch.int32)

    def logits(masked: bool = False):
        return deepgemm.prefill_logits(codes, scales, queries, weights, lengths, masked=masked)

    logits()  # JIT compilation happens outside the timing
    t_logits = median_ms(logits, repeats, device) / 1e3
    t_topk = median_ms(lambda: logits(masked=True).topk(topk, dim=1), repeats, device) / 1e3
    t_fast = median_ms(lambda: rows_topk(logits(), lengths, topk), repeats, device) / 1e3
    return {"logits_seconds": round(t_logits, 5), "logits_topk_seconds": round(min(t_topk, t_fast), 5),
            "torch_topk_seconds": round(t_topk, 5), "threshold_topk_seconds": round(t_fast, 5)}


def markdown_table(report: dict) -> str:
    from dsaindex.console import markdown_rows

    budgets = report["budgets"]
    head = ["prefix", "DeepGEMM logits ms", "DeepGEMM + topk ms", "exhaustive ms",
            *[f"IVF {b // 1024}K ms (x)" for b in budgets], "maintenance ms/chunk",
            *[f"(IVF {b // 1024}K + maint.) / DeepGEMM + topk" for b in budgets],
            *[f"maint./saved {b // 1024}K" for b in budgets]]
    table = []
    for r in report["rows"]:
        dg = r.get("deepgemm", {})
        dg_topk = dg.get("logits_topk_seconds")
        cells = [f"{r['prefix'] // 1024}K",
                 *[f"{dg[k] * 1e3:.1f}" if k in dg else "n/a" for k in ("logits_seconds", "logits_topk_seconds")],
                 f"{r['exhaustive_seconds'] * 1e3:.1f}"]
        cells += [f"{r['ivf'][str(b)]['seconds'] * 1e3:.1f} ({r['ivf'][str(b)]['speedup']:.2f}x)" for b in budgets]
        maintenance = r["maintenance"]["per_chunk_s"]
        cells.append(f"{maintenance * 1e3:.1f}")
        cells += [f"{(r['ivf'][str(b)]['seconds'] + maintenance) / dg_topk:.2f}" if dg_topk else "n/a"
                  for b in budgets]
        cells += [f"{r['ivf'][str(b)]['maintenance_share']}" for b in budgets]
        table.append(cells)
    return markdown_rows(head, table) + "\n"


def bench_prefill_select(
    prefixes: str = typer.Option("131072,262144,524288,1048576", help="Comma-separated prefix lengths (keys)."),
    chunk: int = typer.Option(4096, callback=at_least(1), help="Queries (and keys) per prefill chunk."),
    budgets: str = typer.Option("8192,16384,24576", help="Comma-separated IVF candidate budgets."),
    topk: int = typer.Option(512, callback=at_least(1), help="Keys selected per query."),
    store: Path = typer.Option(None, "--store", "-s", help="Capture store for keys and queries (default: synthetic)."),
    layer: int = typer.Option(None, callback=at_least(0), help="Layer of the store (default: its first)."),
    heads: int = typer.Option(64, callback=at_least(1), help="Indexer heads (synthetic inputs)."),
    window: int = typer.Option(1024, callback=at_least(1), help="Keys per seal."),
    cluster_size: int = typer.Option(128, callback=at_least(1), help="Keys per cluster."),
    refit_every: int = typer.Option(16384, callback=at_least(0), help="Keys between refits (0: never)."),
    refit_fraction: float = typer.Option(None, help="Past refit_every / this many keys, a refit waits for this share "
                                                    "of the prefix (0: every refit_every keys; default: the "
                                                    "index's, 1/16)."),
    refit_iterations: int = typer.Option(1, callback=at_least(1), help="Lloyd iterations per refit."),
    refit_search: str = typer.Option("incremental", help="incremental (old keys keep their center unless a new "
                                     "one is closer) or exact (bound-certified, plain Lloyd's result)."),
    repeats: int = typer.Option(3, callback=at_least(1), help="Timed runs per measurement (median)."),
    key_storage: str = typer.Option("fp8", help="How the index keeps its keys: fp8 (the runtime's: the engines' "
                                                "132-byte format alone) or float32 (also a float32 copy)."),
    device: str = typer.Option("auto", help="cpu, cuda or auto."),
    out: Path = typer.Option(None, help="Also write the JSON result to this file."),
    markdown: Path = typer.Option(None, help="Also write the table as markdown to this file."),
) -> None:
    """Selection time per prefill chunk, causal IVF vs exhaustive, with index maintenance apart."""
    from rich.console import Console

    from dsaindex.console import parse_ints, resolve_device

    prefix_list = parse_ints(prefixes, "--prefixes", minimum=1)
    budget_list = parse_ints(budgets, "--budgets", minimum=1)
    if key_storage not in ("fp8", "float32"):
        from dsaindex.errors import DsaIndexError

        raise DsaIndexError(f"--key-storage {key_storage!r} is not a way this benchmark keeps keys.",
                            "pass fp8 (what the runtime's prefill index keeps) or float32.")
    device = resolve_device(device)
    use_triton = device.startswith("cuda")
    console = Console(stderr=True)
    with console.status("prefill-select") as status:
        report = run_bench(prefix_list, chunk, budget_list, topk, store, layer, heads, window, cluster_size,
                           refit_every, refit_iterations, repeats, device, use_triton,
                           progress=lambda m: status.update(f"prefill-select: {m}"), refit_search=refit_search,
                           refit_fraction=refit_fraction, key_storage=key_storage)
    from dsaindex.console import emit_report

    emit_report(report, out, markdown, markdown_table(report))
    console.print(markdown_table(report))
