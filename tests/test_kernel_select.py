"""Fused-selection kernels (exact FP8, PQ stage 1 and 2, page encoding) against their torch references.

On the CPU through TRITON_INTERPRET=1 at small sizes; the ``gpu`` tests repeat them at full size.
"""

import math
import os

import pytest
import torch

triton = pytest.importorskip("triton")

from dsaindex.kernels.fp8_score import fp8_scores_reference, fp8_topk_reference  # noqa: E402
from dsaindex.kernels.pq_select import (  # noqa: E402
    pq_candidate_scores_reference,
    pq_linear_scores_reference,
)
from dsaindex.quant import fp8_quantize  # noqa: E402

CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)
DEV = "cuda" if CUDA else "cpu"
FP8_DOT_ATOL = 2e-3  # FP8 x FP8 tensor-core products on the H200 against float32 products, per unit of the largest score


def fp8_inputs(b, n, heads, d=128, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, n, d, generator=g) * torch.rand(b, n, 1, generator=g) * 3
    codes, scales = fp8_quantize(keys.reshape(b * n, d))
    q = torch.randn(b, heads, d, generator=g).to(torch.bfloat16)
    w = torch.randn(b, heads, generator=g)
    return (codes.view(torch.uint8).reshape(b, n, d).to(device), scales.reshape(b, n).to(device),
            q.to(device), w.to(device))


def pq_inputs(b, n, heads, m=32, d=4, k=256, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, k, (b, n, m), generator=g, dtype=torch.int32).to(torch.uint8)
    cb = torch.randn(m, k, d, generator=g)
    q = torch.randn(b, heads, m * d, generator=g).to(torch.bfloat16)
    w = torch.rand(b, heads, generator=g)
    return codes.to(device), cb.to(device), q.to(device), w.to(device)


