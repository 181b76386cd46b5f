"""Where a prefill chunk's IVF time goes at a long prefix: a seal-only append, a refit and the selection of one
chunk, each timed (synchronized, median of 3) and profiled once: device time in kernels, launches, the top
kernels and the host's own time (a GPU; not part of the package). The index keeps FP8 keys, as the runtime's.
``python3 tools/prefill_profile.py OUT.json [PREFIX]``."""

import json
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from dsaindex.pipelines.bench.prefill import bench_inputs
from dsaindex.pipelines.bench.timing import time_call
from dsaindex.runtime.causal_ivf import CausalIVF
from dsaindex.runtime.ivf_prefill import select_chunk

CHUNK, BUDGET, TOPK = 4096, 16384, 512


def timed(fn) -> float:
    """Milliseconds of one synchronized call."""
    return time_call(fn, "cuda")[1] * 1e3


def profiled(fn) -> dict:
    """One call of ``fn`` under the profiler: device ms in kernels, launches, top kernels and host ops."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels, host = {}, {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA or getattr(e, "self_device_time_total", 0) > 0:
            dev = getattr(e, "self_device_time_total", 0.0)
            if dev:
                kernels[e.key] = (dev / 1e3, e.count)
        if e.device_type == torch.autograd.DeviceType.CPU and e.self_cpu_time_total > 0:
            host[e.key] = (e.self_cpu_time_total / 1e3, e.count)
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    return {"device_ms": round(sum(v[0] for v in kernels.values()), 3),
            "launches": int(sum(v[1] for v in kernels.values())),
            "top_kernels": [{"name": k[:80], "ms": round(v[0], 3), "calls": v[1]} for k, v in top[:12]],
            "top_host_ops": [{"name": k[:80], "ms": round(v[0], 3), "calls": v[1]}
                             for k, v in sorted(host.items(), key=lambda kv: -kv[1][0])[:12]]}


def main() -> None:
    dest = Path(sys.argv[1])
    prefix = int(sys.argv[2]) if len(sys.argv) > 2 else 262144
    keys, queries, weights, _ = bench_inputs(prefix + 40 * CHUNK, CHUNK, None, None, 64)
    keys, queries, weights = keys.cuda(), queries.cuda(), weights.cuda()
    index = CausalIVF(128, device="cuda", key_storage="fp8", refit_fraction=0.0, refit_every=1 << 30)
    for lo in range(0, prefix - 32768, 65536):  # seals only (refits off while building)
        index.append(keys[lo : min(prefix - 32768, lo + 65536)])
    index._refit()
    at = [prefix - 32768]

    def seal():  # one chunk's append: four seals, no refit
        index.append(keys[at[0] : at[0] + CHUNK])
        at[0] += CHUNK

    refits = []
    for _ in range(2):  # a refit as the index runs them: 16K keys sealed since the last
        for _ in range(4):
            seal()
        refits.append(timed(index._refit))
    out = {"prefix": at[0], "chunk": CHUNK, "budget": BUDGET}
    times = [timed(seal) for _ in range(3)]
    out["seal_append"] = {"ms": round(statistics.median(times), 3), **profiled(seal)}
    seal()
    out["refit"] = {"ms": round(statistics.median(refits), 3), **profiled(index._refit)}
    positions = torch.arange(at[0] - CHUNK, at[0], device="cuda")

    def select():
        return select_chunk(index, queries, weights, positions, BUDGET, TOPK, use_triton=True)

    select()
    out["select"] = {"ms": round(statistics.median([timed(select) for _ in range(3)]), 3), **profiled(select)}
    for name in ("seal_append", "refit", "select"):
        r = out[name]
        print(f"{name}: {r['ms']} ms wall, {r['device_ms']} ms in {r['launches']} kernels", flush=True)
        for k in r["top_kernels"][:8]:
            print(f"    {k['ms']:8.3f} ms x{k['calls']:<5} {k['name']}")
        for k in r["top_host_ops"][:6]:
            print(f"    host {k['ms']:8.3f} ms x{k['calls']:<5} {k['name']}")
    dest.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
