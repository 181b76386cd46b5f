"""PQ training (faiss and torch trainers, score-aware metric) and the held-out recall evaluation."""

import pytest
import torch

from dsaindex.errors import DsaIndexError
from dsaindex.pq import PQSpec, decode, encode, quantization_mse, relative_mse
from dsaindex.score import indexer_scores
from dsaindex.train.codebooks import score_gradient_metric, train_codebooks
from dsaindex.train.recall import HeldOut, band_rows, evaluate_selection, prefix_band, split_sequences


def clustered_keys(n=4096, dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(40, dim, generator=g) * 2
    return centers[torch.randint(0, 40, (n,), generator=g)] + 0.3 * torch.randn(n, dim, generator=g)


def test_spec_refuses_bad_shapes():
    with pytest.raises(DsaIndexError, match="not divisible by 48"):
        PQSpec(dim=128, subspaces=48)
    with pytest.raises(DsaIndexError, match="8-bit"):
        PQSpec(dim=128, subspaces=32, centroids=512)
    assert PQSpec(128, 32).bytes_per_key == 32 and PQSpec(128, 16).sub_dim == 8


def test_trainer_refuses_bad_keys():
    spec = PQSpec(dim=64, subspaces=16, centroids=32)
    keys = clustered_keys()
    keys[17, 3] = float("nan")
    with pytest.raises(DsaIndexError, match="NaN or inf .*row 17"):
        train_codebooks(keys, spec, "torch")
    with pytest.raises(DsaIndexError, match="at least 128 needed"):
        train_codebooks(clustered_keys(n=100), spec, "torch")
    with pytest.raises(DsaIndexError, match="Unknown PQ trainer"):
        train_codebooks(clustered_keys(), spec, "sklearn")


def test_faiss_and_torch_trainers_agree():
    keys = clustered_keys()
    spec = PQSpec(dim=64, subspaces=16, centroids=32)
    errors = {t: relative_mse(keys, train_codebooks(keys, spec, t, iterations=15)) for t in ("faiss", "torch")}
    assert errors["faiss"] < 0.2 and errors["torch"] < 0.2
    assert abs(errors["faiss"] - errors["torch"]) / errors["faiss"] < 0.05, errors


def test_encode_decode():
    keys = clustered_keys(n=2048)
    spec = PQSpec(dim=64, subspaces=8, centroids=64)
    cb = train_codebooks(keys, spec, "torch", iterations=10)
    codes = encode(keys, cb)
    assert codes.dtype == torch.uint8 and codes.shape == (2048, 8)
    # a decoded key re-encodes to itself; decoding is the nearest-centroid reconstruction
    assert torch.equal(encode(decode(codes, cb), cb), codes)
    assert quantization_mse(keys, cb, codes) < float((keys - keys.mean(0)).pow(2).sum(-1).mean())
    # more centroids -> smaller error
    cb_small = train_codebooks(keys, PQSpec(dim=64, subspaces=8, centroids=8), "torch", iterations=10)
    assert relative_mse(keys, cb) < relative_mse(keys, cb_small)


def test_score_aware_metric_cuts_score_error():
    """When queries only read some directions, the score-aware metric spends resolution there."""
    g = torch.Generator().manual_seed(4)
    dim, heads = 32, 4
    keys = torch.randn(4096, dim, generator=g)
    queries = torch.randn(64, heads, dim, generator=g) * 0.05
    queries[..., ::4] *= 40  # queries lean on every 4th dim
    weights = torch.rand(64, heads, generator=g)
    spec = PQSpec(dim=dim, subspaces=8, centroids=16)
    metric = score_gradient_metric(queries, weights, [keys[i * 64 : (i + 1) * 64] for i in range(64)], spec)
    assert metric.shape == (8, 4, 4)
    assert bool((metric[:, 0, 0] > 10 * metric[:, 1, 1]).all())
    plain = train_codebooks(keys, spec, "torch", 15)
    aware = train_codebooks(keys, spec, "torch", 15, metric=metric)

    def score_error(cb, m):
        approx = decode(encode(keys, cb, m), cb)
        return float((indexer_scores(queries, approx, weights) - indexer_scores(queries, keys, weights)).abs().mean())

    assert score_error(aware, metric) < 0.8 * score_error(plain, None)
    assert relative_mse(keys, aware) > relative_mse(keys, plain)  # it trades key error for score error


def heldout(n_keys=600, n_queries=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return HeldOut(
        queries=torch.randn(n_queries, 4, 32, generator=g),
        head_weights=torch.rand(n_queries, 4, generator=g),
        visible=torch.full((n_queries,), n_keys),
        key_start=torch.zeros(n_queries, dtype=torch.long),
        keys=torch.randn(n_keys, 32, generator=g),
    )


def test_recall_evaluation_bounds():
    data = heldout()
    perfect = evaluate_selection(data, data.keys, ks=(16, 200), candidates=(64, 128))
    assert perfect["k16/direct"] == 1.0 and perfect["k16/rerank@64"] == 1.0 and perfect["k16/filter@64"] == 1.0
    assert perfect["k16/queries"] == 12 and perfect["k200/queries"] == 0  # 600 keys < 4 * 200
    noise = torch.randn_like(data.keys)
    bad = evaluate_selection(data, noise, ks=(16,), candidates=(64, 128))
    assert bad["k16/direct"] < 0.3
    assert bad["k16/rerank@64"] <= bad["k16/rerank@128"]  # more candidates, more recall
    assert 0 < bad["k16/fetch@64"] <= 1 and bad["k16/filter@64"] <= bad["k16/rerank@64"] + 1e-9
    near = evaluate_selection(data, data.keys + 0.05 * noise, ks=(16,), candidates=(64, 128))
    assert near["k16/rerank@64"] > 0.95 and near["k16/direct"] > bad["k16/direct"]
    # C at or above the prefix is exhaustive, not reported
    assert "k16/rerank@600" not in evaluate_selection(data, data.keys, ks=(16,), candidates=(600,))


def test_served_recall_counts_what_stage_1_drops():
    data = heldout()
    q = data.queries[:, :1]
    # heads that agree: the folded score ranks the top keys as the indexer does, stage 1 drops none of them
    data.queries, data.head_weights = q.expand(-1, 4, -1).contiguous(), torch.ones(12, 4)
    agree = evaluate_selection(data, data.keys, ks=(16,), candidates=(64,), prefilters=(4, 16))
    assert agree["k16/rerank@64"] == agree["k16/prefilter4@64"] == 1.0
    # heads in opposite pairs: the folded query is zero, so stage 1's 4 x 64 of 600 keys is blind and keeps
    # about 43% of the top-16; where 16 x 64 covers the prefix every key passes and nothing is lost
    data.queries = torch.cat([q, -q, q, -q], dim=1)
    blind = evaluate_selection(data, data.keys, ks=(16,), candidates=(64,), prefilters=(4, 16))
    assert blind["k16/rerank@64"] == 1.0 and blind["k16/prefilter16@64"] == 1.0
    assert 0.2 < blind["k16/prefilter4@64"] < 0.7
    assert blind["k16@0-16K/prefilter4@64"] == blind["k16/prefilter4@64"]
    assert not any("prefilter" in name for name in evaluate_selection(data, data.keys, ks=(16,), candidates=(64,),
                                                                      prefilters=()))
    # the fold scan's stage 1 groups q apart from -q, each through its ReLU: it ranks the keys by |q . k| as the
    # indexer does here (2 relu(q . k) + 2 relu(-q . k)), so at 1 x 64 it keeps every key of the top-16
    assert blind["k16/folds1@64"] == blind["k16/folds2@64"] == 1.0
    assert blind["k16@0-16K/folds1@64"] == 1.0
    # and where the keys it sees are noise it keeps no more than the linear fold's share of them
    noisy = evaluate_selection(data, torch.randn_like(data.keys), ks=(16,), candidates=(64,), prefilters=(1,),
                               fold_prefilters=(1,))
    assert noisy["k16/folds1@64"] <= noisy["k16/rerank@64"] + 1e-9 < 0.5
    assert not any("folds" in name for name in evaluate_selection(data, data.keys, ks=(16,), candidates=(64,),
                                                                  fold_prefilters=()))


def test_grouped_fold_scores_are_the_fold_scans_float_scores():
    """The float score of (e) is what the scan computes before its int8 rounding: against the reference of
    :mod:`dsaindex.kernels.pq_fold_cuda` on codes whose codebook holds the keys exactly (one key a code)."""
    from dsaindex.kernels.pq_fold_cuda import fold_operands, fold_scores_reference
    from dsaindex.train.recall import grouped_fold_scores

    g = torch.Generator().manual_seed(7)
    book = torch.randn(32, 256, 4, generator=g)
    codes = torch.randint(0, 256, (1, 300, 32), generator=g, dtype=torch.int32).to(torch.uint8)
    keys = book[torch.arange(32)[None, :], codes[0].long()].reshape(300, 128)
    queries, weights = torch.randn(3, 64, 128, generator=g), torch.randn(3, 64, generator=g)
    want = grouped_fold_scores(queries, weights, keys)
    q8, slopes, book8 = fold_operands(queries, weights, book)
    got = torch.stack([fold_scores_reference(codes, q8[i : i + 1], slopes[i : i + 1], book8)[0] for i in range(3)])
    for i in range(3):  # int8 rounding aside, the same ranking
        top = set(want[i].topk(30).indices.tolist())
        assert len(top & set(got[i].topk(30).indices.tolist())) >= 27
        assert torch.corrcoef(torch.stack([want[i], got[i].float()]))[0, 1] > 0.99


def test_recall_by_prefix_band():
    assert [prefix_band(n) for n in (0, 16383, 16384, 40000, 131072, 1048575, 1 << 21)] == [
        "0-16K", "0-16K", "16K-32K", "32K-64K", "128K-256K", "512K-1M", "1M-max"]
    data = heldout(n_keys=40000, n_queries=8)
    data.visible = torch.tensor([8000, 9000, 20000, 30000, 33000, 39000, 40000, 40000])
    noise = torch.randn_like(data.keys)
    out = evaluate_selection(data, data.keys + 0.3 * noise, ks=(16,), candidates=(64,))
    counts = {band: out[f"k16@{band}/queries"] for band in ("0-16K", "16K-32K", "32K-64K")}
    assert counts == {"0-16K": 2, "16K-32K": 2, "32K-64K": 4} and out["k16/queries"] == 8
    for name in ("direct", "rerank@64", "fetch@64"):  # the overall figure is the query-weighted band mean
        weighted = sum(out[f"k16@{band}/{name}"] * n for band, n in counts.items()) / 8
        assert abs(weighted - out[f"k16/{name}"]) < 1e-9
    rows = band_rows([("a", out), ("b", out)], 16)
    assert [name for name, _ in rows] == ["a, 0-16K", "b, 0-16K", "a, 16K-32K", "b, 16K-32K", "a, 32K-64K",
                                          "b, 32K-64K"]
    assert rows[4][1]["k16/direct"] == out["k16@32K-64K/direct"] and "k16/queries" in rows[4][1]


def test_split_sequences():
    assert split_sequences(10) == (list(range(8)), [8, 9])
    assert split_sequences(2) == ([0], [1])
    with pytest.raises(DsaIndexError, match="at least 2"):
        split_sequences(1)
    assert split_sequences(7)[1] == [6] and split_sequences(13)[1] == [10, 11, 12]


# ---- OPQ: a codec with a rotation ------------------------------------------------------------------
def random_rotation(dim, seed):
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


@pytest.mark.parametrize("with_metric", [False, True])
def test_rotated_codec_codes_rotated_keys_and_decodes_to_the_original_space(with_metric):
    from dsaindex.pq import PQCodec

    keys = clustered_keys(n=1500, dim=32, seed=5)
    spec = PQSpec(dim=32, subspaces=8, centroids=32)
    rot = random_rotation(32, 1)
    cb = train_codebooks(keys @ rot.t(), spec, "torch", iterations=6)
    metric = None
    if with_metric:
        a = torch.randn(8, 4, 4, generator=torch.Generator().manual_seed(2))
        metric = a @ a.transpose(1, 2) + 0.5 * torch.eye(4)
    codec = PQCodec(cb, metric, rot)
    codes = codec.encode(keys)
    # the codes are PQ of the rotated keys; decoding rotates the reconstruction back
    assert torch.equal(codes, encode(keys @ rot.t(), cb, metric))
    torch.testing.assert_close(codec.decode(codes), decode(codes, cb) @ rot, rtol=0, atol=1e-5)
    assert not torch.equal(codes, encode(keys, cb, metric))  # the rotation is not ignored
    # in the original space, the reconstruction is as close to the keys as it is in the rotated one
    err = float(((codec.decode(codes) - keys) ** 2).sum(-1).mean())
    assert err == pytest.approx(quantization_mse(keys @ rot.t(), cb, codes), rel=1e-4)
    assert codec.relative_mse(keys) == pytest.approx(relative_mse(keys @ rot.t(), cb), rel=1e-4)


def test_rotated_codec_scores_alike_in_either_space():
    """q . decode(k) in the original space equals rotate_queries(q) . C[codes] read from the codebooks."""
    from dsaindex.pq import PQCodec

    keys = clustered_keys(n=1200, dim=64, seed=6)
    rot = random_rotation(64, 3)
    codec = PQCodec(train_codebooks(keys @ rot.t(), PQSpec(dim=64, subspaces=16, centroids=32), "torch", 5),
                    rotation=rot)
    g = torch.Generator().manual_seed(7)
    q, w = torch.randn(5, 3, 64, generator=g), torch.rand(5, 3, generator=g)
    codes = codec.encode(keys)
    original = indexer_scores(q, codec.decode(codes), w)
    code_space = indexer_scores(codec.rotate_queries(q), decode(codes, codec.codebooks), w)
    torch.testing.assert_close(code_space, original, rtol=1e-4, atol=1e-4)
    assert codec.rotate_queries(q).shape == q.shape
    # unrotated queries against the codebooks give other scores: the rotation matters
    assert not torch.allclose(indexer_scores(q, decode(codes, codec.codebooks), w), original, atol=1e-2)
    plain = PQCodec(codec.codebooks)
    assert plain.rotate_queries(q) is q and plain.nbytes + 4 * 64 * 64 == codec.nbytes
    moved = codec.to("cpu")
    assert torch.equal(moved.rotation, rot) and torch.equal(moved.encode(keys), codes)


def test_rotated_codec_refuses_a_bad_rotation():
    from dsaindex.pq import PQCodec

    cb = torch.randn(8, 16, 4)
    with pytest.raises(DsaIndexError, match=r"shape \[32, 16\].*must be \[32, 32\]") as err:
        PQCodec(cb, rotation=torch.eye(32)[:, :16])
    assert "rotation" in err.value.fix
    with pytest.raises(DsaIndexError, match="not orthogonal"):
        PQCodec(cb, rotation=torch.eye(32) * 1.1)
    with pytest.raises(DsaIndexError, match="NaN"):
        PQCodec(cb, rotation=torch.full((32, 32), float("nan")))
    assert PQCodec(cb, rotation=random_rotation(32, 0).double()).rotation.dtype == torch.float32


def test_torch_residual_quantizer_codes_sums_of_codewords_and_beats_greedy_coding():
    """``train_rq_torch`` / ``beam_search``: keys built as sums of one codeword per codebook decode back from
    their codes; a beam keeps the search from a greedy dead end (never worse than a beam of 1); a search
    continued from a saved state equals one from scratch; more codebooks, smaller error."""
    from dsaindex.train.additive import TorchRQ, beam_search, train_rq_torch

    g = torch.Generator().manual_seed(3)
    books = torch.randn(3, 16, 24, generator=g) * torch.tensor([4.0, 2.0, 1.0])[:, None, None]
    truth = torch.randint(0, 16, (500, 3), generator=g)
    x = books[torch.arange(3), truth].sum(1)
    rq = TorchRQ(books, beam=8)
    torch.testing.assert_close(rq.decode(rq.encode(x)), x, atol=1e-4, rtol=0)
    noisy = x + 0.8 * torch.randn(x.shape, generator=g)
    err = {b: float(((TorchRQ(books, b).decode(TorchRQ(books, b).encode(noisy)) - noisy) ** 2).sum()) for b in (1, 8)}
    assert err[8] <= err[1]
    half = beam_search(noisy, books[:2], 4)
    whole, resumed = beam_search(noisy, books, 4), beam_search(noisy, books, 4, state=half)
    assert torch.equal(whole[0], resumed[0])
    keys = clustered_keys(3000, 32, seed=4)
    mse = []
    for m in (2, 4):
        q = train_rq_torch(keys[:2500], m, 16, iterations=6, beam=4)
        held = keys[2500:]
        mse.append(float(((q.decode(q.encode(held)) - held) ** 2).mean()))
        assert q.encode(held).shape == (500, m) and q.encode(held).dtype == torch.uint8
    assert mse[1] < mse[0]


def test_balanced_assignment_fills_every_group_exactly_and_keeps_the_cheapest_choices():
    """Each problem's items land in equal groups; where every item's cheapest group has room it gets it; a
    K not divisible by G is refused."""
    from dsaindex.pq import balanced_assign

    g = torch.Generator().manual_seed(3)
    cost = torch.rand(3, 64, 8, generator=g)
    assign = balanced_assign(cost)
    assert all(torch.equal(torch.bincount(a, minlength=8), torch.full((8,), 8)) for a in assign)
    free = torch.rand(2, 16, 4, generator=g)
    free[:, torch.arange(16), torch.arange(16) % 4] -= 2  # item i's cheapest: group i % 4, four each
    assert torch.equal(balanced_assign(free), (torch.arange(16) % 4).expand(2, 16))
    with pytest.raises(ValueError, match="equal groups"):
        balanced_assign(torch.rand(1, 10, 4))


def test_group_codes_decode_to_the_group_means_through_the_pair_codebooks():
    """Centroids in 16 groups of 16 per subspace (closer to their group mean than to the subspace's mean on
    clustered centroids); a key's group codes, looked up in the pair codebooks, give each subspace's group
    mean: stage 1 on group codes scores the folded query against those means."""
    from dsaindex.pq import GROUPS, group_centroids, group_codes, pair_codebooks

    g = torch.Generator().manual_seed(1)
    centers = torch.randn(4, GROUPS, 4, generator=g) * 3
    cb = centers.repeat_interleave(16, dim=1) + 0.1 * torch.randn(4, 256, 4, generator=g)
    assign, means = group_centroids(cb)
    assert all(torch.equal(torch.bincount(a, minlength=GROUPS), torch.full((GROUPS,), 16)) for a in assign)
    spread = ((cb - means.gather(1, assign[:, :, None].expand(4, 256, 4))) ** 2).sum()
    assert spread < 0.05 * ((cb - cb.mean(1, keepdim=True)) ** 2).sum()  # the planted groups found
    assert torch.equal(assign, group_centroids(cb)[0])  # deterministic
    codes = torch.randint(0, 256, (5, 7, 4), generator=g, dtype=torch.int32).to(torch.uint8)
    gc = group_codes(codes, assign)
    assert gc.shape == (5, 7, 2) and gc.dtype == torch.uint8
    books = pair_codebooks(means)
    assert books.shape == (2, 256, 8)
    decoded = books[torch.arange(2), gc.long()].reshape(5, 7, 16)
    want = means[torch.arange(4), assign[torch.arange(4), codes.long()]].reshape(5, 7, 16)
    assert torch.equal(decoded, want)
    with pytest.raises(ValueError, match="even M"):
        pair_codebooks(means[:3])
