"""SGLang's own objects for one decode or target-verify step on the CPU: the index-K pool
(``DSATokenToKVPool``) with keys written in its page layout, the attention metadata (``DSAMetadata``,
``DSAIndexerMetadata``), the indexer module, and the call of its (patched) ``_get_topk_paged`` inside
SGLang's forward context; the exact reference of the same step."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from bundles import key_sample

from dsaindex.kernels.fp8_score import fp8_scores_reference, paged_keys_reference
from dsaindex.quant import fp8_quantize

H, D, TOPK = 64, 128, 2048  # bench-v32: the production V3.2 indexer
LAYER = 2


def build(lengths, layer_num=4, seed=0, pages_extra=8, next_n=1):
    """SGLang's pool with keys written in its index-K page layout, its metadata for one step, the indexer's
    queries and weights. Pages are handed out in a shuffled order, as an allocator would.

    ``next_n`` 1: a decode step, one query per request of ``lengths[i]`` keys. ``next_n`` > 1: a target
    verify step (MTP / speculative decoding) whose request i holds ``lengths[i]`` keys, its ``next_n``
    draft tokens included; its metadata is what the DSA backend builds for that mode
    (dsa_backend.py:1168-1188): one query row per draft token, the page table repeated ``next_n`` times
    per request and ``dsa_seqlens_expanded`` = lengths[i] - next_n + 1 ... lengths[i]."""
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
    expanded = (seqlens[:, None] - next_n + 1 + torch.arange(next_n, dtype=torch.int32)[None, :]).reshape(-1)
    rows = b * next_n
    table_rows = table.repeat_interleave(next_n, dim=0)
    page_table_1 = (table_rows.long().repeat_interleave(64, dim=1) * 64
                    + torch.arange(64).repeat(table.shape[1])).to(torch.int32)
    cu_k = torch.nn.functional.pad(seqlens.cumsum(0), (1, 0)).to(torch.int32)
    dsa_lens = expanded.clamp(max=TOPK)  # compute_dsa_seqlens (dsa/utils.py:159) without k-pooling
    attn = DSAMetadata(  # sglang/srt/layers/attention/dsa_backend.py:246
        page_size=64, cache_seqlens_int32=seqlens, max_seq_len_q=1, max_seq_len_k=max(lengths),
        cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32), cu_seqlens_k=cu_k, page_table_1=page_table_1,
        real_page_table=table_rows, dsa_cache_seqlens_int32=dsa_lens,
        dsa_cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32),
        dsa_cu_seqlens_k=torch.nn.functional.pad(dsa_lens.cumsum(0), (1, 0)).to(torch.int32),
        dsa_extend_seq_lens_list=[next_n] * b if next_n > 1 else [1] * b, dsa_seqlens_expanded=expanded,
        dsa_max_seqlen_q=1)
    meta = DSAIndexerMetadata(attn_metadata=attn, topk_transform_method=TopkTransformMethod.PAGED,
                              topk_backend=DSATopKBackend.TORCH)
    # queries: FP8 e4m3 [B, H, D] and weights [B, H, 1] float32, the shapes _get_topk_paged asserts
    # (dsa_indexer.py:1268 `len(q_fp8.shape) == 3`, :1331-1332 `len(weights.shape) == 3`, squeeze(2));
    # each query leans toward some of its request's keys so the top-k is not flat
    q = torch.randn(rows, H, D, generator=g) * 0.2 + key_sample(rows * H, D, seed=seed + 7).view(rows, H, D)
    q_fp8, q_scale = fp8_quantize(q)
    weights = (torch.rand(rows, H, 1, generator=g) * q_scale.view(rows, H, 1) * H**-0.5 * D**-0.5).float()
    return pool, buf, table_rows, meta, q_fp8, weights


def indexer():
    """An Indexer module with the attributes _get_topk_paged reads (dsa_indexer.py:301-306, 415-418);
    its projections are not needed: the step's queries and weights are given."""
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer

    idx = Indexer.__new__(Indexer)
    torch.nn.Module.__init__(idx)
    idx.index_topk, idx.n_heads, idx.head_dim, idx.layer_id = TOPK, H, D, LAYER
    idx.num_init_tokens = idx.num_local_tokens = 0
    return idx


def run_sglang(pool, meta, q_fp8, weights, mode=None):
    """SGLang's patched Indexer._get_topk_paged inside SGLang's forward context (which resolves the pool);
    ``mode`` a ``ForwardMode`` (default DECODE)."""
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    # a ForwardBatch has ~60 fields; the plugin and _get_topk_paged read forward_mode
    # (sglang/srt/model_executor/forward_batch_info.py:198 ForwardMode)
    batch = SimpleNamespace(forward_mode=mode or ForwardMode.DECODE)
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


