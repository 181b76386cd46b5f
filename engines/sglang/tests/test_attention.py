"""(b) What SGLang's sparse attention computes from the plugin's indices, end to end on the CPU.

The plugin's selection comes out of SGLang's (patched) ``Indexer._get_topk_paged`` and goes into SGLang's
own ``DeepseekSparseAttnBackend.forward_decode`` (decode) or ``forward_extend`` (MTP target verify), for
each decode backend SGLang picks on Hopper and Blackwell: ``fa3``, ``flashmla_sparse`` and
``flashmla_kv``. Only the attention kernels themselves (FA3, FlashMLA, the FP8 MLA cache quantizer) are
torch references (``attention_reference``), which read the indices as the kernels do. With C = 4,096
every key of these requests is a candidate, so the attention output must be the one SGLang computes
from the exact top-k (its own torch top-k over exact index scores), for requests shorter than the top-k
(2,048: FA3 reads only the first min(n, 2048) entries, so the newest keys must be there) and longer."""

from __future__ import annotations

import dataclasses
import sys
from types import SimpleNamespace

import attention_reference as ref
import pytest
import torch
from steps import LAYER, TOPK, build, exact_reference, run_sglang

HQ = 16  # DeepSeek-V3.2's 128 query heads at tensor parallel 8
NOPE, ROPE = 512, 64


@pytest.fixture
def kernels(monkeypatch):
    """The CUDA kernels under SGLang's DSA backend replaced by torch references, nothing above them."""
    from sglang.kernels.ops.attention import flash_attention_v3 as fa3
    from sglang.srt.layers.attention import dsa_backend

    monkeypatch.setattr(fa3, "_load_fa3_kernels", ref.load_fa3_kernels)
    monkeypatch.setattr(fa3, "_is_fa3_supported", lambda *a, **k: True)  # the device check: an H200 is sm_90
    flash_mla = ref.flash_mla_module()
    monkeypatch.setitem(sys.modules, "flash_mla", flash_mla)
    monkeypatch.setitem(sys.modules, "flash_mla.flash_mla_interface", flash_mla.flash_mla_interface)
    monkeypatch.delitem(sys.modules, "sglang.kernels.ops.attention.flash_mla_interface", raising=False)
    monkeypatch.setattr(dsa_backend, "quantize_k_cache", ref.quantize_k_cache)
    monkeypatch.setattr(dsa_backend, "transform_index_page_table_decode", transform_decode)


def transform_decode(page_table, topk_indices, page_size=1):
    """SGLang's Triton ``transform_index_page_table_decode``: logical positions to page_size=1 slots."""
    slots = page_table.long().gather(1, topk_indices.long().clamp_min(0))
    return torch.where(topk_indices >= 0, slots, torch.full_like(slots, -1)).to(torch.int32)


def backend(pool, meta, impl: str, fused: bool):
    """SGLang's DSA attention backend with the state its decode / verify forward reads (what ``__init__``
    sets from a model runner on an H200, dsa_backend.py:510-790)."""
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend, DSAFlashMLAMetadata

    attn = meta.attn_metadata
    if impl == "flashmla_kv":
        rows = attn.dsa_cache_seqlens_int32.shape[0]
        attn = dataclasses.replace(attn, flashmla_metadata=DSAFlashMLAMetadata(
            flashmla_metadata=torch.zeros(1, dtype=torch.int32), num_splits=torch.zeros(rows + 1, dtype=torch.int32)))
    be = DeepseekSparseAttnBackend.__new__(DeepseekSparseAttnBackend)
    be.__dict__.update(
        forward_metadata=attn, token_to_kv_pool=pool, dsa_decode_impl=impl, dsa_prefill_impl="flashmla_sparse",
        use_fused_topk=fused, dsa_topk_backend=DSATopKBackend.SGL_KERNEL, hisparse_coordinator=None,
        dsa_index_kpool=1, num_splits=0, device_sm_major=9, _sink_pad_cache={}, flashmla_kv_num_q_heads=64,
        physical_page_size=64, kv_cache_dim=NOPE + ROPE, dsa_kv_cache_store_fp8=False, dsa_index_topk=TOPK,
        flashmla_kv_format="V32", use_mha=False, qk_rope_head_dim=ROPE)
    return be


