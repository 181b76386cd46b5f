"""Prefill selection for a chunk of queries (runtime/ivf_prefill.py) and its scoring kernel.

The batched candidate table and selection must equal the per-query ``CausalIVF`` reference; the
exhaustive chunk must equal the causal top-k of the exact scores. Kernels run on the CPU through
TRITON_INTERPRET=1 at small sizes, and at full size on a GPU.
"""

import os

import pytest
import torch

from dsaindex.kernels.chunk_score import chunk_scores_reference
from dsaindex.runtime.causal_ivf import CausalIVF
from dsaindex.runtime.ivf_prefill import candidate_table, exhaustive_chunk, select_chunk
from dsaindex.score import indexer_scores

D, H = 32, 4
KERNELS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def keys_queries(n, q, seed=0, d=D, h=H, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    centers = torch.nn.functional.normalize(torch.randn(20, d, generator=g), dim=1) * 3
    keys = centers[torch.randint(0, 20, (n,), generator=g)] + 0.3 * torch.randn(n, d, generator=g)
    queries = keys[torch.randint(0, n, (q, h), generator=g)] + 0.2 * torch.randn(q, h, d, generator=g)
    return keys.to(device), queries.to(device), torch.rand(q, h, generator=g).to(device)


def built_index(keys, device="cpu", key_storage="float32"):
    ivf = CausalIVF(keys.shape[1], window=128, cluster_size=16, refit_every=512, sinks=4, device=device,
                    key_storage=key_storage)
    ivf.append(keys)
    return ivf


# positions before the first seal, inside windows, at seal edges and after refits
POSITIONS = [0, 3, 50, 131, 132, 133, 400, 515, 516, 900, 1299, 1499]


def test_candidate_table_equals_the_per_query_reference():
    keys, queries, w = keys_queries(1500, len(POSITIONS))
    ivf = built_index(keys)
    for budget in (8, 100, 300):
        for i, p in enumerate(POSITIONS):
            v = ivf.version_for(p)
            route = None if v is None else indexer_scores(queries[i : i + 1], v.centers, w[i : i + 1])
            got = candidate_table(ivf, v, route, torch.tensor([p]), budget)[0]
            want = ivf.candidates(queries[i], w[i], p, budget)
            assert got[got >= 0].tolist() == want.tolist(), (budget, p)


@pytest.mark.parametrize("triton_path,key_storage", [(False, "float32"), (True, "float32"), (False, "fp8"),
                                                     (True, "fp8")])
def test_select_chunk_equals_per_query_selection(triton_path, key_storage):
    """The batched selection of a chunk against the per-query reference, on the float32 keys or (the
    runtime's form) the FP8 keys alone, whose float view is dequantized."""
    if triton_path and not KERNELS:
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    dev = DEV if triton_path else "cpu"
    keys, queries, w = keys_queries(1500, len(POSITIONS), device=dev)
    ivf = built_index(keys, device=dev, key_storage=key_storage)
    positions = torch.tensor(POSITIONS, device=dev)
    learned = {}

    def reps(v):  # any deterministic function of the version stands in for a learned encoder
        return learned.setdefault(id(v), v.centers * 1.5 + 0.1)

    for representatives in (None, reps):
        ivf.release_float()
        got = select_chunk(ivf, queries, w, positions, budget=200, topk=20, representatives=representatives,
                           use_triton=triton_path, query_block=5)
        assert got.shape == (len(POSITIONS), 20)
        if key_storage == "fp8":  # the Triton path reads the FP8 keys: no float copy of the prefix made
            assert (ivf._float is None) == triton_path
        for i, p in enumerate(POSITIONS):
            cand = ivf.candidates(queries[i], w[i], p, 200, representatives=representatives)
            exact = indexer_scores(queries[i : i + 1].float(), ivf.keys[cand].float(), w[i : i + 1])[0]
            row = got[i][got[i] >= 0]
            assert row.numel() == min(20, p + 1)
            assert set(row.tolist()) <= set(cand.tolist()), "a selected key outside the candidates"
            kth = exact.topk(row.numel()).values[-1]
            mine = indexer_scores(queries[i : i + 1].float(), ivf.keys[row].float(), w[i : i + 1])[0]
            tol = 0.05 if triton_path else 1e-5  # FP8 keys and bf16 queries in the kernel
            assert float(mine.min()) >= float(kth) - tol * (1 + abs(float(kth)))


def test_select_chunk_takes_queries_in_any_order():
    """A chunk's queries in ascending positions (each version's queries a run of rows) and the same queries
    shuffled select the same keys, row for row."""
    keys, queries, w = keys_queries(1500, len(POSITIONS))
    ivf = built_index(keys)
    positions = torch.tensor(POSITIONS)
    ordered = select_chunk(ivf, queries, w, positions, budget=200, topk=20, query_block=3)
    perm = torch.randperm(len(POSITIONS), generator=torch.Generator().manual_seed(3))
    shuffled = select_chunk(ivf, queries[perm], w[perm], positions[perm], budget=200, topk=20, query_block=3)
    for i, j in enumerate(perm.tolist()):
        assert set(shuffled[i].tolist()) == set(ordered[j].tolist())


def test_exhaustive_chunk_is_the_causal_topk():
    keys, queries, w = keys_queries(700, 6, seed=2)
    positions = torch.tensor([0, 5, 63, 64, 300, 699])
    got = exhaustive_chunk(keys, queries, w, positions, topk=64, query_block=4)
    scores = indexer_scores(queries, keys, w)
    for i, p in enumerate(positions.tolist()):
        want = scores[i, : p + 1].topk(min(64, p + 1)).indices
        assert set(got[i][got[i] >= 0].tolist()) == set(want.tolist())
        assert int((got[i] >= 0).sum()) == min(64, p + 1)


@pytest.mark.skipif(not KERNELS, reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("n,q,h,d", [(37, 3, 3, 32), (300, 6, 8, 64), (1000, 5, 64, 128)])
def test_chunk_score_kernel_matches_reference(n, q, h, d):
    from dsaindex.kernels.chunk_score import chunk_scores

    keys, queries, w = keys_queries(n, q, seed=n, d=d, h=h, device=DEV)
    keys, queries = keys.to(torch.bfloat16), queries.to(torch.bfloat16)
    lengths = torch.randint(0, n + 1, (q,), generator=torch.Generator().manual_seed(1)).to(DEV)
    for kw in ({"lengths": lengths}, {"lengths": lengths, "n_out": n // 2},
               {"rows": torch.randint(-1, n, (q, 77), generator=torch.Generator().manual_seed(2)).to(DEV)}):
        got = chunk_scores(keys, queries, w, **kw)
        want = chunk_scores_reference(keys, queries, w, **kw)
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        finite = ~torch.isinf(want)
        torch.testing.assert_close(got[finite], want[finite], rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
def test_prefill_selection_at_full_size_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    keys, queries, w = keys_queries(40_000, 256, seed=4, d=128, h=64, device="cuda")
    ivf = CausalIVF(128, device="cuda")
    ivf.append(keys)
    positions = torch.arange(40_000 - 256, 40_000, device="cuda")
    fast = select_chunk(ivf, queries, w, positions, 4096, 512, use_triton=True)
    slow = select_chunk(ivf, queries, w, positions, 4096, 512, use_triton=False)

    def overlap(x, y):
        return sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(x, y, strict=True)) / x.numel()

    # the kernels against their spec on the same keys: FP8 keys of the same candidates, bf16 queries
    from dsaindex.kernels.chunk_score import chunk_scores
    from dsaindex.kernels.fp8_score import fp8_gather_scores_reference
    from dsaindex.kernels.ivf_select import ivf_candidates_reference

    keys8, scales8 = ivf.keys_fp8
    spec = torch.empty_like(fast)
    for version in {id(ivf.version_for(int(p))): ivf.version_for(int(p)) for p in positions}.values():
        rows = torch.tensor([i for i, p in enumerate(positions.tolist()) if ivf.version_for(p) is version])
        reps = version.centers.to(torch.bfloat16)
        route = chunk_scores(reps, queries[rows], w[rows], lengths=torch.full((rows.numel(),), reps.shape[0]))
        cand = ivf_candidates_reference(route, positions[rows], version.starts, version.order, version.upto,
                                        ivf.sinks, 4096)
        exact = fp8_gather_scores_reference(keys8, scales8, cand, queries[rows], w[rows])
        spec[rows] = cand.gather(1, exact.topk(512, dim=1).indices)
    assert overlap(fast, spec) > 0.99  # same routing: bf16 products vs float32 differ only at near-ties
    assert overlap(fast, slow) > 0.95  # FP8 keys (the engines' format) against float32 keys
    ex = exhaustive_chunk(keys, queries, w, positions, 512, use_triton=True)
    ref = exhaustive_chunk(keys, queries, w, positions, 512, use_triton=False)
    assert sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ex, ref, strict=True)) / ex.numel() > 0.99
