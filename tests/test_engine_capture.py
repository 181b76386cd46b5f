"""The engine capture's shared part (:mod:`dsaindex.runtime.engine_capture`) on the CPU: what the SGLang and vLLM
plugins call while serving. Index-K pages are laid out as both engines keep them (per 64-key page: 64 x D FP8
e4m3 bytes, then 64 float32 ue8m0 scales); the engines' own hooks are tested in engines/*/tests/test_capture.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dsaindex.artifacts.capture_store import CaptureStore
from dsaindex.errors import StoreMismatchError
from dsaindex.kernels.fp8_score import paged_keys_reference
from dsaindex.pipelines.capture.presets import preset_config
from dsaindex.quant import fp8_quantize
from dsaindex.runtime.engine_capture import (
    DecodeSampling,
    EngineCapture,
    check_store,
    engine_fingerprint,
    engine_manifest,
)

PRESET = "tiny-v32"  # 4 indexer layers, 8 heads x 128
CONFIG = preset_config(PRESET)
LAYERS, H, D = (0, 1, 2, 3), 8, 128
PAGE_BYTES = 64 * (D + 4)


def manifest(queries=4, basis="hadamard", engine="sglang"):
    return engine_manifest(engine_fingerprint(CONFIG, f"preset:{PRESET}"), engine, basis, queries)


def caches(num_pages=40, seed=0):
    """One index-K cache per layer [pages, 64 * (D + 4)] uint8 of random FP8 keys with ue8m0 scales."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in LAYERS:
        keys = torch.randn(num_pages * 64, D, generator=g) * (1 + layer)
        fp8, scales = fp8_quantize(keys)
        buf = torch.empty(num_pages, PAGE_BYTES, dtype=torch.uint8)
        buf[:, : 64 * D] = fp8.view(torch.uint8).reshape(num_pages, 64 * D)
        buf[:, 64 * D :] = scales.reshape(num_pages, 64).contiguous().view(torch.uint8)
        out[layer] = buf
    return out


def dequantized(cache, pages, n):
    keys, scales = paged_keys_reference(cache, pages[None].to(torch.int32), D)
    return keys[0, :n].view(torch.float8_e4m3fn).float() * scales[0, :n, None]


def step(capture, lengths, seed):
    """One decode step of len(lengths) rows: every layer's queries and weights staged; returns them."""
    g = torch.Generator().manual_seed(seed)
    staged = {}
    for layer in LAYERS:
        q, _ = fp8_quantize(torch.randn(len(lengths), H, D, generator=g))
        w = torch.rand(len(lengths), H, 1, generator=g)
        capture.stage(layer, q, w, torch.tensor(lengths, dtype=torch.int32))
        staged[layer] = (q, w.squeeze(2))
    return staged


def serve(capture, requests, steps, seed=0):
    """Decode ``steps`` steps of ``requests`` {id: (pages, prompt length)}: each step adds one key per request.
    Returns {id: [(position, {layer: (q, w)})]} of every step, and each request's final key count."""
    seen = {rid: [] for rid in requests}
    lengths = {rid: prompt for rid, (_, prompt) in requests.items()}
    for s in range(steps):
        for rid in requests:
            lengths[rid] += 1
        ids = list(requests)
        staged = step(capture, [lengths[r] for r in ids], seed + s)
        for b, rid in enumerate(ids):
            seen[rid].append((lengths[rid] - 1, {layer: (q[b], w[b]) for layer, (q, w) in staged.items()}))
        capture.decode_step(ids)
    return seen, lengths


