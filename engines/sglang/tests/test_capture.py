"""``DSAINDEX_CAPTURE`` through SGLang's own code (CPU; SGLang 0.5.23): the plugin's capture hooks registered in
SGLang's ``HookRegistry`` and applied by it; requests held by SGLang's ``ReqToTokenPool``, paged allocator
(``PagedTokenToKVPoolAllocator``) and ``DSATokenToKVPool``, with keys written in its index-K page layout; decode
steps through the patched ``Indexer._get_topk_paged`` inside SGLang's forward context; finished requests
released by SGLang's own (patched) ``release_kv_cache`` with a ``RadixCache`` and ``Req`` objects, under a
runtime context published as SGLang's launcher publishes it.

Replicated by shape only: the ``ForwardBatch`` handed to the ``ModelRunner.forward`` hook (a namespace with the
``forward_mode`` and ``rids`` SGLang's ``ForwardBatch.init_new`` sets, forward_batch_info.py:1102) and, as in
the other tests here, the step's FP8 queries and weights, and the ``Indexer`` module.
"""

from __future__ import annotations

import time
from array import array
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from bundles import key_sample
from conftest import run_json
from steps import TOPK, D, H, indexer

from dsaindex.artifacts.capture_store import CaptureStore
from dsaindex.kernels.fp8_score import paged_keys_reference
from dsaindex.quant import fp8_quantize

LAYERS = (0, 1, 2, 3)  # bench-v32's indexer layers


