"""What vLLM's sparse attention computes from the plugin's indices is exact attention (CPU; vLLM 0.33.0).

vLLM's own CUDA-path code runs end to end: ``DeepseekV32Attention._sparse_indexer_and_attn`` (models/
deepseek_v32/attention.py) calls the hooked ``sparse_attn_indexer`` (the plugin writes
``topk_indices_buffer``), then the FlashMLA-sparse backend's ``FlashMLASparseImpl.forward_mqa`` (built by its
own ``__init__``, BF16 latent cache) reads that buffer, converts request-local positions to cache rows
through its ``SparseMLAIndexGroup`` and the block table, and runs the sparse kernel; the attention module
applies ``W_UV``. The metadata is built by ``FlashMLASparseMetadataBuilder.build`` from vLLM's
``CommonAttentionMetadata``. Geometry of DeepSeek-V3.2's attention: latent 512 + RoPE 64 (576-wide BF16
rows), 64-token pages, the indexer's 64 heads x 128 FP8 keys, top-2048.

Replaced by torch references (``sparse_mla.py``), at the kernel: FlashMLA's ``sparse_prefill_fwd``, the Triton
index remap (``triton_convert_req_index_to_global_index``) and token -> request map, ``concat_mla_q``, CUDA
streams/events, and the TP world size (1). The decode-only batch runs no DeepGEMM logits (the plugin skips
vLLM's exact scan), which the tests check. Replicated by shape only: the cache contents (the tests write the
FP8 index pages and BF16 latent rows), ``q_fp8``, ``weights`` and the MLA queries.
"""

from __future__ import annotations

import functools
import types

import pytest
import sparse_mla
import torch
import vllm.models.deepseek_v32.attention as cuda_path
from test_plugin import CFG, TOPK, H, build_layer, cuda_attention, exact_topk, vllm_config
from vllm.config import set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention.mla_attention import MLAAttention
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend, FlashMLASparseMetadata
from vllm.v1.attention.backends.mla.indexer import (
    DeepSeekV32IndexerDecodeMetadata,
    DeepseekV32IndexerMetadata,
)

from helpers import PAGE, D, synthetic_keys, write_keys

LATENT, ROPE = CFG.kv_lora_rank, CFG.qk_rope_head_dim  # 512 + 64: DeepSeek-V3.2's MLA cache row
HEADS, V_DIM = CFG.num_attention_heads, CFG.v_head_dim
SCALE = (CFG.qk_nope_head_dim + ROPE) ** -0.5
NUM_BLOCKS = 128  # of both caches (the block table's ids index both, as one KV-cache group)
ROWS = 16  # max_num_batched_tokens: the top-k buffer's rows


@pytest.fixture
def kernels(monkeypatch):
    """Install the torch references of the kernels that do not run on the CPU; count their calls."""
    import vllm._custom_ops as custom_ops
    import vllm.model_executor.layers.attention.sparse_mla_attention as sparse_mla_attention
    import vllm.v1.attention.backends.mla.flashmla_sparse as flashmla_sparse
    import vllm.v1.attention.backends.mla.index_group as index_group
    import vllm.v1.attention.ops.metadata as ops_metadata
    import vllm.v1.worker.workspace as workspace

    calls: dict[str, list] = {"attention": [], "convert": []}

    def attention(q, kv, indices, sm_scale, *args, **kwargs):
        calls["attention"].append(kwargs.get("topk_length"))
        return sparse_mla.flash_mla_sparse_fwd(q, kv, indices, sm_scale, *args, **kwargs)

    def convert(req_id, block_table, token_indices, *args, **kwargs):
        calls["convert"].append(token_indices.clone())
        return sparse_mla.convert_req_index_to_global_index(req_id, block_table, token_indices, *args, **kwargs)

    monkeypatch.setattr(flashmla_sparse, "flash_mla_sparse_fwd", attention)
    monkeypatch.setattr(flashmla_sparse, "triton_convert_req_index_to_global_index", convert)
    monkeypatch.setattr(index_group, "triton_convert_req_index_to_global_index", convert)
    monkeypatch.setattr(index_group, "current_stream", sparse_mla.HostStream)
    monkeypatch.setattr(ops_metadata, "compute_token_to_req_indices", sparse_mla.compute_token_to_req_indices)
    monkeypatch.setattr(custom_ops, "concat_mla_q", sparse_mla.concat_mla_q)
    monkeypatch.setattr(sparse_mla_attention, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)  # the workspace's CUDA-cache release
    monkeypatch.setattr(workspace, "_manager", None)
    workspace.init_workspace_manager(torch.device("cpu"))
    return calls