def test_finished_requests_are_written_with_their_keys_and_sampled_queries(tmp_path):
    path = tmp_path / "store"
    cache = caches()
    capture = EngineCapture(str(path), manifest(queries=4), 64 << 20, 4)
    requests = {"a": (torch.tensor([7, 3, 11, 30, 2]), 250), "b": (torch.tensor([5, 21, 9]), 140)}
    seen, lengths = serve(capture, requests, steps=13)
    tokens = {rid: list(range(100, 100 + n)) for rid, n in lengths.items()}
    for rid, (pages, _) in requests.items():
        assert capture.finish(rid, tokens[rid], cache, pages, lengths[rid])
    capture.close()
    c = capture.counters()
    assert c["requests_written"] == 2 and c["requests_dropped"] == 0 and c["bytes_held"] == 0
    # steps 0-2, 3 and 4 (the stride doubled to 2), 6 (to 4), 10 (to 8) were copied; 4 a request were kept
    assert c["queries_sampled"] == 2 * 7 and c["keys_written"] == sum(lengths.values())

    store = CaptureStore.open(path)
    assert store.committed.sequences == 2 and store.manifest.model.name == f"preset:{PRESET}"
    assert store.manifest.settings.basis == "hadamard" and store.manifest.corpus["engine"] == "sglang"
    assert store.array("sequence_keys").tolist() == [lengths["a"], lengths["b"]]
    assert store.array("tokens").tolist() == tokens["a"] + tokens["b"]
    offsets = np.cumsum([0, lengths["a"]])
    positions, sequence = store.array("query_position"), store.array("query_sequence")
    window = store.array("query_window")
    for s, rid in enumerate(requests):
        pages, prompt = requests[rid]
        n = lengths[rid]
        for layer in LAYERS:
            want = dequantized(cache[layer], pages, n)
            got = store.as_float(store.keys(layer)[offsets[s] : offsets[s] + n])
            assert torch.equal(got, want)  # FP8 x power of two: exact in bf16
            assert torch.equal(store.engine_keys(store.keys(layer)[offsets[s] : offsets[s] + n]), want)
        # 2 steps of one window, then 2 spread over the 11 later steps (the stride doubled to 8: steps 2 and 10)
        mine = np.nonzero(sequence == s)[0]
        assert positions[mine].tolist() == [prompt, prompt + 1, prompt + 2, prompt + 10]
        assert window[mine].tolist() == [0, 0, -1, -1]
        by_position = dict(seen[rid])
        for row in mine:
            for layer in LAYERS:
                q, w = by_position[int(positions[row])][layer]
                assert torch.equal(store.as_float(store.queries(layer)[row : row + 1])[0], q.float())
                assert torch.equal(torch.from_numpy(store.head_weights(layer)[row]), w)

    # what `dsaindex train pq` reads: the chunk check, the split, each layer's engine keys, held-out queries
    from dsaindex.train.recall import held_out, layer_keys, split_sequences

    assert store.check_chunks() > 0 and store.verify() > 0
    train, held = split_sequences(store.committed.sequences)
    assert train == [0] and held == [1]
    assert layer_keys(store, 2, train, store.manifest.model.geometry.key_format).shape == (lengths["a"], D)
    ho = held_out(store, 2, held, min_prefix=1, key_format=store.manifest.model.geometry.key_format)
    assert ho.queries.shape == (4, H, D) and ho.visible.tolist() == [141, 142, 143, 151]


def test_train_pq_reads_an_engine_capture(tmp_path):
    from dsaindex.train.pq_job import PQOptions, train_pq

    path = tmp_path / "store"
    cache = caches(num_pages=60, seed=3)
    capture = EngineCapture(str(path), manifest(queries=8), 64 << 20, 8)
    pages = torch.randperm(60, generator=torch.Generator().manual_seed(1))
    requests = {f"r{i}": (pages[i * 12 : (i + 1) * 12], 700) for i in range(5)}
    _, lengths = serve(capture, requests, steps=6)
    for rid, (p, _) in requests.items():
        capture.finish(rid, list(range(lengths[rid])), cache, p, lengths[rid])
    capture.close()
    report = train_pq(path, PQOptions(subspaces=32, centroids=16, iterations=2, metric_queries=8, max_eval_queries=8,
                                      candidates=(64,)))
    assert sorted(report["results"]) == list(LAYERS) and report["split"] == ([0, 1, 2, 3], [4])