def gather_rows_spec(host_fp8, host_scales, page_table, src_pos, dst_slot, pool_fp8, pool_scales, page_size):
    """Row by row: pool[b, dst] = host[page_table[b, pos // page], pos % page] for every pos >= 0."""
    for b in range(src_pos.shape[0]):
        for pos, dst in zip(src_pos[b].tolist(), dst_slot[b].tolist(), strict=True):
            if pos < 0:
                continue
            page, slot = int(page_table[b, pos // page_size]), pos % page_size
            pool_fp8[b, dst] = host_fp8[page, slot]
            pool_scales[b, dst] = host_scales[page, slot]


def same_selection(got_rows, want_rows, got_scores, want_scores):
    """Equal sets of rows, up to ties: the same scores (in any order) and at most one row swapped."""
    torch.testing.assert_close(got_scores.sort(1).values, want_scores.sort(1).values, rtol=1e-3, atol=1e-3)
    for g, w in zip(got_rows.tolist(), want_rows.tolist(), strict=True):
        assert len(set(g) ^ set(w)) <= 2, (sorted(set(g) - set(w)), sorted(set(w) - set(g)))


@pytest.mark.parametrize("b,n,heads,d,k,query_fp8", [(1, 37, 3, 32, 8, False), (3, 700, 5, 64, 40, False),
                                                     (2, 1500, 64, 128, 64, False), (3, 700, 5, 64, 40, True),
                                                     (2, 1500, 64, 128, 64, True)])
def test_fp8_topk_matches_reference(b, n, heads, d, k, query_fp8):
    from dsaindex.kernels.fp8_score import fp8_topk

    keys, scales, q, w = fp8_inputs(b, n, heads, d)
    lengths = torch.tensor([n - 7 * i for i in range(b)], dtype=torch.int32, device=DEV)
    want_s, want_r = fp8_topk_reference(keys, scales, lengths, q, w, k, query_fp8=query_fp8)
    got_s, got_r, counts = fp8_topk(keys, scales, lengths, q, w, k, capacity=256, target=96, return_counts=True,
                                    query_fp8=query_fp8)
    same_selection(got_r, want_r, got_s, want_s)
    assert (got_r < lengths[:, None]).all(), "a row past its request's end was selected"
    assert (counts >= torch.clamp(lengths, max=96)).all()


def test_fp8_topk_threshold_path_is_exercised():
    """With far more keys than the buffer, the sampled threshold (not the take-all path) decides."""
    from dsaindex.kernels.fp8_score import fp8_topk

    keys, scales, q, w = fp8_inputs(2, 2000, 4, 32)
    lengths = torch.tensor([2000, 1500], dtype=torch.int32, device=DEV)
    got_s, got_r, counts = fp8_topk(keys, scales, lengths, q, w, 16, capacity=256, target=64, return_counts=True)
    assert (counts < lengths).all() and (counts >= 16).all() and (counts <= 256).all(), counts
    want_s, want_r = fp8_topk_reference(keys, scales, lengths, q, w, 16)
    same_selection(got_r, want_r, got_s, want_s)


def test_fp8_gather_scores_match_reference():
    from dsaindex.kernels.fp8_score import fp8_gather_scores

    keys, scales, q, w = fp8_inputs(3, 99, 7, 64)
    rows = torch.randint(-1, 99, (3, 45), dtype=torch.int32, device=DEV)
    want = fp8_scores_reference(keys, scales, q, w).gather(1, rows.clamp_min(0).long())
    want = want.masked_fill(rows < 0, float("-inf"))
    torch.testing.assert_close(fp8_gather_scores(keys, scales, rows, q, w), want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("b,n,m,c,table", [(1, 50, 16, 8, torch.float32), (3, 1111, 32, 64, torch.float32),
                                           (3, 1111, 32, 64, torch.float16), (3, 1111, 32, 64, torch.int8),
                                           (2, 700, 16, 64, torch.int8)])
def test_pq_linear_topc_matches_reference(b, n, m, c, table):
    from dsaindex.kernels.pq_select import pq_linear_topc

    codes, cb, q, w = pq_inputs(b, n, 8, m=m, d=128 // m)
    lengths = torch.tensor([n - 11 * i for i in range(b)], dtype=torch.int32, device=DEV)
    scores = pq_linear_scores_reference(codes, q, w, cb)
    scores = scores.masked_fill(torch.arange(n, device=DEV)[None, :] >= lengths[:, None], float("-inf"))
    want_s, want_r = scores.topk(min(c, n), dim=1)
    got_s, got_r, counts = pq_linear_topc(codes, lengths, q, w, cb, c, capacity=4 * c, return_counts=True,
                                          table_dtype=table)
    if table != torch.float32:  # scaled tables: the scores agree to their rounding, and the selection, a
        # pre-filter, keeps every row clearly inside the top c (its best half)
        tol = 3e-3 if table == torch.float16 else 2e-2
        torch.testing.assert_close(got_s, want_s, rtol=tol, atol=tol * float(want_s.abs().max()))
        for g, w_ in zip(got_r.tolist(), want_r.tolist(), strict=True):
            assert set(w_[: len(w_) // 2]) - {-1} <= set(g)
    else:
        same_selection(got_r, want_r, got_s, want_s)
    assert (counts >= torch.clamp(lengths, max=c)).all() and (counts <= 4 * c).all() | (lengths <= 4 * c).all()
    _, every, filled = pq_linear_topc(codes, lengths, q, w, cb, c, capacity=4 * c, keep_all=True,
                                      return_counts=True)
    for kept, n_kept, best in zip(every.tolist(), filled.tolist(), want_r.tolist(), strict=True):
        assert set(best) - {-1} <= set(kept[:n_kept]), "keep_all lost one of the top c"


@pytest.mark.parametrize("table,m", [(torch.float32, 32), (torch.int8, 32), (torch.int8, 16)])
def test_pq_linear_topc_load_variants_select_the_same_keys(table, m):
    """Where the stage-1 kernel reads its codes from (past L1, evicted first or cached) and its launch
    shape change its speed only: every variant
    keeps the same keys with the same scores, paged or not (keys of 32 codes, and of 16: the CUDA scan's
    form for 16 code bytes)."""
    from dsaindex.kernels.pq_select import paged_codes_reference, pq_linear_topc, stage1_launch

    b, n, c = 2, 1280, 48
    # a decode step's launch by its size: wide tiles where few keys leave the default's programs short of a wave
    assert stage1_launch(b, n) == dict(block_n=512, iters=1, num_warps=8) == stage1_launch(8, 1 << 20)
    assert stage1_launch(16, 1 << 20) == {} == stage1_launch(9, 1 << 20)
    codes, cb, q, w = pq_inputs(b, n, 8, m=m, d=128 // m, seed=5)
    lengths = torch.tensor([n, n - 333], dtype=torch.int32, device=DEV)
    pages = n // 64
    perm = torch.randperm(b * pages, generator=torch.Generator().manual_seed(2)).to(DEV)
    store = torch.empty(b * pages, 64, m, dtype=torch.uint8, device=DEV)
    store[perm] = codes.reshape(b * pages, 64, m)
    page_table = perm.view(b, pages).to(torch.int32)
    assert torch.equal(paged_codes_reference(store, page_table), codes)

    def kept(**kw):  # per request: the kept rows in order, and their scores
        s, r, k = pq_linear_topc(codes if "page_table" not in kw else store, lengths, q, w, cb, c, capacity=3 * c,
                                 keep_all=True, return_counts=True, table_dtype=table, **kw)
        order = [r[i, : k[i]].argsort() for i in range(b)]
        return [(r[i, : k[i]][o].tolist(), s[i, : k[i]][o]) for i, o in enumerate(order)]

    want = kept(stream=0, block_n=128, iters=8)
    assert all(len(rows) >= c for rows, _ in want)
    variants = [dict(), dict(stream=1), dict(stream=2), dict(block_n=64, iters=2, num_warps=2),
                dict(page_table=page_table, **stage1_launch(b, n)), dict(page_table=page_table, stream=0)]
    if CUDA and table == torch.int8:  # the selecting pass as the CUDA kernel (tables in shared memory)
        variants += [dict(scan="cuda"), dict(page_table=page_table, scan="cuda")]
    for kw in variants:
        for (rows, scores), (want_rows, want_scores) in zip(kept(**kw), want, strict=True):
            assert rows == want_rows, kw
            if table == torch.int8:  # integer sums: any order gives the same
                assert torch.equal(scores, want_scores), kw
            else:  # float32 sums in another order (another tile shape or chunk)
                torch.testing.assert_close(scores, want_scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("b,n,m,c,block_n,iters,paged", [(3, 1300, 32, 64, 32, 2, False),
                                                          (2, 1500, 16, 100, 64, 1, True)])
def test_int8_stage1_threshold_is_the_sample_rank_of_integer_scores(b, n, m, c, block_n, iters, paged):
    """With int8 tables the sampling pass reads its threshold off a histogram of integer scores (several
    programs per request, the last one to finish deciding): it must equal the rank-th largest sample, the
    rule of ``thresholds_from_samples``, so the buffer holds exactly the keys at or above it."""
    from dsaindex.kernels.pq_select import lookup_tables, paged_codes_reference, pq_linear_topc
    from dsaindex.kernels.select import sample_stride, thresholds_from_samples

    codes, cb, q, w = pq_inputs(b, n, 8, m=m, d=128 // m, seed=3)
    lengths = torch.tensor([n - 700 * i for i in range(b - 1)] + [2 * c], dtype=torch.int32, device=DEV)
    table = None
    if paged:  # codes per physical page, pages in shuffled order
        pages = n // 64
        perm = torch.randperm(b * pages, generator=torch.Generator().manual_seed(1)).to(DEV)
        store = torch.empty(b * pages, 64, m, dtype=torch.uint8, device=DEV)
        store[perm] = codes[:, : pages * 64].reshape(b * pages, 64, m)
        table = perm.view(b, pages).to(torch.int32)
        codes, n = paged_codes_reference(store, table), pages * 64
        lengths = lengths.clamp_max(n)
    lut, _ = lookup_tables(q, w, cb, dtype=torch.int8)
    exact = lut.long().unsqueeze(1).expand(b, n, m, lut.shape[2]).gather(3, codes.long().unsqueeze(-1)).sum((2, 3))
    stride = sample_stride(n)
    samples = exact[:, ::stride].float()
    samples = samples.masked_fill(torch.arange(samples.shape[1], device=DEV)[None, :] * stride >= lengths[:, None],
                                  float("-inf"))
    capacity = 2 * c
    thr = thresholds_from_samples(samples, lengths, stride, c, capacity)
    assert thr[-1] == float("-inf") and torch.isfinite(thr[:-1]).all()
    source = store if paged else codes
    scores, rows, counts = pq_linear_topc(source, lengths, q, w, cb, c, capacity=capacity, keep_all=True,
                                          return_counts=True, table_dtype=torch.int8, block_n=block_n, iters=iters,
                                          page_table=table)
    for i in range(b):
        live = exact[i, : lengths[i]]
        want = set((live >= thr[i]).nonzero().flatten().tolist())
        assert int(counts[i]) == len(want), (i, int(counts[i]), len(want))
        kept = rows[i, : min(int(counts[i]), capacity)].tolist()
        assert set(kept) == want if len(want) <= capacity else set(kept) <= want
        assert torch.equal(scores[i, : len(kept)], exact[i, kept].float())
    again = pq_linear_topc(source, lengths, q, w, cb, c, capacity=capacity, keep_all=True, return_counts=True,
                           table_dtype=torch.int8, block_n=block_n, iters=iters, page_table=table)[2]
    assert torch.equal(again, counts)  # the step's scratch (histogram, counters) starts from zero every time


@pytest.mark.parametrize("m,heads", [(32, 64), (16, 5)])
def test_scaled_lookup_tables_round_the_folded_tables(m, heads):
    """float16 / int8 tables times their scale are the float32 tables up to the type's rounding; an int8
    table stays inside its range and uses most of it."""
    from dsaindex.kernels.pq_select import folded_lookup_tables, lookup_tables

    codes, cb, q, w = pq_inputs(3, 8, heads, m=m, d=128 // m)
    want = folded_lookup_tables(q, w, cb)
    f32, none = lookup_tables(q, w, cb)
    assert none is None
    torch.testing.assert_close(f32, want, rtol=1e-4, atol=1e-4)
    half, scale = lookup_tables(q, w, cb, dtype=torch.float16)
    torch.testing.assert_close(half.float() * scale[:, None, None], want, rtol=2e-3, atol=2e-3 * float(want.abs().max()))
    i8, scale = lookup_tables(q, w, cb, dtype=torch.int8)
    # the bound is loose by at most the cosine of the best-aligned centroid: most of the range is used
    assert i8.dtype == torch.int8 and (i8.abs().amax(dim=(1, 2)) > 60).all() and (i8.abs() <= 127).all()
    err = (i8.float() * scale[:, None, None] - want).abs()
    assert (err <= scale[:, None, None] * 0.5 + 1e-4 * want.abs().max()).all()
    with pytest.raises(ValueError, match="lookup table dtype"):
        lookup_tables(q, w, cb, dtype=torch.bfloat16)


@pytest.mark.parametrize("m", [32, 16])  # 4 dims per subspace: 8-byte centroid loads; 8 dims: 2-byte loads
def test_pq_candidate_scores_match_reference(m):
    from dsaindex.kernels.pq_select import pq_candidate_scores

    codes, cb, q, w = pq_inputs(2, 300, 6, m=m, d=128 // m)
    rows = torch.randint(-1, 300, (2, 77), dtype=torch.int32, device=DEV)
    torch.testing.assert_close(pq_candidate_scores(codes, rows, q, w, cb),
                               pq_candidate_scores_reference(codes, rows, q, w, cb), rtol=1e-3, atol=1e-3)


def test_pq_candidate_scores_skip_rows_past_the_count():
    from dsaindex.kernels.pq_select import pq_candidate_scores

    codes, cb, q, w = pq_inputs(2, 300, 6)
    rows = torch.randint(0, 300, (2, 150), dtype=torch.int32, device=DEV)
    rows[0, 70:] = -1  # a stage-1 buffer: filled from the front, count 70
    counts = torch.tensor([70, 150], dtype=torch.int32, device=DEV)
    for block_n, iters in ((64, 1), (32, 3)):  # 3 tiles per program: the last program's run past the rows
        got = pq_candidate_scores(codes, rows, q, w, cb, counts=counts, block_n=block_n, iters=iters)
        torch.testing.assert_close(got, pq_candidate_scores_reference(codes, rows, q, w, cb), rtol=1e-3, atol=1e-3)
        assert torch.isinf(got[0, 70:]).all() and torch.isfinite(got[1]).all()


def test_pq_candidate_reference_is_the_decoded_exact_score():
    """Stage 2's spec is the exact score of the decoded keys (bf16 rounding aside)."""
    from dsaindex.pq import decode
    from dsaindex.score import indexer_scores

    codes, cb, q, w = pq_inputs(1, 64, 4, device="cpu")
    rows = torch.arange(64, dtype=torch.int32).unsqueeze(0)
    decoded = decode(codes[0], cb.to(torch.bfloat16).float())
    want = indexer_scores(q.float(), decoded, w)[0]
    torch.testing.assert_close(pq_candidate_scores_reference(codes, rows, q, w, cb)[0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("with_metric", [False, True])
def test_pq_encode_matches_reference(with_metric):
    from dsaindex.kernels.pq_select import pq_encode, pq_encode_reference

    g = torch.Generator().manual_seed(3)
    cb = torch.randn(32, 256, 4, generator=g)
    keys = torch.randn(130, 128, generator=g)
    metric = None
    if with_metric:
        a = torch.randn(32, 4, 4, generator=g, dtype=torch.float64)
        metric = a @ a.transpose(1, 2) + 0.1 * torch.eye(4, dtype=torch.float64)
    want = pq_encode_reference(keys, cb, metric)
    got = pq_encode(keys.to(DEV), cb.to(DEV), None if metric is None else metric.to(DEV)).cpu()
    assert (got == want).float().mean() > 0.999  # float ties aside


@pytest.mark.gpu
def test_full_size_on_gpu():
    from dsaindex.kernels.fp8_score import fp8_topk
    from dsaindex.kernels.pq_select import pq_linear_topc

    if not CUDA:
        pytest.skip("needs a GPU")
    keys, scales, q, w = fp8_inputs(4, 1 << 18, 64)
    lengths = torch.tensor([1 << 18, 200_000, 70_000, 5000], dtype=torch.int32, device=DEV)
    want_s, want_r = fp8_topk_reference(keys, scales, lengths, q, w, 512)
    got_s, got_r = fp8_topk(keys, scales, lengths, q, w, 512)
    same_selection(got_r, want_r, got_s, want_s)
    codes, cb, q, w = pq_inputs(4, 1 << 20, 64)
    lengths = torch.tensor([1 << 20, 900_000, 300_000, 9000], dtype=torch.int32, device=DEV)
    scores = pq_linear_scores_reference(codes, q, w, cb)
    scores = scores.masked_fill(torch.arange(1 << 20, device=DEV)[None, :] >= lengths[:, None], float("-inf"))
    want_s, want_r = scores.topk(8192, dim=1)
    got_s, got_r = pq_linear_topc(codes, lengths, q, w, cb, 8192)
    same_selection(got_r, want_r, got_s, want_s)
    for table in (torch.float16, torch.int8):  # a pre-filter: the best quarter is kept whole, most of the rest
        got_s, got_r = pq_linear_topc(codes, lengths, q, w, cb, 8192, table_dtype=table)
        for g, w_ in zip(got_r.tolist(), want_r.tolist(), strict=True):
            assert set(w_[:2048]) - {-1} <= set(g)
            assert len(set(g) & set(w_)) >= 0.95 * len(set(w_) - {-1})


@pytest.mark.parametrize("kernel", [True, False])
def test_host_row_gather_matches_reference(kernel):
    from dsaindex.kernels.select import gather_host_rows, gather_host_rows_reference

    g = torch.Generator().manual_seed(4)
    host_fp8 = torch.randint(0, 120, (9, 64, 32), generator=g, dtype=torch.int32).to(torch.uint8)
    host_scales = torch.rand(9, 64, generator=g)
    table = torch.tensor([[3, 1, 7], [0, 8, 2]], dtype=torch.int32)
    src = torch.tensor([[0, 70, -1, 191, 5], [-1, 128, 64, 3, 127]])
    dst = torch.tensor([[4, 0, 9, 2, 1], [9, 3, 1, 0, 2]])
    want = torch.zeros(2, 10, 32, dtype=torch.uint8), torch.zeros(2, 10)
    gather_rows_spec(host_fp8, host_scales, table, src, dst, *want, page_size=64)
    assert torch.equal(want[0][0, 2], host_fp8[7, 63]) and torch.equal(want[0][1, 1], host_fp8[8, 0])
    got = torch.zeros(2, 10, 32, dtype=torch.uint8, device=DEV), torch.zeros(2, 10, device=DEV)
    fn = gather_host_rows if kernel else gather_host_rows_reference
    pinned = CUDA and kernel
    fn(host_fp8.pin_memory() if pinned else host_fp8, host_scales.pin_memory() if pinned else host_scales,
       table.to(DEV), src.to(DEV), dst.to(DEV), *got)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def test_binned_keep_skips_empty_slots_whatever_their_bins_hold():
    """Stage 2 writes no bin for an empty candidate slot (-1) below a request's count; ``keep_binned`` keeps
    only slots holding a key, whatever such a slot's bin holds, and never more than the kept count (an empty
    slot counted above the boundary would be given a slot past the output)."""
    from dsaindex.kernels.pq_select import BIN_COUNT, boundary_of_bins, keep_binned, keep_binned_reference

    b, n, c, cap = 2, 600, 50, 70
    g = torch.Generator().manual_seed(3)
    rows = torch.stack([torch.randperm(5000, generator=g)[:n] for _ in range(b)]).to(torch.int32)
    bins = torch.randint(BIN_COUNT // 2, BIN_COUNT // 2 + 200, (b, n), generator=g, dtype=torch.int32)
    counts = torch.tensor([600, 450], dtype=torch.int32)
    empty = torch.rand(b, n, generator=g) < 0.2
    rows[empty] = -1
    live = (torch.arange(n)[None, :] < counts[:, None]) & (rows >= 0)
    sel = boundary_of_bins(bins, live, c, cap)
    bins[empty] = BIN_COUNT - 1  # what an unwritten slot may hold: above every boundary
    scratch = torch.zeros(b, BIN_COUNT + 4, dtype=torch.int32, device=DEV)
    kept = keep_binned(rows.to(DEV), bins.to(DEV), counts.to(DEV), sel.to(DEV), scratch, cap).cpu()
    want = keep_binned_reference(rows, bins, counts, sel, cap)
    for i in range(b):
        got = kept[i][: int(sel[i, 2])]
        assert (got >= 0).all() and (kept[i][int(sel[i, 2]):] == -1).all(), i
        assert torch.equal(got.sort().values, want[i][want[i] >= 0].sort().values), i
        assert c <= int(sel[i, 2]) <= cap


def test_binned_candidates_are_kept_without_a_top_c_kernel_through_a_page_table():
    """``keep_binned``: after ``pq_candidate_bins`` over codes kept per physical page, the candidates above
    the boundary bin and those in it up to the kept count, the same set as ``keep_binned_reference``, padded
    with -1; they hold the top C by stage-2 score (but for ties in the boundary bin past the capacity), and a
    second step on the same scratch keeps the same set."""
    from dsaindex.kernels.pq_select import (
        BIN_COUNT,
        decoded_key_bound,
        keep_binned,
        keep_binned_reference,
        pq_candidate_bins,
    )

    b, n, c, cap = 3, 1024, 100, 140
    codes, cb, q, w = pq_inputs(b, n, 16, m=16, d=8, seed=5)
    g = torch.Generator().manual_seed(9)
    pages = torch.randperm(b * n // 64, generator=g)  # the codes' physical pages, shuffled
    paged = torch.zeros(b * n // 64, 64, 16, dtype=torch.uint8, device=DEV)
    paged[pages.to(DEV)] = codes.reshape(b * n // 64, 64, 16)
    table = pages.reshape(b, n // 64).to(torch.int32).to(DEV)
    rows = torch.stack([torch.randperm(n, generator=g)[:700] for _ in range(b)]).to(torch.int32).to(DEV)
    counts = torch.tensor([700, 60, 400], dtype=torch.int32, device=DEV)
    scratch = torch.zeros(b, BIN_COUNT + 4, dtype=torch.int32, device=DEV)
    scores, bins, sel = pq_candidate_bins(paged, rows, counts, q, w, cb, decoded_key_bound(cb), c, cap, scratch,
                                          page_table=table)
    live = torch.arange(700, device=DEV)[None, :] < counts[:, None]
    flat_scores, _, _ = pq_candidate_bins(codes, rows, counts, q, w, cb, decoded_key_bound(cb), c, cap,
                                          torch.zeros_like(scratch))
    torch.testing.assert_close(scores[live], flat_scores[live])  # the page table reads the same codes
    kept = keep_binned(rows, bins, counts, sel, scratch, cap)
    want = keep_binned_reference(rows, bins, counts, sel, cap)
    # the histogram and the done counter are zero; the append counters are reset by the next step's stage 2
    assert int(scratch[:, : BIN_COUNT + 2].abs().sum()) == 0
    _, bins2, sel2 = pq_candidate_bins(paged, rows, counts, q, w, cb, decoded_key_bound(cb), c, cap, scratch,
                                       page_table=table)
    again = keep_binned(rows, bins2, counts, sel2, scratch, cap)
    assert torch.equal(again.sort(dim=1).values, kept.sort(dim=1).values)  # a second step keeps the same
    for i in range(b):
        got, ref = kept[i][kept[i] >= 0], want[i][want[i] >= 0]
        assert torch.equal(got.sort().values, ref.sort().values), i
        assert got.numel() == int(sel[i, 2]) and (kept[i][got.numel():] == -1).all()
        assert got.unique().numel() == got.numel()
    assert int(sel[1, 2]) == 60  # fewer live candidates than C: every one kept
    for i in (0, 2):
        assert c <= int(sel[i, 2]) <= cap
        top = rows[i][live[i]][scores[i][live[i]].topk(c).indices].long()
        if int(sel[i, 2]) < cap:  # the boundary bin fitted: the top C are all there
            assert torch.isin(top, kept[i]).all(), i


def test_a_c_grown_by_each_requests_length_sets_its_own_boundary_and_stage1_width():
    """``grow`` (band, most): each request's C is ``grown_counts`` of it by its length (1, 2, 4 x up to the cap),
    in the bins' boundary (the same as :func:`boundary_of_bins` given those Cs, the capacity keeping its slack)
    and in stage 1's threshold, which aims at the grown width inside a buffer ``most`` times as wide."""
    from dsaindex.kernels.pq_select import (
        BIN_COUNT,
        boundary_of_bins,
        decoded_key_bound,
        grown_counts,
        pq_candidate_bins,
        pq_linear_topc,
        step_growth,
    )

    b, n, c, slack = 4, 1024, 40, 8
    codes, cb, q, w = pq_inputs(b, n, 16, m=16, d=8, seed=6)
    lengths = torch.tensor([200, 300, 700, 1024], dtype=torch.int32, device=DEV)  # 1, 2, 4, and 4 x capped
    grown = grown_counts(c, lengths, 256, 4)
    assert grown.tolist() == [40, 80, 160, 160]
    assert grown_counts(c, lengths, 0, 4).tolist() == [40] * 4 and grown_counts(c, lengths, 256, 2).tolist() == \
        [40, 80, 80, 80]
    # a step's (band, factor) is its longest request's growth, and (0, 1) where that request needs none
    assert [step_growth(k, 256, 4) for k in (200, 300, 700, 1024)] == [(0, 1), (256, 2), (256, 4), (256, 4)]
    assert step_growth(1024, 0, 4) == (0, 1) and step_growth(1024, 256, 1) == (0, 1)
    g = torch.Generator().manual_seed(4)
    rows = torch.stack([torch.randperm(int(n), generator=g)[:600] for _ in range(b)]).to(torch.int32).to(DEV)
    counts = torch.tensor([600, 600, 600, 150], dtype=torch.int32, device=DEV)  # the last: fewer than its C
    scratch = torch.zeros(b, BIN_COUNT + 4, dtype=torch.int32, device=DEV)
    _, bins, sel = pq_candidate_bins(codes, rows, counts, q, w, cb, decoded_key_bound(cb), c, c + slack, scratch,
                                     lengths=lengths, grow=(256, 4))
    live = torch.arange(600, device=DEV)[None, :] < counts[:, None]
    assert torch.equal(sel.cpu(), boundary_of_bins(bins, live, grown, grown + slack).cpu())
    assert [int(x) for x in sel[:3, 2]] >= grown[:3].tolist() and int(sel[3, 2]) == 150
    assert all(grown[i] <= int(sel[i, 2]) <= grown[i] + slack for i in range(3))
    c1 = 32
    _, pos, got = pq_linear_topc(codes, lengths, q, w, cb, c1, capacity=2 * c1, return_counts=True, keep_all=True,
                                 table_dtype=torch.int8, grow=(256, 4))
    assert pos.shape == (b, 2 * c1 * 4)
    aim = grown_counts(c1, lengths, 256, 4).cpu()
    assert (got.cpu() >= aim * 3 // 4).all() and (got.cpu() <= 2 * aim).all(), (got, aim)
    for bad in ((-1, 2), (256, 3), (256, 1 << 16)):
        with pytest.raises(ValueError, match="growth"):
            pq_linear_topc(codes, lengths, q, w, cb, c1, keep_all=True, table_dtype=torch.int8, grow=bad)
    with pytest.raises(ValueError, match="keep_all and int8"):
        pq_linear_topc(codes, lengths, q, w, cb, c1, grow=(256, 2))


def test_stage2_bins_find_the_boundary_of_the_top_c():
    """``pq_candidate_bins``: the stage-2 scores of ``pq_candidate_scores``, each candidate's bin as
    ``score_bins`` computes it, the boundary of :func:`boundary_of_bins` from the kernel's own histogram,
    and the scratch left zeroed for the next step."""
    from dsaindex.kernels.pq_select import (
        BIN_COUNT,
        boundary_of_bins,
        decoded_key_bound,
        pq_candidate_bins,
        score_bins,
        score_bound,
    )

    b, n, c = 3, 900, 100
    codes, cb, q, w = pq_inputs(b, n, 16, m=16, d=8, seed=3)
    w[2] = -w[2]  # negative head weights: every score of request 2 is at most 0
    g = torch.Generator().manual_seed(8)
    rows = torch.stack([torch.randperm(n, generator=g)[:600] for _ in range(b)]).to(torch.int32).to(DEV)
    counts = torch.tensor([600, 80, 350], dtype=torch.int32, device=DEV)  # request 1 has fewer than c
    scratch = torch.zeros(b, BIN_COUNT + 4, dtype=torch.int32, device=DEV)
    bound = decoded_key_bound(cb)
    for _ in range(2):  # a second step finds the scratch zeroed by the first
        scores, bins, sel = pq_candidate_bins(codes, rows, counts, q, w, cb, bound, c, c + 8, scratch)
        assert int(scratch.abs().sum()) == 0
    live = torch.arange(600, device=DEV)[None, :] < counts[:, None]
    want = pq_candidate_scores_reference(codes, rows.masked_fill(~live, -1), q, w, cb)
    torch.testing.assert_close(scores[live], want[live], rtol=1e-3, atol=1e-3)
    ref_bins = score_bins(want, score_bound(q, w, bound))
    assert (bins[live] - ref_bins[live]).abs().max() <= 1  # float rounding at a bin's edge
    agree = bins[live] == ref_bins[live]
    assert agree.float().mean() > 0.99
    want_sel = boundary_of_bins(bins, live, c, c + 8)
    assert torch.equal(sel.cpu(), want_sel.cpu())
    # ``dedup``: one atomic per distinct bin of a tile builds the same histogram, also where every score
    # crowds into a few bins (a bound 10^4 too wide)
    for scale in (1.0, 1e4):
        _, plain_bins, plain = pq_candidate_bins(codes, rows, counts, q, w, cb, bound * scale, c, c + 8, scratch,
                                                 dedup=False)
        _, got_bins, got = pq_candidate_bins(codes, rows, counts, q, w, cb, bound * scale, c, c + 8, scratch,
                                             dedup=True)
        assert torch.equal(got_bins[live], plain_bins[live]) and torch.equal(got.cpu(), plain.cpu()), scale
        assert int(scratch.abs().sum()) == 0
    assert plain_bins[live].unique().numel() < 40  # crowded: the dedup had many repeats to count
    edge, above, kept = sel[0, :3].tolist()
    top = want[0][live[0]].topk(c).values
    assert above < c <= kept <= c + 8 and edge > 0
    assert (score_bins(top[None], score_bound(q[:1], w[:1], bound))[0] >= edge - 1).all()
    assert sel[1, 0] == 0 and sel[1, 2] == 80  # fewer candidates than c: every one kept
    # negative scores are ranked too: request 2's boundary separates its top c from the rest
    edge, above, kept = sel[2, :3].tolist()
    order = want[2][live[2]].sort(descending=True).values
    assert (order[:c] < 0).any() and above < c <= kept <= c + 8
    ranked = score_bins(order[None], score_bound(q[2:], w[2:], bound))[0]
    assert (ranked[:c] >= edge - 1).all() and (ranked[c + 8 :] <= edge + 1).all()


@pytest.mark.parametrize("kernel", [True, False])
def test_host_select_reads_the_kept_candidates_from_host_pages_and_the_tail_from_the_pool(kernel):
    """``fp8_host_select``: candidates above the boundary bin, then the boundary bin's up to the capacity,
    each scored from its host page (through the page table); the tail from the device pool; -inf / -1 in
    the unused slots; every score as computed key by key."""
    from dsaindex.kernels.fp8_score import fp8_host_select, fp8_host_select_reference
    from dsaindex.kernels.pq_select import BIN_COUNT

    g = torch.Generator().manual_seed(5)
    d, heads, cap = 32, 5, 6
    keys, scales, q, w = fp8_inputs(1, 9 * 64, heads, d, seed=6, device="cpu")
    host_fp8, host_scales = keys[0].reshape(9, 64, d), scales[0].reshape(9, 64).float()
    table = torch.tensor([[3, 1, 7, 0], [0, 8, 2, 5]], dtype=torch.int32)
    rows = torch.tensor([[0, 70, -1, 9, 191, 5, 130, 12, 250], [-1, 200, 128, 64, 3, 127, 1, 2, 4]],
                        dtype=torch.int32)
    bins = torch.tensor([[50, 40, 40, 60, 40, 39, 40, 99, 70], [99, 7, 7, 7, 7, 9, 0, 0, 0]], dtype=torch.int32)
    counts = torch.tensor([8, 6], dtype=torch.int32)  # request 0's last slot is unfilled
    # request 0: boundary bin 40 (3 candidates in it), 3 above it (50, 60, 99), 6 kept; bin 39 and the unfilled
    # slot are not; request 1: boundary 7 (4 in it), 1 above (9), 5 kept. An empty slot (-1) below the count
    # holds a bin stage 2 never wrote (here the boundary's, or one above it): never kept
    sel = torch.tensor([[40, 3, 6, 0], [7, 1, 5, 0]], dtype=torch.int32)
    pool_fp8 = torch.randint(0, 120, (2, 80, d), generator=g, dtype=torch.int32).to(torch.uint8)
    pool_scales = torch.rand(2, 80, generator=g)
    tail_len, n_encoded = torch.tensor([3, 0], dtype=torch.int32), torch.tensor([192, 256], dtype=torch.int32)
    q2, w2 = q.expand(2, heads, d).contiguous(), torch.stack([w[0], -w[0]])
    scratch = torch.zeros(2, BIN_COUNT + 4, dtype=torch.int32, device=DEV)
    pinned = CUDA and kernel
    host = (host_fp8.pin_memory(), host_scales.pin_memory()) if pinned else (host_fp8, host_scales)
    args = [table, rows, bins, counts, sel]
    if kernel:
        out = fp8_host_select(*host, *(t.to(DEV) for t in args), scratch, pool_fp8.to(DEV), pool_scales.to(DEV),
                              tail_len.to(DEV), n_encoded.to(DEV), 10, q2.to(DEV), w2.to(DEV), cap)
    else:
        out = fp8_host_select_reference(*host, *args, pool_fp8, pool_scales, tail_len, n_encoded, 10, q2, w2, cap)
    scores, positions, stats = (t.cpu() for t in out)
    assert scores.shape == positions.shape == (2, cap + 64)
    want_pos = [{0, 70, 9, 191, 130, 12}, {200, 128, 64, 3, 127}]
    for b in range(2):
        kept = int(sel[b, 2])
        assert set(positions[b, :kept].tolist()) == want_pos[b]
        assert (positions[b, kept:cap] == -1).all() and (scores[b, kept:cap] == float("-inf")).all()
        for i in list(range(kept)) + list(range(cap, cap + 64)):
            if i >= cap and i - cap >= tail_len[b]:
                assert positions[b, i] == -1 and scores[b, i] == float("-inf")
                continue
            if i < cap:
                pos = int(positions[b, i])
                page = int(table[b, pos // 64])
                key, scale = host_fp8[page, pos % 64], host_scales[page, pos % 64]
            else:
                pos = int(n_encoded[b]) + i - cap
                key, scale = pool_fp8[b, 10 + i - cap], pool_scales[b, 10 + i - cap]
                assert int(positions[b, i]) == pos
            want = fp8_scores_reference(key[None, None], scale[None, None], q2[b : b + 1], w2[b : b + 1])[0, 0]
            torch.testing.assert_close(scores[b, i], want, rtol=1e-3, atol=1e-3)
    assert stats.tolist() == [[6, 0, 6, 0], [5, 0, 5, 0]]


def plan_inputs(b, c, cap, seed, positions=10_000):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(b, c, generator=g)
    cand = torch.stack([torch.randperm(positions, generator=g)[:c] for _ in range(b)])
    cand[1, c // 2 :] = -1  # a request with fewer candidates
    scores[1, c // 2 :] = float("-inf")
    # a cache holding some of the candidates (in their sets) and other positions
    cache_pos = torch.full((b, cap), -1, dtype=torch.long)
    cache_stamp = torch.zeros(b, cap, dtype=torch.long)
    sets = cap // 4
    for i in range(b):
        for p in torch.cat([cand[i][torch.rand(c, generator=g) < 0.3], torch.randint(0, positions, (cap // 2,), generator=g)]):
            p = int(p)
            if p < 0 or (cache_pos[i] == p).any():
                continue
            row = (p % sets) * 4 + int(torch.randint(0, 4, (1,), generator=g))
            cache_pos[i, row], cache_stamp[i, row] = p, int(torch.randint(1, 5, (1,), generator=g))
    n_encoded = torch.tensor([640, 128, 0][:b], dtype=torch.int32)
    tail_len = torch.tensor([5, 0, 64][:b], dtype=torch.int32)
    return cand, scores, cache_pos, cache_stamp, torch.full((b,), 6), n_encoded, tail_len


@pytest.mark.parametrize("c,cap,miss_filter,width,chunk", [
    (1, 4, True, 1.0, None), (37, 256, True, 1.0, None), (300, 2048, False, 1.0, None), (2048, 4096, True, 1.0, None),
    (300, 128, True, 1.0, None), (2048, 4096, True, 0.25, None), (300, 2048, True, 2.5, None),
    # the chunked kernel (a grown C's wide list, no miss filter): chunks of 64 with a partial last one, and sets
    # shared across chunks; a small cache whose sets overflow into the spill rows and past them
    (300, 2048, False, 1.0, 64), (1000, 512, False, 1.0, 128), (300, 128, False, 1.0, 32)])
def test_decode_plan_matches_reference(c, cap, miss_filter, width, chunk):
    """Same hits, drops, fetches and rescoring list as the reference; rows assigned inside the right set
    (in the kernel, the misses of one set may take its rows in another order), spills past the tail. The
    chunked kernel (``chunk``) as the one-tile one."""
    check_plan_against_reference(c, cap, miss_filter, width, chunk)


@pytest.mark.parametrize("c,cap,chunk", [(1000, 512, 128), (300, 128, 32), (300, 2048, 64)])
def test_decode_plan_checks_hold_in_any_atomic_order(c, cap, chunk):
    """The misses of a set take their turns in the order of an atomic counter: on a GPU not the candidates'
    order, which the interpreter follows. The kernel fed the candidates reversed (its turns in the opposite
    order to the reference's, sets overflowing into and past the spill rows) passes the same checks."""
    check_plan_against_reference(c, cap, False, 1.0, chunk, reverse=True)


def check_plan_against_reference(c, cap, miss_filter, width, chunk, reverse=False):
    from dsaindex.kernels.decode_plan import decode_plan, decode_plan_reference

    page = 64
    inputs = plan_inputs(3, c, cap, seed=c)
    want_state = [inputs[2].clone(), inputs[3].clone(), inputs[4].clone()]
    want = decode_plan_reference(inputs[0], inputs[1], *want_state, *inputs[5:], topk=16, page=page,
                                 miss_filter=miss_filter, spill=32, filter_width=width)
    got_state = [inputs[2].to(DEV).clone(), inputs[3].to(DEV).clone(), inputs[4].to(DEV).clone()]
    args = [t.to(DEV) for t in inputs]
    order = torch.arange(c - 1, -1, -1) if reverse else torch.arange(c)
    got = decode_plan(args[0][:, order.to(DEV)], args[1][:, order.to(DEV)], *got_state, *args[5:], topk=16, page=page,
                      miss_filter=miss_filter, spill=32, filter_width=width, chunk=chunk)
    back = order.argsort()  # outputs in the candidates' own order again
    src, dst, rows, positions, stats = (t.cpu() for t in got)
    src, dst = src[:, back], dst[:, back]
    rows = torch.cat([rows[:, :c][:, back], rows[:, c:]], dim=1)
    positions = torch.cat([positions[:, :c][:, back], positions[:, c:]], dim=1)
    assert torch.equal(stats, want[4])
    assert (got_state[2].cpu() == 7).all() and (want_state[2] == 7).all()  # each request's step advanced
    if cap >= 256 and c <= cap // 2:  # no set overflows its spill rows: the same keys are fetched and rescored
        assert torch.equal(src, want[0]) and torch.equal(positions, want[3])
    else:  # which misses of a full set are lost depends on the kernel's atomic order: only how many
        assert torch.equal((src >= 0).sum(1), (want[0] >= 0).sum(1))
    assert torch.equal(rows[:, c:], want[2][:, c:])  # the tail
    fetched = src >= 0
    cached = fetched & (dst < cap)
    # as many misses enter the cache (each side's own fetches: with overflowing sets, which misses are lost
    # past the spill rows follows the atomic order, so the kernel's fetches need not be the reference's)
    assert torch.equal(cached.sum(1), ((want[0] >= 0) & (want[1] < cap)).sum(1))
    sets = cap // 4
    assert (dst[cached] // 4 == src[cached] % sets).all()  # a row of the key's own set
    assert ((dst[fetched & ~cached] >= cap + 1 + page) & (dst[fetched & ~cached] < cap + 1 + page + 32)).all()
    for i in range(3):
        used = rows[i][rows[i] >= 0]
        assert used.unique().numel() == used.numel()  # no two candidates share a row
        held = got_state[0][i].cpu()
        assert torch.equal((held >= 0).view(-1, 4).sum(1), (want_state[0][i] >= 0).view(-1, 4).sum(1))
        assert set(held.tolist()) <= set(inputs[2][i].tolist()) | set(src[i].tolist())
    hits, fetches, drops = stats[:, 1], stats[:, 2], stats[:, 3]
    assert (hits + fetches + drops == stats[:, 0]).all()
    if miss_filter and c > 16:
        assert drops.sum() > 0
    # the cache now holds every cached miss where the plan put it
    assert torch.equal(got_state[0].cpu().gather(1, dst.clamp_max(cap - 1))[cached], src[cached])


def test_miss_filter_width_sets_the_margin():
    """Width 0 keeps exactly the top k of distinct scores; a wider margin keeps a superset; a margin past
    the spread keeps every valid candidate; a negative or infinite width is refused, by the kernel too."""
    from dsaindex.coarse import check_filter_width, miss_filter_keep
    from dsaindex.kernels.decode_plan import decode_plan

    g = torch.Generator().manual_seed(5)
    scores = torch.randn(3, 200, generator=g).sort(dim=1, descending=True).values
    valid = torch.ones_like(scores, dtype=torch.bool)
    valid[2, 150:] = False
    kept = [miss_filter_keep(scores, valid, 16, w) for w in (0.0, 0.5, 1.0, 3.0, 1e6)]
    assert (kept[0].sum(1) == 16).all()
    for narrow, wide in zip(kept, kept[1:], strict=False):
        assert (narrow <= wide).all()
    assert kept[1].sum() > kept[0].sum() and kept[3].sum() > kept[2].sum()
    assert torch.equal(kept[4], valid)
    for bad in (-0.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="filter width"):
            check_filter_width(bad)
    inputs = plan_inputs(2, 40, 256, seed=1)
    with pytest.raises(ValueError, match="filter width"):
        decode_plan(*[t.to(DEV) for t in inputs], topk=16, page=64, filter_width=-1.0)


def test_decode_plan_second_step_hits_what_the_first_fetched():
    from dsaindex.kernels.decode_plan import decode_plan

    cand, scores, _, _, _, n_encoded, tail_len = plan_inputs(3, 500, 2048, seed=3)
    cache_pos = torch.full((3, 2048), -1, dtype=torch.long, device=DEV)
    cache_stamp = torch.zeros(3, 2048, dtype=torch.long, device=DEV)
    args = [t.to(DEV) for t in (cand, scores)]
    step = torch.zeros(3, dtype=torch.long, device=DEV)
    first = decode_plan(*args, cache_pos, cache_stamp, step, n_encoded.to(DEV), tail_len.to(DEV), topk=16,
                        page=64)[4].cpu()
    second = decode_plan(*args, cache_pos, cache_stamp, step, n_encoded.to(DEV), tail_len.to(DEV), topk=16,
                         page=64)[4].cpu()
    assert first[:, 1].sum() == 0 and first[:, 2].sum() > 0
    # 500 keys in 512 sets of 4 rows: a few sets overflow; the rest hit
    assert (second[:, 1] >= first[:, 2] * 0.97).all() and (second[:, 2] <= first[:, 2] * 0.03 + 1).all()


def test_wrappers_name_the_bad_argument():
    """Each wrapper checks its inputs first: ValueError naming the argument, what it got and what it wants."""
    from dsaindex.kernels.chunk_score import chunk_scores
    from dsaindex.kernels.decode_plan import decode_plan
    from dsaindex.kernels.fp8_score import fp8_gather_scores, fp8_topk
    from dsaindex.kernels.pq_select import pq_candidate_scores, pq_encode, pq_linear_topc
    from dsaindex.kernels.select import gather_host_rows

    keys, scales, q, w = fp8_inputs(2, 50, 3, 32)
    lengths = torch.tensor([50, 40], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match=r"keys_fp8 \(FP8 e4m3 bits\): got dtype torch.float32, want torch.uint8"):
        fp8_topk(keys.float(), scales, lengths, q, w, 8, capacity=256, target=64)
    with pytest.raises(ValueError, match=r"scales: got shape \(2, 49\), want \[B, N\] = \(2, 50\)"):
        fp8_gather_scores(keys, scales[:, :49], torch.zeros(2, 3, dtype=torch.int32, device=DEV), q, w)
    with pytest.raises(ValueError, match="capacity: got 100, want >= 128"):
        fp8_topk(keys, scales, lengths, q, w, 8, capacity=100, target=64)
    with pytest.raises(ValueError, match="key dim D.: got 24, want a power of two >= 16"):
        fp8_topk(keys[..., :24], scales, lengths, q[..., :24], w, 8, capacity=256, target=64)
    codes, cb, pq_q, pq_w = pq_inputs(2, 60, 4)
    with pytest.raises(ValueError, match="codes: got dtype torch.int32, want torch.uint8"):
        pq_linear_topc(codes.int(), lengths, pq_q, pq_w, cb, 8)
    with pytest.raises(ValueError, match="subspaces M.: got 24, want a power of two"):
        pq_candidate_scores(codes[..., :24], torch.zeros(2, 5, dtype=torch.int32, device=DEV), pq_q[..., :96],
                            pq_w, cb[:24])
    with pytest.raises(ValueError, match=r"keys: got shape \(5, 64\), want \[N, D\] = \(\*, 128\)"):
        pq_encode(torch.randn(5, 64, device=DEV), cb)
    with pytest.raises(ValueError, match="rows / lengths: got rows and lengths, want exactly one of them"):
        chunk_scores(keys[0].float(), q, w, rows=torch.zeros(2, 4, dtype=torch.int32, device=DEV), lengths=lengths)
    cand = torch.zeros(2, 4, dtype=torch.long, device=DEV)
    cache = torch.zeros(2, 8, dtype=torch.long, device=DEV)
    with pytest.raises(ValueError, match=r"cache_stamp: got shape \(2, 3\), want \[B, cap\] = \(2, 8\)"):
        decode_plan(cand, cand.float(), cache, cache[:, :3], cache[:, 0], lengths, lengths, topk=2, page=64)
    host = torch.zeros(3, 64, 32, dtype=torch.uint8), torch.zeros(3, 64)
    pool = torch.zeros(2, 10, 32, dtype=torch.uint8, device=DEV), torch.zeros(2, 10, dtype=torch.float64, device=DEV)
    table, pos = torch.zeros(2, 1, dtype=torch.int32, device=DEV), torch.zeros(2, 4, dtype=torch.long, device=DEV)
    with pytest.raises(ValueError, match="pool_scales: got dtype torch.float64, want torch.float32"):
        gather_host_rows(*host, table, pos, pos, *pool)
    from dsaindex.kernels.fp8_score import fp8_host_select
    from dsaindex.kernels.pq_select import BIN_COUNT, pq_candidate_bins

    rows32, counts32 = torch.zeros(2, 4, dtype=torch.int32, device=DEV), lengths.clone()
    scratch = torch.zeros(2, BIN_COUNT + 4, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match=r"scratch: got shape \(2, 8192\), want \[B, BIN_COUNT \+ 4\] = \(2, 8196\)"):
        pq_candidate_bins(codes, rows32, counts32, pq_q, pq_w, cb, 1.0, 2, 4, scratch[:, :8192])
    with pytest.raises(ValueError, match="capacity: got 1, want >= 2"):
        pq_candidate_bins(codes, rows32, counts32, pq_q, pq_w, cb, 1.0, 2, 1, scratch)
    sel = torch.zeros(2, 4, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="counts: got dtype torch.int64, want torch.int32"):
        fp8_host_select(*host, table, rows32, rows32, counts32.long(), sel, scratch, pool[0], pool[1].float(),
                        lengths, lengths, 0, q, w, 4)


def test_check_counts_flags_overflow_and_shortfall():
    from dsaindex.kernels.select import check_counts

    counts = torch.tensor([100, 300, 40, 10])
    lengths = torch.tensor([5000, 5000, 5000, 10])
    assert check_counts(counts, lengths, target=64, capacity=256).tolist() == [False, True, True, False]


def test_fp8_topk_over_engine_pages_matches_reference():
    """The fallback exact scorer reads DeepGEMM's page layout (64 x D key bytes, then 64 scales) through
    a block table: pages shared by requests, in any order."""
    from dsaindex.kernels.fp8_score import fp8_topk_paged, paged_keys_reference

    keys, scales, q, w = fp8_inputs(3, 640, 8, 128)
    rows = torch.cat([keys.reshape(30, 64 * 128), scales.float().reshape(30, 64).contiguous().view(torch.uint8)], 1)
    order = torch.randperm(30, generator=torch.Generator().manual_seed(0)).to(DEV)
    pages = torch.empty_like(rows)
    pages[order] = rows  # request b's i-th page sits at order[10 b + i]
    table = order.view(3, 10).to(torch.int32)
    unpacked = paged_keys_reference(pages, table, 128)
    assert torch.equal(unpacked[0], keys) and torch.equal(unpacked[1], scales.float())
    lengths = torch.tensor([640, 333, 5], dtype=torch.int32, device=DEV)
    for query_fp8 in (False, True):
        want_s, want_r = fp8_topk_reference(keys, scales, lengths, q, w, 40, query_fp8=query_fp8)
        got_s, got_r = fp8_topk_paged(pages, table, lengths, q, w, 40, capacity=256, target=64, query_fp8=query_fp8)
        same_selection(got_r, want_r, got_s, want_s)
        assert (got_r[2] >= 0).sum() == 5 and (got_r < lengths[:, None]).all()


def test_fp8_query_rounding_is_what_deepgemm_computes():
    """The FP8-query reference is DeepGEMM's spec (queries rounded to e4m3), and differs from the bf16 one:
    the option changes the products, not just their speed."""
    from dsaindex.kernels.deepgemm import paged_logits_reference

    keys, scales, q, w = fp8_inputs(2, 300, 8, 128)
    lengths = torch.tensor([300, 200], dtype=torch.int32, device=DEV)
    fp8_q = fp8_scores_reference(keys, scales, q, w, query_fp8=True)
    want = paged_logits_reference(keys, scales, lengths, q, w, 300)
    live = torch.isfinite(want)
    torch.testing.assert_close(fp8_q[live], want[live], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(fp8_q, fp8_scores_reference(keys, scales, q, w), rtol=1e-4, atol=1e-4)


def test_fp8_logits_match_reference_with_fp8_queries():
    """The logits kernel writes every key's score (FP8 x FP8 products) and -inf at and past each length, in
    both layouts; rows_topk of them is the exact top-k."""
    from dsaindex.kernels.fp8_score import fp8_logits, fp8_logits_paged
    from dsaindex.kernels.topk import rows_topk

    keys, scales, q, w = fp8_inputs(3, 640, 8, 128)
    lengths = torch.tensor([640, 333, 5], dtype=torch.int32, device=DEV)
    want = fp8_scores_reference(keys, scales, q, w, query_fp8=True)
    past = torch.arange(640, device=DEV)[None, :] >= lengths[:, None]
    want = want.masked_fill(past, float("-inf"))
    got = fp8_logits(keys, scales, lengths, q, w)
    assert torch.equal(torch.isinf(got), past)
    # FP8 tensor cores accumulate with fewer bits than float32: errors scale with the heads' dot products,
    # not with the (signed, head-weighted) sum, so the tolerance is relative to the largest score
    torch.testing.assert_close(got[~past], want[~past], rtol=1e-3, atol=FP8_DOT_ATOL * float(want[~past].abs().max()))
    rows = torch.cat([keys.reshape(30, 64 * 128), scales.float().reshape(30, 64).contiguous().view(torch.uint8)], 1)
    order = torch.randperm(30, generator=torch.Generator().manual_seed(1)).to(DEV)
    pages = torch.empty_like(rows)
    pages[order] = rows
    paged = fp8_logits_paged(pages, order.view(3, 10).to(torch.int32), lengths, q, w)
    torch.testing.assert_close(paged, got, rtol=0, atol=0)
    want_s, want_r = fp8_topk_reference(keys, scales, lengths, q, w, 40, query_fp8=True)
    got_s, got_r = rows_topk(got, lengths, 40)
    # the top-k of the kernel's logits: every pick scores (by the reference) at least the reference's k-th,
    # up to the tensor cores' rounding (a near-tie may swap)
    tol = FP8_DOT_ATOL * float(want_s[torch.isfinite(want_s)].abs().max())
    for b in range(3):
        picks = got_r[b][got_r[b] >= 0]
        assert picks.numel() == min(40, int(lengths[b]))
        kth = want_s[b][torch.isfinite(want_s[b])].min()
        assert (want[b, picks] >= kth - tol).all()


@pytest.mark.parametrize("query_fp8", [True, False])
def test_fp8_gather_scores_shared_match_reference(query_fp8):
    """Every query reads its own rows of one shared key array (a prefill chunk's IVF candidates)."""
    from dsaindex.kernels.fp8_score import fp8_gather_scores_reference, fp8_gather_scores_shared

    keys, scales, _, _ = fp8_inputs(1, 300, 4, 128)
    _, _, q, w = fp8_inputs(5, 1, 8, 128, seed=2)
    rows = torch.randint(-1, 300, (5, 200), generator=torch.Generator().manual_seed(3)).to(torch.int32).to(DEV)
    got = fp8_gather_scores_shared(keys[0], scales[0].float(), rows, q, w, query_fp8=query_fp8)
    want = fp8_gather_scores_reference(keys[0], scales[0].float(), rows, q, w, query_fp8=query_fp8)
    assert torch.equal(torch.isinf(got), rows < 0)
    live = rows >= 0
    torch.testing.assert_close(got[live], want[live], rtol=1e-3, atol=FP8_DOT_ATOL * float(want[live].abs().max()))


def test_the_cuda_scan_states_what_it_takes():
    """The CUDA selecting pass takes int8 tables of 256 centroids and 32 code bytes a key on a CUDA device;
    anything else is refused with the reason, never run on the wrong inputs, and ``auto`` takes Triton
    there."""
    from dsaindex.kernels.pq_scan_cuda import available, resolve_scan
    from dsaindex.kernels.pq_select import pq_linear_topc

    codes, cb, q, w = pq_inputs(1, 256, 4, m=32, d=4, seed=1)
    lengths = torch.tensor([256], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="scan: got 'fast'"):
        pq_linear_topc(codes, lengths, q, w, cb, 16, scan="fast")
    with pytest.raises(ValueError, match="int8 tables of 256 centroids, 16 or 32 subspaces: got 32 subspaces, "
                                         "256 centroids, float tables"):
        pq_linear_topc(codes, lengths, q, w, cb, 16, scan="cuda", table_dtype=torch.float16)
    if not available():
        with pytest.raises(ValueError, match="needs a CUDA device"):
            pq_linear_topc(codes, lengths, q, w, cb, 16, scan="cuda", table_dtype=torch.int8, keep_all=True)
    cuda = torch.device("cuda", 0)
    with pytest.raises(ValueError, match="got 8 subspaces"):
        resolve_scan("cuda", 8, 256, True, cuda)
    assert resolve_scan("auto", 8, 256, True, cuda) == "triton" == resolve_scan("auto", 32, 256, False, cuda)
    assert resolve_scan("auto", 16, 256, True, cuda) == ("cuda" if available() else "triton")
    assert resolve_scan("auto", 32, 256, True, torch.device("cpu")) == "triton"
    assert resolve_scan("auto", 32, 256, True, cuda) == ("cuda" if available() else "triton")


def _nvrtc():
    """NVRTC where this machine has it (CUDA builds of torch ship it), else None."""
    import ctypes
    import ctypes.util
    import glob
    import site

    found = ctypes.util.find_library("nvrtc")
    for root in site.getsitepackages() + [site.getusersitepackages()]:
        found = found or next(iter(sorted(glob.glob(f"{root}/nvidia/cu*/lib/libnvrtc.so*")
                                          + glob.glob(f"{root}/nvidia/cuda_nvrtc/lib/libnvrtc.so*"))), None)
    return ctypes.CDLL(found) if found else None


def _hopper_ptx(source: str) -> str:
    """NVRTC's PTX of ``source`` for sm_90 (the test skips where this machine has no NVRTC)."""
    import ctypes

    lib = _nvrtc()
    if lib is None:
        pytest.skip("no NVRTC on this machine")
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None) == 0
    try:
        opts = (ctypes.c_char_p * 1)(b"--gpu-architecture=compute_90")
        rc = lib.nvrtcCompileProgram(prog, 1, opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        assert rc == 0, log.value.decode()
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, ptx)
        return ptx.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def test_the_cuda_scan_compiles_for_hopper_with_one_shared_lookup_a_code():
    """NVRTC compiles the scan for sm_90 (where NVRTC is installed: CUDA builds of torch ship it): one
    shared-memory load per code byte, at the column offsets 0, 4, .., 124 of the lane's rotated row; each
    row's codes in two 16-byte loads (three places in the source: the first two rows, then each next one
    before the current is scored); one global atomic a block (the kept rows staged in shared memory), and
    in the form for long blocks one more, at a flush within the block."""
    import re

    from dsaindex.kernels.pq_scan_cuda import source

    for m in (32, 16):  # the default form, and the one for keys of 16 codes (one 16-byte load a row)
        text = _hopper_ptx(source(code_bytes=m))
        offsets = [int(x or 0) for x in re.findall(r"ld\.shared\.u32\s+%r\d+, \[%rd?\d+(?:\+(\d+))?\];", text)]
        assert sorted(x for x in offsets if x < 4 * m) == [4 * p for p in range(m)], m
        assert text.count("ld.global.cg") == 3 * m // 16 and text.count("atom.global.add") == 1, m
    assert _hopper_ptx(source(long_blocks=True)).count("atom.global.add") == 2


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("defines", ["#define COALESCED 1\n", "#define COALESCED 1\n#define PREFETCH_ROWS 1\n"])
def test_the_coalesced_cuda_scan_appends_every_passing_row_once(defines):
    """The scan's COALESCED variant compiled by NVRTC (a warp's rows in two 512-byte loads, halves swapped
    between lanes), paged behind a shuffled table with lengths ending inside a warp's rows: every passing row
    once, with its integer sum, the count exact."""
    from dsaindex.kernels import pq_scan_cuda as scan

    b, n, m = 3, 20_000, 32
    g = torch.Generator().manual_seed(4)
    pages = n // 64 + 1
    codes = torch.randint(0, 256, (b * pages, 64, m), generator=g, dtype=torch.int32).to(torch.uint8).to(DEV)
    table = torch.randperm(b * pages, generator=g).view(b, pages).to(torch.int32).to(DEV)
    lut = torch.randint(-127, 128, (b, m, 256), generator=g, dtype=torch.int32).to(torch.int8).to(DEV)
    lengths = torch.tensor([n, n - 1013, 45], dtype=torch.int32, device=DEV)
    rows_of = (table.long()[:, :, None] * 64 + torch.arange(64, device=DEV)).view(b, -1)[:, :n]
    sums = lut.long()[torch.arange(b, device=DEV)[:, None, None], torch.arange(m, device=DEV),
                      codes.view(-1, m)[rows_of].long()].sum(-1)
    thr = torch.tensor([300.0, 0.0, float("-inf")], device=DEV)
    kernel = torch.cuda._compile_kernel(defines + scan.source(), scan.KERNEL)
    kernel.set_shared_memory_config(scan.SHARED)
    scores = torch.full((b, n), float("nan"), device=DEV)
    rows = torch.full((b, n), -1, dtype=torch.int32, device=DEV)
    counts = torch.zeros(b, dtype=torch.int32, device=DEV)
    kernel(grid=(-(-n // scan.MAX_ROWS), b, 1), block=(scan.THREADS, 1, 1), shared_mem=scan.SHARED,
           args=[codes, lengths, lut, thr, scores, rows, counts, table, pages, pages * 64, n, scan.MAX_ROWS, 1])
    for i in range(b):
        want = torch.nonzero(sums[i, : int(lengths[i])] >= thr[i]).flatten()
        got = rows[i, : int(counts[i])].long()
        assert int(counts[i]) == len(want) and torch.equal(got.sort().values, want)
        assert torch.equal(scores[i, : len(got)], sums[i, got].float())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("span,m", [("staged", 32), ("long", 32), ("staged", 16)])
def test_the_cuda_scan_counts_rows_past_its_buffer_and_stores_passing_rows_only(span, m):
    """The compiled kernel with a threshold that passes far more rows than the buffer holds (the sampling pass
    never aims that low, so it is called directly): the count is every passing row, each stored row passes
    and appears once, with its integer sum; a request of 97 rows at -inf takes them all. ``long``: blocks of
    MAX_SPAN rows, each flushing its staging several times (half its rows pass)."""
    from dsaindex.kernels.pq_scan_cuda import MAX_ROWS, MAX_SPAN, pq_scan_select

    b, n, capacity = 3, 70_000, 512
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (b, n, m), generator=g, dtype=torch.int32).to(torch.uint8).to(DEV)
    lut = torch.randint(-127, 128, (b, m, 256), generator=g, dtype=torch.int32).to(torch.int8).to(DEV)
    lengths = torch.tensor([n, n - 1001, 97], dtype=torch.int32, device=DEV)
    sums = lut.long()[torch.arange(b, device=DEV)[:, None, None], torch.arange(m, device=DEV), codes.long()].sum(-1)
    thr = torch.tensor([0.0, 0.0, float("-inf")], device=DEV)
    scores = torch.full((b, capacity), float("nan"), device=DEV)
    rows = torch.full((b, capacity), -1, dtype=torch.int32, device=DEV)
    counts = torch.zeros(b, dtype=torch.int32, device=DEV)
    pq_scan_select(codes, lengths, lut, thr, scores, rows, counts, None, n,
                   block_rows=MAX_SPAN if span == "long" else MAX_ROWS)
    for i in range(b):
        passing = sums[i, : int(lengths[i])] >= thr[i]
        assert int(counts[i]) == int(passing.sum())
        stored = rows[i, : min(int(counts[i]), capacity)].long()
        assert len(set(stored.tolist())) == len(stored) and bool(passing[stored].all())
        assert torch.equal(scores[i, : len(stored)], sums[i, stored].float())
    assert int(counts[0]) > capacity and int(counts[2]) == 97


def test_the_cuda_stage2_compiles_for_hopper_on_tensor_cores_without_spills():
    """NVRTC compiles stage 2 for sm_90 (where NVRTC is installed): the heads scored by ``mma.m16n8k16`` on bf16,
    the queries read by ``ldmatrix``, each codeword one 8-byte shared load, and no local memory in the PTX (the
    64 fragment registers of a warp's 32 keys stay in registers)."""

    from dsaindex.kernels.pq_stage2_cuda import source

    text = _hopper_ptx(source())
    # the loop over the four m-tiles of 16 heads stays rolled (its body: 8 steps x 4 n-tiles)
    assert text.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 8 * 4
    assert text.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") == 8
    assert text.count("ld.shared.v2.u32") == 8 * 4  # a codeword a lookup: 8 steps of 4 n-tiles
    assert ".local" not in text


def test_the_fold_scan_compiles_for_hopper_on_the_s8_tensor_cores():
    """The fold scan (``stage1="folds"``) for sm_90: one m-tile of 16 folds a step, ``mma.m16n8k32`` on s8 over 4
    k-steps x 4 n-tiles, its DEPTH (2) steps in flight unrolled in the loop; the folds' ``ldmatrix`` once, before
    the loop; 4 n-tiles' 8-byte code loads a fetch (DEPTH before the loop, one a step in it, each a scan's or a
    sampling pass's); one global atomic a tile (its flush) and one shared atomic a step's kept rows; every lookup
    addressed by a byte-permute; no local memory."""
    from dsaindex.kernels.pq_fold_cuda import source

    depth = 2
    text = _hopper_ptx(source())
    assert text.count("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32") == depth * 4 * 4
    assert text.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") == 4
    assert text.count("ld.global.nc.v2.u32") == 2 * depth * 2 * 4
    assert text.count("atom.global.add") == 1 and text.count("atom.shared.add") == depth
    assert text.count("prmt.b32") >= depth * 32  # a lookup's offset: one byte-permute of its code
    assert ".local" not in text


def test_the_int8_stage2_compiles_for_hopper_on_the_s8_tensor_cores():
    """The int8 form (``stage2="int8"``) for sm_90: ``mma.m16n8k32`` on s8 (a native IMMA on Hopper, where the e4m3
    form is lowered to f16), half the bf16 form's: 4 steps of 32 dimensions x 4 n-tiles a head tile; half its
    ``ldmatrix``; each codeword one 4-byte shared load; no local memory."""
    import re

    from dsaindex.kernels.pq_stage2_cuda import source

    text = _hopper_ptx(source(int8=True))
    assert text.count("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32") == 4 * 4
    assert "bf16.bf16" not in text
    assert text.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") == 4
    assert len(re.findall(r"ld\.shared\.u32\s", text)) >= 8 * 4  # 8 codewords a candidate, 4 n-tiles
    assert "ld.shared.v2.u32" not in text.split("mma.sync")[0][-4000:]  # the lookups are one word each
    assert ".local" not in text


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("paged", [False, True])
def test_the_cuda_stage2_scores_and_bins_as_the_triton_one(paged):
    """The compiled CUDA stage 2 against the Triton one at a serving shape (64 heads, PQ32), several blocks a
    request, empty slots and unequal counts: the same scores up to float summation order, the same bins but
    at bin edges, the same histogram totals and boundary (within a bin)."""
    from dsaindex.kernels.pq_select import (
        BIN_COUNT,
        decoded_key_bound,
        paged_codes_reference,
        pq_candidate_bins,
        pq_candidate_scores,
    )

    b, n, r = 4, 200_000, 40_000
    codes, cb, q, w = pq_inputs(b, n, 64, seed=9)
    w = w - 0.3  # negative weights too
    g = torch.Generator().manual_seed(4)
    rows = torch.randint(0, n, (b, r), generator=g, dtype=torch.int32)
    rows[torch.rand(b, r, generator=g) < 0.05] = -1
    rows = rows.to(DEV)
    counts = torch.tensor([r, 30_001, 5, 0], dtype=torch.int32, device=DEV)
    table = None
    if paged:
        pages = -(-n // 64)
        padded = torch.zeros(b, pages * 64, 32, dtype=torch.uint8, device=DEV)
        padded[:, :n] = codes
        perm = torch.randperm(b * pages, generator=g).to(DEV)
        store = torch.empty(b * pages, 64, 32, dtype=torch.uint8, device=DEV)
        store[perm] = padded.reshape(b * pages, 64, 32)
        table = perm.view(b, pages).to(torch.int32)
        assert torch.equal(paged_codes_reference(store, table)[:, :n], codes)
        codes = store
    cb16 = cb.to(torch.bfloat16)
    kb = decoded_key_bound(cb16)
    live = (torch.arange(r, device=DEV)[None, :] < counts[:, None]) & (rows >= 0)
    got = {}
    for kernel in ("triton", "cuda"):
        scratch = torch.zeros(b, BIN_COUNT + 4, dtype=torch.int32, device=DEV)
        got[kernel] = pq_candidate_bins(codes, rows, counts, q, w, cb16, kb, 4096, 4096 + 256, scratch,
                                        page_table=table, stage2=kernel)
        assert not scratch.any()  # the boundary launch left it zeroed
        scores = pq_candidate_scores(codes, rows, q, w, cb16, counts=counts, page_table=table, stage2=kernel)
        torch.testing.assert_close(scores[live], got[kernel][0][live])
        assert torch.isneginf(scores[~live]).all()
    (s_t, bins_t, sel_t), (s_c, bins_c, sel_c) = got["triton"], got["cuda"]
    torch.testing.assert_close(s_c[live], s_t[live], rtol=1e-4, atol=1e-5 * float(s_t[live].abs().max()))
    assert (bins_c[live] - bins_t[live]).abs().max() <= 1
    assert (bins_c[live] == bins_t[live]).float().mean() > 0.999
    assert (sel_c[:, 0] - sel_t[:, 0]).abs().max() <= 1  # the boundary bin
    assert torch.equal(sel_c[2:, 2], sel_t[2:, 2])  # requests of fewer candidates than C keep them all


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_the_int8_stage2_keeps_the_triton_ones_scores_and_top_candidates():
    """The compiled int8 stage 2 at a serving shape against the Triton (bf16) one: scores within the 8-bit
    operands' rounding (a small share of a request's score range), the top C nearly the same keys, the boundary
    bin within a few bins; its histogram left zeroed as the other kernels leave it."""
    from dsaindex.kernels.pq_select import BIN_COUNT, decoded_key_bound, pq_candidate_bins

    b, n, r = 4, 200_000, 40_000
    codes, cb, q, w = pq_inputs(b, n, 64, seed=19)
    g = torch.Generator().manual_seed(5)
    rows = torch.randint(0, n, (b, r), generator=g, dtype=torch.int32).to(DEV)
    counts = torch.tensor([r, 30_001, 5, 0], dtype=torch.int32, device=DEV)
    cb16 = cb.to(torch.bfloat16)
    kb = decoded_key_bound(cb16)
    live = torch.arange(r, device=DEV)[None, :] < counts[:, None]
    got = {}
    for kernel in ("triton", "int8"):
        scratch = torch.zeros(b, BIN_COUNT + 4, dtype=torch.int32, device=DEV)
        got[kernel] = pq_candidate_bins(codes, rows, counts, q, w, cb16, kb, 4096, 4096 + 256, scratch, stage2=kernel)
        assert not scratch.any()
    (s_t, _, sel_t), (s_8, _, sel_8) = got["triton"], got["int8"]
    assert torch.isneginf(s_8[~live]).all()
    for i in range(2):  # the two requests of more candidates than C
        x, y = s_t[i][live[i]], s_8[i][live[i]]
        moved = (y - x).abs() / (x.max() - x.min())
        assert float(moved.mean()) < 0.003 and float(moved.max()) < 0.02
        top_t, top_8 = set(x.topk(4096).indices.tolist()), set(y.topk(4096).indices.tolist())
        assert len(top_t & top_8) / 4096 > 0.98
    assert (sel_8[:2, 0] - sel_t[:2, 0]).abs().max() <= 8
    assert torch.equal(sel_8[2:, 2], sel_t[2:, 2])


@pytest.mark.parametrize("seed,warps", [(0, 4), (1, 4), (0, 16)])
def test_the_fused_int8_operands_are_the_torch_ones(seed, warps, monkeypatch):
    """The int8 stage 2's operands in one Triton launch (what a CUDA step runs) against the torch spec: the int8
    queries equal (a float32 quotient may differ in its last bit, which moves an entry only off an exact tie:
    none here in 16,384 a request), the scaled weights and the bins' bounds to float rounding, the codewords the
    cached ones; heads of both signs and one head all zero (its scale clamped, not divided by). At 16 warps a
    program (the default: no spills) and 4."""
    import dsaindex.kernels.pq_stage2_cuda as stage2
    from dsaindex.kernels.pq_stage2_cuda import int8_operands, int8_operands_reference

    monkeypatch.setattr(stage2, "OPERANDS_WARPS", warps)

    g = torch.Generator().manual_seed(seed)
    spread = torch.logspace(0, 1.5, 32)[torch.randperm(32, generator=g)]  # subspaces 30x apart in scale
    codebook = (torch.randn(32, 256, 4, generator=g) * 0.05 * spread[:, None, None]).to(torch.bfloat16).to(DEV)
    queries = (torch.randn(3, 64, 128, generator=g) * torch.rand(3, 64, 1, generator=g) * 4).to(torch.bfloat16)
    queries[1, 5] = 0
    weights = torch.randn(3, 64, generator=g) * 0.1
    queries, weights = queries.to(DEV), weights.to(DEV)
    want = int8_operands_reference(queries, weights, codebook, 2.5)
    got = int8_operands(queries, weights, codebook, 2.5, fused=True)
    assert got[0].dtype == torch.int8 and got[0].shape == (3, 64, 128)
    assert (got[0].int() - want[0].int()).abs().max() <= 1
    assert (got[0] == want[0]).float().mean() > 0.9999
    assert (got[0].abs() == 127).any(dim=2)[[0, 2]].all()  # every non-zero head reaches 127
    assert (got[0][1, 5] == 0).all() and got[1][1, 5].abs() < 1e-30  # its weight times the clamped scale
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=0)
    torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=0)
    assert got[2] is want[2]  # the codebook's int8 form, made once


def test_the_torch_paths_keep_what_the_sampled_threshold_keeps_in_expectation():
    """Stage 1's kernels keep every key at or above a threshold read off strided samples at the rank of
    1.5 x the target; the torch paths and the recall recorded at training keep ``stage1_kept`` keys instead.
    Over random scores the threshold keeps that count on average (each request within the sampling's spread,
    1 / sqrt(rank)), and every key of a request up to twice the target; the count and its tensor form agree."""
    from dsaindex.coarse import STAGE1_OVERSAMPLE, stage1_kept, stage1_kept_counts
    from dsaindex.kernels.select import sample_stride, thresholds_from_samples

    g = torch.Generator().manual_seed(3)
    target, capacity, n = 2048, 4096, 1 << 18
    lengths = torch.tensor([n] * 32 + [4096, 3000])
    scores = torch.randn(lengths.numel(), n, generator=g)
    at = torch.arange(n)[None, :]
    scores = scores.masked_fill(at >= lengths[:, None], float("-inf"))
    stride = sample_stride(n)
    thr = thresholds_from_samples(scores[:, ::stride], lengths, stride, target, capacity)
    kept = ((scores >= thr[:, None]) & (at < lengths[:, None])).sum(1)
    want = [stage1_kept(target, int(x)) for x in lengths]
    assert want == [math.ceil(STAGE1_OVERSAMPLE * target)] * 32 + [4096, 3000]
    assert stage1_kept_counts(torch.full_like(lengths, target), lengths).tolist() == want
    assert kept[32:].tolist() == want[32:]  # a request of at most twice the target: every key
    mean = float(kept[:32].float().mean())
    assert abs(mean - want[0]) <= 0.03 * want[0], mean
    assert ((kept[:32] - want[0]).abs() <= 0.35 * want[0]).all()
