"""Time train pq's score-aware metric two ways on one capture store (the figures in results.md, "The
score-aware metric on the training device"): each query's prefix read and scored on the host, as the
metric was built before, against ``metric_for_layer``, which reads each sequence once and scores on
the device. Usage: ``python docs/results/metric_time.py STORE OUT.json`` on a CUDA machine."""

import json
import sys
import time
from pathlib import Path

import torch

from dsaindex.artifacts.capture_store import CaptureStore
from dsaindex.pq import PQSpec
from dsaindex.train.pq_job import metric_for_layer, metric_for_layer_reference
from dsaindex.train.recall import split_sequences

TOPK = 512


def main(store_path: str, out: str) -> None:
    store = CaptureStore.open(store_path)
    train = split_sequences(store.committed.sequences)[0]
    spec, layer, rows = PQSpec(dim=128, subspaces=32), 0, {}
    key_format = store.manifest.model.geometry.key_format
    for n in (32, 256):
        t = time.perf_counter()
        new = metric_for_layer(store, layer, train, key_format, spec, n, TOPK, device="cuda")
        torch.cuda.synchronize()
        row = {"new_cuda_s": round(time.perf_counter() - t, 2), "old_host_s": None, "max_rel_diff": None}
        if n == 32:  # the host path only where it takes seconds
            t = time.perf_counter()
            old = metric_for_layer_reference(store, layer, train, key_format, spec, n, TOPK)
            row["old_host_s"] = round(time.perf_counter() - t, 2)
            row["max_rel_diff"] = float((new - old).abs().max() / old.abs().max())
        rows[f"{n}q_layer{layer}"] = row
        print(rows, flush=True)
    Path(out).write_text(json.dumps({"train_sequences": train, "rows": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