def attention(pool, meta, impl, fused, indices, q_nope, q_rope, mode):
    """SGLang's backend forward for one step with ``indices`` as the indexer's output."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    be = backend(pool, meta, impl, fused)
    layer = SimpleNamespace(is_cross_attention=False, tp_q_head_num=HQ, tp_k_head_num=1, v_head_dim=NOPE,
                            head_dim=NOPE + ROPE, layer_id=LAYER, scaling=(NOPE + ROPE) ** -0.5, logit_cap=0.0)
    batch = SimpleNamespace(forward_mode=mode, batch_size=meta.attn_metadata.cache_seqlens_int32.shape[0],
                            extend_prefix_lens_cpu=None)
    forward = be.forward_decode if mode == ForwardMode.DECODE else be.forward_extend
    out = forward(q_nope.reshape(q_nope.shape[0], -1), None, None, layer, batch, save_kv_cache=False,
                  q_rope=q_rope, topk_indices=indices)
    return out.float().reshape(q_nope.shape[0], HQ, NOPE)


def step(lengths, fused, monkeypatch, next_n=1, seed=0):
    """(pool, metadata, the plugin's indices, the exact indices, MLA queries, mode) of one step."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    monkeypatch.setenv("SGLANG_DSA_FUSE_TOPK", "1" if fused else "0")
    mode = ForwardMode.DECODE if next_n == 1 else ForwardMode.TARGET_VERIFY
    pool, buf, table, meta, q_fp8, weights = build(lengths, seed=seed, next_n=next_n)
    kv = pool.get_key_buffer(LAYER)
    g = torch.Generator().manual_seed(seed + 1)
    kv.copy_(torch.randn(kv.shape, generator=g).to(kv.dtype))
    got = run_sglang(pool, meta, q_fp8, weights, mode=mode)
    monkeypatch.setenv("SGLANG_DSA_FUSE_TOPK", "0")  # SGLang's torch top-k: logical positions
    _, want = exact_reference(buf, table, meta, q_fp8, weights)
    if fused:  # what SGLang's fused transform would emit for them: page_table_1 slots
        pt1 = meta.attn_metadata.page_table_1
        want = torch.where(want >= 0, pt1.gather(1, want.long().clamp_min(0)).to(torch.int32), torch.full_like(want, -1))
    monkeypatch.setenv("SGLANG_DSA_FUSE_TOPK", "1" if fused else "0")
    rows = q_fp8.shape[0]
    q_nope = torch.randn(rows, HQ, NOPE, generator=g).to(torch.bfloat16)
    q_rope = torch.randn(rows, HQ, ROPE, generator=g).to(torch.bfloat16)
    return pool, meta, got, want, q_nope, q_rope, mode


LENGTHS = [300, 2047, 2100, 4000]  # shorter than the top-k (2,048), at it, longer (all <= C = 4,096)


@pytest.mark.parametrize("impl", ["fa3", "flashmla_sparse", "flashmla_kv"])
def test_decode_attention_equals_exact_selection(plugin, kernels, monkeypatch, impl):
    pool, meta, got, want, q_nope, q_rope, mode = step(LENGTHS, True, monkeypatch, seed=1)
    out = attention(pool, meta, impl, True, got, q_nope, q_rope, mode)
    exact = attention(pool, meta, impl, True, want, q_nope, q_rope, mode)
    torch.testing.assert_close(out, exact, atol=2e-3, rtol=2e-2)
    # the order the issue found (the newest key after the -1 padding, at the last column) is what each
    # backend would get wrong: FA3 reads a -1 slot, flashmla_sparse (topk_length) skips the newest key,
    # flashmla_kv reads every column and is indifferent to the order
    misplaced = want.clone()
    newest = int(meta.attn_metadata.page_table_1[0, LENGTHS[0] - 1])
    row = misplaced[0]
    row[row == newest] = -1
    row[-1] = newest
    if impl == "fa3":
        with pytest.raises(ref.NegativeSlotRead):
            attention(pool, meta, impl, True, misplaced, q_nope, q_rope, mode)
    else:
        moved = attention(pool, meta, impl, True, misplaced, q_nope, q_rope, mode)
        if impl == "flashmla_sparse":
            assert (moved[0] - exact[0]).abs().max() > 2e-2  # the tolerance tells the two apart
        else:
            torch.testing.assert_close(moved, exact, atol=2e-3, rtol=2e-2)


def test_unfused_decode_attention_equals_exact_selection(plugin, kernels, monkeypatch):
    """SGLANG_DSA_FUSE_TOPK=0: logical positions, mapped by SGLang's own transform in the backend."""
    pool, meta, got, want, q_nope, q_rope, mode = step(LENGTHS, False, monkeypatch, seed=2)
    out = attention(pool, meta, "fa3", False, got, q_nope, q_rope, mode)
    exact = attention(pool, meta, "fa3", False, want, q_nope, q_rope, mode)
    torch.testing.assert_close(out, exact, atol=2e-3, rtol=2e-2)


@pytest.mark.parametrize("impl", ["fa3", "flashmla_sparse", "flashmla_kv"])
def test_mtp_verify_is_served_and_equals_exact_selection(plugin, kernels, monkeypatch, impl):
    """Target verify with next_n = 4 (MTP's usual 3 draft tokens + 1): every query row selected by the plugin
    as a request of its own length, read by SGLang's verify forward."""
    state = plugin["state"]
    before = state.rows.get("target_verify", 0)
    lengths = [500, 2049, 3000]
    pool, meta, got, want, q_nope, q_rope, mode = step(lengths, True, monkeypatch, next_n=4, seed=3)
    assert state.rows["target_verify"] == before + 4 * len(lengths)  # served, not SGLang's fallback
    assert got.shape == (4 * len(lengths), TOPK)
    out = attention(pool, meta, impl, True, got, q_nope, q_rope, mode)
    exact = attention(pool, meta, impl, True, want, q_nope, q_rope, mode)
    torch.testing.assert_close(out, exact, atol=2e-3, rtol=2e-2)
    # a draft row sees its own prefix only: the first row of request 0 (497 keys) never selects the 3 later
    # draft tokens' slots
    pt1 = meta.attn_metadata.page_table_1
    later = set(pt1[0, 497:500].tolist())
    assert not later & set(got[0].tolist())
    assert set(pt1[3, 497:500].tolist()) <= set(got[3].tolist())


def test_mtp_verify_long_requests_keep_most_of_the_exact_topk(plugin, kernels, monkeypatch):
    from steps import as_sets

    lengths = [20000, 9000]
    pool, meta, got, want, *_ = step(lengths, False, monkeypatch, next_n=2, seed=4)
    for i, (g, w) in enumerate(zip(as_sets(got), as_sets(want), strict=True)):
        assert len(g) == TOPK
        assert len(g & w) / len(w) >= 0.9, f"row {i}"
