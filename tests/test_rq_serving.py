"""Residual (RQ) codes served by the decode runtime: the core codec, the Triton coarse stages against their
torch references with whole-key codebooks, the decode group, and a bundle written by `train pq --quantizer
rq`, loaded and served."""

import functools
import json
import os

import pytest
import torch

pytest.importorskip("triton")

from dsaindex.errors import DsaIndexError  # noqa: E402
from dsaindex.kernels import pq_select  # noqa: E402
from dsaindex.pq import PQCodec  # noqa: E402
from dsaindex.runtime.host_store import HostKeyStore  # noqa: E402
from helpers import exact_fp8_topk as exact_topk  # noqa: E402
from helpers import run_cli  # noqa: E402
from helpers import selection_overlap as overlap  # noqa: E402

CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)
DEV = "cuda" if CUDA else "cpu"
D, H, M = 128, 8, 8
CENTERS = torch.randn(32, D, generator=torch.Generator().manual_seed(9)) * 2


def clustered(n, g):
    """Keys around a few centers, as real indexer keys are."""
    return CENTERS[torch.randint(0, CENTERS.shape[0], (n,), generator=g)] + 0.5 * torch.randn(n, D, generator=g)


def spd_metric(seed=3):
    """A full [1, D, D] score-gradient-like metric: symmetric positive definite and far from the identity."""
    a = torch.randn(D, D, generator=torch.Generator().manual_seed(seed))
    return (a @ a.t() / D + 0.1 * torch.eye(D))[None]


@functools.lru_cache
def trained_rq(score_aware=False):
    """(served residual codec, the trainer's AdditiveCodec, the training keys), M = 8 codebooks of 256."""
    from dsaindex.train.additive import train_additive

    keys = clustered(4000, torch.Generator().manual_seed(0))
    metric = spd_metric() if score_aware else None
    trained = train_additive(keys, "rq", M, 256, metric, trainer="torch", iterations=4)
    return trained.served(metric), trained, keys


def queries(b, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, H, D, generator=g).to(torch.bfloat16), torch.rand(b, H, generator=g) - 0.2


