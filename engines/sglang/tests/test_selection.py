"""(c) The plugin's decode selection, called through SGLang's (patched) ``Indexer._get_topk_paged`` with
inputs built by SGLang's own classes on the CPU: the index-K pool (``DSATokenToKVPool``), the attention
metadata (``DSAMetadata``, ``DSAIndexerMetadata``), the forward context and ``ForwardMode``. The exact
reference is dsaindex's torch score over the same pages, selected by SGLang's own torch top-k
(``DSAIndexerMetadata.topk_transform`` with the TORCH backend and SGLANG_DSA_FUSE_TOPK=0)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from bundles import key_sample

from dsaindex.kernels.fp8_score import fp8_scores_reference, paged_keys_reference
from dsaindex.quant import fp8_quantize

H, D, TOPK = 64, 128, 2048  # bench-v32: the production V3.2 indexer
LAYER = 2


def build(lengths, layer_num=4, seed=0, pages_extra=8):
    """SGLang's pool with keys written in its index-K page layout, its metadata for one decode step, a
    query per request. Pages are handed out in a shuffled order, as an allocator would."""
    from sglang.srt.layers.attention.dsa.dsa_indexer_metadata import DSAIndexerMetadata
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend, TopkTransformMethod
    from sglang.srt.layers.attention.dsa_backend import DSAMetadata
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    widths = [-(-n // 64) for n in lengths]
    n_pages = sum(widths) + pages_extra
    # sglang/srt/mem_cache/memory_pool.py:5279 DSATokenToKVPool (index_buf_size given: no parallel config here)
    pool = DSATokenToKVPool(size=n_pages * 64, page_size=64, kv_lora_rank=512, dtype=torch.bfloat16,
                            qk_rope_head_dim=64, layer_num=layer_num, device="cpu", index_head_dim=D,
                            enable_memory_saver=False, kv_cache_dim=576, index_buf_size=n_pages * 64)
    buf = pool.get_index_k_with_scale_buffer(LAYER)  # [pages, 64 * 132] uint8
    assert buf.shape[1] == 64 * (D + 4) and buf.dtype == torch.uint8
    order = torch.randperm(buf.shape[0] - 1, generator=g) + 1  # page 0 left unused
    table = torch.zeros(b, max(widths), dtype=torch.int32)
    at = 0
    for i, (n, w) in enumerate(zip(lengths, widths, strict=True)):
        pages = order[at : at + w]
        at += w
        table[i, :w] = pages.to(torch.int32)
        keys = key_sample(w * 64, D, seed=seed + 100 + i)
        fp8, scales = fp8_quantize(keys)
        fp8 = fp8.view(torch.uint8).view(w, 64, D)
        scales = scales.view(w, 64)
        fp8[(torch.arange(w * 64) >= n).view(w, 64)] = 0  # slots past the end: never written
        # the page layout of sglang/srt/mem_cache/index_key_cache.py:75-95: 64 x D key bytes, then 64 fp32 scales
        buf[pages, : 64 * D] = fp8.reshape(w, 64 * D)
        buf[pages, 64 * D :] = scales.contiguous().view(torch.uint8).reshape(w, 256)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    page_table_1 = (table.long().repeat_interleave(64, dim=1) * 64 + torch.arange(64).repeat(table.shape[1])).to(torch.int32)
    cu_k = torch.nn.functional.pad(seqlens.cumsum(0), (1, 0)).to(torch.int32)
    attn = DSAMetadata(  # sglang/srt/layers/attention/dsa_backend.py:246 (decode: one query per request)
        page_size=64, cache_seqlens_int32=seqlens, max_seq_len_q=1, max_seq_len_k=max(lengths),
        cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32), cu_seqlens_k=cu_k, page_table_1=page_table_1,
        real_page_table=table, dsa_cache_seqlens_int32=seqlens.clamp(max=TOPK),
        dsa_cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32),
        dsa_cu_seqlens_k=torch.nn.functional.pad(seqlens.clamp(max=TOPK).cumsum(0), (1, 0)).to(torch.int32),
        dsa_extend_seq_lens_list=[1] * b, dsa_seqlens_expanded=seqlens)
    meta = DSAIndexerMetadata(attn_metadata=attn, topk_transform_method=TopkTransformMethod.PAGED,
                              topk_backend=DSATopKBackend.TORCH)
    # queries: FP8 e4m3 [B, H, D] and weights [B, H, 1] float32, the shapes _get_topk_paged asserts
    # (dsa_indexer.py:1268 `len(q_fp8.shape) == 3`, :1331-1332 `len(weights.shape) == 3`, squeeze(2));
    # each query leans toward some of its request's keys so the top-k is not flat
    q = torch.randn(b, H, D, generator=g) * 0.2 + key_sample(b * H, D, seed=seed + 7).view(b, H, D)
    q_fp8, q_scale = fp8_quantize(q)
    weights = (torch.rand(b, H, 1, generator=g) * q_scale.view(b, H, 1) * H**-0.5 * D**-0.5).float()
    return pool, buf, table, meta, q_fp8, weights


def indexer():
    """An Indexer module with the attributes _get_topk_paged reads (dsa_indexer.py:301-306, 415-418);
    its projections are not needed: the step's queries and weights are given."""
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer

    idx = Indexer.__new__(Indexer)
    torch.nn.Module.__init__(idx)
    idx.index_topk, idx.n_heads, idx.head_dim, idx.layer_id = TOPK, H, D, LAYER
    idx.num_init_tokens = idx.num_local_tokens = 0
    return idx


def run_sglang(pool, meta, q_fp8, weights, rows=None):
    """SGLang's patched Indexer._get_topk_paged inside SGLang's forward context (which resolves the pool)."""
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    # a ForwardBatch has ~60 fields; the plugin and _get_topk_paged read forward_mode
    # (sglang/srt/model_executor/forward_batch_info.py:198 ForwardMode)
    batch = SimpleNamespace(forward_mode=ForwardMode.DECODE)
    with forward_context(ForwardContext(attn_backend=SimpleNamespace(token_to_kv_pool=pool))):
        return Indexer._get_topk_paged(indexer(), batch, LAYER, q_fp8, weights, meta)


def exact_reference(buf, table, meta, q_fp8, weights):
    """Exact scores of every key (dsaindex's torch reference over the same pages) and SGLang's own top-k
    of them (logical positions, -1 padded)."""
    keys, scales = paged_keys_reference(buf, table, D)
    logits = fp8_scores_reference(keys, scales, q_fp8.float(), weights.squeeze(2))
    return logits, meta.topk_transform(logits, TOPK)


def as_sets(sel):
    return [set(r[r >= 0].tolist()) for r in sel]


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


def test_layers_without_artifacts_and_other_modes_keep_sglangs_path(plugin, unfused):
    """The original _get_topk_paged runs (on a CPU it stops at its first CUDA-only step, which shows it
    was reached)."""
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    pool, buf, table, meta, q_fp8, weights = build([300])
    calls = plugin["state"].calls
    for layer, mode in ((7, ForwardMode.DECODE), (LAYER, ForwardMode.TARGET_VERIFY)):
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
