"""(c) The plugin's decode selection, called through SGLang's (patched) ``Indexer._get_topk_paged`` with
inputs built by SGLang's own classes on the CPU: the index-K pool (``DSATokenToKVPool``), the attention
metadata (``DSAMetadata``, ``DSAIndexerMetadata``), the forward context and ``ForwardMode``. The exact
reference is dsaindex's torch score over the same pages, selected by SGLang's own torch top-k
(``DSAIndexerMetadata.topk_transform`` with the TORCH backend and SGLANG_DSA_FUSE_TOPK=0)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from steps import LAYER, TOPK, as_sets, build, exact_reference, indexer, run_sglang


@pytest.fixture
def unfused(monkeypatch):
    monkeypatch.setenv("SGLANG_DSA_FUSE_TOPK", "0")


def test_every_key_a_candidate_equals_the_exact_topk(plugin, unfused):
    lengths = [700, 2100, 4000, 4096]  # C = 4096: every completed page is a candidate
    pool, buf, table, meta, q_fp8, weights = build(lengths)
    got = run_sglang(pool, meta, q_fp8, weights)
    assert got.dtype == torch.int32 and got.shape == (len(lengths), TOPK)
    _, want = exact_reference(buf, table, meta, q_fp8, weights)
    assert want.dtype == torch.int32 and want.shape == got.shape
    for g, w, n in zip(as_sets(got), as_sets(want), lengths, strict=True):
        assert g == w and len(g) == min(n, TOPK)
    assert ((got == -1).sum(1) == torch.tensor([TOPK - min(n, TOPK) for n in lengths])).all()


def test_long_requests_keep_most_of_the_exact_topk(plugin, unfused):
    lengths = [20000, 12345, 64 * 150]
    pool, buf, table, meta, q_fp8, weights = build(lengths, seed=3)
    before = plugin["state"].calls
    got = run_sglang(pool, meta, q_fp8, weights)
    assert plugin["state"].calls == before + 1  # the plugin served it, not a fallback
    logits, want = exact_reference(buf, table, meta, q_fp8, weights)
    for i, (g, w) in enumerate(zip(as_sets(got), as_sets(want), strict=True)):
        assert len(g) == TOPK and all(0 <= p < lengths[i] for p in g)
        recall = len(g & w) / len(w)
        assert recall >= 0.9, f"request {i}: recall {recall:.3f}"
        # score mass: what is missed is near the boundary
        row = logits[i]
        assert row[list(g)].sum() >= 0.99 * row[list(w)].sum()
    # the incomplete tail page (12345 = 192 pages + 57 keys) is scored exactly: its keys can be selected
    tail = set(range(12345 - 57, 12345))
    assert (as_sets(got)[1] & tail) == (as_sets(want)[1] & tail)


def test_a_small_step_is_scored_as_sglang_scores_it(plugin, unfused, monkeypatch):
    """DSAINDEX_EXACT_BELOW: a step whose batch size times its longest request (less the selector's
    per-request offset) is at most the bound is the engine's own exact top-k (every key scored, stage 1
    passes nothing), through the same hook; one key over the bound, the same step goes through the codes."""
    lengths = [20000, 12345, 64 * 150]
    layer = plugin["state"].selectors[LAYER]
    pool, buf, table, meta, q_fp8, weights = build(lengths, seed=3)
    _, want = exact_reference(buf, table, meta, q_fp8, weights)
    monkeypatch.setattr(layer, "selector", None)  # rebuilt with the bound below
    monkeypatch.setattr(layer, "exact_below", 3 * 20000)
    got = run_sglang(pool, meta, q_fp8, weights)
    assert as_sets(got) == as_sets(want)
    assert int(layer.selector.stats.stage1.sum()) == 0
    layer.selector.exact_offset = 0  # the bound alone: B x N
    layer.selector.exact_below = 3 * 20000 - 1
    run_sglang(pool, meta, q_fp8, weights)
    assert int(layer.selector.stats.stage1.sum()) > 0


def test_fused_topk_returns_page_table_slots(plugin, monkeypatch):
    monkeypatch.setenv("SGLANG_DSA_FUSE_TOPK", "1")
    lengths = [900, 3000]
    pool, buf, table, meta, q_fp8, weights = build(lengths, seed=5)
    got = run_sglang(pool, meta, q_fp8, weights)
    monkeypatch.setenv("SGLANG_DSA_FUSE_TOPK", "0")
    _, want = exact_reference(buf, table, meta, q_fp8, weights)
    # what SGLang's fused transform emits: page_table_1[b, p] for each selected position p, -1 kept
    page_table_1 = meta.attn_metadata.page_table_1
    want_slots = torch.where(want >= 0, page_table_1.gather(1, want.long().clamp_min(0)).to(torch.int32),
                             torch.full_like(want, -1))
    assert as_sets(got) == as_sets(want_slots)


def test_pages_reused_by_another_request_are_encoded_again(plugin, unfused):
    selector = plugin["state"].selectors[LAYER]
    lengths = [64 * 80]
    pool, buf, table, meta, q_fp8, weights = build(lengths, seed=11)
    run_sglang(pool, meta, q_fp8, weights)
    first = selector.encoded_pages
    run_sglang(pool, meta, q_fp8, weights)
    assert selector.encoded_pages == first  # nothing new: codes are kept per page
    # another request's keys land in the same physical pages (freed and handed out again)
    _, buf2, _, _, _, _ = build(lengths, seed=12)
    buf.copy_(buf2)
    got = run_sglang(pool, meta, q_fp8, weights)
    assert selector.encoded_pages == first + 80
    _, want = exact_reference(buf, table, meta, q_fp8, weights)
    assert len(as_sets(got)[0] & as_sets(want)[0]) / TOPK >= 0.9


def test_prefill_hook_encodes_the_prompts_pages_before_decode(plugin, unfused):
    """The AFTER hook of SGLang's eager prefill top-k encodes every completed page, so the decode step
    (captured in SGLang's CUDA graph, where it cannot synchronize) finds the codes ready."""
    import dsaindex_sglang.hooks as hooks
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    lengths = [64 * 30 + 7, 64 * 12]
    pool, buf, table, meta, q_fp8, weights = build(lengths, seed=13)
    layer = plugin["state"].selectors[LAYER]
    layer.selector = None  # a fresh buffer: its selector starts with no codes
    before = 0
    batch = SimpleNamespace(forward_mode=ForwardMode.EXTEND)
    with forward_context(ForwardContext(attn_backend=SimpleNamespace(token_to_kv_pool=pool))):
        kept = object()
        assert hooks.encode_after_get_topk_ragged(kept, indexer(), False, batch, LAYER, q_fp8, weights, meta) is None
    assert layer.encoded_pages == before + 30 + 12
    got = run_sglang(pool, meta, q_fp8, weights)
    assert layer.encoded_pages == before + 30 + 12  # the decode step had nothing left to encode
    assert int(layer.selector.stats.stale.sum()) == 0
    _, want = exact_reference(buf, table, meta, q_fp8, weights)
    assert as_sets(got) == as_sets(want)  # C = 4096 covers every key here: the exact top-k


def test_pd_transfer_hook_encodes_the_arrived_pages(plugin, unfused):
    """On a PD decode node no prefill runs: the pages a KV transfer wrote are encoded when
    ``DecodeTransferQueue.pop_transferred`` hands their requests over (SGLang's own ``ReqToTokenPool`` maps
    each request's tokens to the pool's slots), so the first decode step finds nothing stale."""
    import dsaindex_sglang.hooks as hooks
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    lengths = [64 * 40 + 3, 64 * 7]
    pool, buf, table, meta, q_fp8, weights = build(lengths, seed=17)
    layers = plugin["state"].selectors
    for layer in layers.values():
        layer.selector = None  # a fresh node: no codes yet
    pt1 = meta.attn_metadata.page_table_1
    tokens = ReqToTokenPool(size=4, max_context_len=pt1.shape[1], device="cpu", enable_memory_saver=False)
    tokens.req_to_token[1:3] = pt1  # requests in pool rows 1 and 2
    reqs = [SimpleNamespace(req_pool_idx=1 + i, origin_input_ids=[0] * n) for i, n in enumerate(lengths)]
    queue = SimpleNamespace(scheduler=SimpleNamespace(
        req_to_token_pool=tokens, token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool)))
    before = plugin["state"].arrived_pages
    assert hooks.encode_after_pop_transferred(reqs, queue) is None
    assert plugin["state"].arrived_pages == before + len(layers) * (40 + 7)
    layer = layers[LAYER]
    assert layer.encoded_pages == 40 + 7
    got = run_sglang(pool, meta, q_fp8, weights)
    assert layer.encoded_pages == 40 + 7 and int(layer.selector.stats.stale.sum()) == 0
    _, want = exact_reference(buf, table, meta, q_fp8, weights)
    assert as_sets(got) == as_sets(want)
    # nothing arrived: nothing to do
    assert hooks.encode_after_pop_transferred([], queue) is None