# ---- the core codec ---------------------------------------------------------------------------------
@pytest.mark.parametrize("score_aware", [False, True])
def test_served_codec_codes_like_the_trainer_and_reconstructs_better_than_pq(score_aware):
    from dsaindex.pq import PQSpec
    from dsaindex.train.codebooks import train_codebooks

    codec, trained, keys = trained_rq(score_aware)
    assert codec.residual and codec.dim == D and codec.subspaces == M and codec.codebooks.shape == (M, 256, D)
    assert codec.label == f"RQ{M}" + (" score-aware" if score_aware else "")
    held = clustered(500, torch.Generator().manual_seed(5))
    codes = codec.encode(held)
    assert codes.dtype == torch.uint8 and codes.shape == (500, M)
    # the served codec's beam search (in the metric's whitened space) finds the trainer's codes
    assert (codes == trained.encode(held).cpu()).float().mean() > 0.99
    torch.testing.assert_close(codec.decode(codes), trained.decode(codes), atol=1e-3, rtol=1e-3)
    if not score_aware:  # about PQ's error at equal bytes; each codebook refines what the earlier ones left
        pq = PQCodec(train_codebooks(keys, PQSpec(dim=D, subspaces=M), "torch", 4))
        assert codec.relative_mse(held) < 1.1 * pq.relative_mse(held) < 0.1
        seen = keys[:500]  # on training keys, past the held-out noise floor
        assert PQCodec(codec.codebooks[: M // 2], residual=True).relative_mse(seen) > 1.2 * codec.relative_mse(seen)
    else:  # the metric decides which codes win: without it the search picks other codes
        plain = PQCodec(codec.codebooks, residual=True)
        assert (plain.encode(held) != codes).any()


def test_codec_refuses_inconsistent_parts():
    codec, _, _ = trained_rq()
    with pytest.raises(DsaIndexError, match="rotation"):
        PQCodec(codec.codebooks, rotation=torch.eye(D), residual=True)
    with pytest.raises(DsaIndexError, match=r"metric has shape \[8, 128, 128\]"):
        PQCodec(codec.codebooks, torch.eye(D).expand(M, D, D), residual=True)
    with pytest.raises(DsaIndexError, match="no subspace split"):
        _ = codec.spec


# ---- the coarse stages' kernels with whole-key codebooks -----------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
def test_lookup_tables_of_whole_codewords_match_the_folded_reference(dtype):
    codec, _, _ = trained_rq()
    q, w = queries(3)
    books = codec.codebooks.to(DEV)
    want = pq_select.folded_lookup_tables(q.to(DEV), w.to(DEV), books)
    folded = torch.einsum("bh,bhd->bd", w.float(), q.float()).to(DEV)
    torch.testing.assert_close(want, torch.einsum("bd,mkd->bmk", folded, books))  # the whole query per codebook
    got, scale = pq_select.lookup_tables(q.to(DEV), w.to(DEV), books, dtype=dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        return
    back = got.float() * scale[:, None, None]
    if dtype == torch.int8:  # rounded to the nearest step of a per-request scale bounding every entry
        bound = folded.norm(dim=1) * books.norm(dim=2).amax()
        torch.testing.assert_close(scale, bound / 127, rtol=1e-4, atol=0)
        assert ((back - want).abs() <= 0.5 * scale[:, None, None] + 1e-4).all()
    else:
        torch.testing.assert_close(back, want, rtol=2e-3, atol=1e-3)


def _history(b, n, seed=4):
    codec, _, _ = trained_rq()
    g = torch.Generator().manual_seed(seed)
    codes = torch.stack([codec.encode(clustered(n, g)) for _ in range(b)]).to(DEV)
    return codec, codes


def test_stage_two_decodes_the_sum_of_codewords_like_its_reference():
    codec, codes = _history(2, 333)
    q, w = queries(2, 7)
    rows = torch.randint(0, 333, (2, 150), generator=torch.Generator().manual_seed(1))
    rows[1, 140:] = -1
    rows = rows.to(DEV)
    books = codec.codebooks.to(DEV)
    want = pq_select.pq_candidate_scores_reference(codes, rows, q.to(DEV), w.to(DEV), books)
    # the reference is the 64-head score of the decoded keys (up to their bf16 rounding)
    keys = codec.decode(codes[0, rows[0].clamp_min(0)].cpu())
    exact = (torch.relu(keys @ q[0].float().t()) * w[0]).sum(1)
    torch.testing.assert_close(want[0].cpu(), exact, rtol=2e-2, atol=2e-2 * exact.abs().max().item())
    got = pq_select.pq_candidate_scores(codes, rows.to(torch.int32), q.to(DEV), w.to(DEV), books)
    # the kernel rounds its float32 sums to bf16 as the reference does (the CPU interpreter truncates instead)
    scale = want[torch.isfinite(want)].abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * scale)
    assert torch.isinf(got[1, 140:]).all()
    # the binned form of the direct step: same scores, the bins and boundary of the torch twins
    counts = torch.tensor([150, 140], dtype=torch.int32, device=DEV)
    scratch = torch.zeros(2, pq_select.BIN_COUNT + 4, dtype=torch.int32, device=DEV)
    bound = pq_select.decoded_key_bound(books, residual=True)
    assert bound >= codec.decode(codes[0].cpu()).norm(dim=1).max().item()
    scores, bins, sel = pq_select.pq_candidate_bins(codes, rows.to(torch.int32), counts, q.to(DEV), w.to(DEV),
                                                    books, bound, 64, 96, scratch)
    torch.testing.assert_close(scores[0], got[0])
    live = torch.arange(150, device=DEV)[None, :] < counts[:, None]
    want_bins = pq_select.score_bins(scores, pq_select.score_bound(q.to(DEV), w.to(DEV), bound))
    assert torch.equal(bins[live], want_bins[live])
    assert torch.equal(sel, pq_select.boundary_of_bins(want_bins, live, 64, 96))
    assert (scratch == 0).all()


def test_stage_one_selects_by_the_folded_score_of_whole_codewords():
    codec, codes = _history(2, 700)
    q, w = queries(2, 8)
    lengths = torch.tensor([700, 390])
    books = codec.codebooks.to(DEV)
    ref_scores, ref_rows = pq_select.pq_linear_topc_reference(codes, lengths.to(DEV), q.to(DEV), w.to(DEV), books, 64)
    scores, rows = pq_select.pq_linear_topc(codes, lengths, q.to(DEV), w.to(DEV), books, 64)
    for b in range(2):
        assert len(set(rows[b].tolist()) & set(ref_rows[b].tolist())) >= 62
        assert (rows[b] < lengths[b]).all()
    torch.testing.assert_close(scores[:, :8], ref_scores[:, :8], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("score_aware", [False, True])
def test_encode_kernel_finds_the_beam_searchs_codes(score_aware):
    codec, _, _ = trained_rq(score_aware)
    keys = clustered(7 if DEV == "cpu" else 999, torch.Generator().manual_seed(21)).to(DEV)  # the interpreter is slow
    want = pq_select.rq_encode_reference(keys, codec.codebooks.to(DEV), None if codec.metric is None else
                                         codec.metric.to(DEV), codec.beam)
    # a grid of fewer programs than keys: each program codes several keys in turn
    got = pq_select.rq_encode(keys, codec.codebooks.to(DEV), None if codec.metric is None else codec.metric.to(DEV),
                              codec.beam, programs=3)
    assert got.dtype == torch.uint8 and got.shape == (keys.shape[0], M)
    assert (got == want).float().mean() > 0.96  # float ties aside
    error = lambda c: (codec.decode(c.cpu()) - keys.cpu()).pow(2).sum(1).mean()  # noqa: E731
    assert error(got) <= error(want) * 1.01
    if codec.metric is None:  # width 1: greedy, no better than the beam (Euclidean errors compared)
        assert error(pq_select.rq_encode(keys, codec.codebooks.to(DEV), beam=1)) >= error(want) * 0.999
    with pytest.raises(ValueError, match="keys"):
        pq_select.rq_encode(keys[:, :64], codec.codebooks.to(DEV))


# ---- the decode group ---------------------------------------------------------------------------------
def rq_group(lengths, topk, candidates, use_triton=None, score_aware=True, **kwargs):
    from dsaindex.runtime.pq_batch import PQDecodeGroup

    codec = trained_rq(score_aware)[0]
    pages = sum(-(-n // 64) for n in lengths) + 4
    group = PQDecodeGroup(codec, HostKeyStore(pages, D), len(lengths), max(lengths) + 64, topk, candidates=candidates,
                          prefilter=2, cache_capacity=max(candidates, 128), device=DEV, use_triton=use_triton, **kwargs)
    g = torch.Generator().manual_seed(11)
    keys = [clustered(n, g) for n in lengths]
    for slot, x in enumerate(keys):
        group.admit(slot)
        group.append(slot, x[:100])  # two appends: a partial page carried over
        group.append(slot, x[100:])
    return group, keys


def test_group_encodes_pages_with_the_codecs_search_and_every_key_a_candidate_is_exact():
    lengths = [300, 129, 10]
    group, keys = rq_group(lengths, topk=16, candidates=320)
    assert group.residual and group.codes.shape[2] == M
    exact = group.host.fp8[torch.tensor(group.pages[0])].reshape(-1, D).view(torch.float8_e4m3fn).float()
    exact = exact * group.host.scales[torch.tensor(group.pages[0])].reshape(-1, 1)
    assert torch.equal(group.codes[0, :256].cpu(), group.layer.encode(exact))
    q, w = queries(3, 12)
    picked, _ = group.select(q, w)
    assert overlap(picked.cpu(), exact_topk(keys, q, w, 16)) >= 0.98


def test_group_keeps_recall_with_few_candidates_and_the_kernel_and_torch_paths_agree():
    lengths = [1000, 700]
    group, keys = rq_group(lengths, topk=16, candidates=128)
    plain, _ = rq_group(lengths, topk=16, candidates=128, use_triton=False)
    assert torch.equal(plain.codes, group.codes)
    q, w = queries(2, 13)
    picked, _ = group.select(q, w)
    want = exact_topk(keys, q, w, 16)
    assert overlap(picked.cpu(), want) >= 0.9
    assert overlap(plain.select(q, w)[0].cpu(), picked.cpu()) >= 15 / 16
    # the direct step (candidates read straight from the host pages) selects what the cached step does
    # without its miss filter
    direct, _ = rq_group(lengths, topk=16, candidates=128, direct_upto=2)
    cached, _ = rq_group(lengths, topk=16, candidates=128, miss_filter=False)
    assert overlap(direct.select(q, w)[0].cpu(), cached.select(q, w)[0].cpu()) >= 15 / 16


# ---- a bundle: `train pq --quantizer rq`, loaded and served -----------------------------------------------
def test_train_pq_rq_writes_a_bundle_the_runtime_loads_and_serves(tmp_path, monkeypatch):
    from dsaindex.artifacts.bundle import read_bundle
    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.pipelines.capture.models import preset_config
    from dsaindex.runtime import load_bundle
    from dsaindex.runtime.pq_batch import PQDecodeGroup
    from dsaindex.train.recall import layer_keys

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch paths: the kernels have tests of their own
    store = tmp_path / "store"
    proc = run_cli("capture", str(store), "-m", "preset:tiny-v32", "-n", "3", "--seq-len", "640", "--chunk-len", "320",
                   "--no-progress")
    assert proc.returncode == 0, proc.stderr
    bundle = tmp_path / "rq"
    proc = run_cli("train", "pq", str(store), "--quantizer", "rq", "--subspaces", "4", "--trainer", "torch",
                   "--iterations", "3", "--max-train-keys", "1024", "--eval-queries", "4", "--candidates", "64",
                   "--beam", "8", "--device", "cpu", "--no-register", "--out", str(bundle), "--json")
    assert proc.returncode == 0, proc.stderr
    trained = json.loads(proc.stdout)
    manifest, arrays = read_bundle(bundle)
    for layer in manifest.layer_ids:
        params = manifest.layers[str(layer)].params
        assert params["quantizer"] == "rq" and params["beam"] == 8 and params["rotate"] is False
        assert arrays[layer]["codebooks"].shape == (4, 256, 128) and arrays[layer]["metric"].shape == (1, 128, 128)
    loaded = load_bundle(bundle, preset_config("tiny-v32"))
    codec = loaded.layers[manifest.layer_ids[0]]
    assert codec.residual and codec.metric is not None and codec.label == "RQ4 score-aware" and codec.beam == 8
    # `eval pq` reproduces the training's held-out figures from the bundle alone
    again = run_cli("eval", "pq", str(bundle), "--store", str(store), "--eval-queries", "4", "--candidates", "64",
                    "--json")
    assert again.returncode == 0, again.stderr
    mean = json.loads(again.stdout)["mean"]
    assert mean["k32/direct"] == pytest.approx(trained["mean"]["k32/direct"])
    assert mean["relative_mse"] == pytest.approx(trained["mean"]["relative_mse"], rel=1e-4) and mean["relative_mse"] < 0.5
    # the loaded codec serves a held-out sequence: every key a candidate, so the exact top-k
    captured = CaptureStore.open(store)
    keys = layer_keys(captured, 1, [2], captured.manifest.model.geometry.key_format)
    q = captured.as_float(captured.queries(1)[:2])
    w = torch.from_numpy(captured.head_weights(1)[:2]).float()
    group = PQDecodeGroup(loaded.layers[1], HostKeyStore(-(-keys.shape[0] // 64) * 2, 128), 2, keys.shape[0] + 64, 32,
                          candidates=keys.shape[0], cache_capacity=-(-keys.shape[0] // 4) * 4, device="cpu",
                          use_triton=False)
    for slot in range(2):
        group.admit(slot)
        group.append(slot, keys)
    picked, _ = group.select(q, w)
    want = exact_topk([keys, keys], q.to(torch.bfloat16), w, 32)
    assert overlap(picked, want) >= 31 / 32
    # LSQ stays a comparison: a clear refusal names the codes that can be served
    proc = run_cli("train", "pq", str(store), "--quantizer", "lsq", "--no-register", "--device", "cpu")
    assert proc.returncode != 0 and "--quantizer pq or rq" in proc.stderr and "Traceback" not in proc.stderr
    # a beam width is for residual codes: refused with PQ, before any training
    proc = run_cli("train", "pq", str(store), "--beam", "8", "--no-register", "--device", "cpu")
    assert proc.returncode != 0 and "--beam 8 applies to residual codes only" in proc.stderr
    assert "--quantizer rq" in proc.stderr and "Traceback" not in proc.stderr


def test_the_engines_paged_selector_refuses_residual_codes_at_load():
    from dsaindex.runtime.paged_select import PagedCacheSelector, check_paged_codes

    codec = trained_rq()[0]
    product = PQCodec(torch.randn(32, 256, 4))
    check_paged_codes({0: product, 1: object()})  # product codes and other kinds pass
    with pytest.raises(DsaIndexError, match="layers 3 hold residual codes") as err:
        check_paged_codes({0: product, 3: codec})
    assert "dsaindex serve" in err.value.fix
    with pytest.raises(DsaIndexError, match="residual codes"):
        PagedCacheSelector(codec, 4, 16, device="cpu")
