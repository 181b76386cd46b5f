"""Batched Triton decode path (runtime/pq_batch.py) against exhaustive selection and the torch reference."""

import functools
import os

import pytest
import torch

pytest.importorskip("triton")

from dsaindex.pq import PQCodec  # noqa: E402
from dsaindex.runtime.host_store import HostKeyStore, HostMemoryError  # noqa: E402
from helpers import exact_fp8_topk as exact_topk  # noqa: E402
from helpers import selection_overlap as overlap  # noqa: E402

CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)
DEV = "cuda" if CUDA else "cpu"
D, H = 128, 8


CENTERS = torch.randn(32, D, generator=torch.Generator().manual_seed(9)) * 2


def clustered(n, g):
    """Keys around a few centers, as real indexer keys are (isotropic noise makes PQ meaningless)."""
    return CENTERS[torch.randint(0, CENTERS.shape[0], (n,), generator=g)] + 0.5 * torch.randn(n, D, generator=g)


@functools.cache
def layer(seed=0):
    """A PQ32 codec of the clustered keys (trained once per seed; tests only read it)."""
    from dsaindex.pq import PQSpec
    from dsaindex.train.codebooks import train_codebooks

    keys = clustered(4000, torch.Generator().manual_seed(seed))
    return PQCodec(codebooks=train_codebooks(keys, PQSpec(dim=D, subspaces=32), "torch", 6))


@pytest.fixture
def torch_encoding(monkeypatch):
    """Completed pages encoded by the encoder's reference (the codec's own ``encode``) where the kernel
    would run interpreted (about a second a page on the CPU), for tests of selection, not of encoding.
    The kernel's codes in a group are compared with the reference's in
    ``test_torch_path_selects_like_the_kernels`` and ``test_opq_codec_every_key_a_candidate_is_the_exact_topk``
    (and the kernel alone in test_kernel_select.py)."""
    import dsaindex.runtime.pq_batch as pq_batch
    from dsaindex.kernels.pq_select import pq_encode_reference

    if not CUDA:
        monkeypatch.setattr(pq_batch, "pq_encode", pq_encode_reference)


