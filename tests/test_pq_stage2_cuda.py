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


def test_auto_takes_the_cuda_stage2_for_large_launches_of_the_serving_geometry_only(monkeypatch):
    """``stage2="auto"``: the CUDA kernel from CUDA_FROM_SLOTS candidate slots where it compiles and takes the
    codes, Triton below (a block's setup outweighs its scoring there) and elsewhere; an explicit ``"cuda"`` that
    cannot run is refused with the reason."""
    from dsaindex.kernels import pq_stage2_cuda as s2

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(s2, "compiles", lambda device: True)
    assert s2.resolve_stage2("auto", 64, 128, 32, 256, False, gpu, s2.CUDA_FROM_SLOTS) == "cuda"
    assert s2.resolve_stage2("auto", 64, 128, 32, 256, False, gpu, s2.CUDA_FROM_SLOTS - 1) == "triton"
    assert s2.resolve_stage2("auto", 32, 128, 32, 256, False, gpu, 1 << 30) == "triton"
    assert s2.resolve_stage2("triton", 64, 128, 32, 256, False, gpu, 1 << 30) == "triton"
    with pytest.raises(ValueError, match="stage2: got 'fast'"):
        s2.resolve_stage2("fast", 64, 128, 32, 256, False, gpu)
    with pytest.raises(ValueError, match="got 64 heads, 128 dims, 16 x 256"):
        s2.resolve_stage2("cuda", 64, 128, 16, 256, False, gpu)
    monkeypatch.setattr(s2, "compiles", lambda device: False)
    assert s2.resolve_stage2("auto", 64, 128, 32, 256, False, gpu, 1 << 30) == "triton"


def test_the_selector_keeps_candidates_by_bins_where_the_cuda_stage2_scores(monkeypatch):
    """Above the bins' batch limit ``top_c="auto"`` still takes bins where the CUDA stage 2 scores the step (its
    shared-memory histogram is cheaper than a top-C kernel), the top-C kernel where Triton does."""
    from dsaindex.kernels import pq_stage2_cuda as s2
    from dsaindex.pq import PQCodec
    from dsaindex.runtime.paged_select import PagedCacheSelector, bins_batch_limit

    monkeypatch.setattr(s2, "compiles", lambda device: True)
    codec = PQCodec(torch.randn(32, 256, 4))
    sel = PagedCacheSelector(codec, 64, topk=2048, candidates=4096, prefilter=4, device="cpu")
    over = max(bins_batch_limit(4 * 4096) + 1, s2.CUDA_FROM_SLOTS // (2 * 4 * 4096))  # and slots enough
    assert sel.stage2_kernel(over, 16384, 64) == "cuda" and sel.auto_top_c(over, 16384, 64) == "bins"
    assert sel.auto_top_c(over, 16384, 32) == "topk"  # 32 heads: Triton scores, the top-C kernel keeps
    triton = PagedCacheSelector(codec, 64, topk=2048, candidates=4096, prefilter=4, device="cpu", stage2="triton")
    assert triton.auto_top_c(over, 16384, 64) == "topk"
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
