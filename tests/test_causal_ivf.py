"""Causal IVF (runtime/causal_ivf.py): capped clustering, causality of versions, routing vs blocks."""

import pytest
import torch

from dsaindex.errors import DsaIndexError
from dsaindex.runtime.causal_ivf import BlockIndex, CausalIVF
from dsaindex.runtime.clustering import (
    Bounds,
    KMeansStats,
    capacity_assign,
    capped_kmeans,
    hamerly_lloyd,
    seal_kmeans,
)
from dsaindex.score import indexer_scores

D, H = 32, 4


def interleaved_keys(n, groups=24, seed=0):
    """Keys from a few directions, shuffled in position: similar keys are not contiguous."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.nn.functional.normalize(torch.randn(groups, D, generator=g), dim=1) * 3
    return centers[torch.randint(0, groups, (n,), generator=g)] + 0.3 * torch.randn(n, D, generator=g)


def test_capped_kmeans_respects_the_cap_and_returns_member_means():
    x = interleaved_keys(1024)
    assign, centers, _ = capped_kmeans(x, 8, 128)
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


def test_refits_wait_for_a_share_of_the_prefix_past_the_fixed_schedule():
    """Up to ``refit_every / refit_fraction`` sealed keys the refits fall where the fixed schedule puts them;
    past it, each waits until the keys since the last reach that share of the sealed prefix, at the first
    seal where they do. Keys appended a window at a time (one seal an append), both ways."""
    keys = interleaved_keys(4000)

    def refit_points(fraction):
        ivf = CausalIVF(D, window=64, cluster_size=16, refit_every=128, sinks=4, refit_fraction=fraction)
        points = []
        for lo in range(0, keys.shape[0], 64):
            before = ivf.refits
            ivf.append(keys[lo : lo + 64])
            if ivf.refits > before:
                points.append(ivf.last_refit)
        return ivf, points

    grown, points = refit_points(0.25)
    _, fixed = refit_points(0.0)
    assert [p for p in fixed if p <= 512] == [p for p in points if p <= 512]  # 128 / 0.25 keys: as before
    assert len(points) < len(fixed) and fixed == list(range(4 + 128, 4 + 3968 + 1, 128))[: len(fixed)]
    for before, at in zip(points, points[1:], strict=False):
        due = max(128, int(0.25 * at))
        assert due <= at - before < due + 64, (before, at)  # due, and at the first seal where it was
        assert grown.refit_interval(at) == due
    assert points[-1] > 2000 and points[-1] - points[-2] > 400  # the intervals grew with the prefix
    with pytest.raises(DsaIndexError, match="refit_fraction"):
        CausalIVF(D, refit_fraction=1.5)


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


def plain_lloyd(x, centers, iterations):
    for _ in range(iterations):
        assign = torch.cdist(x, centers).argmin(1)
        sums = torch.zeros_like(centers).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=centers.shape[0]).unsqueeze(1)
        centers = torch.where(counts > 0, sums / counts.clamp_min(1), centers)
    return centers


def assert_bounds_valid(bounds, x, centers, group, tol):
    d = torch.cdist(x, centers)
    assert torch.all(bounds.upper >= d.gather(1, bounds.nearest[:, None]).squeeze(1) - tol)
    others = d.scatter(1, bounds.nearest[:, None], float("inf"))
    assert bounds.lower.shape[1] == -(-centers.shape[0] // group)
    for g in range(bounds.lower.shape[1]):
        assert torch.all(bounds.lower[:, g] <= others[:, g * group : (g + 1) * group].min(1).values + tol)


@pytest.mark.parametrize("group", [8, 256])  # several lower-bound groups, and one (Hamerly)
def test_bounded_lloyd_equals_plain_lloyd_and_skips_work(monkeypatch, group):
    import dsaindex.runtime.clustering as clustering

    monkeypatch.setattr(clustering, "GROUP", group)
    x = interleaved_keys(3000, groups=40).double()
    init = x[:60].clone()
    stats = KMeansStats()
    got, bounds = hamerly_lloyd(x, init, 10, stats=stats)
    torch.testing.assert_close(got, plain_lloyd(x, init, 10))
    assert_bounds_valid(bounds, x, got, group, 1e-9)
    assert stats.plain == 10 * 3000 * 60 and 0.3 < stats.saved < 1


def test_capacity_assign_fills_nearest_first_and_respects_the_cap():
    x = interleaved_keys(1000, groups=6)
    centers = x[:10]
    free = capacity_assign(x, centers, cap=1000)
    assert torch.equal(free, torch.cdist(x, centers).argmin(1))  # no cap binds: plain nearest
    capped = capacity_assign(x, centers, cap=100)
    assert torch.bincount(capped, minlength=10).tolist() == [100] * 10
    # a point away from its nearest cluster only when that cluster is full of closer points
    d = torch.cdist(x, centers)
    for i in (capped != free).nonzero().squeeze(1)[:50].tolist():
        c = int(free[i])
        assert (d[capped == c, c] <= d[i, c] + 1e-6).all()


@pytest.mark.parametrize("group,search", [(4, "exact"), (256, "exact"), (4, "incremental")])
def test_refits_keep_valid_bounds(monkeypatch, group, search):
    import dsaindex.runtime.clustering as clustering

    monkeypatch.setattr(clustering, "GROUP", group)
    keys = interleaved_keys(9000, groups=50, seed=3)
    ivf = CausalIVF(D, window=256, cluster_size=32, refit_every=1024, sinks=4, refit_search=search)
    ivf.append(keys)
    assert ivf.refits == 8
    v = next(v for v in reversed(ivf.versions) if v.upto == ivf.last_refit)  # the last refit's version
    x = ivf.keys[4 : ivf.last_refit]
    assert_bounds_valid(ivf._bounds, x, v.centers, group, 1e-4)
    if search == "incremental":  # new keys x all centers + old keys x new centers: less than a full pass
        assert all(0 < s.saved < 1 for s in ivf.refit_stats[1:]), [s.saved for s in ivf.refit_stats]
    counts = torch.bincount(torch.repeat_interleave(torch.arange(v.clusters), v.starts.diff()))
    assert counts.max() <= 32 + 8


def test_forgetting_old_versions_keeps_later_queries_unchanged():
    keys = interleaved_keys(3000)
    ivf = CausalIVF(D, window=256, cluster_size=32, refit_every=1024)
    ivf.append(keys)
    q, w = torch.randn(H, D), torch.rand(H)
    before = {p: ivf.candidates(q, w, p, 300).tolist() for p in (1800, 2100, 2999)}
    n = len(ivf.versions)
    ivf.forget_before(1800)
    assert len(ivf.versions) < n and ivf.versions[0].upto <= 1801
    assert {p: ivf.candidates(q, w, p, 300).tolist() for p in before} == before


def test_seal_kmeans_gives_equal_clusters_independent_of_batching():
    x = interleaved_keys(4 * 256, groups=5).view(4, 256, D)
    assign, centers = seal_kmeans(x, 8, 8, seeds=[10, 20, 30, 40])
    for w in range(4):
        assert torch.bincount(assign[w], minlength=8).tolist() == [32] * 8
        for c in range(8):
            torch.testing.assert_close(centers[w, c], x[w][assign[w] == c].mean(0))
        alone_a, alone_c = seal_kmeans(x[w : w + 1], 8, 8, seeds=[10 * (w + 1)])
        assert torch.equal(alone_a[0], assign[w])
    # clustering beats arbitrary equal groups: members sit closer to their own mean
    spread = (x - centers.gather(1, assign[:, :, None].expand(-1, -1, D))).norm(dim=2).mean()
    blocks = (x.view(4, 8, 32, D) - x.view(4, 8, 32, D).mean(2, keepdim=True)).norm(dim=3).mean()
    assert spread < 0.8 * blocks


def test_appending_in_pieces_equals_appending_at_once():
    keys = interleaved_keys(5000, seed=7)
    whole = CausalIVF(D, window=256, cluster_size=32, refit_every=1024)
    whole.append(keys)
    for step in (700, 256):  # several windows sealed together between refits, and one seal an append
        pieces = CausalIVF(D, window=256, cluster_size=32, refit_every=1024)
        for lo in range(0, 5000, step):
            pieces.append(keys[lo : lo + step])
        assert len(whole.versions) == len(pieces.versions)
        for a, b in zip(whole.versions, pieces.versions, strict=True):
            assert a.upto == b.upto and torch.equal(a.order, b.order) and torch.equal(a.starts, b.starts)
            torch.testing.assert_close(a.centers, b.centers)


def test_warm_bounds_lead_to_the_plain_lloyd_result():
    x = interleaved_keys(2000, groups=30).double()
    init = x[:40].clone()
    wrong = torch.randint(0, 40, (2000,), generator=torch.Generator().manual_seed(0))
    # valid bounds that certify nothing: any center, its true distance, lower bounds of 0
    loose = Bounds(wrong, (x - init[wrong]).norm(dim=1), torch.zeros(2000, 1, dtype=x.dtype))
    got, _ = hamerly_lloyd(x, init, 3, bounds=loose)
    torch.testing.assert_close(got, plain_lloyd(x, init, 3))


def test_version_cluster_maps_agree_with_members():
    ivf = CausalIVF(D, window=256, cluster_size=32, refit_every=1024)
    ivf.append(interleaved_keys(2000))
    v = ivf.versions[-1]
    of = v.cluster_of(ivf.length)
    for c in (0, 5, v.clusters - 1):
        assert sorted((of == c).nonzero().squeeze(1).tolist()) == sorted(v.members(c).tolist())
    assert (of[:4] == -1).all() and (of[v.upto :] == -1).all()  # sinks and the open window


def test_fp8_key_storage_holds_a_fifth_of_the_bytes_and_routes_alike():
    """The runtime's form keeps the engines' 132-byte FP8 keys alone: its float view is the FP8 copy of
    the float32 form dequantized, it is released on demand, and the index is built and routes as the
    float32 form does on the same (dequantized) keys."""
    from dsaindex.quant import fp8_dequantize

    keys = interleaved_keys(3000)
    full = CausalIVF(D, window=256, cluster_size=32, refit_every=1024, sinks=4)
    lean = CausalIVF(D, window=256, cluster_size=32, refit_every=1024, sinks=4, key_storage="fp8")
    for lo in range(0, 3000, 700):  # chunks that cut windows
        full.append(keys[lo : lo + 700])
        lean.append(keys[lo : lo + 700])
    fp8, scales = full.keys_fp8
    dequantized = fp8_dequantize(fp8.view(torch.float8_e4m3fn), scales[:, None])
    assert torch.equal(lean.keys, dequantized)
    assert lean.device_bytes()["float_view"] == dequantized.numel() * 4
    lean.release_float()
    held, full_held = lean.device_bytes(), full.device_bytes()
    capacity = full._fp8.shape[0]
    assert held["float_view"] == 0 and held["keys"] == capacity * (D + 4) == lean._fp8.shape[0] * (D + 4)
    assert full_held["keys"] == capacity * (4 * D + D + 4)  # float32 and FP8 copies
    assert held["versions"] > 0 and held["bounds"] > 0
    # the same seals and refits: same versions, clusters over the same positions
    assert [v.upto for v in lean.versions] == [v.upto for v in full.versions] and lean.refits == full.refits
    # built from the dequantized keys, it equals a float32 index given those keys
    twin = CausalIVF(D, window=256, cluster_size=32, refit_every=1024, sinks=4)
    for lo in range(0, 3000, 700):
        twin.append(dequantized[lo : lo + 700])
    for a, b in zip(lean.versions, twin.versions, strict=True):
        assert torch.equal(a.order, b.order) and torch.allclose(a.centers, b.centers, atol=1e-5)
    with pytest.raises(DsaIndexError, match="key storage"):
        CausalIVF(D, key_storage="bf16")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_streamed_key_storage_borrows_a_streamer_buffer_per_chunk_and_equals_fp8_storage(device):
    """The served runtime's streamed form: each layer's index borrows their layer's buffer of a
    PrefixStreamer for each chunk (prefix loaded from the host, the chunk's bytes written in place and
    committed back). Chunk after chunk (seals, refits, learned-style representatives) they select exactly
    as the resident FP8 form does; between chunks they hold only scales and versions (on CUDA the refit
    bounds wait on the host), and the host holds every key's bytes."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from dsaindex.runtime.ivf_prefill import select_chunk
    from dsaindex.runtime.streaming import PrefixStreamer

    n, chunk = 3000, 700
    layers = (0, 1, 2)  # three layers over two buffers: a layer's buffer changes from chunk to chunk
    keys = {layer: interleaved_keys(n, seed=layer).to(device) for layer in layers}
    g = torch.Generator().manual_seed(5)
    queries = torch.randn(n, 3, D, generator=g).to(device)
    weights = torch.rand(n, 3, generator=g).to(device)
    settings = dict(window=256, cluster_size=32, refit_every=1024, sinks=4)
    resident = {layer: CausalIVF(D, key_storage="fp8", device=device, **settings) for layer in layers}
    streamed = {layer: CausalIVF(D, key_storage="streamed", device=device, **settings) for layer in layers}
    streamer = PrefixStreamer(list(layers), (D,), torch.uint8, n, device)
    with pytest.raises(DsaIndexError, match="no key buffer attached"):
        streamed[0].append(keys[0][:10])

    def reps(v):  # a deterministic function of the version and its members' keys, as learned routing reads
        return v.centers * 1.5 + 0.1

    for lo in range(0, n, chunk):
        positions = torch.arange(lo, min(n, lo + chunk), device=device)
        streamer.begin_chunk()
        for layer in layers:
            want_index, got_index = resident[layer], streamed[layer]
            streamer.acquire(layer)
            got_index.attach(streamer.buffer(layer))
            want_index.append(keys[layer][positions])
            got_index.append(keys[layer][positions])
            want = select_chunk(want_index, queries[positions], weights[positions], positions, 96, 16, reps)
            got = select_chunk(got_index, queries[positions], weights[positions], positions, 96, 16, reps)
            if device == "cpu":
                assert torch.equal(got, want), (lo, layer)
            else:  # k-means on the GPU sums with atomics: two builds may group a few keys differently
                assert (got == want).float().mean() >= 0.98, (lo, layer)
            assert torch.equal(got_index.keys, want_index.keys)
            streamer.commit(layer, got_index.length)
            got_index.detach()
            streamer.release(layer)
            held = got_index.device_bytes()
            assert held["keys"] == got_index._scales.numel() * 4 and held["float_view"] == 0
            if device == "cuda" and got_index.refits:  # parked on the host until the next refit
                assert held["bounds"] == 0 and want_index.device_bytes()["bounds"] > 0
            with pytest.raises(DsaIndexError, match="no key buffer attached"):
                _ = got_index.keys_fp8
    streamer.finish()
    for layer in layers:
        want_fp8, _ = resident[layer].keys_fp8
        assert streamer.length[layer] == n and torch.equal(streamer.host[layer][:n], want_fp8.cpu())
        assert [v.upto for v in streamed[layer].versions] == [v.upto for v in resident[layer].versions]
        assert streamed[layer].refits == resident[layer].refits == 2
    small = torch.zeros(10, D, dtype=torch.uint8, device=device)
    streamed[0].attach(streamer.buffers[0][: n + 0])
    with pytest.raises(DsaIndexError, match="uint8"):
        streamed[0].attach(small)  # shorter than the index's keys
    with pytest.raises(DsaIndexError, match="streamed key buffer holds"):
        streamed[0].append(keys[0][:1])
    with pytest.raises(DsaIndexError, match="lends key bytes to a streamed index"):
        resident[0].attach(streamer.buffers[0])