def histories(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [clustered(n, g) for n in lengths]


def make_group(lengths, topk, candidates, cache=None, pages=64, prefilter=2):
    from dsaindex.runtime.pq_batch import PQDecodeGroup

    host = HostKeyStore(pages, D)
    group = PQDecodeGroup(layer(), host, len(lengths), max(lengths) + 64, topk, candidates=candidates,
                          prefilter=prefilter, cache_capacity=cache or candidates, device=DEV)
    keys = histories(lengths)
    for slot, x in enumerate(keys):
        group.admit(slot)
        group.append(slot, x[: x.shape[0] // 3])  # two appends: a partial page carried over
        group.append(slot, x[x.shape[0] // 3 :])
    return group, keys, host


def queries(b, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, H, D, generator=g).to(torch.bfloat16), torch.rand(b, H, generator=g)


@pytest.mark.usefixtures("torch_encoding")
def test_equals_exhaustive_when_every_key_is_a_candidate():
    lengths = [300, 129, 64, 10]
    group, keys, _ = make_group(lengths, topk=16, candidates=320, prefilter=2)
    assert group.encoded_host == [256, 128, 64, 0] and group.tail_host == [44, 1, 0, 10]
    q, w = queries(4)
    picked, stats = group.select(q, w)
    want = exact_topk(keys, q, w, 16)
    assert overlap(picked.cpu(), want) >= 0.98, (picked, want)
    assert (picked.cpu() < torch.tensor(lengths)[:, None]).all()
    assert stats.totals()["hits"] == 0 and stats.totals()["fetched"] > 0


@pytest.mark.usefixtures("torch_encoding")
def test_recall_with_few_candidates_and_cache_hits_on_the_next_step():
    lengths = [1000, 700]
    group, keys, _ = make_group(lengths, topk=16, candidates=128, pages=40)
    q, w = queries(2)
    picked, first = group.select(q, w)
    assert overlap(picked.cpu(), exact_topk(keys, q, w, 16)) >= 0.9
    picked2, second = group.select(q, w)  # the same query again: kept candidates now sit in the cache
    assert torch.equal(picked.sort(1).values, picked2.sort(1).values)
    assert second.totals()["hits"] >= first.totals()["fetched"] * 0.9 and second.totals()["fetched"] <= 2


@pytest.mark.usefixtures("torch_encoding")
def test_matches_the_torch_reference_indexer():
    from pq_decode_reference import PQDecodeIndexer

    lengths = [640, 500]
    group, keys, _ = make_group(lengths, topk=16, candidates=128, prefilter=8)  # stage 1 passes everything
    ref = PQDecodeIndexer(group.layer, HostKeyStore(40, D), topk=16, candidates=128, cache_capacity=128)
    q, w = queries(2)
    picked, _ = group.select(q, w)
    for slot, x in enumerate(keys):
        ref.admit(slot)
        ref.append(slot, x)
        want, _ = ref.select(slot, q[slot].float(), w[slot])
        assert len(set(picked[slot].tolist()) & set(want.tolist())) >= 15


@pytest.mark.usefixtures("torch_encoding")
def test_bad_use_gives_clear_errors_and_other_requests_keep_running():
    from dsaindex.errors import DsaIndexError

    group, keys, host = make_group([200, 100], topk=8, candidates=64, pages=5)  # 3 + 1 pages used
    with pytest.raises(HostMemoryError, match="free pages"):
        group.append(1, torch.randn(200, D))  # needs 4 more pages, 1 left: nothing changes
    assert group.length(1) == 100 and host.free_pages == 1
    group.free(1)
    with pytest.raises(DsaIndexError, match="already freed"):
        group.free(1)
    q, w = queries(2)
    picked, _ = group.select(q, w)
    assert (picked[1] == -1).all() and (picked[0] >= 0).all()
    assert overlap(picked[:1].cpu(), exact_topk(keys[:1], q[:1], w[:1], 8)) >= 0.85
    from dsaindex.runtime.pq_batch import PQDecodeGroup

    with pytest.raises(DsaIndexError, match="miss filter's width"):
        PQDecodeGroup(group.layer, HostKeyStore(4, D), 1, 128, 8, candidates=64, cache_capacity=64, device=DEV,
                      filter_width=-1)
    with pytest.raises(DsaIndexError, match="int32"):  # the decode plan holds positions as int32
        PQDecodeGroup(group.layer, HostKeyStore(4, D), 1, 2**31, 8, candidates=64, cache_capacity=64, device=DEV)


@pytest.mark.usefixtures("torch_encoding")
def test_index_bytes_per_key_are_a_quarter_of_exact():
    group, _, _ = make_group([128], topk=8, candidates=64)
    per_key = group.gpu_bytes()["index"] / group.codes.shape[1]
    assert per_key == 32 and per_key <= (128 + 4) / 4


@pytest.mark.gpu
def test_request_groups_on_streams_match_one_by_one():
    from dsaindex.runtime.pq_batch import RequestGroups

    a, _, _ = make_group([5000, 3000], topk=64, candidates=512, pages=300)
    b, _, _ = make_group([4000, 6000], topk=64, candidates=512, pages=300)
    qa, wa = queries(2, 5)
    qb, wb = queries(2, 6)
    want = [a.select(qa, wa)[0], b.select(qb, wb)[0]]
    got = RequestGroups([a, b]).select([qa, qb], [wa, wb])
    torch.cuda.synchronize()
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x.sort(1).values, y.sort(1).values)


def test_torch_path_selects_like_the_kernels():
    """``use_triton=False`` (the CPU serving path) runs the kernels' references: same selection."""
    from dsaindex.runtime.pq_batch import PQDecodeGroup

    lengths = [900, 333]
    group, keys, _ = make_group(lengths, topk=16, candidates=128)
    plain = PQDecodeGroup(group.layer, HostKeyStore(40, D), 2, 1000, 16, candidates=128, prefilter=2,
                          cache_capacity=128, device=DEV, use_triton=False)
    for slot, x in enumerate(keys):
        plain.admit(slot)
        plain.append(slot, x)
    assert torch.equal(plain.codes, group.codes)
    q, w = queries(2)
    for _ in range(2):
        a, sa = group.select(q, w)
        b, sb = plain.select(q, w)
        assert overlap(a, b) >= 15 / 16 and abs(sa.totals()["hits"] - sb.totals()["hits"]) <= 2


@pytest.mark.usefixtures("torch_encoding")
@pytest.mark.parametrize("use_triton", [True, False])
def test_direct_host_rescoring_selects_like_the_cached_step_without_the_filter(use_triton):
    """``direct_upto``: the top C found by stage 2's score bins (no top-C kernel) and read straight from the
    host store give the cached step's selection when the cached step reranks every candidate (no miss
    filter); the direct step keeps C candidates and the boundary bin's ties (a few more, never fewer),
    leaves the cache alone, and counts every candidate as read from the host."""
    from dsaindex.runtime.pq_batch import PQDecodeGroup

    lengths = [400, 333, 70]  # stage 1 keeps about 1.5 x 256 keys, stage 2 the top 128 of them
    keys = histories(lengths)
    codec = layer()
    groups = []
    for direct in (0, 3):
        group = PQDecodeGroup(codec, HostKeyStore(40, D), 3, 1000, 16, candidates=128, prefilter=2,
                              cache_capacity=128, device=DEV, miss_filter=False, direct_upto=direct,
                              use_triton=use_triton)
        for slot, x in enumerate(keys):
            group.admit(slot)
            group.append(slot, x[: x.shape[0] // 2])
            group.append(slot, x[x.shape[0] // 2 :])  # a partial page: the tail is rescored from the device
        groups.append(group)
    cached, direct = groups
    assert direct.tail_host == [16, 13, 6]
    q, w = queries(3)
    want, cached_stats = cached.select(q, w)
    got, stats = direct.select(q, w)
    assert torch.equal(got.sort(1).values, want.sort(1).values)
    assert (direct.cache_pos == -1).all() and int(direct.step.sum()) == 0  # the cache was not touched
    totals = stats.totals()
    per_request = stats.candidates.cpu()
    assert (per_request >= cached_stats.candidates.cpu()).all() and (per_request <= 128 + direct.direct_slack).all()
    assert totals["candidates"] == totals["fetched"] <= cached_stats.totals()["candidates"] + 8
    assert totals["hits"] == totals["dropped"] == 0
    # a tail key that scores highest is selected: the tail comes from the device pool, not the host
    boost = direct.tail_host[0]
    q_boost = q.clone()
    q_boost[0] = (keys[0][-1] * 4).to(torch.bfloat16)
    picked, _ = direct.select(q_boost, torch.ones_like(w))
    assert lengths[0] - 1 in picked[0].tolist() and boost > 0
    # a larger batch than direct_upto takes the cached path (the plan advances the step counter)
    direct.direct_upto = 2
    direct.select(q, w)
    assert int(direct.step.sum()) == 3


@pytest.mark.usefixtures("torch_encoding")
@pytest.mark.parametrize("use_triton", [True, False])
def test_a_direct_step_grows_each_requests_c_past_the_band_as_the_plugins_step_does(use_triton):
    """``grow_past``: on a direct step a request longer than the band keeps C doubled for each doubling of its
    prefix (up to ``most``), read straight from the host; a request within the band selects as with a fixed C.
    A group whose steps can be cached ones (more live requests than ``direct_upto``) keeps them cached with the
    grown C: every candidate rescored (no miss filter), so it selects what the direct step selects, through a
    device cache sized for the growth, whose hits the next step does not read from the host again."""
    from dsaindex.errors import DsaIndexError
    from dsaindex.runtime.pq_batch import PQDecodeGroup

    lengths = [230, 1100]  # 192 coded keys (within a band of 256), 1,088 (4.25 x: grown 4 x, the cap)
    keys = histories(lengths, seed=4)
    codec = layer()
    q, w = queries(2, seed=5)
    picked, stats = {}, {}
    for band in (0, 256):
        group = PQDecodeGroup(codec, HostKeyStore(40, D), 2, 1200, 16, candidates=32, prefilter=2,
                              cache_capacity=32, device=DEV, direct_upto=2, use_triton=use_triton)
        assert group.grow_past(band, 4) == ((band, 4) if band else (0, 1))
        for slot, x in enumerate(keys):
            group.admit(slot)
            group.append(slot, x)
        picked[band], stats[band] = group.select(q, w)
        assert (picked[band].cpu() < torch.tensor(lengths)[:, None]).all()
    assert torch.equal(picked[256][0].sort().values, picked[0][0].sort().values)  # within the band: as fixed
    grown, fixed = stats[256].candidates.cpu(), stats[0].candidates.cpu()
    assert grown[0] == fixed[0] and 128 <= int(grown[1]) <= 128 + 256 and int(fixed[1]) <= 32 + 256
    assert int(stats[256].stage1[1]) >= 4 * int(stats[0].stage1[1]) * 3 // 4
    want = exact_topk(keys, q, w, 16)
    assert overlap(picked[256][1:].cpu(), want[1:]) > overlap(picked[0][1:].cpu(), want[1:])
    # three live requests, direct_upto 2: a step with the 1,100-key one stays cached, its C grown as above
    cached = PQDecodeGroup(codec, HostKeyStore(80, D), 3, 1200, 16, candidates=32, prefilter=2, cache_capacity=64,
                           device=DEV, direct_upto=2, use_triton=use_triton)
    assert (cached.cache_capacity, cached.spill) == (64, 64)
    assert cached.grow_past(256, 4) == (256, 4)
    assert (cached.cache_capacity, cached.spill) == (64 * 4, 64)  # 1,200 keys grow C 4 x: the cache alike
    assert cached.cache_pos.shape == (3, 256) and cached.pool_fp8.shape[1] == 256 + 1 + 64 + 64
    for slot, x in enumerate(keys + keys[:1]):
        cached.admit(slot)
        cached.append(slot, x)
    q3, w3 = torch.cat([q, q[:1]]), torch.cat([w, w[:1]])
    got, got_stats = cached.select(q3, w3)
    assert cached.step.tolist() == [1, 1, 1]  # the plan ran: a cached step
    assert torch.equal(got[:2].sort(1).values, picked[256].sort(1).values)  # the direct step's selection
    assert torch.equal(got_stats.candidates[:2].cpu(), grown)
    assert int(got_stats.dropped.sum()) == 0  # no miss filter on a grown step: every candidate rescored
    assert int(got_stats.fetched.sum()) == int(got_stats.candidates.sum())  # a cold cache: all read from the host
    again, again_stats = cached.select(q3, w3)  # the same step again: the cache holds them
    assert torch.equal(again.sort(1).values, got.sort(1).values)
    assert int(again_stats.fetched.sum()) * 10 < int(again_stats.candidates.sum())
    assert int(again_stats.hits.sum()) + int(again_stats.fetched.sum()) == int(again_stats.candidates.sum())
    with pytest.raises(DsaIndexError, match="call grow_past before admitting requests"):
        cached.grow_past(512, 2)  # a different cache while requests hold this one
    cached.free(1)
    cached.admit(1)
    cached.append(1, keys[0])  # now none is past the band: the cached step with a fixed C and the miss filter
    cached.select(q3, w3)
    assert cached.step.tolist() == [3, 3, 3] and (cached.cache_pos >= 0).any()
    with pytest.raises(DsaIndexError, match="power of two"):
        group.grow_past(256, 3)
    with pytest.raises(DsaIndexError, match="negative"):
        group.grow_past(-1)


@pytest.mark.usefixtures("torch_encoding")
def test_load_encoded_history_selects_like_appending_it():
    """A history handed over already encoded (codes + FP8 pages) gives the same state and selection."""
    from dsaindex.errors import DsaIndexError
    from dsaindex.runtime.pq_batch import PQDecodeGroup

    appended, keys, _ = make_group([640, 384], topk=16, candidates=128)
    loaded = PQDecodeGroup(appended.layer, HostKeyStore(40, D), 2, 704, 16, candidates=128, prefilter=2,
                           cache_capacity=128, device=DEV)
    for slot, n in enumerate((640, 384)):
        host_rows = torch.tensor(appended.pages[slot])
        loaded.admit(slot)
        loaded.load_encoded(slot, appended.codes[slot, :n], appended.host.fp8[host_rows].reshape(n, D),
                            appended.host.scales[host_rows].reshape(n))
    assert torch.equal(loaded.codes, appended.codes) and loaded.encoded_host == appended.encoded_host
    q, w = queries(2)
    assert torch.equal(loaded.select(q, w)[0].sort(1).values, appended.select(q, w)[0].sort(1).values)
    with pytest.raises(DsaIndexError, match="must be empty"):
        loaded.load_encoded(0, appended.codes[0, :64], appended.host.fp8[0].reshape(64, D), appended.host.scales[0])


@pytest.mark.usefixtures("torch_encoding")
@pytest.mark.parametrize("use_triton", [True, False])
def test_length_policy_scores_short_requests_exactly(use_triton):
    """Requests up to ``exact_below`` keys are scored exactly from device pages; a request that grows past
    it returns its pages and is served by PQ; a mixed batch gives each request its own path."""
    from dsaindex.runtime.pq_batch import PQDecodeGroup

    keys = histories([900, 300, 500], seed=4)
    group = PQDecodeGroup(layer(), HostKeyStore(60, D), 3, 1600, 16, candidates=128, prefilter=2, cache_capacity=256,
                          device=DEV, use_triton=use_triton if not CUDA else None, exact_below=640)
    for slot, x in enumerate(keys):
        group.admit(slot)
        group.append(slot, x[:200])
        group.append(slot, x[200:])
    assert group.short_host == [False, True, True]
    assert len(group.exact_owned[0]) == 0 and len(group.exact_owned[1]) == 5 and len(group.exact_owned[2]) == 8
    q, w = queries(3, 7)
    q = q.to(torch.float8_e4m3fn).to(torch.bfloat16)  # the exact path scores FP8 queries, as the engines do
    picked, stats = group.select(q, w)
    want = exact_topk(keys, q, w, 16)
    for slot in (1, 2):  # exact: the exhaustive top-k, whatever PQ would have chosen
        assert set(picked[slot].tolist()) == set(want[slot].tolist()), slot
    # the long request went through PQ (its candidates counted), with PQ's recall on these toy keys
    assert overlap(picked[:1].cpu(), want[:1]) >= 0.75 and stats.candidates[0] > 0 and stats.totals()["candidates"] > 0
    more = histories([200], seed=5)[0]
    group.append(2, more)  # 700 keys: past the policy's length, served by PQ from now on
    assert group.short_host == [False, True, False] and group.exact_owned[2] == []
    assert len(group.exact_free) == 3 * 10 - 5
    keys[2] = torch.cat([keys[2], more])
    picked, _ = group.select(q, w)
    want = exact_topk(keys, q, w, 16)
    assert set(picked[1].tolist()) == set(want[1].tolist())
    assert overlap(picked[2:].cpu(), want[2:]) >= 0.75
    group.free(1)
    assert len(group.exact_free) == 30


@pytest.mark.usefixtures("torch_encoding")
def test_policy_per_batch_size_sends_large_batches_to_pq():
    """``pq_from``: with enough live requests, short requests at or past its length go through PQ (the
    step's stats count their candidates); a smaller batch of the same requests is scored exactly."""
    from dsaindex.runtime.pq_batch import PQDecodeGroup

    keys = histories([500, 400, 450], seed=6)
    group = PQDecodeGroup(layer(), HostKeyStore(60, D), 3, 1600, 16, candidates=128, prefilter=2, cache_capacity=256,
                          device=DEV, exact_below=640, pq_from={3: 448})
    for slot in range(2):
        group.admit(slot)
        group.append(slot, keys[slot])
    q, w = queries(3, 8)
    q = q.to(torch.float8_e4m3fn).to(torch.bfloat16)
    picked, stats = group.select(q, w)  # two live requests: the rule for 3 does not apply
    want = exact_topk(keys, q, w, 16)
    assert stats.totals()["candidates"] == 0
    assert all(set(picked[s].tolist()) == set(want[s].tolist()) for s in range(2))
    group.admit(2)
    group.append(2, keys[2])
    picked, stats = group.select(q, w)  # three, the longest past 448 keys: PQ for all of them
    assert (stats.candidates > 0).all()
    assert overlap(picked.cpu(), want) >= 0.75
    group.free(0)  # two live again: exact
    assert group.select(q, w)[1].totals()["candidates"] == 0


# ---- OPQ: a codec with a learned rotation ----------------------------------------------------------
@functools.cache
def opq_layer(seed=0):
    """An OPQ codec trained on the clustered keys: rotation first, then codebooks of the rotated keys."""
    from dsaindex.pq import PQSpec, rotate
    from dsaindex.train.codebooks import train_codebooks, train_rotation

    keys = clustered(4000, torch.Generator().manual_seed(seed))
    spec = PQSpec(dim=D, subspaces=32)
    rotation = train_rotation(keys, spec, "torch", rounds=2, iterations=3, seed=seed)
    return PQCodec(train_codebooks(rotate(keys, rotation), spec, "torch", 6), rotation=rotation)


def opq_group(lengths, topk, candidates, prefilter=2, use_triton=None, codec=None):
    from dsaindex.runtime.pq_batch import PQDecodeGroup

    pages = sum(-(-n // 64) for n in lengths) + 4
    group = PQDecodeGroup(codec or opq_layer(), HostKeyStore(pages, D), len(lengths), max(lengths) + 64, topk,
                          candidates=candidates, prefilter=prefilter, cache_capacity=max(candidates, 128), device=DEV,
                          use_triton=use_triton)
    keys = histories(lengths, seed=11)
    for slot, x in enumerate(keys):
        group.admit(slot)
        group.append(slot, x[:100])
        group.append(slot, x[100:])
    return group, keys


@pytest.mark.parametrize("use_triton", [None, False])
def test_opq_codec_every_key_a_candidate_is_the_exact_topk(use_triton):
    lengths = [300, 129, 10]
    group, keys = opq_group(lengths, topk=16, candidates=320, use_triton=use_triton)
    assert group.rotation is not None
    # the pages were encoded through the rotation, as the codec encodes them
    exact = group.host.fp8[torch.tensor(group.pages[0])].reshape(-1, D).view(torch.float8_e4m3fn).float()
    exact = exact * group.host.scales[torch.tensor(group.pages[0])].reshape(-1, 1)
    codes = group.codes[0, :256].cpu()
    assert (codes == group.layer.encode(exact)).float().mean() > 0.999
    q, w = queries(3, 12)
    picked, _ = group.select(q, w)
    assert overlap(picked.cpu(), exact_topk(keys, q, w, 16)) >= 0.98


@pytest.mark.usefixtures("torch_encoding")
def test_opq_codec_keeps_the_recall_with_few_candidates_and_paths_agree():
    """With C well below the history the coarse stages decide: they must score in the codes' space
    (queries rotated once per step), else the candidates are close to random."""
    from pq_decode_reference import PQDecodeIndexer

    lengths = [1000, 700]
    codec = opq_layer()
    group, keys = opq_group(lengths, topk=16, candidates=128, codec=codec)
    plain, _ = opq_group(lengths, topk=16, candidates=128, use_triton=False, codec=codec)
    assert (plain.codes == group.codes).float().mean() > 0.999
    q, w = queries(2, 13)
    picked, _ = group.select(q, w)
    assert overlap(picked.cpu(), exact_topk(keys, q, w, 16)) >= 0.9
    assert overlap(plain.select(q, w)[0], picked) >= 15 / 16
    ref = PQDecodeIndexer(codec, HostKeyStore(40, D), topk=16, candidates=128, cache_capacity=128)
    for slot, x in enumerate(keys):
        ref.admit(slot)
        ref.append(slot, x)
        want, _ = ref.select(slot, q[slot].float(), w[slot])
        assert len(set(picked[slot].tolist()) & set(want.tolist())) >= 15
    # the same codes scored with unrotated queries: the coarse stage loses the top keys
    unrotated, _ = opq_group(lengths, topk=16, candidates=128, use_triton=False, codec=codec)
    unrotated.rotation = None  # codes stay those of rotated keys
    assert overlap(unrotated.select(q, w)[0], exact_topk(keys, q, w, 16)) < 0.8


@pytest.mark.usefixtures("torch_encoding")
def test_the_group_takes_a_stage2_kernel_by_name_and_hands_it_to_stage2():
    """``stage2``: a name of :data:`~dsaindex.kernels.pq_stage2_cuda.STAGE2S`, refused otherwise with the names;
    the group's coarse stages ask for that kernel (an explicit CUDA kernel that cannot score these 8-head queries
    says why, where ``auto`` takes Triton)."""
    from dsaindex.errors import DsaIndexError
    from dsaindex.runtime.pq_batch import PQDecodeGroup

    with pytest.raises(DsaIndexError, match=r"stage2 'fp8' is not a stage-2 kernel.*auto, triton, cuda, int8"):
        PQDecodeGroup(layer(), HostKeyStore(8, D), 1, 256, 16, candidates=32, prefilter=2, cache_capacity=64,
                      device=DEV, stage2="fp8")
    keys = histories([300], seed=2)
    q, w = queries(1, seed=3)
    picked = {}
    for kernel in ("auto", "int8"):
        group = PQDecodeGroup(layer(), HostKeyStore(8, D), 1, 512, 16, candidates=32, prefilter=2, cache_capacity=64,
                              device=DEV, stage2=kernel)
        group.admit(0)
        group.append(0, keys[0])
        if kernel == "int8":
            with pytest.raises(ValueError, match="the CUDA stage 2 scores 64 heads of 128 dims .* got 8 heads"):
                group.select(q, w)
        else:
            picked[kernel] = group.select(q, w)[0]
    assert picked["auto"].shape == (1, 16)


@pytest.mark.usefixtures("torch_encoding")
def test_a_group_on_group_codes_keeps_them_beside_its_codes_and_selects_alike_on_both_paths():
    """stage1="groups": each committed page's group codes are written beside its codes, the index's bytes count
    them, and the kernels' step keeps what the torch step keeps and most of the exact top-k; an RQ layer is
    refused by name."""
    from dsaindex.errors import DsaIndexError
    from dsaindex.pq import group_codes
    from dsaindex.runtime.pq_batch import PQDecodeGroup

    lengths = [1500, 900]
    keys = histories(lengths, seed=5)
    q, w = queries(2, 7)
    picks = []
    for use_triton in (True, False):
        group = PQDecodeGroup(layer(), HostKeyStore(64, D), 2, 1600, 16, candidates=128, prefilter=2,
                              cache_capacity=128, device=DEV, use_triton=use_triton, stage1="groups")
        for slot, x in enumerate(keys):
            group.admit(slot)
            group.append(slot, x)
        for slot, n in enumerate(lengths):
            done = n // 64 * 64
            assert torch.equal(group.groups[0][slot, :done], group_codes(group.codes[slot, :done], group.group_of))
        assert group.gpu_bytes()["index"] == group.codes[0].numel() * 3 // 2
        picks.append(group.select(q, w)[0])
        assert overlap(picks[-1].cpu(), exact_topk(keys, q, w, 16)) >= 0.85, use_triton
    assert overlap(picks[0].cpu(), picks[1].cpu()) >= 15 / 16
    rq = PQCodec(codebooks=torch.randn(4, 256, D), residual=True)
    with pytest.raises(DsaIndexError, match="residual codes"):
        PQDecodeGroup(rq, HostKeyStore(8, D), 1, 256, 16, candidates=128, cache_capacity=128, device=DEV,
                      stage1="groups")
    with pytest.raises(DsaIndexError, match="not a stage-1 code"):
        PQDecodeGroup(layer(), HostKeyStore(8, D), 1, 256, 16, candidates=128, cache_capacity=128, device=DEV,
                      stage1="half")


@pytest.mark.usefixtures("torch_encoding")
def test_a_group_on_folds_keeps_most_of_the_exact_topk_on_both_paths():
    """stage1="folds": stage 1 scores the codes by 16 folded queries (the heads grouped by sign and direction),
    through the kernels' path (threshold and append) and the torch path (top C1); both keep most of the exact
    top-k and agree, the index holds the codes alone, and a geometry the folds cannot score is refused by name."""
    from dsaindex.errors import DsaIndexError
    from dsaindex.runtime.pq_batch import PQDecodeGroup

    lengths = [1500, 900]
    keys = histories(lengths, seed=6)
    q, w = queries(2, 8)
    picks = []
    for use_triton in (True, False):
        group = PQDecodeGroup(layer(), HostKeyStore(64, D), 2, 1600, 16, candidates=128, prefilter=2,
                              cache_capacity=128, device=DEV, use_triton=use_triton, stage1="folds")
        for slot, x in enumerate(keys):
            group.admit(slot)
            group.append(slot, x)
        assert group.gpu_bytes()["index"] == group.codes[0].numel()
        picks.append(group.select(q, w)[0])
        assert overlap(picks[-1].cpu(), exact_topk(keys, q, w, 16)) >= 0.85, use_triton
    assert overlap(picks[0].cpu(), picks[1].cpu()) >= 15 / 16
    small = PQCodec(codebooks=torch.randn(16, 256, 8))
    with pytest.raises(DsaIndexError, match="folds score 128-dim queries"):
        PQDecodeGroup(small, HostKeyStore(8, D), 1, 256, 16, candidates=128, cache_capacity=128, device=DEV,
                      stage1="folds")
