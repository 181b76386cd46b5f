"""PQ coarse-to-fine decode selection (torch reference) against exhaustive exact selection."""

import pytest
import torch
from pq_decode_reference import PQDecodeIndexer, pq_coarse_scores

from dsaindex.errors import DsaIndexError
from dsaindex.pq import PQCodec, PQSpec, decode, encode
from dsaindex.quant import fp8_dequantize, fp8_quantize
from dsaindex.runtime.host_store import HostKeyStore, HostMemoryError
from dsaindex.score import indexer_scores
from dsaindex.train.codebooks import train_codebooks

D, H = 32, 4


def exact_topk(keys, q, w, k):
    """Exhaustive selection over the engine's (FP8) keys: the reference."""
    engine = fp8_dequantize(*fp8_quantize(keys))
    return set(indexer_scores(q.unsqueeze(0), engine, w.unsqueeze(0))[0].topk(k).indices.tolist())


@pytest.fixture(scope="module")
def setup():
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(24, D, generator=g) * 2
    keys = centers[torch.randint(0, 24, (1000,), generator=g)] + 0.4 * torch.randn(1000, D, generator=g)
    cb = train_codebooks(keys, PQSpec(D, 16, 64), "torch", iterations=10)
    q = torch.randn(H, D, generator=g)
    w = torch.rand(H, generator=g)
    return keys, PQCodec(cb), q, w


def test_coarse_scores_equal_scores_of_decoded_keys(setup):
    keys, layer, q, w = setup
    codes = encode(keys, layer.codebooks)
    got = pq_coarse_scores(q, w, codes, layer.codebooks, block=77)
    want = indexer_scores(q.unsqueeze(0), decode(codes, layer.codebooks), w.unsqueeze(0))[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_all_candidates_equals_exhaustive(setup):
    keys, layer, q, w = setup
    host = HostKeyStore(64, D, pin=False)
    idx = PQDecodeIndexer(layer, host, topk=20, candidates=10_000, miss_filter=False)
    idx.admit("r")
    idx.append("r", keys[:700])
    idx.append("r", keys[700:999])  # 999 keys: 15 pages + a 39-key tail
    assert host.free_pages == 64 - 15
    positions, stats = idx.select("r", q, w)
    assert set(positions.tolist()) == exact_topk(keys[:999], q, w, 20)
    assert stats.candidates == 960 and stats.hits == 0 and stats.fetched == 960


def test_coarse_to_fine_recall_and_cache_reuse(setup):
    keys, layer, q, w = setup
    host = HostKeyStore(64, D, pin=False)
    idx = PQDecodeIndexer(layer, host, topk=16, candidates=128, cache_capacity=256)
    idx.admit("r")
    idx.append("r", keys)
    positions, first = idx.select("r", q, w)
    recall = len(set(positions.tolist()) & exact_topk(keys, q, w, 16)) / 16
    assert recall >= 0.9
    assert first.hits == 0 and 0 < first.fetched <= 128 and first.dropped == 128 - first.fetched
    assert first.host_bytes == first.fetched * (D + 4)
    # the next decode step with a nearby query reuses cached exact keys instead of reading the host
    _, second = idx.select("r", q + 0.01 * torch.randn(q.shape, generator=torch.Generator().manual_seed(1)), w)
    assert second.hits > 0 and second.fetched < first.fetched


def test_free_twice_and_host_exhaustion_leave_other_requests_running(setup):
    keys, layer, q, w = setup
    host = HostKeyStore(10, D, pin=False)
    idx = PQDecodeIndexer(layer, host, topk=8, candidates=64)
    idx.admit("a")
    idx.append("a", keys[:512])  # 8 pages
    idx.admit("b")
    with pytest.raises(HostMemoryError, match="host key store is full"):
        idx.append("b", keys[:256])  # needs 4 pages, 2 left
    before, _ = idx.select("a", q, w)
    assert before.numel() == 8  # request a is unaffected
    idx.free("b")
    idx.free("a")
    assert host.free_pages == 10
    with pytest.raises(DsaIndexError, match="not admitted"):
        idx.free("a")
    with pytest.raises(DsaIndexError, match="already admitted"):
        idx.admit("c")
        idx.admit("c")


def test_gpu_bytes_per_key_is_a_quarter_of_exact_at_pq32():
    cb = torch.randn(32, 256, 4)
    host = HostKeyStore(40, 128, pin=False)
    idx = PQDecodeIndexer(PQCodec(cb), host, topk=8, candidates=64, cache_capacity=0)
    idx.admit("r")
    idx.append("r", torch.randn(64 * 40, 128))
    per_key = idx.gpu_bytes("r") / (64 * 40)
    assert per_key == 32 and per_key <= 132 / 4


def test_second_request_reads_its_own_host_pages(setup):
    """Positions index a request's own page list: a later request never reads an earlier one's keys."""
    keys, layer, q, w = setup
    idx = PQDecodeIndexer(layer, HostKeyStore(40, D, pin=False), topk=10, candidates=10_000, miss_filter=False)
    idx.admit("first")
    idx.append("first", keys[500:1000])
    idx.admit("second")
    idx.append("second", keys[:448])  # 7 pages, allocated after the first request's 7
    got, _ = idx.select("second", q, w)
    assert set(got.tolist()) == exact_topk(keys[:448], q, w, 10)