def sparse_mla_attention_module(layer, cache, buffer, vc, gen):
    """vLLM's CUDA-path attention module (``cuda_attention``) with its real FlashMLA-sparse impl, a BF16 latent
    cache bound in the forward context, and ``W_UV`` [HEADS, 512, V]."""
    vc.scheduler_config.max_num_batched_tokens = ROWS  # sizes the impl's query workspace
    attn = cuda_attention(layer, cache, buffer, vc)
    attn.indexer.topk_indices_buffer = buffer  # DeepseekV32Indexer's; the impl reads the buffer through it
    with set_current_vllm_config(vc):
        attn.impl = FlashMLASparseBackend.get_impl_cls()(
            num_heads=HEADS, head_size=LATENT + ROPE, scale=SCALE, num_kv_heads=1, alibi_slopes=None,
            sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None, attn_type="decoder",
            kv_sharing_target_layer_name=None, q_lora_rank=CFG.q_lora_rank, kv_lora_rank=LATENT,
            qk_nope_head_dim=CFG.qk_nope_head_dim, qk_rope_head_dim=ROPE, qk_head_dim=CFG.qk_nope_head_dim + ROPE,
            v_head_dim=V_DIM, kv_b_proj=None, indexer=attn.indexer, topk_indices_buffer=buffer)
    group = attn.impl.index_group  # converts the logical top-k once per step on a side stream
    group.side_stream, group.logical_topk_ready, group.physical_topk_ready = (
        sparse_mla.HostStream(), sparse_mla.HostEvent(), sparse_mla.HostEvent())
    attn.hisparse_cache = None
    attn._use_sparse_mha = types.MethodType(MLAAttention._use_sparse_mha, attn)
    attn._fp8_kv_needs_view = attn._fp8_query = False  # BF16 cache ("auto")
    attn.kv_lora_rank, attn.num_local_heads, attn.v_head_dim = LATENT, HEADS, V_DIM
    attn.W_UV = (torch.randn(HEADS, LATENT, V_DIM, generator=gen) * LATENT**-0.5).to(torch.bfloat16)
    latent = torch.randn(NUM_BLOCKS, PAGE, LATENT + ROPE, generator=gen).to(torch.bfloat16)  # [blocks, 64, 576]
    vc.compilation_config.static_forward_context[attn.layer_name] = types.SimpleNamespace(kv_cache=latent)
    return attn, latent


def attention_metadata(block_table: torch.Tensor, lens: list[int], next_n: int) -> FlashMLASparseMetadata:
    """FlashMLASparseMetadataBuilder.build (vLLM's code) of a decode batch: ``next_n`` query rows per request,
    ``lens`` keys per request (the last row's)."""
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseMetadataBuilder

    b, rows = len(lens), len(lens) * next_n
    starts = torch.arange(0, rows + 1, next_n, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts.clone(), seq_lens=torch.tensor(lens, dtype=torch.int32),
        num_reqs=b, num_actual_tokens=rows, max_query_len=next_n, max_seq_len=max(lens),
        block_table_tensor=block_table, slot_mapping=torch.zeros(rows, dtype=torch.int64))
    builder = object.__new__(FlashMLASparseMetadataBuilder)  # the state build() reads (__init__ needs a GPU)
    builder.__dict__.update(
        req_id_per_token_buffer=torch.empty(ROWS, dtype=torch.int32), reorder_batch_threshold=256, use_pcp=False,
        _prefill_backend=None, kv_cache_spec=types.SimpleNamespace(block_size=PAGE), topk_tokens=TOPK,
        cp_kv_cache_interleave_size=1, use_fp8_kv_cache=False, fp8_use_mixed_batch=False)
    meta = builder.build(0, common)
    assert isinstance(meta, FlashMLASparseMetadata) and meta.num_decode_tokens == rows and meta.prefill is None
    return meta


