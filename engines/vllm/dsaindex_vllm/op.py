"""The out-of-tree replacement of vLLM's ``SparseAttnIndexer`` (``vllm/model_executor/layers/sparse_attn_indexer.py``).

vLLM's DeepSeek-V3.2 ``Indexer`` (``vllm/model_executor/models/deepseek_v2.py``) builds
``SparseAttnIndexer(k_cache, quant_block_size, scale_fmt, topk_tokens, head_dim, max_model_len,
max_total_seq_len, topk_indices_buffer)`` and calls ``indexer_op(hidden_states, q_fp8, k, weights)``;
``CustomOp.__new__`` (``vllm/model_executor/custom_op.py``) instantiates the class registered under the
layer's class name in ``op_registry_oot`` instead, so registering :class:`DsaIndexSparseAttnIndexer`
with ``SparseAttnIndexer.register_oot`` makes every indexer layer of the model this class.

What it changes: for a layer with a PQ artifact, the decode rows of ``topk_indices_buffer`` are the
runtime's coarse-to-fine selection (:class:`dsaindex.runtime.paged_select.PagedCacheSelector`) over PQ
codes of the engine's own index-K cache pages (``[num_blocks, 64, D + 4]`` uint8: 64 x D FP8 bytes then
64 float32 scales per page). The selection synchronizes with the host nowhere and its launch shapes
depend on the batch and the block table's width only, so vLLM's full decode CUDA graphs capture it; in
a batch with prefill (this op is one of vLLM's splitting ops, so it runs eagerly there) the prefill
requests' completed pages are encoded after the engine's op has written them. Everything else is
vLLM's own path, unchanged: prefill rows,
layers without an artifact, speculative decoding (several queries per request), FP4 caches, MXFP8
(Blackwell) scales, decode/prefill context parallelism, and the profiling run. In a batch with prefill
the engine's op runs first (it writes the keys to the cache and every row) and the decode rows are
then replaced; in a decode-only batch the keys are written with vLLM's ``indexer_k_quant_and_cache``
and the engine's exact decode scan does not run.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer

from dsaindex.runtime.loader import decode_settings
from dsaindex.runtime.paged_select import PagedCacheSelector, check_paged_codes
from dsaindex.runtime.settings import EngineSettings, engine_settings

logger = logging.getLogger("dsaindex_vllm")

OP_NAME = "SparseAttnIndexer"  # the key CustomOp.__new__ looks up: the in-tree class's __name__
OP_QUALNAME = "vllm::dsaindex_sparse_attn_indexer"  # the torch op the served layers run
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_lock = threading.Lock()
_served: dict[tuple, Any] = {}
_LAYERS: dict[str, Any] = {}  # layer name -> the plugin's op instance, for the registered torch op


def settings() -> EngineSettings:
    """The plugin's environment (:func:`dsaindex.runtime.settings.engine_settings`), read when a layer is built."""
    return engine_settings("vllm")


def served_artifacts(hf_config: Any, device: torch.device | str) -> Any:
    """The artifacts of ``DSAINDEX_ARTIFACTS`` resolved, verified and checked against the served model
    (:func:`dsaindex.runtime.loader.load_bundle`, which raises ArtifactMismatchError naming both sides and the
    fix), once per process, bundle, basis and device."""
    from dsaindex.runtime.loader import load_bundle

    s = settings()
    key = (s.artifacts, s.basis, str(device), s.allow_other_weights, id(hf_config))
    with _lock:
        if key not in _served:
            loaded = load_bundle(s.artifacts, hf_config, device=str(device), basis=s.basis, cache_dir=s.cache_dir,
                                 tracking_uri=s.tracking_uri, allow_other_weights=s.allow_other_weights)
            check_paged_codes(loaded.layers)  # RQ layers: refused when the artifacts load
            logger.info("dsaindex: %s (bundle %s) serves decode selection of layers %s",
                        s.artifacts, loaded.manifest.bundle_id, loaded.describe_layers())
            _served[key] = loaded
        return _served[key]


def layer_id_of(prefix: str) -> int | None:
    """``model.layers.7.self_attn.indexer.k_cache`` -> 7."""
    found = _LAYER.search(prefix)
    return int(found.group(1)) if found else None


