"""Causal IVF (runtime/causal_ivf.py): capped clustering, causality of versions, routing vs blocks."""

import pytest
import torch

from dsaindex.errors import DsaIndexError
from dsaindex.runtime.causal_ivf import BlockIndex, CausalIVF, capped_kmeans
from dsaindex.score import indexer_scores

D, H = 32, 4


def interleaved_keys(n, groups=24, seed=0):
    """Keys from a few directions, shuffled in position: similar keys are not contiguous."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.nn.functional.normalize(torch.randn(groups, D, generator=g), dim=1) * 3
    return centers[torch.randint(0, groups, (n,), generator=g)] + 0.3 * torch.randn(n, D, generator=g)


def test_capped_kmeans_respects_the_cap_and_returns_member_means():
    x = interleaved_keys(1024)
    assign, centers = capped_kmeans(x, 8, 128)
    counts = torch.bincount(assign, minlength=8)
    assert counts.max() <= 128 and counts.sum() == 1024
    for c in range(8):
        torch.testing.assert_close(centers[c], x[assign == c].mean(0))
    with pytest.raises(DsaIndexError, match="cannot hold"):
        capped_kmeans(x, 4, 128)


def test_versions_are_causal_and_refits_grow_the_clusters():
    ivf = CausalIVF(D, window=256, cluster_size=32, refit_every=1024, sinks=4)
    keys = interleaved_keys(3000)
    ivf.append(keys[:1000])
    ivf.append(keys[1000:])  # seals happen as windows complete, across appends
    assert ivf.sealed == 4 + 11 * 256 and ivf.refits == 2
    assert [v.clusters for v in ivf.versions][:5] == [8, 16, 24, 32, 32]  # the 4th seal triggered a refit
    for p in (3, 100, 259, 260, 1500, 2999):
        v = ivf.version_for(p)
        assert v is None or v.upto <= p + 1
        cand = ivf.candidates(torch.randn(H, D), torch.rand(H), p, budget=300)
        assert cand.numel() <= 300 and int(cand.max()) <= p, "a candidate from the query's future"
        assert len(set(cand.tolist())) == cand.numel()
    v = ivf.versions[-1]  # every sealed key is in exactly one cluster
    assert sorted(v.order.tolist()) == list(range(4, v.upto))


def test_budget_covering_the_prefix_is_exhaustive():
    keys = interleaved_keys(2000)
    ivf = CausalIVF(D, window=256, cluster_size=32, refit_every=0)
    ivf.append(keys)
    q, w = torch.randn(H, D), torch.rand(H)
    got = ivf.select(q, w, 1500, budget=1501, topk=20)
    want = indexer_scores(q.unsqueeze(0), keys[:1501], w.unsqueeze(0))[0].topk(20).indices
    assert set(got.tolist()) == set(want.tolist())


def test_similarity_clusters_route_better_than_contiguous_blocks():
    keys = interleaved_keys(4096, seed=1)
    ivf = CausalIVF(D, window=512, cluster_size=64, refit_every=2048)
    blocks = BlockIndex(D, window=512, cluster_size=64)
    ivf.append(keys)
    blocks.append(keys)
    g = torch.Generator().manual_seed(5)
    got = {"ivf": 0.0, "blocks": 0.0}
    for _ in range(20):
        q = keys[torch.randint(0, 4096, (H,), generator=g)] + 0.1 * torch.randn(H, D, generator=g)
        w = torch.rand(H, generator=g)
        truth = set(indexer_scores(q.unsqueeze(0), keys[:4000], w.unsqueeze(0))[0].topk(64).indices.tolist())
        for name, index in (("ivf", ivf), ("blocks", blocks)):
            got[name] += len(truth & set(index.candidates(q, w, 3999, 512).tolist())) / 64 / 20
    assert got["ivf"] >= got["blocks"] + 0.2, got
    assert got["ivf"] >= 0.45


def test_window_must_be_whole_clusters():
    with pytest.raises(DsaIndexError, match="multiple of cluster_size"):
        CausalIVF(D, window=1000, cluster_size=128)