def test_sampling_keeps_one_window_and_spreads_the_rest():
    sampling = DecodeSampling(window=3, scattered=4)
    taken = []
    for t in range(200):
        window = sampling.next_step()
        if window is not None:
            taken.append(t)
            sampling.add(SimpleNamespace(window=window))
        held = [t for t, _ in sampling.held]
        assert held[:3] == [0, 1, 2][: t + 1] and len(held) <= 3 + 4
    later = [t - 3 for t in held[3:]]  # evenly spread from the first step after the window
    assert later == [sampling.stride * i for i in range(len(later))] and later[-1] + 2 * sampling.stride > 196
    assert len(later) >= 2 and sampling.stride == 64
    assert len(taken) < 3 + 4 * 8  # each doubling lets half go: copies stay near 4 x log2(steps / 4)


def test_a_full_queue_drops_the_request_counts_it_and_never_waits(tmp_path):
    cache = caches()
    one = len(LAYERS) * 4 * PAGE_BYTES + 4 * 250  # a finished request of 4 pages
    small = len(LAYERS) * PAGE_BYTES + 4 * 60
    capture = EngineCapture(str(tmp_path / "store"), manifest(queries=0), one + small + 100, 0)
    gate, writing = threading.Event(), threading.Event()
    real = capture.store.append

    def slow_append(batch):
        writing.set()
        gate.wait(30)
        real(batch)

    capture.store.append = slow_append
    pages = torch.tensor([1, 2, 3, 4])
    assert capture.finish("first", list(range(250)), cache, pages, 250)
    assert writing.wait(10)  # the writer holds the first request's bytes until its append returns
    t0 = time.perf_counter()
    assert not capture.finish("second", list(range(250)), cache, torch.tensor([5, 6, 7, 8]), 250)
    assert capture.finish("small", list(range(60)), cache, torch.tensor([9]), 60)
    step(capture, [251, 61], 0)
    capture.decode_step(["x", "y"])  # a decode step goes on while the writer is stuck
    assert time.perf_counter() - t0 < 2.0
    c = capture.counters()
    assert c["requests_dropped"] == 1 and c["bytes_dropped"] == one and c["requests_queued"] == 2
    gate.set()
    capture.close()
    store = CaptureStore.open(tmp_path / "store")
    assert store.array("sequence_keys").tolist() == [250, 60]
    assert capture.counters()["bytes_held"] == 0


def test_a_rank_that_does_not_write_opens_and_copies_nothing(tmp_path):
    path = tmp_path / "store"
    capture = EngineCapture(str(path), manifest(), 64 << 20, 4, writing=False)
    step(capture, [10], 0)
    assert capture.decode_step(["a"]) == 0
    assert not capture.finish("a", list(range(9)), caches(), torch.tensor([0]), 9)
    capture.close()
    assert not path.exists() and capture._staging is None
    assert all(v == 0 for v in capture.counters().values())


def test_an_existing_store_is_appended_to_and_another_one_refused(tmp_path):
    path = tmp_path / "store"
    cache = caches()
    for run in range(2):  # two server runs into one store
        capture = EngineCapture(str(path), manifest(queries=2), 64 << 20, 2)
        serve(capture, {f"r{run}": (torch.tensor([run]), 40)}, steps=3)
        capture.finish(f"r{run}", list(range(43)), cache, torch.tensor([run]), 43)
        capture.close()
    store = CaptureStore.open(path)
    assert store.committed.sequences == 2 and store.array("query_sequence").tolist() == [0, 0, 1, 1]
    assert check_store(str(path), manifest(queries=2)) is True
    for other in (manifest(queries=8), manifest(queries=2, basis="raw"), manifest(queries=2, engine="vllm")):
        with pytest.raises(StoreMismatchError, match="was captured with another") as err:
            check_store(str(path), other)
        assert "DSAINDEX_CAPTURE" in err.value.fix and "new path" in err.value.fix
        with pytest.raises(StoreMismatchError):
            EngineCapture(str(path), other, 64 << 20, 2)
    assert CaptureStore.open(path).committed.sequences == 2