def indexer_metadata(block_table: torch.Tensor, row_lens: list[int], next_n: int) -> DeepseekV32IndexerMetadata:
    """The indexer's decode metadata, vLLM's per-row ``seq_lens`` [B, next_n]."""
    b, rows = block_table.shape[0], len(row_lens)
    seq = torch.tensor(row_lens, dtype=torch.int32).view(b, next_n)
    dec = DeepSeekV32IndexerDecodeMetadata(block_table=block_table, seq_lens=seq,
                                           decode_lens=torch.full((b,), next_n, dtype=torch.int32),
                                           requires_padding=False, schedule_metadata=torch.zeros(1, dtype=torch.int32))
    return DeepseekV32IndexerMetadata(seq_lens=seq[:, -1].contiguous(), max_seq_len=int(seq.max()),
                                      slot_mapping=torch.zeros(rows, dtype=torch.int64), num_decodes=b,
                                      num_decode_tokens=rows, num_prefills=0, num_prefill_tokens=0, decode=dec)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per row: ||got - want|| / ||want||."""
    return (got.float() - want.float()).norm(dim=1) / want.float().norm(dim=1)


@pytest.mark.parametrize("keys", ["device", "host"])
@pytest.mark.parametrize("next_n", [1, 2], ids=["decode", "mtp_verify"])
def test_sparse_attention_over_the_plugins_indices_is_exact_attention(plugin, kernels, monkeypatch, next_n, keys):
    """A long request (3,005 keys, top-2048) and a short one (100 keys: every key attended), decode and MTP
    verify (next_n = 2), every key a candidate (C = 4,096): vLLM's call reaches the plugin once per step and
    vLLM's own exact scan does not run; the attention vLLM's FlashMLA-sparse path computes from the plugin's
    indices equals (per row, to BF16 rounding) the attention over the exact top-k of
    ``sum_h w_h relu(q_h . k)`` on the same FP8 keys; the short request's rows keep all their keys, the newest
    included. Side checks that this can fail: dropping a short row's newest key, or the long rows' newest page,
    changes vLLM's output; the indices reversed with padding first give vLLM's output unchanged (its index
    remap compacts valid entries to the front), but a kernel fed them as they are with the valid count (FlashMLA's
    ``topk_length``) reads only padding."""
    from dsaindex_vllm import op as plugin_op

    from dsaindex.runtime.paged_select import PagedCacheSelector

    monkeypatch.setattr(plugin_op, "_platform_is_cuda", lambda: True)  # vLLM's registry on CUDA
    engine_calls = []
    original = cuda_path.sparse_attn_indexer
    monkeypatch.setattr(cuda_path, "sparse_attn_indexer",  # vLLM's function, its calls counted (then hooked)
                        functools.wraps(original)(lambda *a, **k: engine_calls.append(1) or original(*a, **k)))
    vc = vllm_config(CFG.__class__(**{**CFG.to_dict(), "architectures": ["DeepseekV32ForCausalLM"]}))
    monkeypatch.setenv("DSAINDEX_KEYS", keys)
    layer, cache, buffer = build_layer(vc, rows=ROWS)
    assert layer.model_path == "function" and cuda_path.sparse_attn_indexer is not original
    if keys == "host":  # vLLM binds the pool view its planner sized from the layer's spec: the codes' bytes
        spec = cache.get_kv_cache_spec(vc)
        cache.bind_kv_cache(torch.zeros(cache.kv_cache.shape[0], 1, PAGE, spec.head_size, dtype=torch.uint8))
        assert spec.head_size == 32 and cache.kv_cache.shape[2] == D + 4 and cache._dsaindex_codes.shape[2] == 32
    gen = torch.Generator().manual_seed(17 + next_n)
    attn, latent = sparse_mla_attention_module(layer, cache, buffer, vc, gen)

    lens = [3000 + 5, 100]  # the last row's keys: more than top-k, and fewer
    b, rows = len(lens), len(lens) * next_n
    row_lens = [n - (next_n - 1 - j) for n in lens for j in range(next_n)]
    row_request = [i for i in range(b) for _ in range(next_n)]
    width = max(-(-n // PAGE) for n in lens)
    block_table = torch.randperm(NUM_BLOCKS, generator=gen)[: b * width].view(b, width).to(torch.int32)
    pages_flat = cache.kv_cache.view(cache.kv_cache.shape[0], -1)
    for i, n in enumerate(lens):
        write_keys(pages_flat, block_table[i].tolist(), synthetic_keys(n, seed=300 + i))
    if keys == "host":  # what the prefill step does: host-resident pages are encoded when they are written
        layer._selector().prepare(cache.kv_cache, block_table, torch.tensor(lens))
    q_fp8 = (synthetic_keys(rows * H, seed=31).view(rows, H, D) * 0.5).to(torch.float8_e4m3fn)
    weights = torch.rand(rows, H, generator=gen) * (D**-0.5) * (H**-0.5)
    ql_nope = torch.randn(rows, HEADS, LATENT, generator=gen).to(torch.bfloat16)  # q_nope absorbed by W_UK
    q_pe = torch.randn(rows, HEADS, ROPE, generator=gen).to(torch.bfloat16)
    q_mla = torch.cat([ql_nope, q_pe], dim=-1).float()
    for r, n in enumerate(row_lens):  # each row's newest key draws attention (~10% of a short row's), as recent
        blk = block_table[row_request[r], (n - 1) // PAGE]  # tokens do: missing it must show
        latent[blk, (n - 1) % PAGE] = (1.5 * q_mla[r].mean(dim=0)).to(torch.bfloat16)
    selects = []
    real_select = PagedCacheSelector.select
    monkeypatch.setattr(PagedCacheSelector, "select", lambda self, *a: selects.append(1) or real_select(self, *a))
    metadata = {cache.prefix: indexer_metadata(block_table, row_lens, next_n),
                attn.layer_name: attention_metadata(block_table, lens, next_n)}

    def vllm_attention(indices: torch.Tensor | None = None) -> torch.Tensor:
        """One step of vLLM's ``_sparse_indexer_and_attn``: [rows, HEADS * V]. ``indices``: skip the indexer
        (vLLM's ``skip_topk`` layers) and attend over these instead."""
        attn.skip_topk = indices is not None
        if indices is not None:
            buffer[:rows] = indices
        output = torch.full((rows, HEADS * V_DIM), float("nan"), dtype=torch.bfloat16)
        with set_current_vllm_config(vc), set_forward_context(metadata, vc):
            cuda_path.DeepseekV32Attention._sparse_indexer_and_attn(
                attn, torch.arange(rows), torch.zeros(rows, 16, dtype=torch.bfloat16), None, None, q_fp8, None,
                weights, None, None, ql_nope, q_pe, output)
        attn.skip_topk = False
        return output.float()

    buffer.fill_(12345)
    served = vllm_attention()
    picked = buffer[:rows].clone()
    # (a) vLLM's call reached the plugin's selector once, vLLM's own indexer (DeepGEMM logits) not at all; the
    # sparse kernel read exactly what the plugin wrote
    assert len(selects) == 1 and engine_calls == [] and len(kernels["attention"]) == 1
    assert torch.equal(kernels["convert"][0], picked)
    assert kernels["attention"][0].tolist() == [min(n, TOPK) for n in row_lens]  # keys each row's kernel reads
    assert layer.selector.stats.stage1.tolist() == [n // PAGE * PAGE for n in row_lens]
    assert layer.selector.keys_on_host == (keys == "host")

    # (b) the exact top-k of the indexer score over the same FP8 keys, and attention over it (the spec)
    _, exact = exact_topk(pages_flat, block_table.repeat_interleave(next_n, 0), row_lens, q_fp8, weights)
    chosen = [r[r >= 0] for r in exact]
    want = sparse_mla.exact_mla_decode(latent, block_table, row_request, chosen, ql_nope, q_pe, attn.W_UV, SCALE)
    err = relative_error(served, want)
    assert bool((err < 1e-2).all()), err  # BF16 output and W_UV product
    for r, n in enumerate(row_lens):
        got = picked[r][picked[r] >= 0].long()
        assert torch.equal(got.sort().values, chosen[r].sort().values), r  # the same keys as the exact top-k
        if n <= TOPK:  # (c) a short request: all its keys, the newest included, valid entries first
            assert got.tolist() == picked[r, :n].long().tolist() and bool((picked[r, n:] == -1).all())
            assert sorted(got.tolist()) == list(range(n)) and n - 1 in got.tolist()
    exact_through_vllm = vllm_attention(torch.nn.functional.pad(exact, (0, TOPK - exact.shape[1]), value=-1).int())
    assert bool((relative_error(exact_through_vllm, served) < 1e-3).all())  # same keys, another order

    # side checks: the comparison sees a missing newest key (short rows) or newest page (long rows)
    short_rows = [r for r, n in enumerate(row_lens) if n <= TOPK]
    long_rows = [r for r, n in enumerate(row_lens) if n > TOPK]
    dropped = picked.clone()
    for r in short_rows:
        dropped[r][dropped[r] == row_lens[r] - 1] = -1
    for r in long_rows:
        dropped[r][dropped[r] >= row_lens[r] - PAGE] = -1
    missed = relative_error(vllm_attention(dropped), served)
    print(f"next_n={next_n}: error against exact attention {err.max():.2e}; without the newest keys {missed.min():.2e}")
    assert bool((missed > 3e-2).all()), missed
    # the bug fixed earlier, -1 padding first: vLLM's remap compacts the valid entries (same output) ...
    padded_first = picked.flip(1)
    assert bool((padded_first[short_rows, 0] == -1).all())
    assert bool((relative_error(vllm_attention(padded_first), served) < 1e-3).all())
    # ... a kernel fed them as they are, reading the first `valid count` entries, attends to padding only
    slots = sparse_mla.convert_req_index_to_global_index(torch.tensor(row_request, dtype=torch.int32), block_table,
                                                         padded_first, BLOCK_SIZE=PAGE, NUM_TOPK_TOKENS=TOPK)
    counts = (padded_first >= 0).sum(dim=1).int()
    q = torch.cat([ql_nope, q_pe], dim=-1)
    raw, _, _ = sparse_mla.flash_mla_sparse_fwd(q, latent.view(-1, 1, LATENT + ROPE), slots.view(rows, 1, -1), SCALE,
                                                topk_length=counts)
    in_order, _, _ = sparse_mla.flash_mla_sparse_fwd(q, latent.view(-1, 1, LATENT + ROPE),
                                                     slots.flip(1).contiguous().view(rows, 1, -1), SCALE,
                                                     topk_length=counts)
    assert bool((raw[short_rows] == 0).all()) and bool((in_order[short_rows].abs().sum(dim=(1, 2)) > 0).all())
