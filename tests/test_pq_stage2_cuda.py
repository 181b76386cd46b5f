"""Stage 2 as a CUDA kernel (:mod:`dsaindex.kernels.pq_stage2_cuda`), its own source run on the CPU by the
warp-synchronous emulator (``tests/cuda_emulator.py``: the tensor-core fragments exchanged by the PTX ISA's
layouts), against the torch reference of stage 2 (:func:`pq_candidate_scores_reference`) and the score bins'
(:func:`score_bins`, :func:`score_bound`). The GPU test in ``test_kernel_select.py`` compares the compiled kernel
with the Triton stage 2."""

import numpy as np
import pytest
import torch
from cuda_emulator import compiler, run_stage2

from dsaindex.kernels.pq_select import (
    BIN_COUNT,
    decoded_key_bound,
    paged_codes_reference,
    pq_candidate_scores_reference,
    score_bins,
    score_bound,
)
from dsaindex.kernels.pq_stage2_cuda import NBINS, takes

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler to run the emulated kernel")

B, N, M, K, H, D = 3, 200, 32, 256, 64, 128


def _bits(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _inputs(seed: int, paged: bool):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, K, (B, N, M), generator=g, dtype=torch.int32).to(torch.uint8)
    codebook = (torch.randn(M, K, D // M, generator=g) * 0.4).to(torch.bfloat16)
    queries = torch.randn(B, H, D, generator=g).to(torch.bfloat16)
    weights = torch.randn(B, H, generator=g) * 0.1  # negative weights too: scores of both signs
    r = 600
    rows = torch.randint(0, N, (B, r), generator=g, dtype=torch.int32)
    rows[torch.rand(B, r, generator=g) < 0.1] = -1  # empty slots inside the filled ones
    counts = torch.tensor([r, 333, 0], dtype=torch.int32)  # full, a partial warp step, nothing
    table = None
    stored = codes
    if paged:  # the codes kept per physical 64-row page, behind a shuffled page table
        pages = -(-N // 64)
        padded = torch.zeros(B, pages * 64, M, dtype=torch.uint8)
        padded[:, :N] = codes
        perm = torch.randperm(B * pages, generator=g)
        stored = torch.empty(B * pages, 64, M, dtype=torch.uint8)
        stored[perm] = padded.reshape(B * pages, 64, M)
        table = perm.reshape(B, pages).to(torch.int32)
    return stored, table, codes, rows, counts, queries, weights, codebook


def test_it_takes_the_serving_geometry_only():
    assert takes(64, 128, 32, 256, False) is None
    assert "residual" in takes(64, 128, 32, 256, True)
    assert "32 heads" in takes(32, 128, 32, 256, False)
    assert NBINS == BIN_COUNT


@pytest.mark.parametrize("paged", [False, True])
def test_scores_bins_and_histogram_match_the_reference(paged):
    """Scores within float rounding of the reference's (keys decoded from the codebook through the permuted
    fragment order, every head's ReLU and weight); -inf on empty slots and past each count; every scored key's
    bin that of its score, and the histogram added to, not overwritten."""
    stored, table, codes, rows, counts, queries, weights, codebook = _inputs(11 + paged, paged)
    kb = decoded_key_bound(codebook)
    before = np.random.default_rng(3).integers(0, 5, (B, NBINS + 4)).astype(np.int32)
    scores, bins, scratch = run_stage2(stored.numpy(), rows.numpy(), counts.numpy(), _bits(queries), weights.numpy(),
                                       _bits(codebook), kb, page_table=None if table is None else table.numpy(),
                                       scratch=before.copy())
    view = codes if table is None else paged_codes_reference(stored, table)
    want = pq_candidate_scores_reference(view, rows, queries, weights, codebook)
    filled = torch.arange(rows.shape[1])[None, :] < counts[:, None]
    live = filled & (rows >= 0)
    got = torch.from_numpy(scores)
    scale = float(want[live].abs().max())
    torch.testing.assert_close(got[live], want[live], rtol=1e-4, atol=1e-5 * scale)
    assert torch.isneginf(got[~live]).all()  # empty slots and every slot past the count
    got_bins = torch.from_numpy(bins)
    assert (got_bins[~live] == -1).all()  # no bin written where no key was scored
    ref_bins = score_bins(got, score_bound(queries, weights, kb))
    assert (got_bins[live] - ref_bins[live]).abs().max() <= 1  # the kernel's own bound: float rounding apart
    assert (got_bins[live] == ref_bins[live]).float().mean() > 0.99
    assert (got_bins[live] < NBINS // 2).any() and (got_bins[live] >= NBINS // 2).any()  # both signs binned
    for i in range(B):
        counted = np.bincount(bins[i][live[i].numpy()], minlength=NBINS)
        assert np.array_equal(scratch[i, :NBINS] - before[i, :NBINS], counted), i
        assert np.array_equal(scratch[i, NBINS:], before[i, NBINS:]), i  # the append counters untouched


def test_a_scores_only_launch_writes_no_bins():
    stored, _, codes, rows, counts, queries, weights, codebook = _inputs(5, False)
    scores, bins, scratch = run_stage2(stored.numpy(), rows.numpy(), counts.numpy(), _bits(queries), weights.numpy(),
                                       _bits(codebook), 1.0, per_block=512, want_bins=False)
    want = pq_candidate_scores_reference(codes, rows, queries, weights, codebook)
    got = torch.from_numpy(scores)
    live = (torch.arange(rows.shape[1])[None, :] < counts[:, None]) & (rows >= 0)
    torch.testing.assert_close(got[live], want[live], rtol=1e-4, atol=1e-5 * float(want[live].abs().max()))
    assert (bins == -1).all() and not scratch.any()


def test_auto_takes_the_int8_cuda_stage2_for_large_launches_of_the_serving_geometry_only(monkeypatch):
    """``stage2="auto"``: the CUDA kernel on 8-bit operands from CUDA_FROM_SLOTS candidate slots where it compiles
    and takes the codes (its bf16 form where only that compiles), Triton below (a block's setup outweighs its
    scoring there) and elsewhere; an explicit ``"cuda"`` that cannot run is refused with the reason."""
    from dsaindex.kernels import pq_stage2_cuda as s2

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(s2, "compiles", lambda device, int8=False: True)
    assert s2.resolve_stage2("auto", 64, 128, 32, 256, False, gpu, s2.CUDA_FROM_SLOTS) == "int8"
    assert s2.resolve_stage2("auto", 64, 128, 32, 256, False, gpu) == "int8"
    assert s2.resolve_stage2("auto", 64, 128, 32, 256, True, gpu, 1 << 30) == "triton"  # residual codes
    monkeypatch.setattr(s2, "compiles", lambda device, int8=False: not int8)  # the int8 build failed here
    assert s2.resolve_stage2("auto", 64, 128, 32, 256, False, gpu, s2.CUDA_FROM_SLOTS) == "cuda"
    assert s2.resolve_stage2("auto", 64, 128, 32, 256, False, gpu, s2.CUDA_FROM_SLOTS - 1) == "triton"
    assert s2.resolve_stage2("auto", 32, 128, 32, 256, False, gpu, 1 << 30) == "triton"
    assert s2.resolve_stage2("triton", 64, 128, 32, 256, False, gpu, 1 << 30) == "triton"
    with pytest.raises(ValueError, match="stage2: got 'fast'"):
        s2.resolve_stage2("fast", 64, 128, 32, 256, False, gpu)
    with pytest.raises(ValueError, match="got 64 heads, 128 dims, 16 x 256"):
        s2.resolve_stage2("cuda", 64, 128, 16, 256, False, gpu)
    monkeypatch.setattr(s2, "compiles", lambda device, int8=False: False)
    assert s2.resolve_stage2("auto", 64, 128, 32, 256, False, gpu, 1 << 30) == "triton"
    # by name, at any size
    monkeypatch.setattr(s2, "available", lambda: True)
    assert s2.resolve_stage2("int8", 64, 128, 32, 256, False, gpu, 1) == "int8"
    with pytest.raises(ValueError, match="residual"):
        s2.resolve_stage2("int8", 64, 128, 32, 256, True, gpu)
    monkeypatch.setattr(s2, "available", lambda: False)
    with pytest.raises(ValueError, match="the int8 CUDA stage 2 needs a CUDA device"):
        s2.resolve_stage2("int8", 64, 128, 32, 256, False, gpu)


def test_the_selector_keeps_candidates_by_bins_where_the_cuda_stage2_scores(monkeypatch):
    """Above the bins' batch limit ``top_c="auto"`` still takes bins where the CUDA stage 2 scores the step (its
    shared-memory histogram is cheaper than a top-C kernel), the top-C kernel where Triton does."""
    from dsaindex.kernels import pq_stage2_cuda as s2
    from dsaindex.pq import PQCodec
    from dsaindex.runtime.paged_select import PagedCacheSelector, bins_batch_limit

    monkeypatch.setattr(s2, "compiles", lambda device, int8=False: True)
    codec = PQCodec(torch.randn(32, 256, 4))
    sel = PagedCacheSelector(codec, 64, topk=2048, candidates=4096, prefilter=4, device="cpu")
    over = max(bins_batch_limit(4 * 4096) + 1, s2.CUDA_FROM_SLOTS // (2 * 4 * 4096))  # and slots enough
    assert sel.stage2_kernel(over, 16384, 64) == "int8" and sel.auto_top_c(over, 16384, 64) == "bins"
    assert sel.auto_top_c(over, 16384, 32) == "topk"  # 32 heads: Triton scores, the top-C kernel keeps
    grown = PagedCacheSelector(codec, 1 << 14, topk=2048, candidates=4096, prefilter=4, device="cpu",
                               grow_band=131072)
    assert grown.stage2_kernel(1, 1 << 14, 64) == "int8"  # one request of 1M keys, C grown: 128K slots
    assert grown.stage2_kernel(1, 1 << 12, 64) == "int8"  # 256K keys: C grown 2 x, 64K slots
    assert grown.stage2_kernel(1, 1 << 11, 64) == "triton"  # 128K keys: C fixed, 32K slots
    triton = PagedCacheSelector(codec, 64, topk=2048, candidates=4096, prefilter=4, device="cpu", stage2="triton")
    assert triton.auto_top_c(over, 16384, 64) == "topk"
    import dsaindex.runtime.paged_select as ps

    int8 = PagedCacheSelector(codec, 64, topk=2048, candidates=4096, prefilter=4, device="cpu", stage2="int8")
    monkeypatch.setattr(ps, "resolve_stage2", lambda kind, *a: kind)  # as on a GPU where it compiles
    assert int8.stage2_kernel(over, 16384, 64) == "int8" and int8.auto_top_c(over, 16384, 64) == "bins"
    from dsaindex.errors import DsaIndexError

    with pytest.raises(DsaIndexError, match="stage2 'fast'"):
        PagedCacheSelector(codec, 64, topk=2048, device="cpu", stage2="fast")


def test_a_block_scores_about_half_of_its_share_of_the_stage1_slots():
    """Blocks sized to the launch: about two a multiprocessor over the half of the slots a stage 1 fills,
    1,024 to 8,192 candidates (shapes only)."""
    from dsaindex.kernels.pq_stage2_cuda import block_size

    assert block_size(32, 32768, 132) == 2048  # a fixed C at 32 x 1M: 24K filled of 32K slots a request
    assert block_size(32, 131072, 132) == 8192  # grown 4 x
    assert block_size(8, 131072, 132) == 2048
    assert block_size(1, 32768, 132) == 1024 and block_size(64, 131072, 132) == 8192


def _int8_reference(codes: torch.Tensor, rows: torch.Tensor, q8: torch.Tensor, w8: torch.Tensor,
                    book8: torch.Tensor) -> torch.Tensor:
    """``sum_h w8_h relu(q8_h . k8)`` of each candidate (-inf where none), from the operands, written apart from
    the module's :func:`int8_scores_reference` (which makes its operands itself): the products exact in int64."""
    b, r = rows.shape
    keys = torch.stack([book8[s][codes[:, :, s].long()] for s in range(M)], dim=2).reshape(b, -1, D).long()
    picked = keys.gather(1, rows.clamp_min(0).long()[:, :, None].expand(b, r, D))  # [B, R, D]
    dots = torch.einsum("brd,bhd->brh", picked, q8.long()).double()
    out = (dots.clamp_min(0) * w8.double()[:, None, :]).sum(-1).float()
    return torch.where(rows >= 0, out, torch.full_like(out, float("-inf")))


@pytest.mark.parametrize("paged", [False, True])
def test_the_int8_form_scores_its_integer_operands_exactly(paged):
    """The int8 kernel (``stage2="int8"``): the s8 ``mma.m16n8k32`` fragments exchanged by their PTX layouts, the
    queries in their natural order, one-word codewords; its scores are the integer operands' to float rounding,
    every scored key's bin that of its score on the bound passed in, the histogram added to."""
    from dsaindex.kernels.pq_stage2_cuda import int8_operands

    stored, table, codes, rows, counts, queries, weights, codebook = _inputs(21 + paged, paged)
    kb = decoded_key_bound(codebook)
    q8, w8, book8, bounds = int8_operands(queries, weights, codebook, kb)
    before = np.random.default_rng(4).integers(0, 5, (B, NBINS + 4)).astype(np.int32)
    scores, bins, scratch = run_stage2(stored.numpy(), rows.numpy(), counts.numpy(), q8.numpy(), w8.numpy(),
                                       book8.numpy(), kb, page_table=None if table is None else table.numpy(),
                                       scratch=before.copy(), bounds=bounds.numpy())
    view = codes if table is None else paged_codes_reference(stored, table)
    want = _int8_reference(view, rows, q8, w8, book8)
    live = (torch.arange(rows.shape[1])[None, :] < counts[:, None]) & (rows >= 0)
    got = torch.from_numpy(scores)
    torch.testing.assert_close(got[live], want[live], rtol=1e-5, atol=1e-6 * float(want[live].abs().max()))
    assert torch.isneginf(got[~live]).all()
    got_bins = torch.from_numpy(bins)
    assert (got_bins[~live] == -1).all()
    ref_bins = score_bins(got, bounds)
    assert (got_bins[live] - ref_bins[live]).abs().max() <= 1
    assert (got_bins[live] == ref_bins[live]).float().mean() > 0.99
    for i in range(B):
        counted = np.bincount(bins[i][live[i].numpy()], minlength=NBINS)
        assert np.array_equal(scratch[i, :NBINS] - before[i, :NBINS], counted), i


def test_the_16_head_form_scores_all_rows_of_a_request_exactly():
    """``#define MTILES 1`` (16 heads: ``tools/fold_scan_parts.py``'s stage 1 of 16 folded queries, weights +-1):
    the same kernel over every row of each request, in order, scores its integer operands exactly."""
    from dsaindex.kernels.pq_stage2_cuda import int8_operands_reference

    stored, table, codes, _, _, _, _, codebook = _inputs(31, True)
    view = paged_codes_reference(stored, table)
    n = view.shape[1]
    g = torch.Generator().manual_seed(5)
    queries = torch.randn(B, 16, D, generator=g).to(torch.bfloat16)
    signs = torch.where(torch.rand(B, 16, generator=g) < 0.5, -1.0, 1.0)
    kb = decoded_key_bound(codebook)
    q8, w8, book8, bounds = int8_operands_reference(queries, signs, codebook, kb)
    counts = torch.tensor([n - 64 * i for i in range(B)], dtype=torch.int32)
    rows = torch.arange(n, dtype=torch.int32).repeat(B, 1).contiguous()
    scores, _, _ = run_stage2(stored.numpy(), rows.numpy(), counts.numpy(), q8.numpy(), w8.numpy(), book8.numpy(),
                              kb, page_table=table.numpy(), want_bins=False, bounds=bounds.numpy(),
                              defines="#define MTILES 1\n")
    want = _int8_reference(view, rows, q8, w8, book8)
    live = torch.arange(n)[None, :] < counts[:, None]
    got = torch.from_numpy(scores)
    torch.testing.assert_close(got[live], want[live], rtol=1e-5, atol=1e-6 * float(want[live].abs().max()))
    assert torch.isneginf(got[~live]).all()
    assert (want[live] < 0).any() and (want[live] > 0).any()  # both signs' groups decide somewhere


def test_the_int8_operands_keep_the_bf16_scores_and_their_top_candidates():
    """The 8-bit operands move a score by a small share of the request's score range, and the top quarter of
    the candidates by score is nearly the bf16 one's, also where the codebook's subspaces differ 30x in scale
    (the per-subspace scales folded into the queries keep the small subspaces' bits)."""
    from dsaindex.kernels.pq_stage2_cuda import int8_operands

    g = torch.Generator().manual_seed(7)
    n, r = 4096, 2048
    codes = torch.randint(0, K, (2, n, M), generator=g, dtype=torch.int32).to(torch.uint8)
    spread = torch.logspace(0, 1.5, M)[torch.randperm(M, generator=g)]  # subspace scales 1 .. 31.6
    codebook = (torch.randn(M, K, D // M, generator=g) * 0.05 * spread[:, None, None]).to(torch.bfloat16)
    queries = torch.randn(2, H, D, generator=g).to(torch.bfloat16)
    weights = torch.randn(2, H, generator=g).abs() * 0.1
    rows = torch.stack([torch.randperm(n, generator=g)[:r] for _ in range(2)]).to(torch.int32)
    q8, w8, book8, _ = int8_operands(queries, weights, codebook, 1.0)
    exact = pq_candidate_scores_reference(codes, rows, queries, weights, codebook)
    rounded = _int8_reference(codes, rows, q8, w8, book8)
    from dsaindex.kernels.pq_stage2_cuda import int8_scores_reference

    torch.testing.assert_close(int8_scores_reference(codes, rows, queries, weights, codebook), rounded)
    moved = (rounded - exact).abs() / (exact.amax(1) - exact.amin(1))[:, None]  # here 0.2% mean, 1.1% at most
    assert moved.mean() < 0.003 and moved.max() < 0.02
    for c in (r // 4, r // 16):  # random scores crowd at any boundary: 99.2-99.6% kept here
        for i in range(2):
            top_exact = set(exact[i].topk(c).indices.tolist())
            top_rounded = set(rounded[i].topk(c).indices.tolist())
            assert len(top_exact & top_rounded) / c > 0.98


def test_a_cpu_group_asked_for_int8_scores_with_its_arithmetic():
    """Without the kernels (``use_triton`` off), ``stage2="int8"`` scores stage 2 with the int8 kernel's own
    arithmetic (what a CPU run of ``bench frontier --stage2 int8`` measures), the others with the bf16 reference:
    the two groups' coarse scores differ by the 8-bit rounding only, and the int8 ones are the reference's
    exactly. A code the int8 form cannot take is refused."""
    from dsaindex.kernels.pq_stage2_cuda import int8_scores_reference
    from dsaindex.pq import PQCodec
    from dsaindex.runtime.host_store import HostKeyStore
    from dsaindex.runtime.pq_batch import PQDecodeGroup

    g = torch.Generator().manual_seed(3)
    codec = PQCodec(torch.randn(M, K, D // M, generator=g) * 0.3)
    keys = torch.randn(700, D, generator=g)
    q, w = torch.randn(1, H, D, generator=g), torch.rand(1, H, generator=g) * 0.1
    coarse = {}
    for kernel in ("auto", "int8"):
        group = PQDecodeGroup(codec, HostKeyStore(16, D, pin=False), 1, 1024, 64, candidates=128, prefilter=2,
                              cache_capacity=256, device="cpu", use_triton=False, stage2=kernel)
        group.admit(0)
        group.append(0, keys)
        longest = group.encoded_host[0]
        rows1, _, coarse[kernel] = group._coarse_reference(q.to(torch.bfloat16), w, longest)
        codes = group.codes[:, :longest]
    live = rows1 >= 0
    assert torch.equal(coarse["int8"], int8_scores_reference(codes, rows1, q.to(torch.bfloat16), w,
                                                             group.codebooks_bf16))
    moved = (coarse["int8"] - coarse["auto"])[live].abs() / (coarse["auto"][live].max() - coarse["auto"][live].min())
    assert 0 < float(moved.max()) < 0.02
    pq16 = PQDecodeGroup(PQCodec(torch.randn(16, K, D // 16)), HostKeyStore(16, D, pin=False), 1, 1024, 64,
                         candidates=128, prefilter=2, cache_capacity=256, device="cpu", use_triton=False, stage2="int8")
    pq16.admit(0)
    pq16.append(0, keys)
    with pytest.raises(ValueError, match="product codes of 32 x 256 centroids"):
        pq16.select(q, w)
