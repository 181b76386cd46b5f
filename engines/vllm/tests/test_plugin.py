"""Contract tests of the dsaindex vLLM plugin through vLLM's own code (CPU; vLLM 0.33.0).

Ran through vLLM's code: the entry-point loader (``vllm.plugins.load_general_plugins``), the op registry
(``CustomOp.register_oot`` / ``op_registry_oot``, ``CustomOp.__new__`` and its forward dispatch),
``VllmConfig`` / ``set_current_vllm_config``, ``set_forward_context``, the in-tree
``SparseAttnIndexer.__init__``, ``DeepseekV32IndexerCache`` (+ ``bind_kv_cache``), the indexer backend's
``get_kv_cache_shape`` and the ``DeepseekV32IndexerMetadata`` / ``DeepSeekV32IndexerDecodeMetadata``
dataclasses. Replicated by shape only (vLLM computes them in CUDA kernels or in the model's forward):
the FP8 page contents (helpers.write_keys), ``q_fp8`` and ``weights``.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import vllm.plugins  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.custom_op import op_registry_oot  # noqa: E402
from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer  # noqa: E402
from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache  # noqa: E402
from vllm.v1.attention.backends.mla.indexer import (  # noqa: E402
    DeepseekV32IndexerBackend,
    DeepSeekV32IndexerDecodeMetadata,
    DeepseekV32IndexerMetadata,
    DeepseekV32IndexerPrefillChunkMetadata,
    DeepseekV32IndexerPrefillMetadata,
)

from dsaindex.artifacts.bundle import read_bundle  # noqa: E402
from dsaindex.artifacts.compat import check_bundle_for_model  # noqa: E402
from dsaindex.errors import ArtifactMismatchError  # noqa: E402
from dsaindex.geometry import geometry_from_config  # noqa: E402
from dsaindex.kernels.fp8_score import fp8_scores_reference, paged_keys_reference  # noqa: E402
from dsaindex.kernels.select import topk_of_prefixes  # noqa: E402
from dsaindex.pipelines.capture.models import preset_config  # noqa: E402
from dsaindex.score import topk_agree  # noqa: E402
from helpers import PAGE, D, synthetic_keys, write_keys, write_pq_bundle  # noqa: E402

PRESET = "bench-v32"  # the production indexer: 64 heads x 128, top-2048
CFG = preset_config(PRESET)
TOPK = CFG.index_topk
H = CFG.index_n_heads

LOAD = ("import json, vllm.plugins as p; p.load_general_plugins(); "
        "from vllm.model_executor.custom_op import op_registry_oot as r; "
        "c = r.get('SparseAttnIndexer'); print(json.dumps(None if c is None else [c.__module__, c.__name__, c.name]))")


def run_loader(env_extra: dict[str, str]) -> object:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_PLUGINS", "DSAINDEX_"))}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def vllm_config(hf_config):
    """vLLM's own VllmConfig; the model config is a stand-in carrying the served model's hf_config
    (building vLLM's ModelConfig needs a loadable model; the plugin reads model_config.hf_config only)."""
    vc = VllmConfig()
    object.__setattr__(vc, "model_config", SimpleNamespace(hf_config=hf_config, max_model_len=1 << 16))
    return vc


def build_layer(vc, prefix="model.layers.1.self_attn.indexer", num_blocks=1200, rows=16):
    """vLLM's indexer cache + op as deepseek_v2.py's Indexer.__init__ builds them (lines 724-751)."""
    with set_current_vllm_config(vc):
        cache = DeepseekV32IndexerCache(head_dim=D + D // 128 * 4, dtype=torch.uint8, prefix=f"{prefix}.k_cache",
                                        cache_config=vc.cache_config)
        # the indexer backend's page size, and the raw per-layer cache [blocks, H=1, block_size, C] that
        # DeepseekV32IndexerCache.bind_kv_cache squeezes to [blocks, block_size, C] (deepseek_v2.py:653-656)
        assert DeepseekV32IndexerBackend.get_supported_kernel_block_sizes() == [PAGE]
        cache.bind_kv_cache(torch.zeros(num_blocks, 1, PAGE, D + 4, dtype=torch.uint8))
        # DeepseekV2Model: topk_indices_buffer = torch.empty(max_num_batched_tokens, index_topk, int32)
        buffer = torch.empty(rows, TOPK, dtype=torch.int32)
        op = SparseAttnIndexer(cache, 128, "ue8m0", TOPK, D, 1 << 16, 1 << 16, buffer, skip_k_cache_insert=True)
    return op, cache, buffer


def decode_metadata(block_table: torch.Tensor, lens: list[int]) -> DeepseekV32IndexerMetadata:
    b = len(lens)
    seq = torch.tensor(lens, dtype=torch.int32)
    dec = DeepSeekV32IndexerDecodeMetadata(block_table=block_table, seq_lens=seq, decode_lens=torch.ones(b, dtype=torch.int32),
                                           requires_padding=False, schedule_metadata=torch.zeros(1, dtype=torch.int32))
    return DeepseekV32IndexerMetadata(seq_lens=seq, max_seq_len=max(lens), slot_mapping=torch.zeros(b, dtype=torch.int64),
                                      num_decodes=b, num_decode_tokens=b, num_prefills=0, num_prefill_tokens=0,
                                      decode=dec)


# ---- (a) + (b): vLLM's loader discovers and runs the entry point; its registry maps the op ---------------
def test_vllm_loader_runs_the_entry_point_and_registers_the_op(bundle):
    got = run_loader({"VLLM_PLUGINS": "dsaindex", "DSAINDEX_ARTIFACTS": str(bundle)})
    assert got == ["dsaindex_vllm.op", "DsaIndexSparseAttnIndexer", "SparseAttnIndexer"]


def test_loader_leaves_the_op_alone_when_not_allowed_or_unconfigured(bundle):
    assert run_loader({"VLLM_PLUGINS": "someone-else", "DSAINDEX_ARTIFACTS": str(bundle)}) is None
    assert run_loader({"VLLM_PLUGINS": "dsaindex"}) is None


def test_entry_point_is_declared_for_vllm():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group=vllm.plugins.DEFAULT_PLUGINS_GROUP)}
    assert eps.get("dsaindex") == "dsaindex_vllm.plugin:register"


