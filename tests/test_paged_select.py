"""The engines' paged-cache PQ selection (runtime/paged_select.py) and the paged kernels under it.

On the CPU through TRITON_INTERPRET=1 at small sizes (and through the torch references); the ``gpu``
test captures a step in a CUDA graph and replays it against eager steps.
"""

import os

import pytest
import torch

pytest.importorskip("triton")

from dsaindex.kernels.fp8_score import fp8_gather_scores_reference, fp8_topk_reference, paged_keys_reference  # noqa: E402
from dsaindex.kernels.pq_select import (  # noqa: E402
    paged_codes_reference,
    pq_candidate_scores_reference,
    pq_linear_scores_reference,
)
from dsaindex.pq import PQCodec, PQSpec  # noqa: E402
from dsaindex.quant import fp8_quantize  # noqa: E402
from dsaindex.runtime.paged_select import PagedCacheSelector, page_rows, takes_exact_path, to_slots  # noqa: E402

CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)
DEV = "cuda" if CUDA else "cpu"
D, H = 32, 4
CENTERS = torch.randn(16, D, generator=torch.Generator().manual_seed(5)) * 2


def clustered(n, g):
    return CENTERS[torch.randint(0, CENTERS.shape[0], (n,), generator=g)] + 0.5 * torch.randn(n, D, generator=g)


def codec(seed=0):
    from dsaindex.train.codebooks import train_codebooks

    keys = clustered(3000, torch.Generator().manual_seed(seed))
    return PQCodec(codebooks=train_codebooks(keys, PQSpec(dim=D, subspaces=8), "torch", 6))


def page_bytes(keys):
    """Float keys [64 n, D] -> n engine pages [n, 64 * (D + 4)] uint8 (FP8 bytes, then float32 scales)."""
    fp8, scales = fp8_quantize(keys)
    n = keys.shape[0] // 64
    return torch.cat([fp8.view(torch.uint8).reshape(n, 64 * D),
                      scales.float().reshape(n, 64).contiguous().view(torch.uint8)], dim=1)


def engine_cache(lengths, num_pages, seed=1, strided=False, room=0):
    """A cache with each request's keys on shuffled pages: (cache rows, page table [B, W] int32, keys);
    ``room`` more keys' pages are allocated (and filled) past each length, for keys appended later."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-(n + room) // 64) for n in lengths)
    order = torch.randperm(num_pages, generator=g)
    alloc = torch.zeros(num_pages, 64 * (D + 4) + (64 if strided else 0), dtype=torch.uint8)
    cache = alloc[:, : 64 * (D + 4)]  # strided: pages further apart than their width (a view, as vLLM's)
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    keys, used = [], 0
    for b, n in enumerate(lengths):
        pages = -(-(n + room) // 64)
        x = clustered(pages * 64, g)
        mine = order[used : used + pages]
        used += pages
        cache[mine] = page_bytes(x)
        table[b, :pages] = mine.to(torch.int32)
        keys.append(x[:n])
    alloc = alloc.to(DEV)
    return alloc[:, : 64 * (D + 4)], table.to(DEV), keys


def queries(b, seed=2):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, H, D, generator=g) * 0.5).to(torch.float8_e4m3fn)
    return q.to(DEV), torch.rand(b, H, generator=g).to(DEV)


def exact(cache, table, lengths, q, w, k):
    keys, scales = paged_keys_reference(cache, table, D)
    lens = torch.tensor(lengths, device=DEV)
    return fp8_topk_reference(keys, scales, lens, q.float(), w, k, query_fp8=True)[1]


def one_request(n):
    """One request of ``n`` keys in an 8-page cache: (lengths, cache, page table, queries, weights, lengths on
    the device)."""
    cache, table, _ = engine_cache([n], 8)
    q, w = queries(1)
    return [n], cache, table, q, w, torch.tensor([n], device=DEV)


def as_sets(positions):
    return [set(row) - {-1} for row in positions.tolist()]


def recall(got, want):
    """Share of ``want``'s kept positions that ``got`` kept too, over all rows."""
    pairs = list(zip(as_sets(got), as_sets(want), strict=True))
    return sum(len(g & w) for g, w in pairs) / max(1, sum(len(w) for _, w in pairs))


