"""``DSAINDEX_KEYS=host``: the served layers' exact index keys leave the GPU. SGLang's own
``DSATokenToKVPool`` is built with the plugin's hooks applied; the served layers get a 0-row device
placeholder from SGLang's ``IndexKeyCache`` and their buffer from host memory, the pool sizing counts the
codes' bytes for them, and the selection over those buffers is the one over device buffers. (On the CPU
host memory is where every tensor lives; the GPU side, pinned memory read in place, is
``tests/test_mapped.py`` on the H200.)"""

from __future__ import annotations

import math

import pytest
from steps import LAYER, as_sets, build, exact_reference, run_sglang

CELL = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_dsa_indexer_cell_size"
PAGES = "sglang.srt.mem_cache.index_key_cache.IndexKeyCache._layer_num_pages"
KEYS = "sglang.srt.mem_cache.index_key_cache.IndexKeyCache.__init__"


@pytest.fixture
def host_keys(plugin, monkeypatch):
    import dsaindex_sglang.hooks as hooks

    monkeypatch.setattr(hooks.STATE, "keys", "host")
    calls = []
    real = __import__("dsaindex.runtime.mapped", fromlist=["host_mapped_zeros"]).host_mapped_zeros

    def counted(shape, dtype, device):
        calls.append(tuple(shape))
        return real(shape, dtype, device)

    monkeypatch.setattr("dsaindex.runtime.mapped.host_mapped_zeros", counted)
    for layer in hooks.STATE.selectors.values():
        monkeypatch.setattr(layer, "selector", None)
    return calls


def test_the_hooks_sit_on_sglangs_pool(plugin):
    import dsaindex_sglang.hooks as hooks
    from sglang.srt.mem_cache.index_key_cache import IndexKeyCache
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, kind, hook in ((CELL, HookType.AROUND, hooks.index_cell_size_around),
                               (PAGES, HookType.AROUND, hooks.index_pages_around),
                               (KEYS, HookType.AFTER, hooks.host_keys_after_init)):
        assert [(ht, h) for ht, h, _ in HookRegistry._hooks[target]] == [(kind, hook)]
        assert target in HookRegistry._patched
    assert IndexKeyCache._layer_num_pages.__wrapped__.__qualname__ == "IndexKeyCache._layer_num_pages"
    assert DefaultPoolConfigurator._compute_dsa_indexer_cell_size.__wrapped__.__qualname__.endswith(
        "_compute_dsa_indexer_cell_size")


def test_served_layers_keys_live_in_host_memory_and_select_the_same(plugin, host_keys, monkeypatch):
    monkeypatch.setenv("SGLANG_DSA_FUSE_TOPK", "0")
    lengths = [700, 2100, 4000]
    before = plugin["state"].host_key_bytes
    pool, buf, table, meta, q_fp8, weights = build(lengths, seed=31)
    cache = pool.index_key_cache
    served = sorted(plugin["state"].selectors)
    assert served == list(range(pool.layer_num))
    # SGLang's own allocation gave every served layer a 0-row placeholder; each buffer came from host memory
    num_pages = (pool.index_buf_size + pool.page_size + 1) // pool.page_size
    assert cache._layer_num_pages(0, num_pages) == 0
    assert host_keys == [cache._buffer_shape(num_pages)] * len(served)
    assert all(tuple(b.shape) == cache._buffer_shape(num_pages) for b in cache.buffer)
    assert plugin["state"].host_key_bytes - before == len(served) * num_pages * cache._buffer_shape(1)[1]
    # SGLang writes and reads them through its usual accessors; the selection is the exact one (C >= n)
    assert pool.get_index_k_with_scale_buffer(LAYER).data_ptr() == cache.buffer[LAYER].data_ptr()
    got = run_sglang(pool, meta, q_fp8, weights)
    _, want = exact_reference(buf, table, meta, q_fp8, weights)
    assert as_sets(got) == as_sets(want)


def test_device_mode_allocates_as_sglang_does(plugin):
    import dsaindex_sglang.hooks as hooks

    assert hooks.STATE.keys == "device"
    pool, *_ = build([300])
    cache = pool.index_key_cache
    num_pages = (pool.index_buf_size + pool.page_size + 1) // pool.page_size
    assert cache._layer_num_pages(0, num_pages) == num_pages


def test_pool_sizing_counts_codes_not_keys(plugin, host_keys):
    """The hook's arithmetic on SGLang's result (its configurator needs a published server config, not
    built here): per token, each served layer's 132 index-key bytes become the selector's code bytes."""
    from types import SimpleNamespace

    import dsaindex_sglang.hooks as hooks

    state = hooks.STATE
    layers = len(state.selectors)
    original = lambda self, *, kvc, num_layers, allocate_all_layers=False: 132 * num_layers  # noqa: E731
    kvc = SimpleNamespace(is_draft_worker=False, layer_info=SimpleNamespace(start_layer=0, end_layer=layers))
    got = hooks.index_cell_size_around(original, None, kvc=kvc, num_layers=layers)
    assert state.code_bytes == pytest.approx(32 + 33 / 64)  # PQ32 codes, the page signature and flag
    assert got == math.ceil(layers * state.code_bytes)
    assert got < 132 * layers / 4
    # the draft model's sizing (another layer count) and the draft worker are left alone
    assert hooks.index_cell_size_around(original, None, kvc=kvc, num_layers=1) == 132
    draft = SimpleNamespace(is_draft_worker=True, layer_info=kvc.layer_info)
    assert hooks.index_cell_size_around(original, None, kvc=draft, num_layers=layers) == 132 * layers
    state.keys = "device"
    assert hooks.index_cell_size_around(original, None, kvc=kvc, num_layers=layers) == 132 * layers
