"""Threshold top-k of score rows against the exhaustive top-k (CPU through TRITON_INTERPRET=1, or the GPU)."""

import os

import pytest
import torch

pytest.importorskip("triton")

from dsaindex.kernels.topk import rows_topk, rows_topk_reference  # noqa: E402

CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)
DEV = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("n,lengths,k", [(5000, [5000, 100, 3001], 64), (20000, [20000, 19999], 512),
                                         (700, [1, 700], 16)])
def test_rows_topk_selects_the_exhaustive_top_k(n, lengths, k):
    g = torch.Generator().manual_seed(n)
    logits = torch.randn(len(lengths), n, generator=g).to(DEV)
    lengths = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    values, columns, counts = rows_topk(logits, lengths, k, block_n=256, iters=2, return_counts=True)
    want_values, want_columns = rows_topk_reference(logits, lengths, k)
    assert values.shape == (len(lengths), k) and columns.dtype == torch.int64
    for b in range(len(lengths)):
        got = set(columns[b].tolist()) - {-1}
        assert got == set(want_columns[b].tolist()) - {-1}, b
        assert int(counts[b]) >= min(k, int(lengths[b]))  # the threshold let enough through
    torch.testing.assert_close(values[:, : want_values.shape[1]], want_values)


def test_rows_topk_checks_its_inputs():
    with pytest.raises(ValueError, match="logits"):
        rows_topk(torch.zeros(2, 10, dtype=torch.float64, device=DEV), torch.tensor([10, 10]), 4)
    with pytest.raises(ValueError, match="lengths"):
        rows_topk(torch.zeros(2, 10, device=DEV), torch.tensor([10]), 4)