def test_layers_without_artifacts_and_other_modes_keep_sglangs_path(plugin, unfused):
    """The original _get_topk_paged runs (on a CPU it stops at its first CUDA-only step, which shows it
    was reached)."""
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    pool, buf, table, meta, q_fp8, weights = build([300])
    calls = plugin["state"].calls
    for layer, mode in ((7, ForwardMode.DECODE), (LAYER, ForwardMode.DRAFT_EXTEND_V2)):
        batch = SimpleNamespace(forward_mode=mode)
        with forward_context(ForwardContext(attn_backend=SimpleNamespace(token_to_kv_pool=pool))):
            with pytest.raises(Exception):  # noqa: B017 - SGLang's own CUDA path cannot run here
                Indexer._get_topk_paged(indexer(), batch, layer, q_fp8, weights, meta)
    assert plugin["state"].calls == calls


def test_report_recall(plugin, unfused, capsys):
    """Not a contract: prints the recall at a few lengths (shown with -s)."""
    lengths = [8192, 20000, 32768]
    pool, buf, table, meta, q_fp8, weights = build(lengths, seed=21)
    got = run_sglang(pool, meta, q_fp8, weights)
    _, want = exact_reference(buf, table, meta, q_fp8, weights)
    for n, g, w in zip(lengths, as_sets(got), as_sets(want), strict=True):
        print(f"recall@{TOPK} at {n} keys (C=4096): {len(g & w) / len(w):.3f}")