def test_vllm_builds_the_plugin_class_for_its_indexer(plugin):
    from dsaindex_vllm.op import DsaIndexSparseAttnIndexer

    assert op_registry_oot["SparseAttnIndexer"] is DsaIndexSparseAttnIndexer
    op, _, _ = build_layer(vllm_config(CFG))
    assert type(op) is DsaIndexSparseAttnIndexer and isinstance(op, SparseAttnIndexer)
    assert op.codec is not None and op.layer_id == 1
    vllm.plugins.load_general_plugins()  # a second call in one process changes nothing
    from dsaindex_vllm.op import OP_QUALNAME, install
    from vllm.config.compilation import CompilationConfig

    # served layers run one registered torch op, split out of vLLM's piecewise graphs like vLLM's own
    assert hasattr(torch.ops.vllm, "dsaindex_sparse_attn_indexer")
    assert CompilationConfig._attention_ops.count(OP_QUALNAME) == 1

    install()
    assert op_registry_oot["SparseAttnIndexer"] is DsaIndexSparseAttnIndexer


def test_auto_candidates_take_each_layers_c_from_the_bundles_recall(plugin, monkeypatch, tmp_path):
    """DSAINDEX_CANDIDATES=auto: the served layer's C is the smallest whose recorded held-out recall reaches
    DSAINDEX_RECALL_TARGET; a layer that reaches it at no C stops the layer's construction, naming it."""
    from dsaindex.errors import DsaIndexError

    layers = geometry_from_config(CFG).indexer_layers
    metrics = {f"layer{i}/k{TOPK}/rerank@{c}": r for i in layers for c, r in ((4096, 0.990), (8192, 0.997))}
    write_pq_bundle(tmp_path / "b", PRESET, metrics=metrics)
    monkeypatch.setenv("DSAINDEX_ARTIFACTS", str(tmp_path / "b"))
    monkeypatch.setenv("DSAINDEX_CANDIDATES", "auto")
    op, _, _ = build_layer(vllm_config(CFG))
    assert op.codec is not None and op.candidates == 8192
    monkeypatch.setenv("DSAINDEX_RECALL_TARGET", "0.98")
    assert build_layer(vllm_config(CFG))[0].candidates == 4096
    monkeypatch.setenv("DSAINDEX_RECALL_TARGET", "0.999")
    with pytest.raises(DsaIndexError, match=r"Layer 1 of .* reaches at most 99\.70% .*C = 8192"):
        build_layer(vllm_config(CFG))


# ---- (c): selection with vLLM's shapes, dtypes and layouts ----------------------------------------------
def exact_topk(pages_flat, block_table, lens, q_fp8, weights):
    keys, scales = paged_keys_reference(pages_flat, block_table, D)
    scores = fp8_scores_reference(keys, scales, q_fp8.float(), weights)
    _, rows = topk_of_prefixes(scores, torch.tensor(lens), TOPK)
    return scores, rows


