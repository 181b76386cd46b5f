"""One decode step of the paged selector replayed from a CUDA graph, kernel by kernel on the device's clock: each
kernel's start (from the step's first kernel), its duration and the gap before it, medians over replays (a GPU;
not part of the package). The eager profile of ``bench paged --profile`` sums kernel times; this shows where a
small step's latency goes between them; ``codes`` and ``default`` run stage 1's CUDA scan
(kernels/pq_scan_cuda.py, the default), ``codes_scan_triton`` the codes' path with the Triton scan. ``python3 tools/step_timeline.py OUT.json [B,...] [N]``."""

import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from dsaindex.kernels import deepgemm
from dsaindex.pipelines.bench.decode import synthetic_state
from dsaindex.pipelines.bench.timing import captured_graph
from dsaindex.pq import PQCodec
from dsaindex.runtime.paged_select import PagedCacheSelector

C, P, REPLAYS = 4096, 4, 30


def replay_kernels(graph: torch.cuda.CUDAGraph) -> list[list[dict]]:
    """Kernels of each of :data:`REPLAYS` replays of ``graph``: [{name, ts, dur}] in start order."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_launch: dict[int, list[dict]] = {}  # a replay's kernels share its graph launch's correlation id
    for e in kernels:
        by_launch.setdefault(e.get("args", {}).get("correlation", -1), []).append(
            {"name": e["name"][:70], "ts": e["ts"], "dur": e["dur"]})
    replays = [sorted(r, key=lambda k: k["ts"]) for _, r in sorted(by_launch.items())]
    return replays[2:]  # the first replays warm the trace


def timeline(step) -> dict:
    """The step ``step`` captured in a graph and replayed: its kernels' median start, duration and gap."""
    replays = replay_kernels(captured_graph(step))
    count = statistics.mode(len(r) for r in replays)
    replays = [r for r in replays if len(r) == count]
    rows = []
    for i in range(count):
        starts = [r[i]["ts"] - r[0]["ts"] for r in replays]
        ends_before = [max(k["ts"] + k["dur"] for k in r[:i]) if i else r[0]["ts"] for r in replays]
        rows.append({"kernel": replays[0][i]["name"], "start_us": round(statistics.median(starts), 2),
                     "dur_us": round(statistics.median(r[i]["dur"] for r in replays), 2),
                     "gap_us": round(statistics.median(r[i]["ts"] - e for r, e in zip(replays, ends_before, strict=True)), 2)})
    span = statistics.median(max(k["ts"] + k["dur"] for k in r) - r[0]["ts"] for r in replays)
    busy = statistics.median(sum(k["dur"] for k in r) for r in replays)
    return {"kernels": count, "span_us": round(span, 2), "busy_us": round(busy, 2), "replays": len(replays),
            "timeline": rows}


def case(b: int, n: int) -> dict:
    fp8, scales, codes, codebooks, q, w = synthetic_state(b, n, 64, 32)
    lengths = torch.full((b,), n, dtype=torch.int32, device="cuda")
    cache, table = deepgemm.paged_cache(fp8, scales)
    schedule = deepgemm.paged_schedule(lengths)
    out = {"batch": b, "keys": n}

    def baseline():
        from dsaindex.kernels.topk import rows_topk
        return rows_topk(deepgemm.paged_logits(cache, table, lengths, q, w, n, schedule, masked=False), lengths, 512)

    out["deepgemm_fast_topk"] = timeline(baseline)
    for name, bound, scan in (("codes", 0, "auto"), ("default", None, "auto"), ("codes_scan_triton", 0, "triton")):
        kw = {} if bound is None else {"exact_below": bound}
        sel = PagedCacheSelector(PQCodec(codebooks.float().cpu()), cache.shape[0], 512, candidates=C, prefilter=P,
                                 device="cuda", scan=scan, **kw)
        sel.adopt(cache, table.reshape(-1), codes.reshape(-1, 64, codes.shape[2]))
        out[name] = timeline(lambda sel=sel: sel.select(cache, table, lengths, q, w, eager_refresh=False,
                                                        schedule=schedule))
    return out


def main() -> None:
    dest = Path(sys.argv[1])
    batches = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1,8").split(",")]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 1 << 20
    results = []
    for b in batches:
        results.append(case(b, n))
        for name in ("deepgemm_fast_topk", "codes", "default", "codes_scan_triton"):
            r = results[-1][name]
            print(f"B={b} {name}: span {r['span_us']} us, busy {r['busy_us']} us, {r['kernels']} kernels", flush=True)
            for row in r["timeline"]:
                print(f"   {row['start_us']:8.2f} +{row['dur_us']:7.2f} (gap {row['gap_us']:6.2f})  {row['kernel']}")
        torch.cuda.empty_cache()
    dest.write_text(json.dumps({"device": torch.cuda.get_device_name(), "candidates": C, "prefilter": P,
                                "cases": results}, indent=1))


if __name__ == "__main__":
    main()