def captured(step, warmups=1, strict=False):
    """``step`` run ``warmups`` times on a side stream (Triton compiles outside the capture), then captured in a
    CUDA graph: (the graph, the output the capture wrote). ``strict``: any host synchronization inside the
    capture is an error."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    if strict:
        torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return graph, out


# ---- the paged kernels -----------------------------------------------------------------------------
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.int8])
def test_paged_stage_one_and_two_match_their_references(table_dtype):
    from dsaindex.kernels.pq_select import pq_candidate_scores, pq_linear_topc

    g = torch.Generator().manual_seed(0)
    m, k = 8, 16
    codes = torch.randint(0, k, (9, 64, m), generator=g, dtype=torch.int32).to(torch.uint8).to(DEV)
    cb = torch.randn(m, k, D // m, generator=g).to(DEV)
    table = torch.tensor([[4, 0, 7, 2], [1, 8, 0, 0]], dtype=torch.int32, device=DEV)  # page 0 shared
    lengths = torch.tensor([256, 100], dtype=torch.int32, device=DEV)
    q, w = queries(2)
    q = q.float().to(torch.bfloat16)
    flat = paged_codes_reference(codes, table)
    assert torch.equal(flat[0, 64:128], codes[0]) and torch.equal(flat[1, 64:100], codes[8, :36])
    scores = pq_linear_scores_reference(flat, q, w, cb)
    scores = scores.masked_fill(torch.arange(256, device=DEV)[None, :] >= lengths[:, None], float("-inf"))
    want = scores.topk(20, dim=1).indices
    got_s, got_r = pq_linear_topc(codes, lengths, q, w, cb, 20, capacity=80, page_table=table, table_dtype=table_dtype)
    for g_, w_ in zip(as_sets(got_r), want.tolist(), strict=True):
        assert set(w_[:10]) <= g_, "the paged scan lost a clear top row"
        assert all(r < 256 for r in g_)
    assert (got_r[1] < 100).all()
    rows = torch.randint(-1, 100, (2, 50), generator=g, dtype=torch.int32).to(DEV)
    torch.testing.assert_close(pq_candidate_scores(codes, rows, q, w, cb, page_table=table),
                               pq_candidate_scores_reference(flat, rows, q, w, cb), rtol=1e-3, atol=1e-3)


def test_a_wide_stage_one_keeps_the_same_top_c_through_the_threshold_top_k():
    """Stage-1 buffers wider than one program holds (C1 = 8 x 4,096 at the plugins' default point) take the
    threshold top-k; it keeps the same C rows as the one-program top-k, padding past short rows included."""
    from dsaindex.kernels.pq_select import pq_coarse_topc

    g = torch.Generator().manual_seed(3)
    m, k = 8, 16
    codes = torch.randint(0, k, (40, 64, m), generator=g, dtype=torch.int32).to(torch.uint8).to(DEV)
    cb = torch.randn(m, k, D // m, generator=g).to(DEV)
    table = torch.randperm(40, generator=g)[:36].view(2, 18).to(torch.int32).to(DEV)
    lengths = torch.tensor([64 * 18, 64 * 3], dtype=torch.int32, device=DEV)
    q, w = queries(2)
    q = q.float().to(torch.bfloat16)
    one = pq_coarse_topc(codes, lengths, q, w, cb, 400, 300, page_table=table)
    wide = pq_coarse_topc(codes, lengths, q, w, cb, 400, 300, page_table=table, one_program_max=64)
    assert torch.equal(one[2], wide[2]) and int(one[2][1]) == 64 * 3
    assert as_sets(one[1]) == as_sets(wide[1]) and len(as_sets(wide[1])[1]) == 64 * 3
    assert (wide[1][1, 64 * 3 :] == -1).all()


@pytest.mark.parametrize("strided", [False, True])
def test_paged_exact_gather_reads_the_engines_pages_in_place(strided):
    from dsaindex.kernels.fp8_score import fp8_gather_scores_paged

    cache, table, _ = engine_cache([300, 130], 12, strided=strided)
    q, w = queries(2)
    pos = torch.tensor([[0, 299, 64, -1, 150], [129, -1, 0, 65, 3]], device=DEV)
    keys, scales = paged_keys_reference(cache, table, D)
    want = fp8_gather_scores_reference(keys, scales, pos, q.float(), w, query_fp8=True)
    got = fp8_gather_scores_paged(cache, table, pos, q.float(), w)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    assert torch.isinf(got[pos < 0]).all()


@pytest.mark.parametrize("strided", [False, True])
def test_stale_page_listing_matches_its_reference(strided):
    from dsaindex.kernels.paged_codes import page_words, signature_words, stale_pages, stale_pages_reference

    cache, table, _ = engine_cache([64 * 9 + 3, 64 * 4, 10], 16, strided=strided)
    lengths = torch.tensor([64 * 9 + 3, 64 * 4, 10], dtype=torch.int32, device=DEV)
    signature = torch.zeros(17, 4, dtype=torch.int64, device=DEV)
    valid = torch.zeros(17, dtype=torch.uint8, device=DEV)
    words = page_words(cache)[:, signature_words(D)]
    for page in table[0, [1, 4, 5]].tolist() + table[1, [0, 3]].tolist():  # codes made from the current bytes
        signature[page], valid[page] = words[page], 1
    signature[int(table[0, 4]), 2] += 1  # ... but page 4 of request 0 has changed since
    stale = [set(table[0, [0, 2, 3, 4, 6, 7, 8]].tolist()), set(table[1, [1, 2]].tolist()), set()]
    for e in (1, 3, 8):
        got = stale_pages(cache, table, lengths, signature, valid, e, D, block=4)  # 3 tiles for request 0
        want = stale_pages_reference(cache, table, lengths, signature, valid, e, D)
        assert torch.equal(got[1], want[1]) and got[1].tolist() == [7, 2, 0]
        for row, every, n in zip(got[0].tolist(), stale, got[1].tolist(), strict=True):
            listed = [p for p in row if p != 16]  # 16: the scratch page
            assert len(listed) == len(set(listed)) == min(e, n) and set(listed) <= every
    assert set(want[0][0, :7].tolist()) == stale[0] and (want[0][0, 7:] == 16).all()
    # a window: only each request's last 3 completed pages (request 0: pages 6-8, request 1: 1-3)
    windowed = [set(table[0, [6, 7, 8]].tolist()), set(table[1, [1, 2]].tolist()), set()]
    got = stale_pages(cache, table, lengths, signature, valid, 8, D, block=4, window=3)
    want = stale_pages_reference(cache, table, lengths, signature, valid, 8, D, window=3)
    assert torch.equal(got[1], want[1]) and got[1].tolist() == [3, 2, 0]
    assert [{p for p in row if p != 16} for row in got[0].tolist()] == windowed
    # the window and a sweep: one column in 4 of the older pages, the phase taken mod 4 (6 % 4: columns 2, 6)
    phase = torch.tensor([6], dtype=torch.int32, device=DEV)
    swept = [windowed[0] | {int(table[0, 2])}, windowed[1], set()]
    got = stale_pages(cache, table, lengths, signature, valid, 8, D, block=4, window=3, sweep=4, phase=phase)
    want = stale_pages_reference(cache, table, lengths, signature, valid, 8, D, window=3, sweep=4, phase=phase)
    assert torch.equal(got[1], want[1]) and got[1].tolist() == [4, 2, 0]
    assert [{p for p in row if p != 16} for row in got[0].tolist()] == swept


@pytest.mark.parametrize("with_metric,warps", [(False, 4), (True, 4), (False, 8)])
def test_page_encoding_in_place_matches_the_codec(with_metric, warps, monkeypatch):
    """At 4 warps a program (the default) and 8 (no spills under the GPU's Triton; to be timed)."""
    import dsaindex.kernels.paged_codes as paged_codes
    from dsaindex.kernels.paged_codes import encode_pages, encode_pages_reference, whitened_codebooks

    monkeypatch.setattr(paged_codes, "ENCODE_WARPS", warps)

    cache, table, _ = engine_cache([64 * 5], 8, strided=True)
    cb = codec().codebooks.to(DEV)
    metric = None
    if with_metric:
        a = torch.randn(8, 4, 4, generator=torch.Generator().manual_seed(4))
        metric = (a @ a.transpose(1, 2) + 0.5 * torch.eye(4)).to(DEV)
    pages = torch.cat([table[0, [3, 0, 2]].long().cpu(), torch.tensor([8, 8])]).to(DEV)  # 8: the scratch page
    got = torch.full((9, 64, 8), 77, dtype=torch.uint8, device=DEV)
    want = got.clone()
    whitened, lt = whitened_codebooks(cb, metric)
    encode_pages(cache, pages, whitened, lt, got, D)
    encode_pages_reference(cache, pages, cb, metric, want, D)
    listed = table[0, [3, 0, 2]].long()
    assert (got[listed] == want[listed]).float().mean() > 0.99  # float ties aside
    assert (got[8] == 77).all() and (got[table[0, 1].long()] == 77).all()  # scratch and unlisted: untouched
    # a decode step's bookkeeping in the same launch: completed pages' keys, the sweep's phase advanced once
    lengths = torch.tensor([0, 63, 64, 1000, 4097], dtype=torch.int32, device=DEV)
    phase = torch.tensor([6], dtype=torch.int32, device=DEV)
    again = got.clone()
    coded = encode_pages(cache, pages, whitened, lt, again, D, lengths=lengths, phase=phase)
    assert coded.tolist() == [0, 0, 64, 960, 4096] and phase.tolist() == [7] and torch.equal(again, got)
    none = encode_pages(cache, pages[:0], whitened, lt, again, D, lengths=lengths[:0], phase=phase)  # no launch
    assert none.numel() == 0 and phase.tolist() == [8]
    with pytest.raises(ValueError, match="requests"):  # one program a page writes a request's entry
        encode_pages(cache, pages[:2], whitened, lt, again, D, lengths=lengths)


def test_rescoring_list_appends_each_requests_open_page_as_its_reference():
    """``with_tail``: the candidates as they are, then the 64 positions of the request's open page, -1 at and
    past its length (a request ending on a page boundary has an empty tail; a request shorter than a page
    has its whole tail)."""
    from dsaindex.kernels.paged_codes import with_tail, with_tail_reference

    g = torch.Generator().manual_seed(8)
    cand = torch.randint(-1, 5000, (4, 300), generator=g)
    lengths = torch.tensor([5000, 640, 37, 4097], dtype=torch.int32)
    got = with_tail(cand.to(DEV), lengths.to(DEV)).cpu()
    want = with_tail_reference(cand, lengths)
    assert torch.equal(got, want) and got.shape == (4, 364)
    assert torch.equal(got[:, :300], cand)
    assert got[1, 300:].eq(-1).all()  # 640 keys: ten complete pages, no open one
    assert got[2, 300:337].tolist() == list(range(37)) and got[2, 337:].eq(-1).all()
    assert got[0, 300:308].tolist() == list(range(4992, 5000)) and got[0, 308:].eq(-1).all()


def test_page_rows_takes_both_engine_layouts_and_refuses_others():
    from dsaindex.errors import DsaIndexError

    flat = torch.zeros(5, 64 * (D + 4), dtype=torch.uint8)
    assert page_rows(flat, D).data_ptr() == flat.data_ptr()
    blocks = torch.zeros(5, 64, D + 4, dtype=torch.uint8)  # vLLM's bound cache
    rows = page_rows(blocks, D)
    assert rows.shape == (5, 64 * (D + 4)) and rows.data_ptr() == blocks.data_ptr()
    with pytest.raises(DsaIndexError, match="page size 64"):
        page_rows(torch.zeros(5, 32 * (D + 4), dtype=torch.uint8), D)
    with pytest.raises(DsaIndexError, match="uint8"):
        page_rows(flat.float(), D)


# ---- the selector ----------------------------------------------------------------------------------
@pytest.mark.parametrize("use_triton", [True, False])
@pytest.mark.parametrize("opq", [False, True])
def test_every_key_a_candidate_is_the_exact_topk(use_triton, opq):
    lengths = [300, 131, 40]
    cache, table, _ = engine_cache(lengths, 16)
    q, w = queries(3)
    sel = PagedCacheSelector(opq_codec() if opq else codec(), 16, topk=24, candidates=512, head_dim=D, device=DEV, exact_below=0,
                             use_triton=use_triton)
    got = sel.select(cache, table, torch.tensor(lengths, device=DEV), q, w)
    assert got.dtype == torch.int32 and got.shape == (3, 24)
    assert as_sets(got) == as_sets(exact(cache, table, lengths, q, w, 24))
    assert int(sel.stats.stale.sum()) == 0


@pytest.mark.parametrize("use_triton", [True, False])
def test_a_request_shorter_than_topk_has_every_key_first_and_padding_after(use_triton):
    """SGLang's decode backends read the first min(n, topk) entries as KV slots: a request of n < topk keys
    must find all n there (the newest, which sit in the tail after the candidate block, included) and -1
    only after them, for the kernels (which keep column order) as for the references."""
    lengths = [300, 131, 40, 64]
    cache, table, _ = engine_cache(lengths, 16)
    q, w = queries(4)
    sel = PagedCacheSelector(codec(), 16, topk=512, candidates=1024, head_dim=D, device=DEV, exact_below=0, use_triton=use_triton)
    got = sel.select(cache, table, torch.tensor(lengths, device=DEV), q, w).cpu()
    for row, n in zip(got, lengths, strict=True):
        assert sorted(row[:n].tolist()) == list(range(n)), (n, row[:n])
        assert (row[n:] == -1).all(), (n, row[n:][row[n:] >= 0])


def test_the_final_top_k_spread_over_programs_selects_what_one_program_a_row_selects(monkeypatch):
    """kernels.topk.RADIX_UP_TO_ROWS sends a step's final top-k to radix_topk: the codes step then selects the same
    keys, with every key of a request shorter than top-k first and -1 after. The selector keeps the radix scratch of
    a batch size across steps (no fill kernel a step): a second step with other queries still selects as one
    program a row does, and leaves the scratch zeroed."""
    import dsaindex.kernels.topk as topk

    lengths = [2000, 1500, 40]
    cache, table, _ = engine_cache(lengths, 70)
    q, w = queries(3)
    q2, w2 = queries(3, seed=11)
    lens = torch.tensor(lengths, device=DEV)
    calls = []
    radix = topk.radix_topk
    monkeypatch.setattr(topk, "radix_topk", lambda *a, **kw: calls.append(kw["scratch"]) or radix(*a, **kw))
    picks = []
    monkeypatch.setattr(topk, "RADIX_FROM_SLOTS", 0)  # these rows are short: spread them anyway
    for rows in (0, 8):
        monkeypatch.setattr(topk, "RADIX_UP_TO_ROWS", rows)
        sel = PagedCacheSelector(codec(), 70, topk=64, candidates=128, prefilter=2, head_dim=D, device=DEV,
                                 exact_below=0, use_triton=True)
        picks.append((sel.select(cache, table, lens, q, w), sel.select(cache, table, lens, q2, w2)))
        assert len(calls) == (2 if rows else 0)  # the final top-k, once a step
    assert calls[0] is calls[1] and not calls[1].any()  # one scratch for both steps, zeroed after each
    for step in (0, 1):
        assert as_sets(picks[0][step]) == as_sets(picks[1][step]), step
    assert as_sets(picks[1][0])[0] != as_sets(picks[1][1])[0]  # the second step's queries pick other keys
    assert sorted(picks[1][0][2, :40].tolist()) == list(range(40)) and (picks[1][0][2, 40:] == -1).all()


def _long_requests_on_both_paths(**options):
    """Two long requests selected once by the Triton path and once by the torch path of selectors built with
    ``options``: (picks, selectors, the exact top-32, lengths)."""
    lengths = [2000, 1500]
    cache, table, _ = engine_cache(lengths, 60)
    q, w = queries(2)
    want = exact(cache, table, lengths, q, w, 32)
    picks, selectors = [], []
    for use_triton in (True, False):
        sel = PagedCacheSelector(codec(), 60, topk=32, candidates=128, prefilter=2, head_dim=D, device=DEV, exact_below=0,
                                 use_triton=use_triton, **options)
        picks.append(sel.select(cache, table, torch.tensor(lengths, device=DEV), q, w))
        selectors.append(sel)
    return picks, selectors, want, lengths


def test_long_requests_keep_most_of_the_exact_topk_and_both_paths_agree():
    picks, _, want, lengths = _long_requests_on_both_paths()
    for use_triton, picked in zip((True, False), picks, strict=True):
        kept = recall(picked, want)
        assert kept >= 0.9, (use_triton, kept)
        assert (picked < torch.tensor(lengths, device=DEV)[:, None]).all()
    assert recall(picks[0], picks[1]) >= 0.95


def test_stage_one_on_group_codes_keeps_most_of_the_exact_topk_on_both_paths():
    """stage1="groups": the selector keeps each page's group codes beside its codes (made from them at the catch-up
    and at adopt), stage 1 scores those against the pair codebooks, stage 2 the codes; both paths keep most of
    the exact top-k and agree; the group codes count in the selector's bytes; a codec whose centroids do not
    split in 16 groups of 16 is refused by name."""
    from dsaindex.errors import DsaIndexError
    from dsaindex.pq import group_codes

    picks, selectors, want, lengths = _long_requests_on_both_paths(stage1="groups")
    for use_triton, picked, sel in zip((True, False), picks, selectors, strict=True):
        assert recall(picked, want) >= 0.85, use_triton
        coded = torch.nonzero(sel.valid[:60]).flatten()  # the completed pages, encoded by the step
        assert len(coded) >= sum(n // 64 for n in lengths)
        assert torch.equal(sel.groups[0][coded], group_codes(sel.codes[coded], sel.group_of))
        assert sel.gpu_bytes() == PagedCacheSelector(codec(), 60, topk=32, candidates=128, head_dim=D, device=DEV,
                                                     exact_below=0, use_triton=use_triton).gpu_bytes() + 61 * 64 * 4
    assert recall(picks[0], picks[1]) >= 0.95
    small = PQCodec(codebooks=torch.randn(8, 64, 4))
    with pytest.raises(DsaIndexError, match="16 groups of 256 centroids"):
        PagedCacheSelector(small, 60, topk=32, candidates=128, head_dim=D, device=DEV, stage1="groups")
    with pytest.raises(DsaIndexError, match="not a stage-1 code"):
        PagedCacheSelector(small, 60, topk=32, candidates=128, head_dim=D, device=DEV, stage1="nibbles")
    with pytest.raises(DsaIndexError, match="folds score 128-dim queries .* got 32 dims, 8 x 256"):
        PagedCacheSelector(codec(), 60, topk=32, candidates=128, head_dim=D, device=DEV, stage1="folds")


@pytest.mark.parametrize("use_triton", [True, False])
def test_binned_top_c_keeps_at_least_what_the_top_c_kernel_keeps(use_triton):
    """``top_c="bins"`` (``"auto"``'s choice for small steps) keeps every stage-2 candidate above the C-th's score bin, and ties in it
    up to C + BIN_SLACK, with no top-C kernel: the final top-k keeps at least as much of the exact top-k as
    the exact top C does (``"topk"``), and an unknown ``top_c`` is refused."""
    lengths = [2000, 1500]
    cache, table, _ = engine_cache(lengths, 60)
    q, w = queries(2)
    want = exact(cache, table, lengths, q, w, 32)
    kept, chosen = {}, {}
    for top_c in ("bins", "topk", "auto"):
        sel = PagedCacheSelector(codec(), 60, topk=32, candidates=48, prefilter=4, head_dim=D, device=DEV,
                                 exact_below=0, use_triton=use_triton, top_c=top_c)
        picks = sel.select(cache, table, torch.tensor(lengths, device=DEV), q, w)
        chosen[top_c] = picks.sort(dim=1).values
        if top_c == "bins" and use_triton:  # a scratch per batch size, kept: a graph captured with one reuses it
            held = sel._bin_scratch[2]
            sel.select(cache, table[:1], torch.tensor(lengths[:1], device=DEV), q[:1], w[:1])
            assert sorted(sel._bin_scratch) == [1, 2] and sel._bin_scratch[2] is held
            again = sel.select(cache, table, torch.tensor(lengths, device=DEV), q, w)
            assert torch.equal(again.sort(dim=1).values, chosen[top_c])
        assert (picks < torch.tensor(lengths, device=DEV)[:, None]).all()
        assert all(row[row >= 0].unique().numel() == int((row >= 0).sum()) for row in picks)
        kept[top_c] = recall(picks, want)
    assert kept["bins"] >= kept["topk"] - 0.02 and kept["bins"] >= 0.8, kept
    assert torch.equal(chosen["auto"], chosen["bins"])  # auto: bins for a step of 2 requests
    default = PagedCacheSelector(codec(), 60, topk=32, head_dim=D, device=DEV)
    assert default.top_c == "auto"
    # auto: bins while the step's stage 1 keeps at most 256K keys in all (B x P x C), the top-C kernel above
    from dsaindex.runtime.paged_select import BINS_UP_TO_KEYS

    for prefilter, most in ((4, 16), (8, 8)):
        wide = PagedCacheSelector(codec(), 60, topk=32, candidates=4096, prefilter=prefilter, head_dim=D, device=DEV)
        assert most * 4096 * prefilter == BINS_UP_TO_KEYS
        assert wide.auto_top_c(most) == "bins" and wide.auto_top_c(most + 1) == "topk"
    from dsaindex.errors import DsaIndexError

    with pytest.raises(DsaIndexError, match="top_c 'sorted'"):
        PagedCacheSelector(codec(), 60, topk=32, head_dim=D, device=DEV, top_c="sorted")


@pytest.mark.parametrize("use_triton", [True, False])
def test_codes_kept_in_an_engines_pool_select_as_the_selectors_own(use_triton):
    """``codes=``: the codes live in bytes an engine sized for the layer ([P, 64, M], no scratch page: the
    vLLM plugin's DSAINDEX_KEYS=host gives the layer's pool bytes). Encoding writes them there, and the
    steps select what a selector with its own codes selects; a region of the wrong shape is refused."""
    from dsaindex.errors import DsaIndexError

    lengths = [64 * 9 + 5, 200, 64 * 3]
    cache, table, _ = engine_cache(lengths, 20)
    seq = torch.tensor(lengths, device=DEV)
    q, w = queries(3)
    pool = torch.full((20 + 7, 64, 8), 0xAB, dtype=torch.uint8, device=DEV)  # the layer's region in a pool
    region = pool[7:]
    own = PagedCacheSelector(codec(), 20, topk=16, candidates=64, head_dim=D, device=DEV, exact_below=0,
                             use_triton=use_triton)
    kept = PagedCacheSelector(codec(), 20, topk=16, candidates=64, head_dim=D, device=DEV, exact_below=0,
                              use_triton=use_triton, codes=region)
    assert kept.codes.data_ptr() == region.data_ptr() and own.codes.shape[0] == 21
    want = own.select(cache, table, seq, q, w)
    got = kept.select(cache, table, seq, q, w)
    done = torch.cat([table[b, : n // 64] for b, n in enumerate(lengths)]).long()
    assert torch.equal(region[done], own.codes[done])  # written in the pool, as the selector's own
    assert bool((pool[:7] == 0xAB).all())  # nothing outside the region
    assert as_sets(got) == as_sets(want)
    with pytest.raises(DsaIndexError, match="contiguous"):
        PagedCacheSelector(codec(), 20, topk=16, candidates=64, head_dim=D, device=DEV, codes=pool[:, :, :4])
    with pytest.raises(DsaIndexError, match=r"\[20, 64, 8\]"):
        PagedCacheSelector(codec(), 20, topk=16, candidates=64, head_dim=D, device=DEV, codes=pool)


def test_a_captured_step_catches_up_on_pages_it_never_saw_prepared():
    """Without prepare() (a step inside a CUDA graph), stale pages are encoded ``catch_up`` per request
    per step, and the stats say how many are left; a page reused for other keys is encoded again."""
    lengths = [64 * 7 + 5]
    cache, table, _ = engine_cache(lengths, 10)
    q, w = queries(1)
    seq = torch.tensor(lengths, device=DEV)
    sel = PagedCacheSelector(codec(), 10, topk=16, candidates=64, catch_up=3, head_dim=D, device=DEV, exact_below=0,
                             check_every=1)
    left = []
    for _ in range(3):
        sel.select(cache, table, seq, q, w, eager_refresh=False)
        left.append(int(sel.stats.stale[0]))
    assert left == [4, 1, 0] and [int(sel.stats.encoded[0])] == [1]
    sel.select(cache, table, seq, q, w, eager_refresh=False)
    assert int(sel.stats.encoded[0]) == 0
    # the engine gives page table[0, 2] new keys: its codes are stale and encoded again
    page = int(table[0, 2])
    cache[page] = page_bytes(clustered(64, torch.Generator().manual_seed(99))).to(DEV)
    sel.select(cache, table, seq, q, w, eager_refresh=False)
    assert int(sel.stats.encoded[0]) == 1 and int(sel.stats.stale[0]) == 0
    fresh = PagedCacheSelector(codec(), 10, topk=16, candidates=64, head_dim=D, device=DEV, exact_below=0)
    assert fresh.prepare(cache, table, seq) == 7 and fresh.prepare(cache, table, seq) == 0
    assert torch.equal(fresh.codes[table[0, :7].long()], sel.codes[table[0, :7].long()])
    assert as_sets(sel.select(cache, table, seq, q, w)) == as_sets(fresh.select(cache, table, seq, q, w))


@pytest.mark.parametrize("use_triton", [False, True])
def test_a_page_changed_without_prepare_is_found_within_check_every_steps(use_triton):
    """On the device a step checks each request's newest pages and one in ``check_every`` of the older
    ones, turning: an old page whose bytes change outside decode (no prepare) is re-encoded within
    ``check_every`` steps, and the steps before that leave it alone."""
    lengths = [64 * 20 + 5]
    cache, table, _ = engine_cache(lengths, 24)
    q, w = queries(1)
    seq = torch.tensor(lengths, device=DEV)
    sel = PagedCacheSelector(codec(), 24, topk=16, candidates=64, head_dim=D, device=DEV, exact_below=0,
                             use_triton=use_triton, check_every=4)
    sel.prepare(cache, table, seq)
    page = int(table[0, 5])  # an old page: outside the last catch_up (2) completed pages
    cache[page] = page_bytes(clustered(64, torch.Generator().manual_seed(7))).to(DEV)
    found = []
    for _ in range(4):
        sel.select(cache, table, seq, q, w, eager_refresh=False)
        found.append(int(sel.stats.encoded[0]))
    assert sorted(found) == [0, 0, 0, 1]  # once, in the step whose phase reached column 5
    assert sel._phase.tolist() == [4]  # advanced once a step (by the encoding launch on the kernels' path)
    fresh = PagedCacheSelector(codec(), 24, topk=16, candidates=64, head_dim=D, device=DEV, use_triton=use_triton)
    fresh.prepare(cache, table, seq)
    assert torch.equal(sel.codes[page], fresh.codes[page])


@pytest.mark.parametrize("use_triton", [False, True])
def test_keys_on_host_check_only_the_pages_a_step_can_complete(use_triton):
    """keys_on_host: a step checks the signatures of each request's last ``catch_up`` completed pages only
    (the ones decode completes); an older page rewritten behind its back is found by prepare(), which the
    engine plugins run where pages are written otherwise (prefill, transfer)."""
    lengths = [64 * 7 + 63]
    cache, table, _ = engine_cache(lengths, 10, room=1)
    q, w = queries(1)
    sel = PagedCacheSelector(codec(), 10, topk=16, candidates=64, head_dim=D, device=DEV, exact_below=0, use_triton=use_triton,
                             keys_on_host=True)
    assert sel.prepare(cache, table, torch.tensor(lengths, device=DEV)) == 7
    seq = torch.tensor([lengths[0] + 1], device=DEV)  # the next key completes page 7: found and encoded
    sel.select(cache, table, seq, q, w, eager_refresh=False)
    assert int(sel.stats.encoded[0]) == 1 and int(sel.stats.stale[0]) == 0
    old = int(table[0, 2])
    cache[old] = page_bytes(clustered(64, torch.Generator().manual_seed(98))).to(DEV)
    sel.select(cache, table, seq, q, w, eager_refresh=False)
    assert int(sel.stats.encoded[0]) == 0  # outside the window: not read
    assert sel.prepare(cache, table, seq) == 1  # prepare reads every page


def test_adopted_codes_count_as_current_until_the_page_changes():
    lengths = [64 * 6]
    cache, table, _ = engine_cache(lengths, 8)
    q, w = queries(1)
    seq = torch.tensor(lengths, device=DEV)
    made = PagedCacheSelector(codec(), 8, topk=16, candidates=64, head_dim=D, device=DEV, exact_below=0)
    made.prepare(cache, table, seq)
    pages = table[0].long()
    sel = PagedCacheSelector(codec(), 8, topk=16, candidates=64, head_dim=D, device=DEV, exact_below=0)
    sel.adopt(cache, pages, made.codes[pages])
    got = sel.select(cache, table, seq, q, w, eager_refresh=False)
    assert int(sel.stats.encoded[0]) == 0 and int(sel.stats.stale[0]) == 0
    assert as_sets(got) == as_sets(made.select(cache, table, seq, q, w))
    with pytest.raises(Exception, match="one page of PQ codes per page"):
        sel.adopt(cache, pages, made.codes[pages][:, :32])


@pytest.mark.parametrize("use_triton", [True, False])
@pytest.mark.parametrize("exact_below", [0, 1 << 20])
def test_forced_tokens_are_selected_once_and_slots_map_through_the_table(exact_below, use_triton):
    lengths = [700, 200]
    cache, table, _ = engine_cache(lengths, 20)
    q, w = queries(2)
    sel = PagedCacheSelector(codec(), 20, topk=16, candidates=64, head_dim=D, device=DEV, exact_below=exact_below,
                             use_triton=use_triton)
    got = sel.select(cache, table, torch.tensor(lengths, device=DEV), q, w, init_tokens=3, local_tokens=5)
    for row, n in zip(got.tolist(), lengths, strict=True):
        kept = [p for p in row if p >= 0]
        assert len(kept) == len(set(kept)) == 16
        assert {0, 1, 2} | set(range(n - 5, n)) <= set(kept)
    slots = to_slots(got, table)
    p = int(got[0, 0])
    assert int(slots[0, 0]) == int(table[0, p // 64]) * 64 + p % 64
    assert ((slots >= 0) == (got >= 0)).all()


# ---- the exact path: a small step scored as the engine scores it ----------------------------------
@pytest.mark.parametrize("use_triton", [True, False])
def test_a_small_step_is_the_engines_exact_topk_with_every_key_of_a_short_request_first(use_triton):
    """At most ``exact_below`` keys (B x the longest request): the step scores every key (stage 1 passes
    nothing), selects the exact top-k, and a request shorter than top-k has all its keys first, -1 after.
    The same step through PQ at a narrow C misses part of the exact top-k, so the exact path is what ran."""
    lengths = [1300, 700, 100]
    cache, table, _ = engine_cache(lengths, 40)
    q, w = queries(3)
    lens = torch.tensor(lengths, device=DEV)
    want = exact(cache, table, lengths, q, w, 256)
    small = PagedCacheSelector(codec(), 40, topk=256, candidates=256, prefilter=1, head_dim=D, device=DEV,
                               use_triton=use_triton, exact_below=3 * 1300, exact_offset=0)
    got = small.select(cache, table, lens, q, w).cpu()
    assert as_sets(got) == as_sets(want)
    assert int(small.stats.stage1.sum()) == 0
    assert sorted(got[2, :100].tolist()) == list(range(100)) and (got[2, 100:] == -1).all()
    pq = PagedCacheSelector(codec(), 40, topk=256, candidates=256, prefilter=1, head_dim=D, device=DEV,
                            use_triton=use_triton, exact_below=3 * 1300 - 1, exact_offset=0)  # one key over: PQ
    through_pq = pq.select(cache, table, lens, q, w)
    assert int(pq.stats.stage1.sum()) > 0
    assert recall(through_pq, want) < 1.0


def test_the_exact_path_bound_counts_each_requests_fixed_share_of_the_codes_step():
    """B x (N - offset) <= bound: the offset (default 14 x the stage-1 width, P x C) is what a request's fixed
    share of the codes' step is worth in keys, so a step of few long requests leaves the exact path sooner
    than one of many short ones of the same B x N; the shapes' and the device's choices agree."""
    from dsaindex.coarse import PAGED_EXACT_BELOW, PAGED_EXACT_OFFSET

    sel = PagedCacheSelector(codec(), 8, topk=16, candidates=64, prefilter=4, head_dim=D, device=DEV)
    assert sel.exact_offset == PAGED_EXACT_OFFSET * 4 * 64 and sel.exact_below == PAGED_EXACT_BELOW
    wide = PagedCacheSelector(codec(), 8, topk=16, candidates=128, prefilter=4, head_dim=D, device=DEV)
    assert wide.exact_offset == 2 * sel.exact_offset
    # at the production points (16K and 32K stage 1, the default bound): the sides of the H200 grid that timed
    # both paths at every point (docs/results/bench_paged_exact_rule_p{4,8}_fused_h200.json)
    prod = PagedCacheSelector(codec(), 8, topk=16, candidates=4096, prefilter=4, head_dim=D, device=DEV)
    assert not prod.takes_exact(8, 1 << 20) and not prod.takes_exact(32, 1 << 19)  # codes faster there
    assert not prod.takes_exact(2, 1 << 20) and not prod.takes_exact(3, 1 << 20)  # the codes: 1.06x at 2 x 1M
    assert prod.takes_exact(32, 1 << 18) and prod.takes_exact(1, 1 << 20) and prod.takes_exact(2, 1 << 19)
    assert not prod.takes_exact(64, 1 << 18) and not prod.takes_exact(4, 1 << 19)  # bins win there
    assert not prod.takes_exact(64, 1 << 20) and not prod.takes_exact(8, 1 << 19)
    p8 = PagedCacheSelector(codec(), 8, topk=16, candidates=4096, prefilter=8, head_dim=D, device=DEV)
    assert p8.takes_exact(1, 1 << 20) and p8.takes_exact(16, 1 << 19) and p8.takes_exact(64, 1 << 18)
    assert not p8.takes_exact(2, 1 << 20) and not p8.takes_exact(4, 1 << 20) and not p8.takes_exact(32, 1 << 19)
    # the pages the exact path may read: every length it takes fits, the first it refuses does not
    off = sel.exact_offset
    for b in (1, 3, 8):
        n = sel.exact_below // b + off  # the longest request a step of b still scores exactly
        assert sel.takes_exact(b, n) and not sel.takes_exact(b, n + 1)
        assert sel.exact_pages(b, 1 << 20) * 64 >= n
    off_sel = PagedCacheSelector(codec(), 8, topk=16, candidates=64, head_dim=D, device=DEV, exact_below=0)
    assert not off_sel.takes_exact(1, 1) and off_sel.exact_pages(1, 10) == 0
    # the device predicate of a real step: a request just over the bound goes through the codes
    lengths, cache, table, q, w, lens = one_request(64 * 5 + 3)
    for over in (0, 1):
        step = PagedCacheSelector(codec(), 8, topk=16, candidates=64, prefilter=1, head_dim=D, device=DEV,
                                  exact_below=lengths[0] - 100 - over, exact_offset=100)
        step.select(cache, table, lens, q, w)
        assert (int(step.stats.stage1.sum()) == 0) == (over == 0)


def test_the_fold_scans_exact_path_bound_adds_its_fixed_part():
    """Stage 1 by the fold scan costs a step a fixed part the codes' does not (its operands, sampling and
    threshold): its exact-path bound is the codes' plus that part in keys. On the H100 (C = 4,096, P = 1, band 128K,
    tf32 operands) the folds' step took 0.128 / 0.157 ms at 1 / 2 x 1M against DeepGEMM's 0.106 / 0.159, and 0.160
    against 0.163 at 8 x 256K, 0.326 against 0.482 at 32 x 256K (docs/results/paged_folds_p1_tf32_h100.json)."""
    from dsaindex.coarse import PAGED_EXACT_BELOW, PAGED_FOLDS_EXTRA_BELOW

    pq32 = PQCodec(codebooks=torch.randn(32, 256, 4, generator=torch.Generator().manual_seed(0)))
    made = {kind: PagedCacheSelector(pq32, 8, topk=16, candidates=4096, prefilter=1, head_dim=128, device=DEV,
                                     grow_band=1 << 17, stage1=kind) for kind in ("codes", "folds")}
    assert made["folds"].exact_below == made["codes"].exact_below + PAGED_FOLDS_EXTRA_BELOW == (
        PAGED_EXACT_BELOW + PAGED_FOLDS_EXTRA_BELOW)
    # 6 x 256K: by the runs' lines 0.146 ms for the folds against 0.137 for DeepGEMM; the codes' step wins there
    assert made["folds"].takes_exact(6, 1 << 18) and not made["codes"].takes_exact(6, 1 << 18)
    assert made["folds"].takes_exact(1, 1 << 20)
    assert not made["folds"].takes_exact(2, 1 << 20) and not made["folds"].takes_exact(32, 1 << 18)
    assert not made["folds"].takes_exact(8, 1 << 20) and not made["folds"].takes_exact(64, 1 << 20)
    assert made["folds"].takes_exact(32, 1 << 16)  # 32 x 64K: the fixed part is more than the scan saves
    off = PagedCacheSelector(pq32, 8, topk=16, candidates=4096, prefilter=1, head_dim=128, device=DEV,
                             stage1="folds", exact_below=0)
    assert off.exact_below == 0 and not off.takes_exact(1, 1 << 16)  # no exact path stays none


@pytest.mark.parametrize("use_triton", [False, True])
def test_where_c_grows_the_exact_path_counts_the_longest_requests_grown_share(use_triton):
    """With C grown by length, a request's share of the codes' step grows with its stage-1 width, so the exact
    path's offset does too: B x (N - offset x g - extra x (g - 1)) <= bound, g N's growth. The rule is not
    monotone in N (a request
    just past a band's end costs the codes more than one just before it): the shapes decide only where every
    level's longest length takes the exact path, the exact path reads the pages its longest admitted length
    needs, and the device's predicate (one kernel) agrees with the host's."""
    from dsaindex.kernels.pq_select import grown_exact_rule

    prod = PagedCacheSelector(codec(), 8, topk=16, candidates=4096, prefilter=4, head_dim=D, device=DEV,
                              grow_band=1 << 17)
    fixed = PagedCacheSelector(codec(), 8, topk=16, candidates=4096, prefilter=4, head_dim=D, device=DEV)
    # a grown step's own offset: 4 x C at 512K and 1M is (9 x 4 - 4.5 x 3) = 22.5 stage-1 widths of 16K keys a
    # request, 2 x C at 256K is 13.5. With the final top-k spread over programs, the H200 put the codes ahead at
    # 2 x 1M (1.07x), 8 x 512K (1.06x) and 32 x 256K (1.04x), behind at 1 x 1M (0.86x) and 4 x 512K (0.95x)
    from dsaindex.coarse import PAGED_GROWN_OFFSET

    assert prod.exact_offset == PAGED_GROWN_OFFSET * 4 * 4096 != fixed.exact_offset
    assert prod.takes_exact(1, 1 << 20) and not prod.takes_exact(2, 1 << 20)
    assert not any(prod.takes_exact(b, 1 << 20) for b in (2, 4, 8, 16, 32, 64))
    assert prod.takes_exact(4, 1 << 19) and prod.takes_exact(7, 1 << 19) and not prod.takes_exact(8, 1 << 19)
    assert not fixed.takes_exact(8, 1 << 20) and not fixed.takes_exact(16, 1 << 20)
    assert prod.takes_exact(27, 1 << 18) and not prod.takes_exact(28, 1 << 18)  # 2 x C at 256K: the codes from 28
    assert fixed.takes_exact(28, 1 << 18) and not prod.takes_exact(64, 1 << 18) and not fixed.takes_exact(64, 1 << 18)
    assert not prod.takes_exact(16, 1 << 19) and not fixed.takes_exact(16, 1 << 19)  # 4 x C at 512K: 1.29x
    assert prod.takes_exact(64, 1 << 17) and fixed.takes_exact(64, 1 << 17)  # within the band: every step exact
    # a small selector: band 128 keys, growth to 4 x, offset 50, extra 10; a request of 323 keys grows 4 x
    # (share 50 x 4 + 10 x 3 = 230)
    lengths, cache, table, q, w, lens = one_request(64 * 5 + 3)
    for over in (0, 1):
        step = PagedCacheSelector(codec(), 8, topk=16, candidates=64, prefilter=1, head_dim=D, device=DEV,
                                  exact_below=lengths[0] - 230 - over, exact_offset=50, grow_band=128, grow_most=4,
                                  use_triton=use_triton, grown_extra=10)
        assert step._levels(table.shape[1]) == [(1, 128, 50), (129, 256, 110), (257, 384, 230)]
        assert not step.always_exact(1, table.shape[1])  # 384 keys would not: the step's lengths decide
        assert step.exact_pages(1, table.shape[1]) == -(-(lengths[0] - over) // 64)
        step.select(cache, table, lens, q, w)
        assert (int(step.stats.stage1.sum()) == 0) == (over == 0) == step.takes_exact(1, lengths[0])
    from dsaindex.errors import DsaIndexError

    # a negative extra given by hand is kept (shares growing slower than g, as the default's), down to -offset
    slow = PagedCacheSelector(codec(), 8, topk=16, candidates=64, prefilter=1, head_dim=D, device=DEV, exact_below=10,
                              exact_offset=50, grow_band=128, grow_most=4, use_triton=use_triton, grown_extra=-20)
    assert slow._levels(table.shape[1]) == [(1, 128, 50), (129, 256, 80), (257, 384, 140)]
    with pytest.raises(DsaIndexError, match="grown_extra"):
        PagedCacheSelector(codec(), 8, topk=16, candidates=64, prefilter=1, head_dim=D, device=DEV, exact_below=10,
                           exact_offset=50, grow_band=128, grow_most=4, use_triton=use_triton, grown_extra=-51)
    for n in (100, 128, 129, 200, 250, 256, 257, 300, 384):  # the device's predicate is the host's
        for bound in (1, 60, 130, 170):
            for extra in (0, 10, -10):  # a share growing slower than g too
                got = grown_exact_rule(torch.tensor([3, n, 17], device=DEV), bound, 50, 128, 4, use_triton=use_triton,
                                       extra=extra)
                assert bool(got) == takes_exact_path(1, n, bound, 50, (128, 4), extra), (n, bound, extra)
                pair = grown_exact_rule(torch.tensor([3, n, 17], device=DEV), bound, 50, 128, 4, use_triton=use_triton,
                                        extra=extra, both=True)  # the codes' conditional node reads the second
                assert pair.tolist() == [bool(got), not bool(got)], (n, bound, extra)


@pytest.mark.parametrize("use_triton", [False, True])
def test_an_eager_first_step_on_the_codes_path_compiles_the_exact_path_within_its_pages(monkeypatch, use_triton):
    """The first eager step runs the path it did not choose too (compiled before a graph capture). On a step
    whose requests are longer than the pages the exact path reads, that run gets lengths within those pages
    and no schedule: DeepGEMM's paged logits write a column for every key of a request's length, so the
    real lengths would write past its output (a step of 64 x 1M keys on the H200 faulted)."""
    import dsaindex.runtime.paged_select as ps

    seen = []
    real = ps.rows_topk if use_triton else ps.rows_topk_reference

    def spy(logits, lengths, k, **options):
        seen.append((int(lengths.max()), logits.shape[1]))
        return real(logits, lengths, k, **options)

    monkeypatch.setattr(ps, "rows_topk" if use_triton else "rows_topk_reference", spy)
    lengths = [64 * 9 + 5, 64 * 4]
    cache, table, _ = engine_cache(lengths, 16)
    q, w = queries(2)
    sel = PagedCacheSelector(codec(), 16, topk=16, candidates=64, prefilter=1, head_dim=D, device=DEV,
                             exact_below=2 * 64, exact_offset=64, use_triton=use_triton)
    assert sel.exact_pages(2, table.shape[1]) == 2 < table.shape[1]
    want = exact(cache, table, lengths, q, w, 16)
    got = sel.select(cache, table, torch.tensor(lengths, device=DEV), q, w)
    assert sel._warm == {"exact", "pq"} and int(sel.stats.stage1.sum()) > 0  # the codes' step was served
    assert seen and all(longest <= columns for longest, columns in seen), seen
    assert recall(got, want) > 0.9


def test_the_startup_description_states_the_exact_path_bound_and_the_bins_rule():
    """What a server logs of the step's own choices: the exact path's bound and offset (or none), and per
    stage-1 width the largest step whose candidates are kept by bins (``auto``'s rule)."""
    from dsaindex.coarse import PAGED_EXACT_BELOW, PAGED_EXACT_OFFSET
    from dsaindex.runtime.paged_select import describe_step

    text = describe_step(PAGED_EXACT_BELOW, [4 * 4096, 8 * 4096, 4 * 4096])
    assert f"<= {PAGED_EXACT_BELOW:,} (DSAINDEX_EXACT_BELOW)" in text and f"{PAGED_EXACT_OFFSET} x P x C" in text
    assert "up to 16 requests at a stage 1 of 16,384 keys, up to 8 requests at a stage 1 of 32,768 keys" in text
    sel = PagedCacheSelector(codec(), 8, topk=16, candidates=4096, prefilter=8, head_dim=D, device=DEV)
    assert sel.auto_top_c(8) == "bins" and sel.auto_top_c(9) == "topk"  # what the text says
    off = describe_step(0, [1 << 20])
    assert "no exact path" in off and "no step at a stage 1 of 1,048,576 keys" in off
    assert "can grow" not in text and "by bins at any batch size where a request's C can grow" in \
        describe_step(0, [16384], grows=True)


def test_the_stage1_kernel_is_chosen_and_said():
    """``scan="auto"`` (the default) takes the CUDA scan only where it runs (a CUDA device, 32 subspaces of 256
    centroids); here, without one, the selector runs Triton's, the startup text says so and why, and an
    explicit ``scan="cuda"`` is refused with the reason rather than run."""
    from dsaindex.errors import DsaIndexError
    from dsaindex.kernels.pq_scan_cuda import available
    from dsaindex.runtime.paged_select import describe_step, stage1_scan

    pq = codec()
    sel = PagedCacheSelector(pq, 8, topk=16, candidates=64, prefilter=4, head_dim=D, device=DEV)
    cpu = torch.device("cpu")
    assert sel.scan == ("cuda" if DEV.startswith("cuda") and available() and pq.codebooks.shape[:2] == (32, 256)
                        else "triton")
    said = stage1_scan([pq], cpu)
    assert said == "stage 1 runs the Triton scan (no CUDA device with NVRTC here)"
    assert said in describe_step(0, [256], said)
    if not DEV.startswith("cuda"):
        with pytest.raises(DsaIndexError, match="scan 'cuda'"):
            PagedCacheSelector(pq, 8, topk=16, candidates=64, prefilter=4, head_dim=D, device=DEV, scan="cuda")
    with pytest.raises(DsaIndexError, match="scan 'fast'"):
        PagedCacheSelector(pq, 8, topk=16, candidates=64, prefilter=4, head_dim=D, device=DEV, scan="fast")


def test_the_startup_text_names_stage_2s_operands_where_the_cuda_kernels_run(monkeypatch):
    """Where the CUDA scan runs on PQ32 codes the startup text says stage 2 runs the CUDA kernel, and on which
    operands: 8-bit where that form compiles (``stage2="auto"`` takes it), bf16 where only the bf16 form does."""
    import dsaindex.runtime.paged_select as ps
    from dsaindex.pq import PQCodec

    pq32 = PQCodec(torch.randn(32, 256, 4))
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(ps, "resolve_scan", lambda *a: "cuda")
    monkeypatch.setattr(ps, "stage2_compiles", lambda device, int8=False: True)
    said = ps.stage1_scan([pq32], gpu)
    assert said.startswith("stage 1 looks codes up in shared memory") and "(the CUDA kernel, 8-bit operands)" in said
    monkeypatch.setattr(ps, "stage2_compiles", lambda device, int8=False: not int8)
    assert "(the CUDA kernel, bf16 operands)" in ps.stage1_scan([pq32], gpu)
    monkeypatch.setattr(ps, "stage2_compiles", lambda device, int8=False: False)
    assert "stage 2" not in ps.stage1_scan([pq32], gpu)


def test_the_exact_path_leaves_stale_pages_encoded_for_the_pq_steps_after_it():
    """The catch-up runs on both paths: a captured step that scores exactly still encodes the pages that
    complete, so the request's first PQ step (its batch grown past the bound) finds no stale code."""
    lengths = [64 * 3 + 10]
    cache, table, _ = engine_cache(lengths, 12, room=64 * 4)
    q, w = queries(1)
    sel = PagedCacheSelector(codec(), 12, topk=16, candidates=64, catch_up=4, head_dim=D, device=DEV,
                             exact_below=64 * 7, exact_offset=0)
    sel.select(cache, table, torch.tensor(lengths, device=DEV), q, w, eager_refresh=False)
    assert int(sel.stats.encoded.sum()) == 3 and int(sel.stats.stage1.sum()) == 0
    sel.exact_below = 0
    sel.select(cache, table, torch.tensor(lengths, device=DEV), q, w, eager_refresh=False)
    assert int(sel.stats.stale.sum()) == 0 and int(sel.stats.encoded.sum()) == 0 and int(sel.stats.stage1.sum()) > 0


def test_inside_a_capture_each_path_is_a_conditional_node_writing_one_output(monkeypatch):
    """Where torch puts conditional nodes in a captured graph, both paths are captured, each between its
    begin/end pair with complementary device predicates, into the same output; a stand-in graph records
    the calls (the CUDA semantics run in the GPU test)."""
    from dsaindex.runtime import paged_select

    calls = []

    class Recording:
        def begin_capture_to_if_node(self, pred):
            calls.append(("begin", bool(pred)))

        def end_capture_to_conditional_node(self):
            calls.append(("end",))

    lengths = [700, 200]
    cache, table, _ = engine_cache(lengths, 20)
    q, w = queries(2)
    lens = torch.tensor(lengths, device=DEV)
    sel = PagedCacheSelector(codec(), 20, topk=16, candidates=64, head_dim=D, device=DEV, exact_below=2 * 700,
                             exact_offset=0)
    runs, picks = [], []
    real_run = sel._run

    def run(path, *a):
        runs.append(path)
        picked, counts = real_run(path, *a)
        picks.append(picked.clone())
        return picked, counts

    monkeypatch.setattr(sel, "_run", run)
    monkeypatch.setattr(paged_select, "_capturing_graph", lambda device: Recording())
    got = sel.select(cache, table, lens, q, w, eager_refresh=False)
    assert calls == [("begin", True), ("end",), ("begin", False), ("end",)] and runs == ["exact", "pq"]
    # the last body's own picks (a second run of the codes' path may break ties among equal codes otherwise on a
    # GPU, whose atomics append in any order)
    assert torch.equal(got, picks[1]) and not torch.equal(picks[0], picks[1])


def test_bad_input_names_the_problem():
    from dsaindex.errors import DsaIndexError

    cache, table, _ = engine_cache([100], 4)
    q, w = queries(1)
    with pytest.raises(DsaIndexError, match="built for 9"):
        PagedCacheSelector(codec(), 9, topk=8, head_dim=D, device=DEV).select(cache, table, torch.tensor([100]), q, w)
    with pytest.raises(DsaIndexError, match="at least topk"):
        PagedCacheSelector(codec(), 4, topk=8, candidates=4, head_dim=D, device=DEV)
    with pytest.raises(DsaIndexError, match="D=128"):
        PagedCacheSelector(codec(), 4, topk=8, head_dim=128, device=DEV)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("opq", [False, True])
def test_a_step_captured_in_a_cuda_graph_replays_as_eager_steps(opq):
    """The engines capture their decode step: the selection must replay with new lengths, pages and
    queries, and synchronize with the host nowhere (an OPQ codec's query rotation and page encoding too)."""
    lengths = [64 * 40 + 9, 64 * 25]
    cache, table, _ = engine_cache(lengths, 80, strided=True, room=70)
    layer = opq_codec() if opq else codec()
    sel = PagedCacheSelector(layer, 80, topk=32, candidates=256, head_dim=D, device=DEV, exact_below=0)
    ref = PagedCacheSelector(layer, 80, topk=32, candidates=256, head_dim=D, device=DEV, exact_below=0)
    static_seq = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    static_q, static_w = queries(2)
    sel.prepare(cache, table, static_seq)
    graph, static_out = captured(lambda: sel.select(cache, table, static_seq, static_q, static_w, eager_refresh=False),
                                 warmups=2, strict=True)
    for step in range(70):  # keys appended one per step: two pages complete inside the graph
        lens = [n + step for n in lengths]
        for b, n in enumerate(lens):  # the engine writes the new key into its page
            page, slot = int(table[b, (n - 1) // 64]), (n - 1) % 64
            x = clustered(1, torch.Generator().manual_seed(1000 + step * 2 + b))
            fp8, s = fp8_quantize(x)
            cache[page, slot * D : (slot + 1) * D] = fp8.view(torch.uint8).reshape(-1).to(DEV)
            cache[page, 64 * D + 4 * slot : 64 * D + 4 * slot + 4] = s.float().reshape(1).view(torch.uint8).to(DEV)
        q, w = queries(2, seed=step)
        static_seq.copy_(torch.tensor(lens, dtype=torch.int32))
        static_q.copy_(q)
        static_w.copy_(w)
        graph.replay()
        want = ref.select(cache, table, static_seq, q, w)
        assert as_sets(static_out) == as_sets(want), step
        assert int(sel.stats.stale.sum()) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.skipif(not hasattr(torch.cuda.CUDAGraph, "get_currently_capturing_graph"),
                    reason=f"torch {torch.__version__} puts no conditional nodes in a captured graph")
def test_one_captured_step_replays_the_exact_path_or_pq_as_each_step_needs():
    """Inside a CUDA graph the choice between the exact path and PQ is a pair of conditional nodes: one
    capture, replayed with lengths below and above the bound, gives each step what eager steps give."""
    lengths = [64 * 10 + 9, 64 * 6]
    cache, table, _ = engine_cache(lengths, 80, strided=True, room=64 * 30)
    bound = 2 * (64 * 20)  # B x longest: steps up to 1,280 keys a request are exact
    sel = PagedCacheSelector(codec(), 80, topk=32, candidates=64, prefilter=1, head_dim=D, device=DEV,
                             exact_below=bound, exact_offset=0)
    ref_exact = PagedCacheSelector(codec(), 80, topk=32, candidates=64, prefilter=1, head_dim=D, device=DEV,
                                   exact_below=1 << 30)
    ref_pq = PagedCacheSelector(codec(), 80, topk=32, candidates=64, prefilter=1, head_dim=D, device=DEV,
                                exact_below=0)
    static_seq = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    static_q, static_w = queries(2)
    full = torch.tensor([64 * 38, 64 * 30], dtype=torch.int32, device=DEV)
    for s in (sel, ref_exact, ref_pq):
        s.prepare(cache, table, full)
    step = lambda: sel.select(cache, table, static_seq, static_q, static_w, eager_refresh=False)  # noqa: E731
    graph, static_out = captured(step, strict=True)  # the eager warm-up runs both paths
    assert sel._warm == {"exact", "pq"}
    seen = set()
    for step, lens in enumerate([[640, 300], [1280, 1000], [1281, 100], [2400, 1900], [700, 64], [1900, 1280]]):
        q, w = queries(2, seed=50 + step)
        static_seq.copy_(torch.tensor(lens, dtype=torch.int32))
        static_q.copy_(q)
        static_w.copy_(w)
        graph.replay()
        is_exact = 2 * max(lens) <= bound
        ref = ref_exact if is_exact else ref_pq
        want = ref.select(cache, table, static_seq, q, w, eager_refresh=False)
        assert as_sets(static_out) == as_sets(want), (step, lens)
        assert (int(sel.stats.stage1.sum()) == 0) == is_exact, (step, lens)
        seen.add(is_exact)
    assert seen == {True, False}


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_a_captured_step_takes_the_exact_path_when_its_shapes_never_exceed_the_bound():
    """With the page table's width inside the bound (B x W x 64 keys), every replay is exact, whatever the
    lengths; no conditional node is needed. Checked against eager exact steps; the catch-up queued beside the
    exact path on the selector's side stream encodes the pages the replays complete."""
    lengths = [64 * 10 + 9, 64 * 6]
    cache, table, _ = engine_cache(lengths, 40, strided=True, room=64 * 8)
    sel = PagedCacheSelector(codec(), 40, topk=32, candidates=64, prefilter=1, head_dim=D, device=DEV,
                             exact_below=2 * table.shape[1] * 64, exact_offset=0, catch_up=24)
    ref = PagedCacheSelector(codec(), 40, topk=32, candidates=64, prefilter=1, head_dim=D, device=DEV,
                             exact_below=1 << 30)
    static_seq = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    static_q, static_w = queries(2)
    graph, static_out = captured(lambda: sel.select(cache, table, static_seq, static_q, static_w, eager_refresh=False))
    for step, lens in enumerate([[700, 300], [1100, 64], [40, 1]]):
        q, w = queries(2, seed=80 + step)
        static_seq.copy_(torch.tensor(lens, dtype=torch.int32))
        static_q.copy_(q)
        static_w.copy_(w)
        graph.replay()
        want = ref.select(cache, table, static_seq, q, w, eager_refresh=False)
        assert as_sets(static_out) == as_sets(want), (step, lens)
        assert int(sel.stats.stage1.sum()) == 0
    # the catch-up ran beside the exact path in every replay: the pages the replays completed hold codes
    sel.exact_below = 0
    lens = torch.tensor([1100, 64], dtype=torch.int32, device=DEV)
    sel.select(cache, table, lens, *queries(2), eager_refresh=False)
    assert int(sel.stats.stale.sum()) == 0 and int(sel.stats.stage1.sum()) > 0


# ---- OPQ: a codec with a learned rotation ----------------------------------------------------------
def opq_codec(seed=0):
    from dsaindex.pq import rotate
    from dsaindex.train.codebooks import train_codebooks, train_rotation

    keys = clustered(3000, torch.Generator().manual_seed(seed))
    spec = PQSpec(dim=D, subspaces=8)
    rotation = train_rotation(keys, spec, "torch", rounds=2, iterations=3, seed=seed)
    return PQCodec(train_codebooks(rotate(keys, rotation), spec, "torch", 6), rotation=rotation)


@pytest.mark.parametrize("with_metric", [False, True])
def test_page_encoding_of_an_opq_codec_matches_the_codec(with_metric):
    """The rotation folded into the whitening ([M, D/M, D] per subspace), whole keys projected in the kernel."""
    from dsaindex.kernels.paged_codes import encode_pages, encode_pages_reference, whitened_codebooks

    cache, table, keys = engine_cache([64 * 5], 8, strided=True)
    opq = opq_codec()
    cb, rot = opq.codebooks.to(DEV), opq.rotation.to(DEV)
    metric = None
    if with_metric:
        a = torch.randn(8, 4, 4, generator=torch.Generator().manual_seed(4))
        metric = (a @ a.transpose(1, 2) + 0.5 * torch.eye(4)).to(DEV)
    whitened, projection = whitened_codebooks(cb, metric, rot)
    assert projection.shape == (8, 4, D)
    pages = torch.cat([table[0, [3, 0, 2]].long().cpu(), torch.tensor([8])]).to(DEV)  # 8: the scratch page
    got = torch.full((9, 64, 8), 77, dtype=torch.uint8, device=DEV)
    want = got.clone()
    encode_pages(cache, pages, whitened, projection, got, D)
    encode_pages_reference(cache, pages, cb, metric, want, D, rot)
    listed = table[0, [3, 0, 2]].long()
    assert (got[listed] == want[listed]).float().mean() > 0.99  # float ties aside
    assert (got[8] == 77).all() and (got[table[0, 1].long()] == 77).all()
    # the reference is the codec's own encoder of the page's FP8 keys (rotated), not of the raw keys
    fp8_keys, scales = paged_keys_reference(cache, table[:, :1], D)
    page_keys = fp8_keys[0].view(torch.float8_e4m3fn).float() * scales[0, :, None]
    codec = PQCodec(cb, metric, rot)
    assert torch.equal(want[table[0, 0].long()], codec.encode(page_keys))
    assert not torch.equal(want[table[0, 0].long()], PQCodec(cb, metric).encode(page_keys))


def test_opq_codec_long_requests_keep_the_exact_topk_and_both_paths_agree():
    """C well below the history: the coarse stages decide, so the queries must be rotated into the codes'
    space (the same codes scored with unrotated queries lose much of the top-k)."""
    lengths = [2000, 1500]
    cache, table, _ = engine_cache(lengths, 60)
    q, w = queries(2)
    want = exact(cache, table, lengths, q, w, 32)
    codec = opq_codec()
    picks = []
    for use_triton in (True, False):
        sel = PagedCacheSelector(codec, 60, topk=32, candidates=128, prefilter=2, head_dim=D, device=DEV, exact_below=0,
                                 use_triton=use_triton)
        picks.append(sel.select(cache, table, torch.tensor(lengths, device=DEV), q, w))
        assert recall(picks[-1], want) >= 0.9, use_triton
    assert recall(picks[0], picks[1]) >= 0.95
    assert torch.equal(sel.rotation, codec.rotation.to(DEV))
    sel.rotation = None  # the same (rotated) codes, queries left unrotated
    assert recall(sel.select(cache, table, torch.tensor(lengths, device=DEV), q, w), want) < 0.8


# ---- the engines' layouts at the production shape (GPU) ----------------------------------------------
def _production_pages(keys: torch.Tensor) -> torch.Tensor:
    """Float keys [64 n, 128] -> n engine pages [n, 64 * 132] uint8 (64 x 128 FP8 bytes, then 64 float32 scales)."""
    fp8, scales = fp8_quantize(keys)
    n = keys.shape[0] // 64
    return torch.cat([fp8.view(torch.uint8).reshape(n, 64 * 128),
                      scales.float().reshape(n, 64).contiguous().view(torch.uint8)], dim=1)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="the production shape needs a GPU")
@pytest.mark.parametrize("layout", ["sglang", "vllm"])
def test_production_shape_leads_with_every_key_of_a_short_request_in_the_engines_layouts(layout):
    """V3.2's shape (64 heads x 128, top-2048, C = 4,096) in SGLang's [pages, 64 * 132] and vLLM's
    [blocks, 64, 132] (a view of a wider allocation) index-K caches: a request shorter than top-k has all its
    keys, the tail's newest included, in its first n entries and -1 after (in request positions and as SGLang's
    page_size=1 slots), a longer one top-k distinct keys; a captured step replays the same selection."""
    from dsaindex.train.codebooks import train_codebooks

    d, h, topk, c = 128, 64, 2048, 4096
    lengths = [1000, 2047, 64 * 70 + 3, 9000]
    g = torch.Generator().manual_seed(0)
    widths = [-(-n // 64) for n in lengths]
    num_pages = sum(widths) + 8
    keys = torch.randn(num_pages * 64, d, generator=g)
    pq = PQCodec(codebooks=train_codebooks(keys[:16384], PQSpec(dim=d, subspaces=32), "torch", 4))
    order = torch.randperm(num_pages, generator=g)
    table = torch.full((len(lengths), max(widths)), 0, dtype=torch.int32)
    used = 0
    for b, w in enumerate(widths):
        table[b, :w] = order[used : used + w].to(torch.int32)
        used += w
    rows = _production_pages(keys)
    if layout == "sglang":
        cache = rows.to(DEV)
    else:  # vLLM: [blocks, 64, 132], each block's bytes contiguous, blocks further apart (a view, as vLLM binds it)
        alloc = torch.zeros(num_pages, 64 * 132 + 256, dtype=torch.uint8, device=DEV)
        alloc[:, : 64 * 132] = rows.to(DEV)
        cache = alloc[:, : 64 * 132].unflatten(1, (64, 132))
    table, seq = table.to(DEV), torch.tensor(lengths, dtype=torch.int32, device=DEV)
    q = (torch.randn(len(lengths), h, d, generator=g) * 0.5).to(torch.float8_e4m3fn).to(DEV)
    w = (torch.rand(len(lengths), h, generator=g) * d**-0.5 * h**-0.5).to(DEV)
    sel = PagedCacheSelector(pq, num_pages, topk, candidates=c, head_dim=d, device=DEV, exact_below=0)
    got = sel.select(cache, table, seq, q, w)
    slots = to_slots(got, table)
    for b, n in enumerate(lengths):
        row = got[b].cpu()
        if n < topk:
            assert sorted(row[:n].tolist()) == list(range(n)), (layout, n)
            assert bool((row[n:] == -1).all()) and bool((slots[b, n:] == -1).all())
            assert bool((slots[b, :n] >= 0).all())
        else:
            assert bool((row >= 0).all()) and int(row.max()) < n and row.unique().numel() == topk
    graph, out = captured(lambda: sel.select(cache, table, seq, q, w, eager_refresh=False))
    graph.replay()
    torch.cuda.synchronize()
    assert as_sets(out) == as_sets(got)
    for b, n in enumerate(lengths):
        if n < topk:
            assert bool((out[b, :n] >= 0).all()) and bool((out[b, n:] == -1).all())


# ---- DSAINDEX_KEYS=host: the engine's cache in pinned host memory, read in place ------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="host-mapped memory needs a GPU")
def test_a_host_mapped_cache_takes_no_device_memory_and_selects_as_a_device_cache():
    """The runtime's ``host_mapped_zeros`` (what the SGLang plugin gives the served layers' index-K buffers):
    a CUDA tensor whose bytes are pinned host memory. Writing keys into it from the GPU, encoding its pages
    and a step captured in a CUDA graph give the selection of the same cache on the device."""
    from dsaindex.runtime.mapped import host_mapped_zeros

    lengths = [64 * 40 + 9, 64 * 25, 300]
    dev_cache, table, _ = engine_cache(lengths, 120)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    host = host_mapped_zeros(tuple(dev_cache.shape), torch.uint8, DEV)
    assert host.device.type == "cuda" and torch.cuda.memory_allocated() == before  # no device bytes
    host.copy_(dev_cache)  # a device-to-"device" copy: the GPU writes the host pages
    assert torch.equal(host.cpu(), dev_cache.cpu())
    seq = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    q, w = queries(3)
    on_dev = PagedCacheSelector(codec(), 120, topk=32, candidates=256, head_dim=D, device=DEV, exact_below=0)
    on_host = PagedCacheSelector(codec(), 120, topk=32, candidates=256, head_dim=D, device=DEV, exact_below=0)
    want = on_dev.select(dev_cache, table, seq, q, w)
    assert on_host.prepare(host, table, seq) == sum(n // 64 for n in lengths)
    assert torch.equal(on_host.codes, on_dev.codes)
    graph, out = captured(lambda: on_host.select(host, table, seq, q, w, eager_refresh=False))
    graph.replay()
    torch.cuda.synchronize()
    assert as_sets(out) == as_sets(want)
    assert torch.equal((out >= 0).sum(1), (want >= 0).sum(1))
    # the vLLM plugin's form: keys on the host, codes in the bytes the engine's pool kept for the layer
    pool = torch.zeros(120 + 3, 64, on_dev.codes.shape[2], dtype=torch.uint8, device=DEV)
    in_pool = PagedCacheSelector(codec(), 120, topk=32, candidates=256, head_dim=D, device=DEV, keys_on_host=True,
                                 codes=pool[3:])
    assert in_pool.prepare(host, table, seq) == sum(n // 64 for n in lengths)
    graph, out = captured(lambda: in_pool.select(host, table, seq, q, w, eager_refresh=False))
    graph.replay()
    torch.cuda.synchronize()
    assert as_sets(out) == as_sets(want) and bool((pool[:3] == 0).all())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="the Triton kernels' verify rows run on a GPU here")
def test_verify_rows_share_their_requests_pages_and_select_as_decode_steps():
    """MTP target verify (SGLang): next_n query rows per request, the request's page-table row repeated and
    lengths n - next_n + 1 ... n. Rows sharing stale pages encode them in the same launch (the catch-up of
    a captured step, no prepare); each row's selection is a decode step's at its length."""
    lengths, next_n = [64 * 30 + 5, 64 * 12 + 63], 4
    cache, table, _ = engine_cache(lengths, 60)
    rows_table = table.repeat_interleave(next_n, dim=0)
    rows_len = torch.tensor([n - next_n + 1 + j for n in lengths for j in range(next_n)], dtype=torch.int32,
                            device=DEV)
    q, w = queries(len(lengths) * next_n, seed=9)
    sel = PagedCacheSelector(codec(), 60, topk=32, candidates=256, head_dim=D, device=DEV, exact_below=0)
    for _ in range(16):  # 2 stale pages per row and step: the shared pages are done in 15 steps
        out = sel.select(cache, rows_table, rows_len, q, w, eager_refresh=False)
    assert int(sel.stats.stale.sum()) == 0
    one = PagedCacheSelector(codec(), 60, topk=32, candidates=256, head_dim=D, device=DEV, exact_below=0)
    for r in range(rows_len.shape[0]):
        want = one.select(cache, rows_table[r : r + 1], rows_len[r : r + 1], q[r : r + 1], w[r : r + 1])
        assert as_sets(out[r : r + 1]) == as_sets(want), r
        n = int(rows_len[r])
        assert int(out[r].max()) < n and int((out[r] >= 0).sum()) == min(32, n)  # no key past its own


@pytest.mark.parametrize("use_triton", [True, False])
def test_c_grows_with_each_requests_prefix_past_the_band_and_nowhere_else(use_triton):
    """``grow_band``: a request's C (and stage-1 width) doubles for each doubling of its keys past the band, per
    request inside one step. A request within the band selects exactly as with a fixed C; a longer one keeps
    more of the exact top-k; stage 1 passes about its grown width to stage 2; the growth stops at ``grow_most``."""
    from dsaindex.errors import DsaIndexError
    from dsaindex.kernels.pq_select import grown_counts

    lengths = [400, 900, 2000]  # within the band, 2 x it, 4 x it (of 512 keys)
    cache, table, _ = engine_cache(lengths, 60)
    q, w = queries(3)
    lens = torch.tensor(lengths, device=DEV)
    want = exact(cache, table, lengths, q, w, 32)
    book = codec()
    picks, stage1 = {}, {}
    for band in (0, 512):
        sel = PagedCacheSelector(book, 60, topk=32, candidates=32, prefilter=2, head_dim=D, device=DEV,
                                 exact_below=0, use_triton=use_triton, grow_band=band, grow_most=4)
        picks[band] = sel.select(cache, table, lens, q, w)
        stage1[band] = sel.stats.stage1.long().cpu()
        assert (picks[band] < lens[:, None]).all()
        assert all(row[row >= 0].unique().numel() == int((row >= 0).sum()) for row in picks[band])
    assert torch.equal(picks[512][0].sort().values, picks[0][0].sort().values)  # within the band: as a fixed C
    assert torch.equal(grown_counts(64, lens - lens % 64, 512, 4).cpu(), torch.tensor([64, 128, 256]))
    if use_triton:  # a sampled threshold aims at the width: about it, and at most twice it
        assert (stage1[512] >= torch.tensor([48, 96, 192])).all() and (stage1[512] <= torch.tensor([128, 256, 512])).all()
        assert stage1[512][0] == stage1[0][0]
    else:  # the torch path keeps what the threshold keeps in expectation: 1.5 x the width
        assert stage1[512].tolist() == [96, 192, 384] and stage1[0].tolist() == [96, 96, 96]
    longer = [recall(picks[band][2:], want[2:]) for band in (0, 512)]
    assert longer[1] > longer[0] + 0.1, longer
    capped = PagedCacheSelector(book, 60, topk=32, candidates=32, prefilter=2, head_dim=D, device=DEV, exact_below=0,
                                use_triton=use_triton, grow_band=512, grow_most=2)
    assert capped.growth(table.shape[1]) == (512, 2) and capped.growth(8) == (0, 1)  # 512 keys: no room to grow
    assert capped.auto_top_c(3, table.shape[1]) == "bins"
    for bad, match in (({"grow_band": -1}, "negative"), ({"grow_most": 3}, "power of two"),
                       ({"grow_most": 4096}, "power of two"), ({"top_c": "topk"}, "needs bins")):
        with pytest.raises(DsaIndexError, match=match):
            PagedCacheSelector(book, 60, topk=32, candidates=32, head_dim=D, device=DEV,
                               **{"grow_band": 512, "grow_most": 2, **bad})
