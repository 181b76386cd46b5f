"""``DSAINDEX_KEYS=host`` through vLLM's own KV cache planning, allocation and binding (CPU; vLLM 0.33.0).

Run through vLLM's code: ``get_kv_cache_groups`` / ``get_kv_cache_config_from_groups`` (how many blocks the
pool holds at a given free memory), ``resolve_kv_cache_layout`` with the backends' own layout preferences,
``allocate_kv_cache`` (the pool and each layer's view) and ``bind_kv_cache_to_layers``. The MLA layers'
spec is built as ``MLAAttention.get_kv_cache_spec`` builds it for ``fp8_ds_mla`` (656 bytes a token).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from test_plugin import CFG, TOPK, H, decode_metadata, exact_topk, vllm_config  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer  # noqa: E402
from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache  # noqa: E402
from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend  # noqa: E402
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups  # noqa: E402
from vllm.v1.kv_cache_interface import MLAAttentionSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache, bind_kv_cache_to_layers  # noqa: E402

from dsaindex.errors import DsaIndexError  # noqa: E402
from dsaindex.score import topk_agree  # noqa: E402
from helpers import PAGE, D, synthetic_keys, write_keys  # noqa: E402

LAYERS = (0, 1, 2)
FREE = 160 << 20  # the HBM vLLM found free for its KV pool
MLA_BYTES = 656  # fp8_ds_mla: 512 FP8 + 16 scales + 64 bf16 RoPE bytes a token (flashmla_sparse.py)


def mla_spec() -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=PAGE, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=torch.uint8,
                            cache_dtype_str="fp8_ds_mla", state_content_bytes=MLA_BYTES)


def served_model(layout: str | None = None):
    """The model's indexer layers built as vLLM builds them (cache, then op; nothing bound yet), vLLM's specs
    of every layer, its KV cache config at ``FREE`` bytes and its pool bound to the layers."""
    vc = vllm_config(CFG)
    vc.cache_config.block_size = PAGE  # the sparse MLA backends' block size
    with set_current_vllm_config(vc):
        caches, ops = {}, {}
        for i in LAYERS:
            prefix = f"model.layers.{i}.self_attn.indexer"
            cache = DeepseekV32IndexerCache(head_dim=D + D // 128 * 4, dtype=torch.uint8, prefix=f"{prefix}.k_cache",
                                            cache_config=vc.cache_config)
            buffer = torch.empty(16, TOPK, dtype=torch.int32)
            ops[i] = SparseAttnIndexer(cache, 128, "ue8m0", TOPK, D, 1 << 16, 1 << 16, buffer, skip_k_cache_insert=True)
            caches[cache.prefix] = cache
        specs = {f"model.layers.{i}.self_attn.attn": mla_spec() for i in LAYERS}
        specs.update({name: cache.get_kv_cache_spec(vc) for name, cache in caches.items()})
        preferred = [x.name for x in get_supported_kv_cache_layouts([DeepseekV32IndexerBackend])]
        vc.cache_config.kv_cache_layout = layout or resolve_kv_cache_layout(vc, [preferred], specs.values()).name
        config = get_kv_cache_config_from_groups(vc, get_kv_cache_groups(vc, specs), FREE)
        pool = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout[vc.cache_config.kv_cache_layout])
        context = {name: SimpleNamespace(bind_kv_cache=lambda t: None) for name in specs if name.endswith(".attn")}
        context.update(caches)
        bind_kv_cache_to_layers(pool, context)
    return SimpleNamespace(vc=vc, ops=ops, caches=caches, specs=specs, config=config, pool=pool)


def test_the_pool_counts_codes_and_admits_more_tokens_at_equal_memory(plugin, monkeypatch):
    device = served_model()
    monkeypatch.setenv("DSAINDEX_KEYS", "host")
    host = served_model()
    m = 32  # the bundle's PQ subspaces: bytes of codes a key
    # vLLM's own plan: blocks = free bytes over one block of every layer
    per_block = {name: spec.page_size_bytes for name, spec in host.specs.items()}
    assert all(per_block[n] == PAGE * m for n in host.caches)
    assert all(device.specs[n].page_size_bytes == PAGE * (D + 4) for n in device.caches)
    assert host.config.num_blocks == FREE // (len(LAYERS) * PAGE * (MLA_BYTES + m))
    assert device.config.num_blocks == FREE // (len(LAYERS) * PAGE * (MLA_BYTES + D + 4))
    assert host.config.num_blocks > device.config.num_blocks * 1.14  # (656 + 132) / (656 + 32) = 1.145
    # each served layer: its pool bytes hold its codes, its keys are a host buffer of vLLM's page shape
    raw = next(iter(host.pool.values()))
    start = raw.untyped_storage().data_ptr()
    end = start + raw.untyped_storage().nbytes()
    for cache in host.caches.values():
        codes = cache._dsaindex_codes
        assert codes.shape == (host.config.num_blocks, PAGE, m) and codes.is_contiguous()
        assert start <= codes.data_ptr() < end
        assert cache.kv_cache.shape == (host.config.num_blocks, PAGE, D + 4)
        assert not start <= cache.kv_cache.data_ptr() < end
    for cache in device.caches.values():
        assert not hasattr(cache, "_dsaindex_codes") and cache.kv_cache.shape[2] == D + 4


def test_a_host_resident_layer_selects_what_the_device_resident_layer_selects(plugin, monkeypatch):
    lens = [24000 + 5, 3000]
    width = max(-(-n // PAGE) for n in lens)
    table = torch.arange(1, 1 + len(lens) * width, dtype=torch.int32).view(len(lens), width)  # block 0: vLLM's null
    q = (synthetic_keys(len(lens) * H, seed=7).view(len(lens), H, D) * 0.5).to(torch.float8_e4m3fn)
    weights = torch.rand(len(lens), H, generator=torch.Generator().manual_seed(1)) * (D**-0.5) * (H**-0.5)
    picked = {}
    for keys in ("device", "host"):  # one model at a time: the op's registered torch op finds layers by name
        monkeypatch.setenv("DSAINDEX_KEYS", keys)
        model = served_model()
        op, cache = model.ops[1], model.caches["model.layers.1.self_attn.indexer.k_cache"]
        flat = cache.kv_cache.view(cache.kv_cache.shape[0], -1)
        for b, n in enumerate(lens):
            write_keys(flat, table[b].tolist(), synthetic_keys(n, seed=100 + b))
        op._selector().prepare(cache.kv_cache, table, torch.tensor(lens))  # what the prefill step does
        with set_forward_context({cache.prefix: decode_metadata(table, lens)}, model.vc):
            picked[keys] = op(torch.zeros(len(lens), 16, dtype=torch.bfloat16), q, None, weights)[: len(lens)].clone()
        assert op.selector.keys_on_host == (keys == "host")
        if keys == "host":
            assert op.selector.codes.data_ptr() == cache._dsaindex_codes.data_ptr()
            scores, want = exact_topk(flat, table, lens, q, weights)
    # the same keys (in another order: the host path rescores in blocks of 16 keys, the device path of 64)
    assert torch.equal(picked["host"].sort(1).values, picked["device"].sort(1).values)
    assert bool(topk_agree(scores[1:], picked["host"][1:].long(), want[1:], visible=torch.tensor(lens[1:]))[0])
    recall = len(set(picked["host"][0].tolist()) & set(want[0].tolist())) / TOPK
    assert recall >= 0.85, recall


def test_a_layout_that_interleaves_layers_in_a_block_is_refused_naming_the_fix(plugin, monkeypatch):
    monkeypatch.setenv("DSAINDEX_KEYS", "host")
    with pytest.raises(DsaIndexError) as err:
        served_model(layout="BLHNC")  # every layer's page of a block side by side: a layer's codes are strided
    assert "VLLM_KV_CACHE_LAYOUT" in err.value.fix and "DSAINDEX_KEYS=device" in err.value.fix


def test_a_kv_connector_is_refused_at_layer_build(plugin, monkeypatch):
    from test_plugin import build_layer

    monkeypatch.setenv("DSAINDEX_KEYS", "host")
    vc = vllm_config(CFG)
    object.__setattr__(vc, "kv_transfer_config", SimpleNamespace(kv_connector="NixlConnector"))
    with pytest.raises(DsaIndexError) as err:
        build_layer(vc, prefix="model.layers.0.self_attn.indexer")
    assert "KV connector" in str(err.value) and "DSAINDEX_KEYS=device" in err.value.fix
