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
layers without an artifact, decode rows vLLM packs because their counts differ (``requires_padding``), FP4
caches, MXFP8 (Blackwell) scales, decode/prefill context parallelism, and the profiling run. In a batch with prefill
the engine's op runs first (it writes the keys to the cache and every row) and the decode rows are
then replaced; in a decode-only batch the keys are written with vLLM's ``indexer_k_quant_and_cache``
and the engine's exact decode scan does not run.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer

import dsaindex_vllm.capture as capture
from dsaindex.runtime.loader import code_bytes_of, decode_settings, describe_points, growth_bands
from dsaindex.runtime.paged_select import (
    PagedCacheSelector,
    check_paged_codes,
    describe_step,
    fold_scan_unavailable,
    growth_limit,
    stage1_scan,
)
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


# How vLLM's model code calls a DSA layer's indexer, by the module that builds the layer. ``op``: through the
# layer's ``indexer_op`` (this class's forward); ``function``: the module calls the plain function
# ``sparse_attn_indexer(...)`` itself (vLLM's CUDA path for DeepSeek-V3.2 and GLM-5: models/deepseek_v32/
# __init__.py loads nvidia/model.py on CUDA, whose attention.py `_sparse_indexer_and_attn` never calls
# ``indexer_op``), so the plugin replaces that module's name with :func:`_hooked`.
MODEL_PATHS = {
    "vllm.model_executor.models.deepseek_v2": "op",  # the CPU / XPU path (and vLLM's generic DSA code)
    "vllm.models.deepseek_v32.attention": "function",  # CUDA: DeepSeek-V3.2, GLM-5
    "vllm.models.deepseek_v41.attention": "op",  # the V4 family's indexer layers call indexer_op
}
FUNCTION = "sparse_attn_indexer"


def _builder_module() -> str:
    """The module whose code is building this layer: the first frame outside this plugin, vLLM's op
    machinery (``CustomOp``) and the in-tree layer class."""
    skip = {__name__, "vllm.model_executor.custom_op", "vllm.model_executor.layers.sparse_attn_indexer"}
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") in skip:
        frame = frame.f_back
    return "" if frame is None else str(frame.f_globals.get("__name__", ""))


# vLLM's model registry on CUDA: these architectures are served by models/deepseek_v32 (nvidia/model.py)
CUDA_FUNCTION_PATH = {"DeepseekV32ForCausalLM": "vllm.models.deepseek_v32.attention",
                      "GlmMoeDsaForCausalLM": "vllm.models.deepseek_v32.attention"}


def _platform_is_cuda() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda())


def model_path(builder: str, hf_config: Any) -> str:
    """The module whose code calls the served layers' indexer: the module building the layer where the plugin
    knows it (:data:`MODEL_PATHS`), else the one vLLM's registry maps the model's architecture to on this
    platform (:data:`CUDA_FUNCTION_PATH` on CUDA), else the layer's op (``deepseek_v2``'s path)."""
    if builder in MODEL_PATHS:
        return builder
    if _platform_is_cuda():
        for arch in getattr(hf_config, "architectures", None) or []:
            if arch in CUDA_FUNCTION_PATH:
                return CUDA_FUNCTION_PATH[arch]
    return "vllm.model_executor.models.deepseek_v2"


def reach_model_path(module_name: str) -> str:
    """Make the model code of ``module_name`` (:func:`model_path`) reach the plugin: nothing to do where it
    calls the layer's op; where it calls ``sparse_attn_indexer`` itself, that name in the module is replaced
    (once) by :func:`_hooked`. Returns how the calls arrive (``op`` / ``function``). Refuses
    (:class:`DsaIndexError`, at startup, when the first served layer is built) a path whose function it
    cannot find: artifacts the engine never consults would look like a plugin at work."""
    import importlib

    from dsaindex.errors import DsaIndexError

    how = MODEL_PATHS[module_name]
    if how == "function":
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise DsaIndexError(f"vLLM's DSA model path {module_name} does not import here ({err}); the plugin "
                                "cannot hook the indexer that path calls, so its selection would never run.",
                                "serve with the vLLM release the plugin supports (0.33.0), or unset "
                                "DSAINDEX_ARTIFACTS.") from None
        current = getattr(module, FUNCTION, None)
        if current is None:
            raise DsaIndexError(f"{module_name} has no `{FUNCTION}` to hook: this vLLM's DSA model path calls its "
                                "indexer another way, and the plugin's selection would never be called.",
                                "serve with the vLLM release the plugin supports (0.33.0), or unset DSAINDEX_ARTIFACTS.")
        if not getattr(current, "_dsaindex", False):
            setattr(module, FUNCTION, _hooked(current))
            logger.info("dsaindex: %s.%s hooked (vLLM's model path calls it, not the layer's op)", module_name,
                        FUNCTION)
    return how