def test_decode_selection_is_exact_when_every_key_is_a_candidate_and_keeps_most_otherwise(plugin):
    op, cache, buffer = build_layer(vllm_config(CFG), num_blocks=2000)
    # all completed keys candidates (C = 4096); PQ, past twice stage 1's target (which keeps a shorter request
    # whole); fewer than top-k
    lens = [4096 + 37, 40000 + 5, 700]
    g = torch.Generator().manual_seed(3)
    width = max(-(-n // PAGE) for n in lens)
    perm = torch.randperm(cache.kv_cache.shape[0], generator=g)[: len(lens) * width]
    block_table = perm.view(len(lens), width).to(torch.int32)  # scattered pages, like vLLM's block manager
    pages_flat = cache.kv_cache.view(cache.kv_cache.shape[0], -1)
    for b, n in enumerate(lens):
        write_keys(pages_flat, block_table[b].tolist(), synthetic_keys(n, seed=100 + b))
    q = (synthetic_keys(len(lens) * H, seed=7).view(len(lens), H, D) * 0.5).to(torch.float8_e4m3fn)  # q_fp8
    weights = torch.rand(len(lens), H, generator=g) * (D**-0.5) * (H**-0.5)  # q scale folded in
    hidden = torch.zeros(len(lens), 16, dtype=torch.bfloat16)
    buffer.fill_(12345)
    with set_forward_context({cache.prefix: decode_metadata(block_table, lens)}, vllm_config(CFG)):
        out = op(hidden, q, None, weights)
    assert out.data_ptr() == buffer.data_ptr() and out.dtype == torch.int32 and out.shape == (16, TOPK)
    scores, want = exact_topk(pages_flat, block_table, lens, q, weights)
    got = buffer[: len(lens)].long()
    # row 0: every key a candidate -> vLLM's exact top-k
    assert bool(topk_agree(scores[:1], got[:1], want[:1], visible=torch.tensor(lens[:1]))[0])
    # row 2: fewer keys than top-k -> all of them, then -1 (vLLM's padding)
    assert sorted(got[2, : lens[2]].tolist()) == list(range(lens[2])) and bool((got[2, lens[2] :] == -1).all())
    # row 1: PQ candidates: most of the exact top-k, all positions in range, no duplicates
    row = got[1]
    assert bool((row >= 0).all()) and int(row.max()) < lens[1] and row.unique().numel() == TOPK
    recall = len(set(row.tolist()) & set(want[1].tolist())) / TOPK
    print(f"PQ row: recall of the exact top-{TOPK}: {recall:.3f}")
    assert recall >= 0.85, recall  # 4,096 of 40,005 keys rescored; a random 4,096 would keep about 10%
    stage1 = op.selector.stats.stage1.tolist()  # keys stage 1 passed on: all of rows 0 and 2, a cut of row 1
    assert stage1[0] == lens[0] // PAGE * PAGE and stage1[2] == lens[2] // PAGE * PAGE
    assert 4096 <= stage1[1] < lens[1] // PAGE * PAGE
    assert op.selector.encoded_pages == sum(n // PAGE for n in lens)
    assert int(op.selector.stats.stale.sum()) == 0


def test_a_small_step_is_scored_as_vllm_scores_it(plugin, monkeypatch):
    """DSAINDEX_EXACT_BELOW: a step whose batch size times its longest request is at most the bound (here
    the default) is vLLM's own exact top-k, every key scored (stage 1 passes nothing); with the bound
    at 0 the same step's long row goes through the codes and keeps only most of it."""
    from dsaindex_vllm import op as op_module

    from dsaindex.coarse import PAGED_EXACT_BELOW
    from dsaindex.runtime.paged_select import PagedCacheSelector

    monkeypatch.setattr(op_module, "PagedCacheSelector", PagedCacheSelector)  # the plugin as shipped
    op, cache, buffer = build_layer(vllm_config(CFG))
    assert op.exact_below == PAGED_EXACT_BELOW >= 2 * (24000 + 5)
    lens = [24000 + 5, 700]
    g = torch.Generator().manual_seed(4)
    width = max(-(-n // PAGE) for n in lens)
    block_table = torch.randperm(cache.kv_cache.shape[0], generator=g)[: len(lens) * width]
    block_table = block_table.view(len(lens), width).to(torch.int32)
    pages_flat = cache.kv_cache.view(cache.kv_cache.shape[0], -1)
    for b, n in enumerate(lens):
        write_keys(pages_flat, block_table[b].tolist(), synthetic_keys(n, seed=200 + b))
    q = (synthetic_keys(len(lens) * H, seed=9).view(len(lens), H, D) * 0.5).to(torch.float8_e4m3fn)
    weights = torch.rand(len(lens), H, generator=g) * (D**-0.5) * (H**-0.5)
    hidden = torch.zeros(len(lens), 16, dtype=torch.bfloat16)
    scores, want = exact_topk(pages_flat, block_table, lens, q, weights)
    with set_forward_context({cache.prefix: decode_metadata(block_table, lens)}, vllm_config(CFG)):
        op(hidden, q, None, weights)
    got = buffer[: len(lens)].long()
    assert bool(topk_agree(scores, got, want, visible=torch.tensor(lens)).all())
    assert op.selector.stats.stage1.tolist() == [0, 0]
    op.selector.exact_below = 0
    with set_forward_context({cache.prefix: decode_metadata(block_table, lens)}, vllm_config(CFG)):
        op(hidden, q, None, weights)
    assert op.selector.stats.stage1.tolist()[0] > 0


def cuda_attention(layer, cache, buffer, vc) -> SimpleNamespace:
    """The attention module as vLLM's CUDA-path ``DeepseekV32Attention._sparse_indexer_and_attn`` reads it (its
    indexer, flags and attention impl), with its layer registered in the forward context."""
    attn = SimpleNamespace(
        indexer=SimpleNamespace(k_cache=cache, quant_block_size=128, scale_fmt="ue8m0", topk_tokens=TOPK, head_dim=D,
                                max_model_len=1 << 16, max_total_seq_len=1 << 16, indexer_op=layer),
        skip_topk=False, use_pcp=False, pcp_shard_decode_requests=False, topk_indices_buffer=buffer,
        _dense_mha_metadata_layer_name="model.layers.1.self_attn.attn", dcp_manager=None, _vllm_config=vc,
        impl=SimpleNamespace(record_logical_topk_ready=lambda: None), layer_name="model.layers.1.self_attn.attn")
    vc.compilation_config.static_forward_context[attn.layer_name] = SimpleNamespace(kv_cache=None)
    return attn


def test_the_cuda_model_path_calls_reach_the_plugin(plugin, monkeypatch):
    """On CUDA vLLM serves DeepSeek-V3.2 and GLM-5 with models/deepseek_v32 (nvidia/model.py), whose attention
    calls the plain function ``sparse_attn_indexer(...)`` and never the layer's ``indexer_op``. Built as on
    CUDA, the plugin hooks that function; the engine's own ``DeepseekV32Attention._sparse_indexer_and_attn``
    (vLLM's code, called with its CUDA-path arguments) then fills the decode rows with the plugin's selection,
    the same as through the op, and a layer without an artifact keeps vLLM's function."""
    import vllm.models.deepseek_v32.attention as cuda_path
    from dsaindex_vllm import op as plugin_op

    monkeypatch.setattr(plugin_op, "_platform_is_cuda", lambda: True)  # vLLM's registry on CUDA
    original = cuda_path.sparse_attn_indexer
    monkeypatch.setattr(cuda_path, "sparse_attn_indexer", original)  # restored after the test
    hf = CFG.__class__(**{**CFG.to_dict(), "architectures": ["DeepseekV32ForCausalLM"]})
    vc = vllm_config(hf)
    layer, cache, buffer = build_layer(vc)
    assert layer.model_path == "function" and cuda_path.sparse_attn_indexer is not original
    build_layer(vc, prefix="model.layers.2.self_attn.indexer")  # a second layer: hooked once
    assert cuda_path.sparse_attn_indexer.__wrapped__ is original

    lens = [3000 + 11, 700]
    g = torch.Generator().manual_seed(5)
    width = max(-(-n // PAGE) for n in lens)
    block_table = torch.randperm(cache.kv_cache.shape[0], generator=g)[: len(lens) * width].view(len(lens), width)
    block_table = block_table.to(torch.int32)
    pages_flat = cache.kv_cache.view(cache.kv_cache.shape[0], -1)
    for b, n in enumerate(lens):
        write_keys(pages_flat, block_table[b].tolist(), synthetic_keys(n, seed=200 + b))
    q = (synthetic_keys(len(lens) * H, seed=9).view(len(lens), H, D) * 0.5).to(torch.float8_e4m3fn)
    weights = torch.rand(len(lens), H, generator=g) * (D**-0.5) * (H**-0.5)
    q_c = torch.zeros(len(lens), 16, dtype=torch.bfloat16)
    attn = cuda_attention(layer, cache, buffer, vc)
    output = torch.ones(len(lens), 8)
    buffer.fill_(12345)
    metadata = {cache.prefix: decode_metadata(block_table, lens), attn.layer_name: None}
    with set_current_vllm_config(vc), set_forward_context(metadata, vc):
        cuda_path.DeepseekV32Attention._sparse_indexer_and_attn(
            attn, torch.arange(len(lens)), q_c, None, None, q, None, weights, None, None, None, None, output)
    via_function = buffer[: len(lens)].clone()
    assert bool((output == 0).all())  # the engine went on to its attention part (no metadata: zeros)
    assert sorted(via_function[1, : lens[1]].tolist()) == list(range(lens[1]))  # all of a short request, first
    assert bool((via_function[1, lens[1]:] == -1).all())
    assert layer.selector is not None and layer.selector.stats is not None  # the plugin's selector ran
    buffer.fill_(12345)
    with set_forward_context({cache.prefix: decode_metadata(block_table, lens)}, vc):
        layer(q_c, q, None, weights)  # the op path: the same selection
    assert torch.equal(buffer[: len(lens)], via_function)

    calls = []
    monkeypatch.setattr(plugin_op, "_LAYERS", {})  # no served layer: every call is vLLM's own function
    recording = functools.wraps(original)(lambda *a, **k: calls.append(a[1]))  # vLLM's signature, recorded
    monkeypatch.setattr(cuda_path, "sparse_attn_indexer", plugin_op._hooked(recording))
    with set_current_vllm_config(vc), set_forward_context(metadata, vc):
        cuda_path.DeepseekV32Attention._sparse_indexer_and_attn(
            attn, torch.arange(len(lens)), q_c, None, None, q, None, weights, None, None, None, None, output)
    assert calls == [cache.prefix]


def test_a_cuda_model_path_without_the_function_refuses_at_startup(plugin, monkeypatch):
    """A vLLM whose DSA CUDA path has no ``sparse_attn_indexer`` to hook would never consult the plugin: the
    first served layer's construction fails, naming the fix, instead of a log line claiming selection."""
    import vllm.models.deepseek_v32.attention as cuda_path
    from dsaindex_vllm import op as plugin_op

    monkeypatch.setattr(plugin_op, "_platform_is_cuda", lambda: True)
    monkeypatch.delattr(cuda_path, "sparse_attn_indexer")
    hf = CFG.__class__(**{**CFG.to_dict(), "architectures": ["GlmMoeDsaForCausalLM"]})
    with pytest.raises(Exception, match="has no `sparse_attn_indexer` to hook") as err:
        build_layer(vllm_config(hf))
    assert "0.33.0" in str(err.value.fix if hasattr(err.value, "fix") else err.value)


def test_torch_compile_traces_the_layer_to_one_opaque_op(plugin):
    """vLLM compiles the model: the served layer must trace (fullgraph) to the registered op, whose fake
    implementation stands in for it, and the compiled call must select as the eager one."""
    op, cache, buffer = build_layer(vllm_config(CFG))
    lens = [3000, 900]
    block_table = torch.arange(2 * 47, dtype=torch.int32).view(2, 47)
    pages_flat = cache.kv_cache.view(cache.kv_cache.shape[0], -1)
    for b, n in enumerate(lens):
        write_keys(pages_flat, block_table[b].tolist(), synthetic_keys(n, seed=60 + b))
    q = (synthetic_keys(2 * H, seed=61).view(2, H, D) * 0.5).to(torch.float8_e4m3fn)
    weights = torch.rand(2, H) * (D**-0.5) * (H**-0.5)
    hidden = torch.zeros(2, 16, dtype=torch.bfloat16)
    traced = []

    def backend(gm, example_inputs):
        traced.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm

    with set_forward_context({cache.prefix: decode_metadata(block_table, lens)}, vllm_config(CFG)):
        eager = op(hidden, q, None, weights)[:2].clone()
        buffer.fill_(7)
        compiled = torch.compile(lambda h, qq, w: op(h, qq, None, w), backend=backend, fullgraph=True)
        out = compiled(hidden, q, weights)
    assert [t for t in traced[0] if "dsaindex" in str(t)] == [torch.ops.vllm.dsaindex_sparse_attn_indexer]
    assert torch.equal(out[:2], eager)


def test_reused_pages_are_encoded_again(plugin):
    op, cache, buffer = build_layer(vllm_config(CFG))
    lens = [4096 + 64]  # 65 complete pages, all candidates
    block_table = torch.arange(65, dtype=torch.int32).view(1, -1)
    pages_flat = cache.kv_cache.view(cache.kv_cache.shape[0], -1)
    q = (synthetic_keys(H, seed=9).view(1, H, D) * 0.5).to(torch.float8_e4m3fn)
    weights = torch.rand(1, H) * (D**-0.5) * (H**-0.5)
    hidden = torch.zeros(1, 16, dtype=torch.bfloat16)
    for round_ in range(2):  # the block manager hands the same pages to another request
        write_keys(pages_flat, block_table[0].tolist(), synthetic_keys(lens[0], seed=50 + round_))
        with set_forward_context({cache.prefix: decode_metadata(block_table, lens)}, vllm_config(CFG)):
            op(hidden, q, None, weights)
        scores, want = exact_topk(pages_flat, block_table, lens, q, weights)
        assert bool(topk_agree(scores, buffer[:1].long(), want, visible=torch.tensor(lens))[0])
    assert op.selector.encoded_pages == 2 * 65


def test_mixed_batch_encodes_the_prefills_pages_after_vllms_op(plugin, monkeypatch):
    """In a batch with prefill, vLLM's op runs first (it writes the prompt's keys and every row; eager,
    being a splitting op), then the prefill requests' completed pages are encoded, so the next decode
    steps (inside vLLM's full CUDA graphs) find their codes; the decode rows are the runtime's."""
    ran = []
    monkeypatch.setattr(SparseAttnIndexer, "forward_cpu", lambda self, *a: ran.append("engine") or self.topk_indices_buffer)
    op, cache, buffer = build_layer(vllm_config(CFG))
    pages_flat = cache.kv_cache.view(cache.kv_cache.shape[0], -1)
    dec_table = torch.arange(0, 10, dtype=torch.int32).view(1, 10)
    pre_table = torch.arange(10, 40, dtype=torch.int32).view(1, 30)
    write_keys(pages_flat, dec_table[0].tolist(), synthetic_keys(600, seed=21))
    write_keys(pages_flat, pre_table[0].tolist(), synthetic_keys(30 * PAGE - 3, seed=22))
    meta = decode_metadata(dec_table, [600])
    meta.num_prefills, meta.num_prefill_tokens = 1, 30 * PAGE - 3
    n = 30 * PAGE - 3  # the prompt: 29 complete pages and 61 keys
    chunk = DeepseekV32IndexerPrefillChunkMetadata(
        block_table=pre_table, cu_seqlen_ks=torch.zeros(n, dtype=torch.int32),
        cu_seqlen_ke=torch.arange(1, n + 1, dtype=torch.int32), cu_seq_lens=torch.tensor([0, n], dtype=torch.int32),
        token_to_seq=torch.zeros(n, dtype=torch.int32), total_seq_lens=n, max_seqlen_k=n, token_start=0,
        token_end=n, num_reqs=1)
    meta.prefill = DeepseekV32IndexerPrefillMetadata(chunks=[chunk])
    q = (synthetic_keys(H, seed=23).view(1, H, D) * 0.5).to(torch.float8_e4m3fn)
    weights = torch.rand(1, H) * (D**-0.5) * (H**-0.5)
    with set_forward_context({cache.prefix: meta}, vllm_config(CFG)):
        op(torch.zeros(1 + n, 16, dtype=torch.bfloat16), q, None, weights)
    assert ran == ["engine"]
    assert op.selector.encoded_pages == 29 + 600 // PAGE  # the prompt's complete pages, the decode's own
    assert op.selector.valid[pre_table[0, :29].long()].all() and not op.selector.valid[int(pre_table[0, 29])]
    scores, want = exact_topk(pages_flat, dec_table, [600], q, weights)
    assert bool(topk_agree(scores, buffer[:1].long(), want, visible=torch.tensor([600]))[0])


def test_layer_without_artifact_runs_vllms_own_path(plugin, monkeypatch):
    calls = []
    monkeypatch.setattr(SparseAttnIndexer, "forward_cuda", lambda self, *a: calls.append("cuda") or self.topk_indices_buffer)
    monkeypatch.setattr(SparseAttnIndexer, "forward_cpu", lambda self, *a: calls.append("cpu") or self.topk_indices_buffer)
    op, cache, _ = build_layer(vllm_config(CFG), prefix="model.mtp.indexer")  # no layer id: no artifact
    assert op.codec is None
    with set_forward_context({cache.prefix: decode_metadata(torch.zeros(1, 1, dtype=torch.int32), [5])}, vllm_config(CFG)):
        op(torch.zeros(1, 16), torch.zeros(1, H, D).to(torch.float8_e4m3fn), None, torch.zeros(1, H))
    assert len(calls) == 1


# ---- (d): artifacts of another model stop startup with the runtime check's message ----------------------
def test_artifacts_of_another_model_fail_at_layer_build(tmp_path, monkeypatch):
    other = tmp_path / "tiny"
    write_pq_bundle(other, "tiny-v32")  # 8 indexer heads; the served model has 64
    manifest, _ = read_bundle(other, verify=True)
    with pytest.raises(ArtifactMismatchError) as direct:
        check_bundle_for_model(manifest, CFG, "raw")
    monkeypatch.setenv("VLLM_PLUGINS", "dsaindex")
    monkeypatch.setenv("DSAINDEX_ARTIFACTS", str(other))
    saved = dict(op_registry_oot)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    try:
        vllm.plugins.load_general_plugins()
        with pytest.raises(ArtifactMismatchError) as at_startup:
            build_layer(vllm_config(CFG), prefix="model.layers.0.self_attn.indexer")
    finally:
        op_registry_oot.clear()
        op_registry_oot.update(saved)
    assert str(at_startup.value) == str(direct.value)
    assert "indexer heads" in str(at_startup.value) and "Fix:" in str(at_startup.value)


@pytest.mark.parametrize("lens_form", ["per_row", "last_row"])
def test_mtp_verify_rows_each_select_their_own_prefix(plugin, monkeypatch, lens_form):
    """Speculative decoding (MTP): next_n = 3 query rows per request, request-major as vLLM lays out the decode
    tokens; seq_lens either [B, next_n] (vLLM's per-row lengths) or [B, 1] (the last row's). Every completed
    key a candidate: each row's selection is the exact top-k of the keys that row may see (none of a later
    row's), and the newest keys stay in a short request's first entries. vLLM's CUDA model path
    (``_sparse_indexer_and_attn``, calling the hooked ``sparse_attn_indexer``) gives the same rows."""
    import vllm.models.deepseek_v32.attention as cuda_path
    from dsaindex_vllm import op as plugin_op

    monkeypatch.setattr(plugin_op, "_platform_is_cuda", lambda: True)  # vLLM's registry on CUDA
    monkeypatch.setattr(cuda_path, "sparse_attn_indexer", cuda_path.sparse_attn_indexer)  # restored afterwards
    next_n = 3
    vc = vllm_config(CFG.__class__(**{**CFG.to_dict(), "architectures": ["DeepseekV32ForCausalLM"]}))
    op, cache, buffer = build_layer(vc)
    assert op.model_path == "function"
    lens = [3000 + 37, 1500, 200]  # the last row's keys; rows before it see one and two fewer
    b = len(lens)
    g = torch.Generator().manual_seed(5)
    width = max(-(-n // PAGE) for n in lens)
    block_table = torch.randperm(cache.kv_cache.shape[0], generator=g)[: b * width].view(b, width).to(torch.int32)
    pages_flat = cache.kv_cache.view(cache.kv_cache.shape[0], -1)
    for i, n in enumerate(lens):
        write_keys(pages_flat, block_table[i].tolist(), synthetic_keys(n, seed=200 + i))
    rows = b * next_n
    q = (synthetic_keys(rows * H, seed=9).view(rows, H, D) * 0.5).to(torch.float8_e4m3fn)
    weights = torch.rand(rows, H, generator=g) * (D**-0.5) * (H**-0.5)
    row_lens = [n - (next_n - 1 - j) for n in lens for j in range(next_n)]
    seq = torch.tensor(row_lens if lens_form == "per_row" else lens, dtype=torch.int32).view(b, -1)
    dec = DeepSeekV32IndexerDecodeMetadata(block_table=block_table, seq_lens=seq,
                                           decode_lens=torch.full((b,), next_n, dtype=torch.int32),
                                           requires_padding=False, schedule_metadata=torch.zeros(1, dtype=torch.int32))
    meta = DeepseekV32IndexerMetadata(seq_lens=seq[:, -1].contiguous(), max_seq_len=max(lens),
                                      slot_mapping=torch.zeros(rows, dtype=torch.int64), num_decodes=b,
                                      num_decode_tokens=rows, num_prefills=0, num_prefill_tokens=0, decode=dec)
    buffer.fill_(12345)
    with set_forward_context({cache.prefix: meta}, vc):
        op(torch.zeros(rows, 16, dtype=torch.bfloat16), q, None, weights)
    got = buffer[:rows].long()
    attn = cuda_attention(op, cache, buffer, vc)
    buffer[:rows] = 12345
    with set_current_vllm_config(vc), set_forward_context({cache.prefix: meta, attn.layer_name: None}, vc):
        cuda_path.DeepseekV32Attention._sparse_indexer_and_attn(
            attn, torch.arange(rows), torch.zeros(rows, 16, dtype=torch.bfloat16), None, None, q, None, weights,
            None, None, None, None, torch.ones(rows, 8))
    assert torch.equal(buffer[:rows].long(), got)  # the CUDA model path reaches the same selection
    scores, want = exact_topk(pages_flat, block_table.repeat_interleave(next_n, 0), row_lens, q, weights)
    for r, n in enumerate(row_lens):
        if n > TOPK:
            assert bool(topk_agree(scores[r : r + 1], got[r : r + 1], want[r : r + 1], visible=torch.tensor([n]))[0]), r
            assert int(got[r].max()) < n and got[r].unique().numel() == TOPK
        else:  # fewer keys than top-k: all of them first (the newest included), then -1
            assert sorted(got[r, :n].tolist()) == list(range(n)) and bool((got[r, n:] == -1).all()), r
    assert bool((buffer[rows:] == 12345).all())  # rows past the batch untouched
    # the plugin served them (vLLM's own path never builds a selector): every row through stage 1, each with
    # its own completed pages
    assert op.selector is not None and op.selector.stats.stage1.tolist() == [n // PAGE * PAGE for n in row_lens]


def test_by_default_each_layer_serves_its_cheapest_recorded_point_at_the_target(plugin, monkeypatch, tmp_path, caplog):
    """No DSAINDEX_CANDIDATES / DSAINDEX_PREFILTER: the layer serves the cheapest (stage 1, C) whose served
    recall the bundle records at >= 99.5%, and the startup log says which, with that recall."""
    import logging

    layers = geometry_from_config(CFG).indexer_layers
    metrics = {}
    for i in layers:
        metrics.update({f"layer{i}/k{TOPK}/prefilter4@4096": 0.985, f"layer{i}/k{TOPK}/prefilter8@4096": 0.9961,
                        f"layer{i}/k{TOPK}/prefilter4@8192": 0.997, f"layer{i}/k{TOPK}/rerank@4096": 0.999})
    write_pq_bundle(tmp_path / "b", PRESET, metrics=metrics)
    monkeypatch.setenv("DSAINDEX_ARTIFACTS", str(tmp_path / "b"))
    monkeypatch.delenv("DSAINDEX_CANDIDATES")
    with caplog.at_level(logging.INFO, logger="dsaindex_vllm"):
        op = build_layer(vllm_config(CFG))[0]
    # 32K keys in stage 2 either way up to 128K; at 1M C = 4,096 grows 4 x and 8,192 2 x (both to 16,384, what
    # the final top-k holds), so 4 x 8192 reads half the stage-2 keys of 8 x 4096 there
    assert (op.candidates, op.prefilter) == (8192, 4)
    assert op.stage1 == "codes"  # the bundle records no fold-scan point
    assert "C = 8192, stage 1 4 x C by codes, held-out recall 99.70%" in caplog.text
    assert "expected step 20.4 us a query at 1M keys (H100)" in caplog.text  # no band recorded: C stays fixed
    # and what the step itself chooses: bins for up to 8 requests at a 32K stage 1 (256K keys in all)
    assert "by score bins for up to 8 requests at a stage 1 of 32,768 keys" in caplog.text
    # and which stage-1 kernel runs: on this CPU machine, Triton's, with the reason
    assert "stage 1 runs the Triton scan (no CUDA device with NVRTC here)" in caplog.text
    assert op.grow_band == 0 and "C stays fixed" not in caplog.text  # no prefix band recorded: no end to grow past


@pytest.mark.parametrize("rule", ["grow", "fixed"])
def test_c_grows_past_the_prefix_band_the_layers_recall_was_measured_in(plugin, monkeypatch, tmp_path, caplog, rule):
    """DSAINDEX_LONG_PREFIX (default ``grow``): the layer's selector grows C past the end of the longest prefix band
    its bundle records the served recall in, and startup says how; ``fixed`` keeps C and says so."""
    import logging

    metrics = {}
    for i in geometry_from_config(CFG).indexer_layers:
        metrics.update({f"layer{i}/k{TOPK}/prefilter4@4096": 0.998, f"layer{i}/k{TOPK}@64K-128K/prefilter4@4096": 0.996,
                        f"layer{i}/k{TOPK}@64K-128K/queries": 20})
    write_pq_bundle(tmp_path / "b", PRESET, metrics=metrics)
    monkeypatch.setenv("DSAINDEX_ARTIFACTS", str(tmp_path / "b"))
    monkeypatch.delenv("DSAINDEX_CANDIDATES")
    monkeypatch.setenv("DSAINDEX_LONG_PREFIX", rule)
    with caplog.at_level(logging.INFO, logger="dsaindex_vllm"):
        op = build_layer(vllm_config(CFG))[0]
    assert (op.candidates, op.prefilter, op.grow_band) == (4096, 4, 131072 if rule == "grow" else 0)
    assert op._selector().grow_band == op.grow_band
    said = ("past 128K C doubles with each doubling of the prefix, up to 4 x C = 16,384 past 256K" if rule == "grow"
            else "at prefixes up to 128K (longer ones not measured; C stays fixed there)")
    assert said in caplog.text
    assert ("by bins at any batch size where a request's C can grow" in caplog.text) == (rule == "grow")
