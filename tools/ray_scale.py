"""A synthetic 61-layer store trained on Ray with 1, 2 and 4 CPU workers at once (docs/scale_plan.md; not part
of the package). RAY_SCALE=LAYERS,KEYS,SEQ_LEN,QPS and RAY_SCALE_WORK=ITERATIONS,TRAIN_KEYS size the run
(default 61,1048576,131072,4 and 8,32768); tools/ray_scale.sh WORK runs the whole of it.

build: python ray_scale.py build WORK
driver: python ray_scale.py drive WORK ADDRESS WORKERS  (one job, JSON to WORK/ray{WORKERS}.json)
compare: python ray_scale.py compare WORK
"""

import json
import os
import socket
import sys
import time
from pathlib import Path

LAYERS, KEYS, SEQ_LEN, QPS = (int(v) for v in os.environ.get("RAY_SCALE", "61,1048576,131072,4").split(","))
ITERS, TRAIN_KEYS = (int(v) for v in os.environ.get("RAY_SCALE_WORK", "8,32768").split(","))
OPTS = dict(subspaces=32, trainer="torch", iterations=ITERS, score_aware=True, rotate=True, quantizer="pq",
            max_train_keys=TRAIN_KEYS, max_eval_queries=8, device="cpu")


def build(work: Path) -> None:
    import torch

    from dsaindex.pipelines.bench.pq_job import SyntheticKeys, build_store, synthetic_geometry

    geometry = synthetic_geometry(LAYERS)
    t = time.perf_counter()
    last = [0.0]

    def progress(done, total, *a):
        if time.perf_counter() - last[0] > 20:
            last[0] = time.perf_counter()
            print(f"store {done}/{total} keys per layer, {time.perf_counter() - t:.0f} s", flush=True)

    built = build_store(work / "store", geometry, SyntheticKeys(geometry, "cpu"), KEYS // SEQ_LEN, SEQ_LEN, QPS,
                        progress)
    built["threads"] = torch.get_num_threads()
    (work / "store.json").write_text(json.dumps(built, indent=1, default=str))
    print("store", built, flush=True)


def drive(work: Path, address: str, workers: int) -> None:
    import statistics

    from dsaindex.train.cluster import RaySettings, pinned_threads
    from dsaindex.train.pq_job import PQOptions, run_pq_job

    opts = PQOptions(**OPTS)
    settings = RaySettings(address=address, threads=1, workers=workers)
    log = open(work / f"ray{workers}.log", "w")

    def progress(done, total, text=""):
        log.write(f"{time.perf_counter() - t0:.1f} {done}/{total} {text}\n")
        log.flush()

    t0 = time.perf_counter()
    with pinned_threads(1):
        result = run_pq_job(work / "store", opts, out=work / f"bundle-ray{workers}", register=False,
                            progress=progress, ray=settings)
    seconds = time.perf_counter() - t0
    results = result.report["results"].values()
    layer_s = [r.worker["seconds"] for r in results]
    out = {"workers": workers, "seconds": round(seconds, 3), "layers": len(layer_s),
           "layer_seconds": {"mean": round(statistics.fmean(layer_s), 3),
                             "median": round(statistics.median(layer_s), 3), "max": round(max(layer_s), 3)},
           "train_seconds_per_layer_mean": round(statistics.fmean(r.train_seconds for r in results), 3),
           "processes": len({(r.worker["host"], r.worker["pid"]) for r in results}),
           "devices": sorted({r.worker["device"] for r in results}),
           "threads": sorted({r.worker["threads"] for r in results}),
           "recall_mean": {k: round(v, 5) for k, v in result.report["mean"].items()},
           "options": opts.params(), "host": socket.gethostname(), "cpu_count": os.cpu_count()}
    (work / f"ray{workers}.json").write_text(json.dumps(out, indent=1))


def compare(work: Path) -> None:
    from dsaindex.train.cluster import bundle_differences

    runs = {w: json.loads((work / f"ray{w}.json").read_text()) for w in (1, 2, 4) if (work / f"ray{w}.json").exists()}
    base = runs.get(1)
    for w, r in runs.items():
        if base:
            r["speedup_vs_1"] = round(base["seconds"] / r["seconds"], 3)
            r["scaling_efficiency"] = round(base["seconds"] / (r["seconds"] * w), 3)
            diffs = bundle_differences(work / "bundle-ray1", work / f"bundle-ray{w}")
            r["bundle_equals_1_worker"] = not diffs
            r["differences"] = diffs[:5]
    store = json.loads((work / "store.json").read_text())
    report = {"layers": LAYERS, "keys_per_layer": KEYS, "seq_len": SEQ_LEN, "queries_per_seq": QPS, "options": OPTS,
              "store": store, "runs": runs,
              "note": "the three jobs ran at once on one 7-CPU Ray cluster (tasks of one thread; each job keeps "
                      "at most WORKERS layer tasks in flight); the machine has os.cpu_count() cores"}
    (work / "ray_scale.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    cmd, work = sys.argv[1], Path(sys.argv[2])
    work.mkdir(parents=True, exist_ok=True)
    if cmd == "build":
        build(work)
    elif cmd == "drive":
        drive(work, sys.argv[3], int(sys.argv[4]))
    else:
        compare(work)
