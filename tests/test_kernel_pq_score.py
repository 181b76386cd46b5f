"""Triton PQ coarse-score kernel vs its torch reference (CPU through TRITON_INTERPRET=1; full size on GPU)."""

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from dsaindex.kernels.pq_score import pq_coarse_scores  # noqa: E402  (the reference)

CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)


def inputs(n, heads, m, d=4, k=256, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, m * d, generator=g)
    w = torch.rand(heads, generator=g)
    codes = torch.randint(0, k, (n, m), generator=g, dtype=torch.int32).to(torch.uint8)
    cb = torch.randn(m, k, d, generator=g)
    return [t.to(device) for t in (q, w, codes, cb)]


@pytest.mark.parametrize("n,heads,m", [(1, 1, 16), (99, 3, 32), (989, 8, 32), (300, 5, 64)])
def test_kernel_matches_reference_interpreted(n, heads, m):
    from dsaindex.kernels.pq_score import pq_coarse_scores_triton

    device = "cuda" if CUDA else "cpu"
    q, w, codes, cb = inputs(n, heads, m, device=device)
    got = pq_coarse_scores_triton(q, w, codes, cb, block_n=64)
    torch.testing.assert_close(got, pq_coarse_scores(q, w, codes, cb), rtol=1e-4, atol=1e-3)


def test_wrapper_checks_inputs():
    from dsaindex.kernels.pq_score import pq_coarse_scores_triton

    q, w, codes, cb = inputs(10, 2, 16)
    with pytest.raises(AssertionError, match="uint8"):
        pq_coarse_scores_triton(q, w, codes.int(), cb)
    with pytest.raises(AssertionError, match="power of two"):
        pq_coarse_scores_triton(torch.randn(2, 48), w, torch.zeros(4, 12, dtype=torch.uint8), torch.randn(12, 256, 4))


@pytest.mark.gpu
def test_kernel_full_size_on_gpu():
    from dsaindex.kernels.pq_score import pq_coarse_scores_triton

    q, w, codes, cb = inputs(1 << 20, 64, 32, device="cuda")
    torch.testing.assert_close(pq_coarse_scores_triton(q, w, codes, cb), pq_coarse_scores(q, w, codes, cb),
                               rtol=1e-4, atol=1e-3)