def _hooked(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``original`` (vLLM's ``sparse_attn_indexer``) with the plugin's decode selection for served layers:
    a layer the plugin serves, in a call it can take (no context parallelism, no FP4 cache or query scale, no
    candidate blocks), runs the layer's step with ``original(...)`` as its engine part; every other call is
    ``original``'s. It runs on every layer's every step, so the arguments are read by position (found once
    from the signature), not bound per call."""
    import functools
    import inspect

    params = inspect.signature(original).parameters
    index = {name: i for i, name in enumerate(params)}
    default = {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}
    resolve = _layer_resolver()

    def arg(name: str, args: tuple, kwargs: dict) -> Any:
        i = index[name]
        return args[i] if i < len(args) else kwargs.get(name, default.get(name))

    @functools.wraps(original)
    def hooked(*args: Any, **kwargs: Any) -> torch.Tensor:
        layer = _LAYERS.get(resolve(arg("k_cache_prefix", args, kwargs)))
        q_quant = arg("q_quant", args, kwargs)
        plain = not (arg("use_pcp", args, kwargs) or arg("use_fp4_cache", args, kwargs)
                     or arg("q_scale", args, kwargs) is not None or (arg("dcp_world_size", args, kwargs) or 1) > 1
                     or arg("candidate_blocks", args, kwargs) is not None)
        if layer is not None and plain and capture.CAPTURE.on:
            capture.stage(layer, q_quant, arg("weights", args, kwargs), get_forward_context().attn_metadata)
        if layer is None or layer._engine_only(q_quant) or not plain:
            return original(*args, **kwargs)
        return layer._forward(lambda: original(*args, **kwargs), arg("hidden_states", args, kwargs), q_quant,
                              arg("k", args, kwargs), arg("weights", args, kwargs),
                              insert_keys=not arg("skip_k_cache_insert", args, kwargs), stage=False)

    hooked._dsaindex = True  # type: ignore[attr-defined]
    return hooked


def _layer_resolver() -> Callable[[Any], str]:
    """vLLM passes a layer name or its interned form: its ``_resolve_layer_name`` where this vLLM has it."""
    try:
        from vllm.model_executor.layers.sparse_attn_indexer import _resolve_layer_name
    except ImportError:
        return str
    return _resolve_layer_name


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
        self.stage1 = "codes"  # what the layer's stage 1 scores (DSAINDEX_STAGE1; chosen with its artifact, below)
        self.exact_below = s.exact_below  # DSAINDEX_EXACT_BELOW: small steps scored as vLLM scores them
        self.grow_band = 0  # DSAINDEX_LONG_PREFIX=grow: the keys past which C grows (set with the artifact, below)
        self._engine_layer: bool | None = None
        self.model_path = "op"  # how vLLM's model code reaches this layer (reach_model_path)
        if not s.artifacts and not s.capture:
            return
        vllm_config = get_current_vllm_config()
        model_config = vllm_config.model_config
        hf_config = getattr(model_config, "hf_config", None)
        if hf_config is None:
            from dsaindex.errors import DsaIndexError

            raise DsaIndexError("dsaindex could not read the served model's config from vLLM's config, so the "
                                "artifacts of DSAINDEX_ARTIFACTS (or the store of DSAINDEX_CAPTURE) cannot be "
                                "checked against it.",
                                "unset DSAINDEX_ARTIFACTS and DSAINDEX_CAPTURE, or build the model through vLLM's "
                                "engine.")
        loaded = served_artifacts(hf_config, topk_indices_buffer.device) if s.artifacts else None
        if loaded is not None and self.layer_id is not None and self.layer_id in loaded.layers and \
                loaded.kind_of(self.layer_id).role == "decode":
            self.codec = loaded.layers[self.layer_id]
            # a count, or `auto`: this layer's C (and with DSAINDEX_PREFILTER=auto its stage 1) from the bundle's
            # held-out recall, refused here if none reaches the target
            per_layer, factors, stages = decode_settings(s.decode(topk_tokens), loaded, topk_tokens,
                                                         layers=[self.layer_id],
                                                         folds=fold_scan_unavailable(topk_indices_buffer.device))
            self.candidates = max(per_layer[self.layer_id], topk_tokens)
            self.prefilter = factors[self.layer_id]
            self.stage1 = stages[self.layer_id]
            # DSAINDEX_LONG_PREFIX=grow: C grows with a request's prefix past the band its recall was measured in
            self.grow_band = growth_bands(loaded.manifest.metrics, per_layer, factors, topk_tokens,
                                          stages)[self.layer_id] if s.long_prefix == "grow" else 0
            logger.info("dsaindex: %s; %s", describe_points(loaded.manifest.metrics, per_layer, factors, topk_tokens,
                                                            s.recall_target,
                                                            code_bytes={self.layer_id: code_bytes_of(self.codec)},
                                                            grow={self.layer_id: (self.grow_band,
                                                                                  growth_limit(self.candidates))},
                                                            stage1=stages),
                        describe_step(0 if s.keys == "host" else self.exact_below,
                                      [self.candidates * self.prefilter], stage1_scan([self.codec]),
                                      grows=self.grow_band > 0, folds=self.stage1 == "folds"))

        _LAYERS[self.k_cache.prefix] = self
        if s.capture:  # the store checked against this model (startup), the writer decided, once per process
            if not capture.CAPTURE.on:
                capture.CAPTURE.configure(s)
            capture.CAPTURE.prepare(hf_config, str(getattr(model_config, "model", None) or
                                                   getattr(hf_config, "_name_or_path", "") or "served-model"),
                                    s.basis, getattr(vllm_config, "parallel_config", None))
            if self.layer_id is not None:
                capture.CAPTURE.layers[self.layer_id] = self
        if self.codec is not None or capture.CAPTURE.on:
            self.model_path = reach_model_path(model_path(_builder_module(), hf_config))
        if self.codec is not None:
            if s.keys == "host" and not self._engine_only(None):
                from dsaindex_vllm import host_keys

                host_keys.refuse_unsupported(get_current_vllm_config())
                host_keys.mark(self.k_cache, self.codec.codebooks.shape[0])  # M bytes of codes a key

    # vLLM's CustomOp dispatch: CUDA (and platforms vLLM does not know) call forward_cuda, the CPU build
    # forward_cpu; forward_native (custom op disabled in the compilation config) calls one of them. Layers
    # the plugin serves go through one registered torch op (OP_QUALNAME): opaque to torch.compile, and one
    # of the ops vLLM splits its piecewise graphs at, as vLLM's own indexer op is.
    def forward_cuda(self, hidden_states, q_quant, k, weights):
        if self._engine_only(q_quant) and not capture.CAPTURE.on:
            return SparseAttnIndexer.forward_cuda(self, hidden_states, q_quant, k, weights)
        return torch.ops.vllm.dsaindex_sparse_attn_indexer(hidden_states, self.k_cache.prefix, q_quant, k, weights,
                                                           self.topk_indices_buffer)

    def forward_cpu(self, hidden_states, q_quant, k, weights):
        if self._engine_only(q_quant) and not capture.CAPTURE.on:
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

    def _forward(self, engine: Callable[[], torch.Tensor], hidden_states, q_quant, k, weights,
                 insert_keys: bool | None = None, stage: bool = True):
        """The layer's step: ``engine()`` runs vLLM's own indexer for this call (the op's, or the CUDA model
        path's function with its arguments); ``insert_keys``: whether the decode-only path writes the step's
        keys to the cache itself (default: unless the layer was built with ``skip_k_cache_insert``). With
        ``DSAINDEX_CAPTURE`` a decode step's queries and weights are staged first (``stage``: not done yet by
        the caller); a layer the plugin does not serve then runs ``engine()``."""
        metadata = get_forward_context().attn_metadata
        if stage and capture.CAPTURE.on:
            capture.stage(self, q_quant, weights, metadata)
        if self._engine_only(q_quant):
            return engine()
        if not isinstance(metadata, dict):  # profiling / dummy run
            return engine()
        meta = metadata[self.k_cache.prefix]
        decode = meta.decode
        if meta.num_decodes == 0 or decode is None:
            return engine()
        seq_lens = decode.seq_lens
        b, rows = meta.num_decodes, meta.num_decode_tokens
        if rows % b != 0 or getattr(decode, "requires_padding", False):
            return engine()  # ragged queries per request (a short chunked prefill counted as decode): vLLM packs them
        next_n = rows // b  # queries per request: 1, or 1 + the speculative tokens (MTP) verified this step
        if seq_lens.ndim == 2 and seq_lens.shape[1] not in (1, next_n):
            return engine()
        buffer = self.topk_indices_buffer
        selector = self._selector()
        if meta.num_prefills > 0:
            engine()
            self._encode_prefills(selector, meta)
        else:
            if (not self.skip_k_cache_insert) if insert_keys is None else insert_keys:
                self._insert_keys(k, meta.slot_mapping)
            buffer[: hidden_states.shape[0]] = -1
        table, lens = decode_rows(decode.block_table[:b], seq_lens[:b], next_n)
        picked = selector.select(self.k_cache.kv_cache, table, lens, q_quant[:rows], weights[:rows])
        buffer[:rows, : self.topk_tokens] = picked
        return buffer

    def _selector(self) -> PagedCacheSelector:
        """The layer's selector over its bound index-K cache (built on first use: the cache is bound after
        the layer)."""
        kv_cache = self.k_cache.kv_cache
        if self.selector is None or self.selector.num_pages != kv_cache.shape[0]:
            codes = getattr(self.k_cache, "_dsaindex_codes", None)  # DSAINDEX_KEYS=host: the pool holds them
            self.selector = PagedCacheSelector(self.codec, kv_cache.shape[0], self.topk_tokens,
                                               candidates=self.candidates, prefilter=self.prefilter,
                                               stage1=self.stage1, head_dim=self.head_dim, device=kv_cache.device,
                                               exact_below=self.exact_below, keys_on_host=codes is not None,
                                               codes=codes, grow_band=self.grow_band)
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


def decode_rows(block_table: torch.Tensor, seq_lens: torch.Tensor, next_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per decode query row (request-major, ``next_n`` rows a request, as vLLM lays out the decode tokens): its
    request's block table and the keys it may see. ``seq_lens`` is [B, next_n] (vLLM's per-row lengths under
    speculative decoding), [B, 1] or [B] (the request's length, its last query's: query j of ``next_n`` sees
    ``length - (next_n - 1 - j)`` keys, DeepGEMM's paged-logits convention). Shapes depend on B and ``next_n``
    only, so a CUDA graph captures it."""
    b = block_table.shape[0]
    lens = seq_lens.reshape(b, -1)
    if lens.shape[1] != next_n:
        lens = lens[:, -1:] - torch.arange(next_n - 1, -1, -1, device=lens.device, dtype=lens.dtype)
    if next_n == 1:
        return block_table, lens.reshape(b)
    return block_table.repeat_interleave(next_n, dim=0), lens.reshape(b * next_n)


def _op_impl(hidden_states: torch.Tensor, layer_name: str, q_quant: torch.Tensor, k: torch.Tensor | None,
             weights: torch.Tensor, topk_indices_buffer: torch.Tensor) -> torch.Tensor:
    """``vllm::dsaindex_sparse_attn_indexer``: the layer's :meth:`DsaIndexSparseAttnIndexer._forward`, with
    vLLM's own op (for the engine's part) of the tensors' device."""
    layer = _LAYERS[layer_name]
    engine = SparseAttnIndexer.forward_cpu if hidden_states.device.type == "cpu" else SparseAttnIndexer.forward_cuda
    return layer._forward(lambda: engine(layer, hidden_states, q_quant, k, weights), hidden_states, q_quant, k,
                          weights)


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
