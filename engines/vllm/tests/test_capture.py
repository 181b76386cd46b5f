"""``DSAINDEX_CAPTURE`` through vLLM's own code (CPU; vLLM 0.33.0).

Run through vLLM's code: the plugin loader, the op registry and ``CustomOp`` dispatch, ``set_forward_context``,
``DeepseekV32IndexerCache`` (+ ``bind_kv_cache``) and the indexer metadata dataclasses (as in test_plugin.py);
the KV cache groups from vLLM's planner (``get_kv_cache_groups``); Model Runner V2's (vLLM's default)
``finish_requests`` / ``_remove_request`` with its ``RequestState`` and ``BlockTables``; V1's
``_on_request_state_removed`` with its ``CachedRequestState``. Replicated: the FP8 pages, ``q_fp8`` and
``weights`` (as in test_plugin.py); V2's staged-write Triton kernel (``_apply_write_kernel``) by a torch
reference at its signature and its UVA buffers by plain CPU tensors (vLLM's own no-UVA fallback); the runner
objects around those states (``object.__new__`` with the attributes the methods read) and the batch
``execute_model`` ran (the ``input_batch`` names it leaves behind); vLLM's CPU indexer kernel where the plugin
calls vLLM's own op (it needs ``vllm._C``).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from test_host_keys import mla_spec  # noqa: E402
from test_plugin import CFG, H, build_layer, decode_metadata, run_loader, vllm_config  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer  # noqa: E402

from dsaindex.artifacts.capture_store import CaptureStore  # noqa: E402
from dsaindex.kernels.fp8_score import paged_keys_reference  # noqa: E402
from helpers import PAGE, D, synthetic_keys, write_keys  # noqa: E402

LAYERS = (0, 1, 2, 3)  # bench-v32's indexer layers
BLOCKS = 400


class TorchWrite:
    """vLLM's ``_apply_write_kernel`` (v1/worker/gpu/buffer_utils.py, Triton) in torch, called as the kernel is:
    write ``i`` puts ``contents[cu_lens[i - 1] : cu_lens[i]]`` into row ``indices[i]`` of its output from column
    ``starts[i]``; with several groups (``MULTI_GROUP``) the output is the tensor whose address
    ``outputs[group_ids[i]]`` holds, among ``targets``."""

    def __init__(self):
        self.targets: list[torch.Tensor] = []

    def __getitem__(self, grid):
        def run(out, stride, indices, starts, contents, cu_lens, group_ids, BLOCK_SIZE=None, MULTI_GROUP=False):
            by_address = {t.data_ptr(): t for t in self.targets}
            begin = 0
            for i in range(int(grid[0])):
                end = int(cu_lens[i])
                target, row_stride = out, stride
                if MULTI_GROUP:
                    group = int(group_ids[i])
                    target, row_stride = by_address[int(out[group])], int(stride[group])
                row, start = int(indices[i]), int(starts[i])
                flat = target.view(-1)
                flat[row * row_stride + start : row * row_stride + start + end - begin] = contents[begin:end]
                begin = end
        return run


@pytest.fixture
def capture(plugin, tmp_path, monkeypatch):
    """The plugin loaded by vLLM's loader (conftest's ``plugin``), ``DSAINDEX_CAPTURE`` at a fresh store and
    4 queries a request; ``model(artifacts=...)`` builds the model's 4 indexer layers as vLLM does (the first
    build checks the store and opens it on the writer). The capture is reset afterwards."""
    from dsaindex_vllm.capture import CAPTURE

    path = tmp_path / "store"
    monkeypatch.setenv("DSAINDEX_CAPTURE", str(path))
    monkeypatch.setenv("DSAINDEX_CAPTURE_QUERIES", "4")
    CAPTURE.reset()

    def model(artifacts: bool = False, **env):
        if not artifacts:
            monkeypatch.delenv("DSAINDEX_ARTIFACTS", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        vc = vllm_config(CFG)
        vc.cache_config.block_size = PAGE  # the sparse MLA backends' block size
        layers = [build_layer(vc, prefix=f"model.layers.{i}.self_attn.indexer", num_blocks=BLOCKS, rows=8)
                  for i in LAYERS]
        return SimpleNamespace(vc=vc, ops=[op for op, _, _ in layers], caches=[c for _, c, _ in layers])

    yield SimpleNamespace(path=path, model=model, state=CAPTURE)
    CAPTURE.reset()


@pytest.fixture
def engine_op(monkeypatch):
    """vLLM's own CPU indexer op (``SparseAttnIndexer.forward_cpu``, compiled kernels) stands in: it leaves the
    top-k buffer as it is and counts its calls."""
    calls = []

    def forward_cpu(self, hidden_states, q_quant, k, weights):
        calls.append(self.k_cache.prefix)
        return self.topk_indices_buffer

    monkeypatch.setattr(SparseAttnIndexer, "forward_cpu", forward_cpu)
    return calls


class Server:
    """Requests held as vLLM's Model Runner V2 holds them: rows of its ``RequestState`` (token ids, computed
    counts) and ``BlockTables`` (block ids), the keys in every layer's index-K cache."""

    def __init__(self, model, prompts: list[int], max_new: int, monkeypatch, seed: int = 0):
        import vllm.v1.worker.gpu.buffer_utils as buffers
        from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
        from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
        from vllm.v1.kv_cache_interface import KVCacheConfig
        from vllm.v1.worker.gpu.block_table import BlockTables
        from vllm.v1.worker.gpu.states import RequestState

        monkeypatch.setattr(buffers, "is_uva_available", lambda: False)
        writer = TorchWrite()
        monkeypatch.setattr(buffers, "_apply_write_kernel", writer)
        self.model, self.g = model, torch.Generator().manual_seed(seed)
        specs = {f"model.layers.{i}.self_attn.attn": mla_spec() for i in LAYERS}
        specs.update({c.prefix: c.get_kv_cache_spec(model.vc) for c in model.caches})
        preferred = [x.name for x in get_supported_kv_cache_layouts([DeepseekV32IndexerBackend])]
        model.vc.cache_config.kv_cache_layout = resolve_kv_cache_layout(model.vc, [preferred], specs.values()).name
        self.kv_cache_config = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                                             kv_cache_groups=get_kv_cache_groups(model.vc, specs))
        self.group = next(i for i, g in enumerate(self.kv_cache_config.kv_cache_groups)
                          if model.caches[0].prefix in g.layer_names)
        groups = len(self.kv_cache_config.kv_cache_groups)
        self.states = RequestState(8, 8192, 256, 0, 1000, torch.device("cpu"))
        self.tables = BlockTables([PAGE] * groups, 8, 256, [128] * groups, torch.device("cpu"))
        writer.targets = [t.gpu for t in self.tables.block_tables]
        order = torch.randperm(BLOCKS - 1, generator=self.g) + 1  # block 0: vLLM's null block
        self.ids, self.blocks, self.keys, self.tokens, self.lengths = [], {}, {}, {}, {}
        at = 0
        for i, n in enumerate(prompts):
            rid = f"req-{seed}-{i}"
            width = -(-(n + max_new) // PAGE)
            self.blocks[rid] = order[at : at + width].tolist()
            at += width
            self.tokens[rid] = torch.randint(0, 1000, (n + max_new,), generator=self.g).tolist()
            self.keys[rid] = {layer: synthetic_keys(n + max_new, seed=100 * seed + 10 * i + layer) for layer in LAYERS}
            for layer, cache in zip(LAYERS, model.caches, strict=True):
                write_keys(self.flat(cache), self.blocks[rid], self.keys[rid][layer][:n])
            self.states.add_request(rid, n, self.tokens[rid][: n + 1], n, max_new)  # the prefill's token too
            index = self.states.req_id_to_index[rid]
            self.tables.append_block_ids(index, tuple(self.blocks[rid] if g == self.group else [] for g in range(groups)),
                                         overwrite=True)
            self.ids.append(rid)
            self.lengths[rid] = n
        self.states.apply_staged_writes()
        self.tables.apply_staged_writes()

    @staticmethod
    def flat(cache):
        return cache.kv_cache.view(cache.kv_cache.shape[0], -1)

    def step(self, ids) -> dict:
        """One decode step: each request's newest key written, then every layer's op called as vLLM calls it
        (``CustomOp`` dispatch inside ``set_forward_context``), then the runner's after-``execute_model`` part.
        Returns {rid: (position, {layer: (q_fp8 row, weights row)})}."""
        from dsaindex_vllm import capture

        for rid in ids:
            n = self.lengths[rid]
            for layer, cache in zip(LAYERS, self.model.caches, strict=True):
                row = self.blocks[rid][n // PAGE]
                # the page's keys so far again (the same bytes), then the new one
                write_keys(self.flat(cache), [row], self.keys[rid][layer][n - n % PAGE : n + 1])
            self.lengths[rid] = n + 1
            index = self.states.req_id_to_index[rid]
            self.states.num_computed_tokens_np[index] = n + 1  # as update_requests sets it
            self.states.all_token_ids.stage_write(index, n + 1, [self.tokens[rid][n + 1]])  # the sampled token
        self.states.apply_staged_writes()
        width = max(len(self.blocks[r]) for r in ids)
        table = torch.zeros(len(ids), width, dtype=torch.int32)
        for b, rid in enumerate(ids):
            table[b, : len(self.blocks[rid])] = torch.tensor(self.blocks[rid])
        lens = [self.lengths[r] for r in ids]
        meta = {c.prefix: decode_metadata(table, lens) for c in self.model.caches}
        seen = {rid: (self.lengths[rid] - 1, {}) for rid in ids}
        with set_forward_context(meta, self.model.vc):
            for layer, op in zip(LAYERS, self.model.ops, strict=True):
                q = (synthetic_keys(len(ids) * H, seed=int(torch.randint(0, 1 << 20, (1,), generator=self.g)))
                     .view(len(ids), H, D) * 0.5).to(torch.float8_e4m3fn)
                weights = torch.rand(len(ids), H, generator=self.g) * (D**-0.5) * (H**-0.5)
                op(torch.zeros(len(ids), 16, dtype=torch.bfloat16), q, None, weights)
                for b, rid in enumerate(ids):
                    seen[rid][1][layer] = (q[b], weights[b])
        # what execute_model leaves behind: the batch it ran, decode requests first (one token each)
        runner = SimpleNamespace(execute_model_state=SimpleNamespace(input_batch=SimpleNamespace(
            req_ids=list(ids), num_scheduled_tokens=np.ones(len(ids), dtype=np.int32))))
        capture.after_execute_v2(runner)
        return seen

    def runner_v2(self):
        """Model Runner V2 around this server's states (the attributes ``finish_requests`` reads)."""
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

        runner = object.__new__(GPUModelRunner)
        noop = SimpleNamespace(remove_request=lambda *a: None)
        runner.__dict__.update(req_states=self.states, block_tables=self.tables, kv_cache_config=self.kv_cache_config,
                               model_state=noop, lora_state=noop, pooling_runner=None, pp_handler=None,
                               encoder_cache=None, prompt_logprobs_worker=None)
        return runner

    def finish_v2(self, finished, preempted=()):
        self.runner_v2().finish_requests(SimpleNamespace(finished_req_ids=set(finished),
                                                         preempted_req_ids=set(preempted)))
        assert all(rid not in self.states.req_id_to_index for rid in [*finished, *preempted])  # vLLM's part ran

    def finish_v1(self, rid):
        """V1: the worker drops a finished request's ``CachedRequestState`` (``_update_states`` calls
        ``_on_request_state_removed`` with it)."""
        from vllm.v1.worker.gpu_input_batch import CachedRequestState
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        n = self.lengths[rid]
        prompt = n - (self.steps_of(rid))
        groups = len(self.kv_cache_config.kv_cache_groups)
        state = CachedRequestState(req_id=rid, prompt_token_ids=self.tokens[rid][:prompt], mm_features=[],
                                   sampling_params=None, generator=None,
                                   block_ids=tuple(self.blocks[rid] if g == self.group else [] for g in range(groups)),
                                   num_computed_tokens=n, output_token_ids=self.tokens[rid][prompt : n + 1])
        runner = object.__new__(GPUModelRunner)
        runner.kv_cache_config = self.kv_cache_config
        runner._on_request_state_removed(rid, state)

    def steps_of(self, rid):
        return self.lengths[rid] - int(self.states.prompt_len.np[self.states.req_id_to_index[rid]])

    def expected_keys(self, rid, layer):
        cache = self.model.caches[LAYERS.index(layer)]
        n = self.lengths[rid]
        keys, scales = paged_keys_reference(self.flat(cache), torch.tensor([self.blocks[rid]], dtype=torch.int32), D)
        return keys[0, :n].view(torch.float8_e4m3fn).float() * scales[0, :n, None]


def test_the_runner_methods_are_wrapped_once_and_call_vllms(capture, engine_op):
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1

    capture.model()
    capture.model()  # a second build (another process would do the same) wraps nothing twice
    for cls, method in ((V2, "finish_requests"), (V2, "execute_model"), (V1, "_on_request_state_removed"),
                        (V1, "execute_model")):
        wrapped = getattr(cls, method)
        assert wrapped._dsaindex_capture and wrapped.__wrapped__.__qualname__ == f"GPUModelRunner.{method}"
        assert not getattr(wrapped.__wrapped__, "_dsaindex_capture", False)


def test_served_requests_are_captured_with_their_keys_and_sampled_queries(capture, engine_op, monkeypatch):
    """Capture alone (no artifacts: every layer runs vLLM's own op; the capture that trains the first ones)."""
    model = capture.model()
    assert all(op.codec is None for op in model.ops)
    server = Server(model, [700, 1300, 130, 400], max_new=12, monkeypatch=monkeypatch, seed=1)
    a, b, c, d = server.ids
    # the block table the capture reads is the group vLLM's planner put the indexer caches in
    assert capture.state.group_of(server.kv_cache_config) == server.group
    seen = {rid: {} for rid in server.ids}
    for _ in range(9):
        for rid, (position, rows) in server.step(server.ids).items():
            seen[rid][position] = rows
    assert len(engine_op) == 9 * len(LAYERS)  # vLLM's own op served every call
    expected = {rid: {layer: server.expected_keys(rid, layer) for layer in LAYERS} for rid in (a, b, c)}
    tokens = {rid: server.tokens[rid][: server.lengths[rid]] for rid in (a, b, c)}
    server.finish_v1(c)  # V1 holds its state: the request finishes there first
    server.finish_v2([b, a], preempted=[d])  # V2, vLLM's default; d is preempted (comes back later), not captured
    for cache in model.caches:  # the freed blocks handed to other requests and overwritten
        cache.kv_cache.fill_(7)
    engine = capture.state.engine
    assert d in engine._requests  # its samples wait for it to come back
    engine.close()
    assert engine.counters()["requests_written"] == 3 and engine.counters()["bytes_held"] > 0  # d's samples

    store = CaptureStore.open(capture.path)
    assert store.manifest.settings.basis == "raw" and store.manifest.corpus["engine"] == "vllm"
    order = [c, a, b]  # c finished first; V2 frees its finished requests in sorted order
    lengths = [server.lengths[r] for r in order]
    assert store.array("sequence_keys").tolist() == lengths == [139, 709, 1309]
    assert store.array("tokens").tolist() == sum((tokens[r] for r in order), [])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    positions, sequence, window = (store.array(n) for n in ("query_position", "query_sequence", "query_window"))
    for s, rid in enumerate(order):
        for layer in LAYERS:
            got = store.as_float(store.keys(layer)[offsets[s] : offsets[s + 1]])
            assert torch.equal(got, expected[rid][layer])  # the engine's FP8 keys, exactly
        mine = np.nonzero(sequence == s)[0]
        prompt = server.lengths[rid] - 9
        assert positions[mine].tolist() == [prompt, prompt + 1, prompt + 2, prompt + 6]
        assert window[mine].tolist() == [0, 0, -1, -1]
        for row in mine:
            for layer in LAYERS:
                q, w = seen[rid][int(positions[row])][layer]
                assert torch.equal(store.as_float(store.queries(layer)[row : row + 1])[0], q.float())
                assert torch.equal(torch.from_numpy(store.head_weights(layer)[row]), w)

    from dsaindex.train.recall import held_out, layer_keys, split_sequences

    assert store.check_chunks() > 0 and store.verify() > 0
    train, held = split_sequences(store.committed.sequences)
    key_format = store.manifest.model.geometry.key_format
    assert torch.equal(store.engine_keys(store.keys(1)[: lengths[0]]), expected[c][1])
    assert layer_keys(store, 1, train, key_format).shape == (sum(lengths[:2]), D)
    assert held_out(store, 1, held, min_prefix=1, key_format=key_format).visible.tolist() == [1301, 1302, 1303, 1307]


def test_a_full_queue_drops_finished_requests_and_decode_goes_on(capture, monkeypatch):
    """With artifacts too: the served layers' selection runs and the capture beside it."""
    model = capture.model(artifacts=True, DSAINDEX_CAPTURE_QUEUE="1M", DSAINDEX_CAPTURE_QUERIES="0")
    assert all(op.codec is not None for op in model.ops)
    server = Server(model, [1400, 1400, 100], max_new=4, monkeypatch=monkeypatch, seed=2)
    server.step(server.ids)
    engine = capture.state.engine
    gate, real = threading.Event(), engine.store.append
    engine.store.append = lambda batch: (gate.wait(30), real(batch))  # the writer stuck on slow storage
    t0 = time.perf_counter()
    server.finish_v2(server.ids[:2])  # 1,401 keys each: 22 pages x 4 layers x 8,448 B = 0.74 MB; one fits
    server.step(server.ids[2:])  # decode goes on
    assert time.perf_counter() - t0 < 10.0
    c = engine.counters()
    assert c["requests_queued"] == 1 and c["requests_dropped"] == 1 and c["bytes_dropped"] == 22 * 4 * 8448 + 4 * 1401
    gate.set()
    server.finish_v2(server.ids[2:])
    engine.close()
    assert CaptureStore.open(capture.path).array("sequence_keys").tolist() == [1401, 102]


def test_only_tensor_parallel_rank_0_writes(capture, engine_op, monkeypatch):
    import vllm.distributed.parallel_state as parallel

    monkeypatch.setattr(parallel, "get_tensor_model_parallel_rank", lambda: 1)  # as the initialized group says
    model = capture.model()
    server = Server(model, [300, 200], max_new=4, monkeypatch=monkeypatch, seed=3)
    server.step(server.ids)
    server.finish_v2(server.ids)
    assert capture.state.engine is None and "tensor-parallel rank 1" in capture.state.role
    assert not capture.path.exists()


def test_a_store_of_another_model_stops_startup_naming_the_fix(capture, engine_op):
    from dsaindex.errors import StoreMismatchError
    from dsaindex.pipelines.capture.models import preset_config
    from dsaindex.runtime.engine_capture import engine_fingerprint, engine_manifest

    other = engine_manifest(engine_fingerprint(preset_config("tiny-v32"), "served-model"), "vllm", "raw", 4)
    CaptureStore.create(capture.path, other)
    with pytest.raises(StoreMismatchError, match="was captured with another model") as err:
        capture.model()  # the first indexer layer's build, at vLLM's model load
    assert "DSAINDEX_CAPTURE" in err.value.fix and "new path" in err.value.fix
    assert capture.state.engine is None


def test_vllm_loader_registers_the_op_for_the_capture_alone(tmp_path):
    got = run_loader({"VLLM_PLUGINS": "dsaindex", "DSAINDEX_CAPTURE": str(tmp_path / "store")})
    assert got == ["dsaindex_vllm.op", "DsaIndexSparseAttnIndexer", "SparseAttnIndexer"]
    assert not (tmp_path / "store").exists()  # nothing is written before the model's layers are built