class DsaIndexSparseAttnIndexer(SparseAttnIndexer):
    """``SparseAttnIndexer`` whose decode rows come from the layer's PQ artifact (see the module doc)."""

    def __init__(self, k_cache, quant_block_size: int, scale_fmt: str, topk_tokens: int, head_dim: int,
                 max_model_len: int, max_total_seq_len: int, topk_indices_buffer: torch.Tensor, *args, **kwargs):
        super().__init__(k_cache, quant_block_size, scale_fmt, topk_tokens, head_dim, max_model_len,
                         max_total_seq_len, topk_indices_buffer, *args, **kwargs)
        s = settings()
        self.layer_id = layer_id_of(getattr(k_cache, "prefix", ""))
        self.codec = None
        self.selector: PagedCacheSelector | None = None
        self.candidates = 2 * topk_tokens  # the layer's own C once its artifact is known (below)
        self.prefilter = s.decode(topk_tokens).prefilter  # the layer's own once its artifact is known (below)
        self._engine_layer: bool | None = None
        if not s.artifacts:
            return
        model_config = get_current_vllm_config().model_config
        hf_config = getattr(model_config, "hf_config", None)
        if hf_config is None:
            from dsaindex.errors import DsaIndexError

            raise DsaIndexError("dsaindex could not read the served model's config from vLLM's config, so the "
                                "artifacts of DSAINDEX_ARTIFACTS cannot be checked against it.",
                                "unset DSAINDEX_ARTIFACTS, or build the model through vLLM's engine.")
        loaded = served_artifacts(hf_config, topk_indices_buffer.device)
        if self.layer_id is not None and self.layer_id in loaded.layers and loaded.kind_of(self.layer_id).role == "decode":
            self.codec = loaded.layers[self.layer_id]
            # a count, or `auto`: this layer's C (and with DSAINDEX_PREFILTER=auto its stage 1) from the bundle's
            # held-out recall, refused here if none reaches the target
            per_layer, factors = decode_settings(s.decode(topk_tokens), loaded, topk_tokens, layers=[self.layer_id])
            self.candidates = max(per_layer[self.layer_id], topk_tokens)
            self.prefilter = factors[self.layer_id]

        _LAYERS[self.k_cache.prefix] = self

    # vLLM's CustomOp dispatch: CUDA (and platforms vLLM does not know) call forward_cuda, the CPU build
    # forward_cpu; forward_native (custom op disabled in the compilation config) calls one of them. Layers
    # the plugin serves go through one registered torch op (OP_QUALNAME): opaque to torch.compile, and one
    # of the ops vLLM splits its piecewise graphs at, as vLLM's own indexer op is.
    def forward_cuda(self, hidden_states, q_quant, k, weights):
        if self._engine_only(q_quant):
            return SparseAttnIndexer.forward_cuda(self, hidden_states, q_quant, k, weights)
        return torch.ops.vllm.dsaindex_sparse_attn_indexer(hidden_states, self.k_cache.prefix, q_quant, k, weights,
                                                           self.topk_indices_buffer)

    def forward_cpu(self, hidden_states, q_quant, k, weights):
        if self._engine_only(q_quant):
            return SparseAttnIndexer.forward_cpu(self, hidden_states, q_quant, k, weights)
        return torch.ops.vllm.dsaindex_sparse_attn_indexer(hidden_states, self.k_cache.prefix, q_quant, k, weights,
                                                           self.topk_indices_buffer)

    def _engine_only(self, q_quant) -> bool:
        """Whether vLLM's own op serves this call (decided once per layer, plus the FP4 query form)."""
        if self._engine_layer is None:
            self._engine_layer = self._decide_engine_only()
        return self._engine_layer or isinstance(q_quant, tuple)

    def _decide_engine_only(self) -> bool:
        if self.codec is None or self.use_fp4_cache:
            return True
        if self.dcp_world_size > 1 or self.use_pcp or self.candidate_blocks is not None:
            return True
        try:
            from vllm.utils.deep_gemm import mqa_logits_use_mx_scales

            return bool(mqa_logits_use_mx_scales())  # MXFP8 scales: another page layout
        except Exception:  # noqa: BLE001 - no DeepGEMM: FP32 scales
            return False

    def _forward(self, engine, hidden_states, q_quant, k, weights):
        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, dict):  # profiling / dummy run
            return engine(self, hidden_states, q_quant, k, weights)
        meta = metadata[self.k_cache.prefix]
        decode = meta.decode
        if meta.num_decodes == 0 or decode is None:
            return engine(self, hidden_states, q_quant, k, weights)
        seq_lens = decode.seq_lens
        if meta.num_decode_tokens != meta.num_decodes or (seq_lens.ndim == 2 and seq_lens.shape[1] != 1):
            return engine(self, hidden_states, q_quant, k, weights)  # several queries per request (MTP)
        buffer = self.topk_indices_buffer
        selector = self._selector()
        if meta.num_prefills > 0:
            engine(self, hidden_states, q_quant, k, weights)
            self._encode_prefills(selector, meta)
        else:
            if not self.skip_k_cache_insert:
                self._insert_keys(k, meta.slot_mapping)
            buffer[: hidden_states.shape[0]] = -1
        b = meta.num_decodes
        lens = seq_lens.reshape(seq_lens.shape[0], -1)[:b, -1]
        picked = selector.select(self.k_cache.kv_cache, decode.block_table[:b], lens, q_quant[:b], weights[:b])
        buffer[:b, : self.topk_tokens] = picked
        return buffer

    def _selector(self) -> PagedCacheSelector:
        """The layer's selector over its bound index-K cache (built on first use: the cache is bound after
        the layer)."""
        kv_cache = self.k_cache.kv_cache
        if self.selector is None or self.selector.num_pages != kv_cache.shape[0]:
            self.selector = PagedCacheSelector(self.codec, kv_cache.shape[0], self.topk_tokens,
                                               candidates=self.candidates, prefilter=self.prefilter,
                                               head_dim=self.head_dim, device=kv_cache.device)
        return self.selector

    def _encode_prefills(self, selector: PagedCacheSelector, meta) -> None:
        """Encode the completed pages of the batch's prefill requests (eager: this op splits vLLM's graphs)."""
        prefill = getattr(meta, "prefill", None)
        for chunk in getattr(prefill, "chunks", None) or []:
            lengths = chunk.cu_seq_lens[1:] - chunk.cu_seq_lens[:-1]  # each request's keys after this chunk
            selector.prepare(self.k_cache.kv_cache, chunk.block_table[: lengths.shape[0]], lengths)

    def _insert_keys(self, k: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write this step's keys into the index-K cache as vLLM's op does (its CUDA kernel; GPU only)."""
        from vllm import _custom_ops as ops

        ops.indexer_k_quant_and_cache(k[: slot_mapping.shape[0]], self.k_cache.kv_cache, slot_mapping,
                                      self.quant_block_size, self.scale_fmt)


def _op_impl(hidden_states: torch.Tensor, layer_name: str, q_quant: torch.Tensor, k: torch.Tensor | None,
             weights: torch.Tensor, topk_indices_buffer: torch.Tensor) -> torch.Tensor:
    """``vllm::dsaindex_sparse_attn_indexer``: the layer's :meth:`DsaIndexSparseAttnIndexer._forward`, with
    vLLM's own op (for the engine's part) of the tensors' device."""
    layer = _LAYERS[layer_name]
    engine = SparseAttnIndexer.forward_cpu if hidden_states.device.type == "cpu" else SparseAttnIndexer.forward_cuda
    return layer._forward(engine, hidden_states, q_quant, k, weights)


