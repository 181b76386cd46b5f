"""The prefill IVF candidate kernel against its torch spec (CPU through ``TRITON_INTERPRET=1``)."""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)
DEV = "cuda" if CUDA else "cpu"


def clusters(sizes, upto, seed=0):
    """starts [C + 1] and order [M]: a random grouping of keys [sinks=4, upto) into clusters of ``sizes``."""
    g = torch.Generator().manual_seed(seed)
    assert sum(sizes) == upto - 4
    order = torch.randperm(upto - 4, generator=g) + 4
    starts = torch.zeros(len(sizes) + 1, dtype=torch.long)
    starts[1:] = torch.tensor(sizes).cumsum(0)
    return starts, order


def same_sets(got, want):
    assert got.shape == want.shape
    for a, b in zip(got.tolist(), want.tolist(), strict=True):
        assert sorted(a) == sorted(b)


@pytest.mark.parametrize("budget", [40, 300, 1000])
def test_ivf_candidates_match_the_spec(budget):
    from dsaindex.kernels.ivf_select import ivf_candidates, ivf_candidates_reference

    g = torch.Generator().manual_seed(1)
    sizes = torch.randint(5, 40, (37,), generator=g).tolist()
    upto = 4 + sum(sizes)
    starts, order = clusters(sizes, upto)
    # queries inside the open window (some whose reserved slots alone overflow a small budget), one early
    positions = torch.tensor([upto, upto + 3, upto + 60, upto + 500, 2])
    scores = torch.randn(5, len(sizes), generator=g)
    args = (positions.to(DEV), starts.to(DEV), order.to(DEV), upto, 4, budget)
    want = ivf_candidates_reference(scores.to(DEV), *args)
    got = ivf_candidates(scores.to(DEV), *args)
    assert got.dtype == torch.int32
    same_sets(got.long().cpu(), want.cpu())
    # the reserved slots come first, in the same order
    reserved = (want >= 0) & ((want < 4) | (want >= upto))
    assert torch.equal(got.long()[reserved], want[reserved])


def test_ivf_candidates_take_every_cluster_when_the_budget_exceeds_them():
    from dsaindex.kernels.ivf_select import ivf_candidates, ivf_candidates_reference

    sizes = [10, 20, 30]
    upto = 64
    starts, order = clusters(sizes, upto)
    positions = torch.tensor([70, 100])
    scores = torch.tensor([[0.5, -1.0, 2.0], [1.0, 1.0, 1.0]])  # the second query: all tied
    args = (positions.to(DEV), starts.to(DEV), order.to(DEV), upto, 4, 200)
    got = ivf_candidates(scores.to(DEV), *args).long().cpu()
    same_sets(got, ivf_candidates_reference(scores.to(DEV), *args).cpu())
    assert (got[0] >= 0).sum() == 4 + 7 + 60 and (got[1] >= 0).sum() == 4 + 37 + 60
    # ties at the threshold: a whole number of tied clusters plus one cut, totalling the budget
    got = ivf_candidates(scores.to(DEV), positions.to(DEV), starts.to(DEV), order.to(DEV), upto, 4, 80).long().cpu()
    assert (got[1] >= 0).sum() == 80 and len(set(got[1].tolist())) == 80


def test_ivf_candidates_before_any_cluster():
    from dsaindex.kernels.ivf_select import ivf_candidates, ivf_candidates_reference

    positions = torch.tensor([0, 3, 10, 700]).to(DEV)
    want = ivf_candidates_reference(None, positions, None, None, 0, 4, 64)
    got = ivf_candidates(None, positions, None, None, 0, 4, 64)
    assert torch.equal(got.long(), want)