def test_seal_versions_share_buffers_and_stay_as_they_were():
    """Seals after a refit extend shared buffers (a version views a prefix; growth by doubling), so a
    chunk's versions cost about one copy of the clusters, not one each; every version still reads as it
    was made, whatever later seals and refits did."""
    keys = interleaved_keys(4096)
    ivf = CausalIVF(D, window=128, cluster_size=16, refit_every=1024, sinks=4)
    snapshots = []
    for lo in range(0, 4096, 256):
        ivf.append(keys[lo : lo + 256])
        snapshots += [(v, v.order.clone(), v.starts.clone(), v.centers.clone()) for v in ivf.versions[len(snapshots):]]
    assert len(snapshots) == len(ivf.versions) == 31 + 3  # 31 seals, 3 refits
    for v, order, starts, centers in snapshots:
        assert torch.equal(v.order, order) and torch.equal(v.starts, starts) and torch.equal(v.centers, centers)
        assert int(v.starts[-1]) == v.order.numel() and v.order.numel() == v.upto - 4
    storages = {v.order.untyped_storage().data_ptr() for v in ivf.versions}
    assert len(storages) <= 4 * 4  # per refit era a few doublings, not one copy per seal
    held = ivf.device_bytes()["versions"]
    copies = sum(t.numel() * t.element_size() for v in ivf.versions for t in (v.order, v.starts, v.centers))
    assert held < copies / 2  # one copy per version before