def _op_fake(hidden_states, layer_name, q_quant, k, weights, topk_indices_buffer):
    return topk_indices_buffer


def register_op() -> None:
    """Register ``vllm::dsaindex_sparse_attn_indexer`` (vLLM's ``direct_register_custom_op``, as its own
    indexer op) and make it one of the ops vLLM splits piecewise CUDA graphs at
    (``CompilationConfig._attention_ops``, config/compilation.py): batches with prefill run it eagerly,
    so prompts' pages are encoded there; full decode graphs capture it."""
    from vllm.config.compilation import CompilationConfig
    from vllm.utils.torch_utils import direct_register_custom_op

    if not hasattr(torch.ops.vllm, "dsaindex_sparse_attn_indexer"):
        direct_register_custom_op(op_name="dsaindex_sparse_attn_indexer", op_func=_op_impl,
                                  mutates_args=["topk_indices_buffer"], fake_impl=_op_fake)
    if OP_QUALNAME not in CompilationConfig._attention_ops:
        CompilationConfig._attention_ops.append(OP_QUALNAME)


def install() -> None:
    """Register :class:`DsaIndexSparseAttnIndexer` for ``SparseAttnIndexer`` and its torch op (idempotent)."""
    register_op()
    have = op_registry_oot.get(OP_NAME)
    if have is DsaIndexSparseAttnIndexer:
        return
    if have is not None:
        raise RuntimeError(f"another plugin already replaced vLLM's {OP_NAME} ({have.__module__}.{have.__qualname__}); "
                           "dsaindex cannot replace it too. Load one of them (VLLM_PLUGINS).")
    SparseAttnIndexer.register_oot(DsaIndexSparseAttnIndexer)