@pytest.fixture
def context():
    """SGLang's runtime context as its launcher publishes it (rank 0 of one process; ``published(...)`` again
    for another place), reset afterwards."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    def published(rank: int = 0, **server_args):
        reset_context()
        publish(ServerArgs(model_path="dummy", **server_args), role="test", ranks=SpawnRanks(world_rank=rank,
                                                                                              dp_rank=None))

    published()
    yield published
    reset_context()


@pytest.fixture
def capture(plugin, context, bench_dir, tmp_path, monkeypatch):
    """The capture's hooks registered and applied by SGLang's HookRegistry (the plugin was loaded with artifacts
    by conftest's ``plugin``), ``DSAINDEX_CAPTURE`` pointing at a fresh store; building SGLang's ModelConfig
    runs the startup check. The capture state is reset afterwards (its hooks then do nothing)."""
    import dsaindex_sglang
    from dsaindex_sglang.capture import CAPTURE
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.plugins.hook_registry import HookRegistry

    path = tmp_path / "store"
    monkeypatch.setenv("DSAINDEX_CAPTURE", str(path))
    monkeypatch.setenv("DSAINDEX_CAPTURE_QUERIES", "4")

    def start(**env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        CAPTURE.reset()
        dsaindex_sglang.register_capture()
        HookRegistry.apply_hooks()
        ModelConfig(str(bench_dir))
        return CAPTURE

    yield SimpleNamespace(path=path, start=start, state=CAPTURE)
    CAPTURE.reset()


class Server:
    """SGLang's pools for a few requests: ``prompts`` tokens each already prefilled (keys written in every indexer
    layer's index-K buffer), pages from SGLang's paged allocator, rows in its ReqToTokenPool."""

    def __init__(self, prompts: list[int], max_new: int, seed: int = 0):
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache
        from sglang.srt.sampling.sampling_params import SamplingParams

        pages = sum(-(-(n + max_new) // 64) for n in prompts) + 8
        # sglang/srt/mem_cache/memory_pool.py:5279, as tests/steps.py builds it
        self.pool = DSATokenToKVPool(size=pages * 64, page_size=64, kv_lora_rank=512, dtype=torch.bfloat16,
                                     qk_rope_head_dim=64, layer_num=len(LAYERS), device="cpu", index_head_dim=D,
                                     enable_memory_saver=False, kv_cache_dim=576, index_buf_size=pages * 64)
        self.allocator = PagedTokenToKVPoolAllocator(self.pool.size, 64, torch.bfloat16, "cpu", self.pool,
                                                     need_sort=False)
        self.rows = ReqToTokenPool(len(prompts) + 2, max(prompts) + max_new + 64, "cpu", False)
        self.tree = RadixCache(CacheInitParams(disable=True, req_to_token_pool=self.rows,
                                               token_to_kv_pool_allocator=self.allocator, page_size=64))
        self.g = torch.Generator().manual_seed(seed)
        self.reqs, self.slots, self.keys = [], [], []
        for i, n in enumerate(prompts):
            req = Req(f"req-{seed}-{i}", "", array("q", torch.randint(0, 1000, (n,), generator=self.g).tolist()),
                      SamplingParams(max_new_tokens=max_new))
            self.rows.alloc([req])
            slots = self.allocator.alloc(-(-(n + max_new) // 64) * 64)
            self.rows.write((req.kv.req_pool_idx, slice(0, len(slots))), slots.to(torch.int32))
            self.reqs.append(req)
            self.slots.append(slots)
            # each layer's keys of this request (index keys are per layer), FP8 as SGLang stores them
            self.keys.append({layer: fp8_quantize(key_sample(n + max_new, D, seed=1000 * seed + 10 * i + layer))
                              for layer in LAYERS})
            for p in range(n):
                self._write(i, p)
            req.output_ids.append(int(torch.randint(0, 1000, (1,), generator=self.g)))  # the prefill's token
            req.kv.kv_committed_len = req.kv.kv_allocated_len = n

    def _write(self, i: int, p: int) -> None:
        """Key ``p`` of request ``i`` into its slot, in the page layout of index_key_cache.py:75-95."""
        slot = int(self.slots[i][p])
        page, off = slot // 64, slot % 64
        for layer in LAYERS:
            fp8, scales = self.keys[i][layer]
            buf = self.pool.get_index_k_with_scale_buffer(layer)
            buf[page, off * D : (off + 1) * D] = fp8[p].view(torch.uint8)
            buf[page, 64 * D + off * 4 : 64 * D + (off + 1) * 4] = scales[p].reshape(1).view(torch.uint8)

    def table(self, reqs) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = torch.tensor([r.kv.kv_committed_len for r in reqs], dtype=torch.int32)
        width = int((lengths.max() + 63) // 64)
        table = torch.stack([self.rows.req_to_token[r.kv.req_pool_idx, 0 : width * 64 : 64] // 64 for r in reqs])
        return table.to(torch.int32), lengths

    def step(self, reqs) -> dict:
        """One decode step of ``reqs`` through every indexer layer's (patched) ``_get_topk_paged``, then the
        ``ModelRunner.forward`` hook. Returns {rid: (position, {layer: (q_fp8 row, weights row)})}."""
        from dsaindex_sglang import capture

        for r in reqs:  # the step's input token (the newest output) gets its key
            i = self.reqs.index(r)
            self._write(i, r.kv.kv_committed_len)
            r.kv.kv_committed_len += 1
            r.kv.kv_allocated_len = r.kv.kv_committed_len
        table, lengths = self.table(reqs)
        meta = decode_metadata(table, lengths)
        seen = {r.rid: (int(lengths[b]) - 1, {}) for b, r in enumerate(reqs)}
        for layer in LAYERS:
            q = torch.randn(len(reqs), H, D, generator=self.g) * 0.2 + key_sample(len(reqs) * H, D).view(-1, H, D)
            q_fp8, q_scale = fp8_quantize(q)
            weights = (torch.rand(len(reqs), H, 1, generator=self.g) * q_scale.view(-1, H, 1) * H**-0.5).float()
            got = run_layer(self.pool, meta, q_fp8, weights, layer)
            assert got.shape == (len(reqs), TOPK)  # the plugin's selection still served the step
            for b, r in enumerate(reqs):
                seen[r.rid][1][layer] = (q_fp8[b], weights[b, :, 0])
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, rids=[r.rid for r in reqs])
        capture.after_forward(None, SimpleNamespace(is_draft_worker=False), batch)
        for r in reqs:  # the token this step sampled
            r.output_ids.append(int(torch.randint(0, 1000, (1,), generator=self.g)))
        return seen

    def finish(self, req, reason=None) -> None:
        """SGLang's own release (the patched ``release_kv_cache``) of a request that finished with ``reason``
        (None: released unfinished, as a retraction does)."""
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH
        from sglang.srt.mem_cache import common

        req.finished_reason = FINISH_LENGTH(len(req.output_ids)) if reason == "length" else reason
        common.release_kv_cache(req, self.tree, checkpoint=False)
        assert req.kv.req_pool_idx is None  # SGLang freed the row (and the pages)

    def expected_keys(self, req, layer) -> torch.Tensor:
        """What the request's pages hold, dequantized (dsaindex's reference view of the engine's pages)."""
        table, lengths = self.table([req])
        keys, scales = paged_keys_reference(self.pool.get_index_k_with_scale_buffer(layer), table, D)
        n = int(lengths[0])
        return keys[0, :n].view(torch.float8_e4m3fn).float() * scales[0, :n, None]


def decode_metadata(table: torch.Tensor, seqlens: torch.Tensor):
    """SGLang's DSAMetadata + DSAIndexerMetadata of a decode step (as tests/steps.py builds them)."""
    from sglang.srt.layers.attention.dsa.dsa_indexer_metadata import DSAIndexerMetadata
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend, TopkTransformMethod
    from sglang.srt.layers.attention.dsa_backend import DSAMetadata

    b = table.shape[0]
    page_table_1 = (table.long().repeat_interleave(64, dim=1) * 64 + torch.arange(64).repeat(table.shape[1])).int()
    dsa_lens = seqlens.clamp(max=TOPK)
    attn = DSAMetadata(
        page_size=64, cache_seqlens_int32=seqlens, max_seq_len_q=1, max_seq_len_k=int(seqlens.max()),
        cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32),
        cu_seqlens_k=torch.nn.functional.pad(seqlens.cumsum(0), (1, 0)).to(torch.int32), page_table_1=page_table_1,
        real_page_table=table, dsa_cache_seqlens_int32=dsa_lens, dsa_cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32),
        dsa_cu_seqlens_k=torch.nn.functional.pad(dsa_lens.cumsum(0), (1, 0)).to(torch.int32),
        dsa_extend_seq_lens_list=[1] * b, dsa_seqlens_expanded=seqlens, dsa_max_seqlen_q=1)
    return DSAIndexerMetadata(attn_metadata=attn, topk_transform_method=TopkTransformMethod.PAGED,
                              topk_backend=DSATopKBackend.TORCH)


