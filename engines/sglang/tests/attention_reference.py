"""Torch references of the attention kernels SGLang's DSA decode backends call, for the CPU.

Only the lowest level is replaced: SGLang's ``DeepseekSparseAttnBackend`` runs its own code (metadata,
index padding, the fused / unfused index transform, the head padding of FlashMLA, the FP8 quantization
call of ``flashmla_kv``), and where it would launch a CUDA kernel these run instead, with the kernels'
documented reading of the indices:

* FA3 ``flash_attn_with_kvcache`` with ``page_table`` of page size 1 (``_forward_fa3``): a query row
  attends to the KV slots in the first ``cache_seqlens[row]`` entries of its page-table row, every one
  of them (the kernel has no notion of a -1 entry: it would read out of bounds, so the reference
  refuses one instead);
* FlashMLA ``flash_mla_sparse_fwd`` (``_forward_flashmla_sparse``): the first ``topk_length[row]``
  entries of ``indices``, -1 skipped;
* FlashMLA ``flash_mla_with_kvcache`` with ``indices`` (``_forward_flashmla_kv``): every entry of
  ``indices``, -1 skipped, over the V3.2 FP8 cache layout (per token 512 FP8 e4m3 bytes, 4 float32
  tile scales, 64 bf16 rope values: 656 bytes), which :func:`quantize_k_cache` writes.
"""

from __future__ import annotations

import types

import torch

NOPE, ROPE, TILE = 512, 64, 128
FP8_ROW = NOPE + NOPE // TILE * 4 + ROPE * 2  # 656 bytes


class NegativeSlotRead(AssertionError):
    """The engine would hand an attention kernel a -1 slot inside the range it reads."""


def _attend(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, scale: float, d_v: int) -> torch.Tensor:
    """One query row [H, 576] over ``kv`` [N, 576] rows ``slots`` [n]: softmax(q k / sqrt) v, float32."""
    if slots.numel() == 0:
        return torch.zeros(q.shape[0], d_v)
    keys = kv[slots.long()].float()
    logits = q.float() @ keys.T * scale
    return torch.softmax(logits, dim=-1) @ keys[:, :d_v]


def fa3_with_kvcache(q, k_cache, v_cache, k, v, qv, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                     cache_leftpad, page_table, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, rotary_seqlens,
                     q_descale, k_descale, v_descale, softmax_scale, *rest, only_qv=False, **_):
    """FA3's paged decode in the positional order SGLang's wrapper passes (flash_attention_v3.py:149-184):
    q = rope part [rows, H, 64], qv = nope part [rows, H, 512], k_cache / v_cache [blocks, 1, 1, 64 / 512],
    page size 1."""
    rows = qv.shape[0]
    kv = torch.cat([v_cache.reshape(v_cache.shape[0], -1), k_cache.reshape(k_cache.shape[0], -1)], dim=1)
    qall = torch.cat([qv, q], dim=-1)
    outs = []
    for r in range(rows):
        n = int(cache_seqlens[r])
        slots = page_table[r, :n]
        if (slots < 0).any():
            raise NegativeSlotRead(f"row {r}: FA3 reads the first {n} entries and {int((slots < 0).sum())} of "
                                   "them are -1")
        outs.append(_attend(qall[r], kv, slots, softmax_scale, v_cache.shape[-1]))
    return torch.stack(outs).to(qv.dtype)


def load_fa3_kernels():
    return {"flash_attn_with_kvcache": fa3_with_kvcache, "flash_attn_varlen_func": None}


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, **_):
    """FlashMLA's sparse attention: q [rows, H, 576], kv [N, 1, 576], indices [rows, 1, topk]."""
    flat = kv.reshape(kv.shape[0], -1)
    outs = []
    for r in range(q.shape[0]):
        idx = indices[r, 0]
        if topk_length is not None:
            idx = idx[: int(topk_length[r])]
        outs.append(_attend(q[r], flat, idx[idx >= 0], sm_scale, d_v))
    o = torch.stack(outs).to(q.dtype)
    stats = torch.zeros(q.shape[0], q.shape[1])
    return o, stats, stats


def quantize_k_cache(cache_k, dv=None):
    """bf16 [..., 576] rows to the V3.2 FP8 layout [..., 656] (as uint8 viewed FP8): per 128-wide tile of
    the 512 nope values one float32 scale (amax / 448), then the rope values as bf16 bytes."""
    shape = cache_k.shape[:-1]
    x = cache_k.reshape(-1, NOPE + ROPE).float()
    tiles = x[:, :NOPE].reshape(-1, NOPE // TILE, TILE)
    scale = (tiles.abs().amax(-1).clamp_min(1e-12) / 448.0)
    fp8 = (tiles / scale[..., None]).to(torch.float8_e4m3fn).reshape(-1, NOPE)
    out = torch.cat([fp8.view(torch.uint8), scale.contiguous().view(torch.uint8),
                     x[:, NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)], dim=1)
    return out.view(torch.float8_e4m3fn).reshape(*shape, FP8_ROW)


def dequantize_rows(cache: torch.Tensor) -> torch.Tensor:
    rows = cache.reshape(-1, FP8_ROW).view(torch.uint8)
    fp8 = rows[:, :NOPE].contiguous().view(torch.float8_e4m3fn).float().reshape(-1, NOPE // TILE, TILE)
    scale = rows[:, NOPE : NOPE + 16].contiguous().view(torch.float32)
    rope = rows[:, NOPE + 16 :].contiguous().view(torch.bfloat16).float()
    return torch.cat([(fp8 * scale[..., None]).reshape(-1, NOPE), rope], dim=1)


def flash_mla_with_kvcache(q, k_cache, block_table=None, cache_seqlens=None, head_dim_v=512,
                           tile_scheduler_metadata=None, softmax_scale=None, is_fp8_kvcache=False, indices=None,
                           **_):
    """FlashMLA's sparse decode over the FP8 cache: q [rows, 1, H, 576], k_cache [blocks, 64, 1, 656],
    indices [rows, 1, topk] page_size=1 slots, every entry read, -1 skipped."""
    assert indices is not None and is_fp8_kvcache
    kv = dequantize_rows(k_cache)
    outs = []
    for r in range(q.shape[0]):
        idx = indices[r, 0]
        outs.append(_attend(q[r, 0], kv, idx[idx >= 0], softmax_scale, head_dim_v))
    return torch.stack(outs)[:, None].to(q.dtype), None


class SchedMeta:
    def __init__(self, tile_scheduler_metadata=None, num_splits=None):
        self.tile_scheduler_metadata, self.num_splits = tile_scheduler_metadata, num_splits


def flash_mla_module() -> types.ModuleType:
    """A stand-in for the compiled ``flash_mla`` package (what SGLang's ``flash_mla_interface`` imports)."""
    mod = types.ModuleType("flash_mla")
    mod.flash_mla_sparse_fwd = flash_mla_sparse_fwd
    mod.flash_mla_with_kvcache = flash_mla_with_kvcache
    mod.fused_norm_rope_attn_rope_cast = types.SimpleNamespace()
    iface = types.ModuleType("flash_mla.flash_mla_interface")
    iface.FlashMLASchedMeta = SchedMeta
    mod.flash_mla_interface = iface
    return mod
