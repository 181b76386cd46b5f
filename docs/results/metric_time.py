"""Time train pq's score-aware metric two ways on one capture store (the figures in results.md, "The
score-aware metric on the training device"): each query's prefix read and scored on the host, as the
metric was built before, against ``metric_for_layer``, which reads each sequence once and scores on
the device. Usage: ``python docs/results/metric_time.py STORE OUT.json`` on a CUDA machine."""

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dsaindex.artifacts.capture_store import CaptureStore
from dsaindex.geometry import visible_key_count
from dsaindex.pq import PQSpec
from dsaindex.quant import engine_keys
from dsaindex.score import indexer_scores
from dsaindex.train.pq import score_gradient_metric
from dsaindex.train.pq_job import metric_for_layer
from dsaindex.train.recall import sequence_key_offsets, split_sequences

TOPK = 512


def per_query_on_host(store: CaptureStore, layer: int, train: list[int], spec: PQSpec, n: int) -> torch.Tensor:
    key_format = store.manifest.model.geometry.key_format
    positions = store.array("query_position").astype(np.int64)
    seq_of = store.array("query_sequence").astype(np.int64)
    offsets = sequence_key_offsets(store)
    rows = np.nonzero(np.isin(seq_of, train))[0]
    rows = rows[np.linspace(0, len(rows) - 1, n).round().astype(np.int64)]
    queries = store.as_float(store.queries(layer)[rows])
    weights = torch.from_numpy(store.head_weights(layer)[rows])
    chosen = []
    for i, r in enumerate(rows):
        start = offsets[seq_of[r]]
        count = min(int(visible_key_count(positions[r], store.manifest.model.geometry.key_stride)),
                    int(offsets[seq_of[r] + 1] - start))
        keys = engine_keys(store.as_float(store.keys(layer)[start : start + count]), key_format)
        scores = indexer_scores(queries[i : i + 1], keys, weights[i : i + 1])[0]
        chosen.append(keys[scores.topk(min(2 * TOPK, count)).indices])
    return score_gradient_metric(queries, weights, chosen, spec)


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
            old = per_query_on_host(store, layer, train, spec, n)
            row["old_host_s"] = round(time.perf_counter() - t, 2)
            row["max_rel_diff"] = float((new - old).abs().max() / old.abs().max())
        rows[f"{n}q_layer{layer}"] = row
        print(rows, flush=True)
    Path(out).write_text(json.dumps({"train_sequences": train, "rows": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