def run_layer(pool, meta, q_fp8, weights, layer):
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    module = indexer()
    module.layer_id = layer
    with forward_context(ForwardContext(attn_backend=SimpleNamespace(token_to_kv_pool=pool))):
        return Indexer._get_topk_paged(module, SimpleNamespace(forward_mode=ForwardMode.DECODE), layer, q_fp8,
                                       weights, meta)


def _source_tree(module: str):
    import ast
    import importlib.util

    return ast.parse(open(importlib.util.find_spec(module).origin).read())


def test_the_capture_hooks_sit_on_sglangs_functions(capture):
    """Registered and applied by SGLang's HookRegistry; ``ModelRunner`` does not import in this CPU environment
    (its launcher needs uvicorn), so its ``forward`` is checked in SGLang's source: the method exists and takes
    the ``ForwardBatch`` first, whose ``rids`` and ``forward_mode`` the hook reads."""
    import ast
    import dataclasses

    from dsaindex_sglang import FORWARD_TARGET, RELEASE_TARGET
    from dsaindex_sglang import capture as plugin_capture
    from sglang.srt.mem_cache import common
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    capture.start()
    assert [(t, h) for t, h, _ in HookRegistry._hooks[FORWARD_TARGET]] == [(HookType.AFTER, plugin_capture.after_forward)]
    assert [(t, h) for t, h, _ in HookRegistry._hooks[RELEASE_TARGET]] == [(HookType.BEFORE,
                                                                            plugin_capture.before_release)]
    assert RELEASE_TARGET in HookRegistry._patched
    assert common.release_kv_cache.__wrapped__.__qualname__ == "release_kv_cache"
    runner = next(n for n in _source_tree("sglang.srt.model_executor.model_runner").body
                  if isinstance(n, ast.ClassDef) and n.name == "ModelRunner")
    forward = next(n for n in runner.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    assert [a.arg for a in forward.args.args[:2]] == ["self", "forward_batch"]
    assert {"rids", "forward_mode"} <= {f.name for f in dataclasses.fields(ForwardBatch)}
    # the decode result processor binds the function by name from common: the registry rebinds it in modules
    # loaded before the hooks are applied, and a module loaded later imports the patched one
    imports = [n for n in ast.walk(_source_tree("sglang.srt.managers.scheduler_components.batch_result_processor"))
               if isinstance(n, ast.ImportFrom) and n.module == "sglang.srt.mem_cache.common"]
    assert any(a.name == "release_kv_cache" for n in imports for a in n.names)


def test_served_requests_are_captured_with_their_keys_and_sampled_queries(capture, monkeypatch, bench_dir):
    monkeypatch.setenv("SGLANG_DSA_FUSE_TOPK", "0")
    state = capture.start()
    server = Server([700, 1300, 130, 400], max_new=12, seed=1)
    done, retracted = server.reqs[:3], server.reqs[3]
    seen = {r.rid: {} for r in server.reqs}
    for _ in range(9):
        for rid, (position, rows) in server.step(server.reqs).items():
            seen[rid][position] = rows
    expected = {r.rid: {layer: server.expected_keys(r, layer) for layer in LAYERS} for r in done}
    tokens = {r.rid: list(r.origin_input_ids) + list(r.output_ids)[:-1] for r in done}
    server.finish(retracted, None)  # released unfinished: its samples are let go, nothing written
    for r in done:
        server.finish(r, "length")
    for slots in server.slots:  # the freed pages handed to other requests and overwritten
        for layer in LAYERS:
            server.pool.get_index_k_with_scale_buffer(layer)[slots[::64] // 64] = 7
    engine = state.engine
    assert engine is not None and state.role == "writer"
    engine.close()
    c = engine.counters()
    assert c["requests_written"] == 3 and c["requests_dropped"] == 0 and c["bytes_held"] == 0

    store = CaptureStore.open(capture.path)
    assert store.manifest.model.name == str(bench_dir) and store.manifest.model.geometry.n_heads == H
    assert store.manifest.settings.basis == "hadamard" and store.manifest.corpus["engine"] == "sglang"
    lengths = [700 + 9, 1300 + 9, 130 + 9]
    assert store.array("sequence_keys").tolist() == lengths
    assert store.array("tokens").tolist() == sum((tokens[r.rid] for r in done), [])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    positions, sequence, window = (store.array(n) for n in ("query_position", "query_sequence", "query_window"))
    for s, r in enumerate(done):
        for layer in LAYERS:
            got = store.as_float(store.keys(layer)[offsets[s] : offsets[s + 1]])
            assert torch.equal(got, expected[r.rid][layer])  # the engine's FP8 keys, exactly
        # what every trainer reads (the FP8 round trip of the stored keys) is the same
        assert torch.equal(store.engine_keys(store.keys(2)[offsets[s] : offsets[s + 1]]), expected[r.rid][2])
        # 4 queries a request: decode steps 0 and 1 (the window), then 2 and 6 (spread over the later steps)
        mine = np.nonzero(sequence == s)[0]
        prompt = len(r.origin_input_ids)
        assert positions[mine].tolist() == [prompt, prompt + 1, prompt + 2, prompt + 6]
        assert window[mine].tolist() == [0, 0, -1, -1]
        for row in mine:
            for layer in LAYERS:
                q, w = seen[r.rid][int(positions[row])][layer]
                assert torch.equal(store.as_float(store.queries(layer)[row : row + 1])[0], q.float())
                assert torch.equal(torch.from_numpy(store.head_weights(layer)[row]), w)

    from dsaindex.train.recall import held_out, layer_keys, split_sequences

    assert store.check_chunks() > 0 and store.verify() > 0
    train, held = split_sequences(store.committed.sequences)
    key_format = store.manifest.model.geometry.key_format
    assert layer_keys(store, 0, train, key_format).shape == (sum(lengths[:2]), D)
    assert held_out(store, 0, held, min_prefix=1, key_format=key_format).visible.tolist() == [131, 132, 133, 137]


def test_a_full_queue_drops_finished_requests_and_decode_goes_on(capture):
    state = capture.start(DSAINDEX_CAPTURE_QUEUE="1M", DSAINDEX_CAPTURE_QUERIES="0")
    server = Server([1400, 1400, 100], max_new=4, seed=2)
    server.step(server.reqs)
    engine = state.engine
    gate, real = __import__("threading").Event(), engine.store.append
    engine.store.append = lambda batch: (gate.wait(30), real(batch))  # the writer stuck on slow storage
    t0 = time.perf_counter()
    server.finish(server.reqs[0], "length")  # 1,401 keys: 22 pages x 4 layers x 8,448 B = 0.74 MB, fits
    server.finish(server.reqs[1], "length")  # does not fit beside it: dropped
    server.step(server.reqs[2:])  # decode goes on
    assert time.perf_counter() - t0 < 5.0
    c = engine.counters()
    assert c["requests_queued"] == 1 and c["requests_dropped"] == 1 and c["bytes_dropped"] == 22 * 4 * 8448 + 4 * 1401
    gate.set()
    server.finish(server.reqs[2], "length")
    engine.close()
    assert CaptureStore.open(capture.path).array("sequence_keys").tolist() == [1401, 102]


def test_only_tensor_parallel_rank_0_writes(capture, context):
    context(rank=1, tp_size=2)
    state = capture.start()
    server = Server([300, 200], max_new=4, seed=3)
    server.step(server.reqs)
    for r in server.reqs:
        server.finish(r, "length")
    assert state.engine is None and "tensor-parallel rank 1" in state.role
    assert not capture.path.exists()


def test_a_store_of_another_model_stops_startup_naming_the_fix(capture, tmp_path):
    from dsaindex.errors import StoreMismatchError
    from dsaindex.pipelines.capture.presets import preset_config
    from dsaindex.runtime.engine_capture import engine_fingerprint, engine_manifest

    other = engine_manifest(engine_fingerprint(preset_config("tiny-v32"), "preset:tiny-v32"), "sglang", "hadamard", 4)
    CaptureStore.create(capture.path, other)
    with pytest.raises(StoreMismatchError, match="was captured with another model") as err:
        capture.start()
    assert "DSAINDEX_CAPTURE" in err.value.fix and "new path" in err.value.fix
    assert capture.state.engine is None


STARTUP = """
import json
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
load_plugins()
hooks = {t: [ht.value for ht, _, _ in v] for t, v in HookRegistry._hooks.items()}
from sglang.srt.configs.model_config import ModelConfig
try:
    ModelConfig(MODEL_PATH)
    out = {"ok": True}
except Exception as err:
    out = {"ok": False, "type": type(err).__name__, "message": str(err)}
import dsaindex_sglang.hooks as h
print(json.dumps({**out, "hooks": hooks, "selectors": len(h.STATE.selectors)}))
"""


def test_capture_alone_hooks_sglang_and_checks_the_store_at_startup(bench_dir, tmp_path):
    """``DSAINDEX_CAPTURE`` without artifacts (the capture that trains the first ones), through SGLang's loader in
    a fresh interpreter: the capture's hooks and the selection's hook (which stages the queries and, with no
    artifacts, calls SGLang's own) are registered; a new store passes, a store of other settings stops
    ModelConfig."""
    from dsaindex_sglang import FORWARD_TARGET, RELEASE_TARGET, SELECT_TARGET

    script = STARTUP.replace("MODEL_PATH", repr(str(bench_dir)))
    env = {"DSAINDEX_ARTIFACTS": None, "DSAINDEX_CAPTURE": str(tmp_path / "store"), "SGLANG_PLUGINS": "dsaindex"}
    fresh = run_json(script, env)
    assert fresh["ok"] and fresh["selectors"] == 0
    assert fresh["hooks"][SELECT_TARGET] == ["around"] and fresh["hooks"][FORWARD_TARGET] == ["after"]
    assert fresh["hooks"][RELEASE_TARGET] == ["before"]
    from dsaindex.pipelines.capture.presets import preset_config
    from dsaindex.runtime.engine_capture import engine_fingerprint, engine_manifest

    other = engine_manifest(engine_fingerprint(preset_config("bench-v32"), str(bench_dir)), "sglang", "hadamard", 8)
    CaptureStore.create(tmp_path / "store", other)  # the same model, captured with 8 queries a request
    refused = run_json(script, env)
    assert refused["ok"] is False and refused["type"] == "StoreMismatchError"
    assert "captured with another settings" in refused["message"] and "DSAINDEX_CAPTURE" in refused["message"]
