"""``DSAINDEX_CAPTURE``: vLLM's side of the engine capture (:mod:`dsaindex.runtime.engine_capture`).

Where vLLM 0.33.0 shows what the capture needs:

* the served model: when the first indexer layer is built (``DsaIndexSparseAttnIndexer.__init__``, in the
  worker, where the artifacts are checked too), from the same ``hf_config``: a store of another model or other
  settings stops startup there;
* the step's queries and head weights: the plugin's indexer step (its registered op, or the CUDA model path's
  ``sparse_attn_indexer`` it hooks): a decode step's FP8 queries, weights and lengths go to the staging
  buffers (device copies; vLLM's full decode graphs capture them);
* which request each decode row is, after ``execute_model`` of the model runner (outside the graphs):
  vLLM orders decode requests first, so the leading requests of the batch with one scheduled token are the
  decode rows (Model Runner V2, vLLM's default: ``execute_model_state.input_batch``; V1:
  ``input_batch.req_ids`` with the scheduler output's token counts);
* the finished request's pages: where the worker drops a finished request's state, at the start of the
  next ``execute_model``, before that step's forward (which may write the freed blocks) is launched on the
  same stream: V2 ``GPUModelRunner.finish_requests`` (its ``req_states`` and ``block_tables`` still hold
  the request's tokens, computed-token count and block ids), V1 ``GPUModelRunner._on_request_state_removed``
  (vLLM's hook for request-scoped side state: the ``CachedRequestState`` with its block ids). Preempted
  requests (also removed there by V2) keep their samples and are captured when they finish.

The runner methods are wrapped when the first indexer layer is built with the capture on (the runner's
module is loaded by then); the wrappers call vLLM's method unchanged after the capture's part.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any

logger = logging.getLogger("dsaindex_vllm")

V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
V2_RUNNER = "vllm.v1.worker.gpu.model_runner"


class CaptureState:
    """Per worker process: the settings, the served model's manifest, the layers' index-K caches (by layer id
    and cache prefix) and the :class:`EngineCapture` where this rank writes."""

    def __init__(self) -> None:
        self.path: str | None = None
        self.capacity = 0
        self.queries = 0
        self.manifest = None
        self.engine = None
        self.role: str | None = None
        self.layers: dict[int, Any] = {}  # layer id -> the op (its k_cache.kv_cache is the layer's index-K cache)
        self._groups: dict[int, int] = {}  # id(kv_cache_config) -> the KV cache group of the indexer caches

    @property
    def on(self) -> bool:
        return self.path is not None

    def configure(self, settings: Any) -> None:
        self.path, self.capacity, self.queries = settings.capture, settings.capture_queue, settings.capture_queries

    def prepare(self, hf_config: Any, name: str, basis: str, parallel: Any = None) -> None:
        """At the first layer build: the manifest, the store checked (a mismatch raises StoreMismatchError
        naming DSAINDEX_CAPTURE), the writer decided and, on the writer, the store opened and the runners
        wrapped. Later calls do nothing."""
        if self.manifest is not None:
            return
        from dsaindex.runtime.engine_capture import (
            EngineCapture,
            check_store,
            engine_fingerprint,
            engine_manifest,
        )

        manifest = engine_manifest(engine_fingerprint(hf_config, name), "vllm", basis, self.queries)
        check_store(self.path, manifest)
        self.manifest = manifest
        self.role = self._decide(parallel)
        if self.role == "writer":
            self.engine = EngineCapture(self.path, manifest, self.capacity, self.queries)
            patch_runners()
        else:
            logger.info("dsaindex: this worker does not write the capture (%s).", self.role)

    def _decide(self, parallel: Any) -> str:
        rank, pp = tensor_parallel_place()
        dp = int(getattr(parallel, "data_parallel_rank", 0) or 0)
        if pp > 1:
            from dsaindex.errors import DsaIndexError

            raise DsaIndexError(f"DSAINDEX_CAPTURE with pipeline parallelism ({pp} stages): each stage holds only "
                                "its layers' index keys, and the capture writes every layer from one rank.",
                                "capture with tensor parallelism only (pipeline_parallel_size 1), or unset "
                                "DSAINDEX_CAPTURE.")
        if dp:
            return f"data-parallel rank {dp}: data-parallel rank 0 writes (one writer per store)"
        return "writer" if rank == 0 else f"tensor-parallel rank {rank}: rank 0 writes"

    def writer(self):
        return self.engine

    def caches(self) -> dict[int, Any]:
        return {layer: op.k_cache.kv_cache for layer, op in self.layers.items()}

    def group_of(self, kv_cache_config: Any) -> int:
        """The KV cache group whose block tables hold the indexer caches' blocks."""
        key = id(kv_cache_config)
        if key not in self._groups:
            prefixes = {op.k_cache.prefix for op in self.layers.values()}
            groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
            found = [i for i, g in enumerate(groups) if prefixes & set(getattr(g, "layer_names", []))]
            self._groups[key] = found[0] if found else 0
        return self._groups[key]

    def reset(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.__init__()


CAPTURE = CaptureState()


def tensor_parallel_place() -> tuple[int, int]:
    """(tensor-parallel rank, pipeline stages) from vLLM's distributed state; (0, 1) where it is not set
    up (one process)."""
    from vllm.distributed import parallel_state

    try:
        rank = int(parallel_state.get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - not initialized
        rank = 0
    try:
        stages = int(parallel_state.get_pp_group().world_size)
    except Exception:  # noqa: BLE001
        stages = 1
    return rank, stages


def stage(op: Any, q_quant: Any, weights: Any, metadata: Any) -> None:
    """A decode step's queries, weights and lengths of layer ``op`` to the staging buffers (device copies
    only). Plain decode only (one query row a request); rows of speculative steps are not sampled."""
    capture = CAPTURE.engine
    if capture is None or not isinstance(metadata, dict) or isinstance(q_quant, tuple) or op.layer_id is None:
        return
    meta = metadata.get(op.k_cache.prefix)
    decode = getattr(meta, "decode", None)
    if decode is None or not meta.num_decodes or meta.num_decode_tokens != meta.num_decodes:
        return
    b = meta.num_decodes
    lengths = decode.seq_lens.reshape(-1)[:b] if decode.seq_lens.ndim == 1 else decode.seq_lens[:b, -1]
    try:
        capture.stage(op.layer_id, q_quant[:b], weights[:b], lengths)
    except Exception as err:  # noqa: BLE001 - the capture never stops serving
        _log_failure("staging a decode step", err)


def decode_request_ids(req_ids: list, counts) -> list:
    """The decode rows' request ids: the leading requests of the batch scheduled one token each."""
    out = []
    for rid, n in zip(req_ids, counts, strict=False):
        if int(n) != 1:
            break
        out.append(rid)
    return out


# ---- the runners' hooks --------------------------------------------------------------------------------
def after_execute_v1(runner: Any, scheduler_output: Any) -> None:
    """After V1 ``execute_model``: the batch's decode rows (``input_batch.req_ids``, decodes first)."""
    capture = CAPTURE.engine
    if capture is None or scheduler_output is None:
        return
    req_ids = list(runner.input_batch.req_ids)
    counts = [scheduler_output.num_scheduled_tokens.get(r, 0) for r in req_ids]
    capture.decode_step(decode_request_ids(req_ids, counts))


def after_execute_v2(runner: Any) -> None:
    """After V2 ``execute_model``: the batch it ran (``execute_model_state.input_batch``, in sorted order:
    decode requests first)."""
    capture = CAPTURE.engine
    state = getattr(runner, "execute_model_state", None)
    if capture is None or state is None:
        return
    batch = state.input_batch
    capture.decode_step(decode_request_ids(list(batch.req_ids), list(batch.num_scheduled_tokens)))


def finish_v1(runner: Any, req_id: str, req_state: Any) -> None:
    """V1: a finished request's ``CachedRequestState`` (block ids per KV cache group, host lists)."""
    capture = CAPTURE.engine
    if capture is None or req_state is None:
        return
    prompt = req_state.prompt_token_ids
    if prompt is None:  # prompt embeddings: no token ids to record
        capture.discard(req_id)
        return
    import torch

    tokens = list(prompt) + list(req_state.output_token_ids)
    keys = min(int(req_state.num_computed_tokens), len(tokens) - 1)
    blocks = req_state.block_ids[CAPTURE.group_of(runner.kv_cache_config)]
    keys = min(keys, 64 * len(blocks))
    capture.finish(req_id, tokens, CAPTURE.caches(), torch.tensor(blocks[: -(-keys // 64)], dtype=torch.long), keys)


def finish_v2(runner: Any, scheduler_output: Any) -> None:
    """V2: each finished request's row of ``req_states`` (tokens, computed count) and ``block_tables`` (its
    blocks, read on the device: no host sync), before vLLM frees the row."""
    capture = CAPTURE.engine
    if capture is None:
        return
    states, tables = runner.req_states, runner.block_tables
    group = CAPTURE.group_of(runner.kv_cache_config)
    for req_id in sorted(scheduler_output.finished_req_ids):
        index = states.req_id_to_index.get(req_id)
        if index is None:
            continue
        keys = int(states.num_computed_tokens_np[index])
        keys = min(keys, 64 * int(tables.num_blocks.np[group, index]))
        width = -(-keys // 64)
        capture.finish(req_id, states.all_token_ids.gpu[index, :keys], CAPTURE.caches(),
                       tables.block_tables[group].gpu[index, :width], keys)


def patch_runners() -> None:
    """Wrap the model runners' methods (both where their modules import; each once)."""
    _wrap(V1_RUNNER, "_on_request_state_removed", lambda self, args, kwargs: finish_v1(self, *args[:2]), before=True)
    _wrap(V1_RUNNER, "execute_model",
          lambda self, args, kwargs: after_execute_v1(self, kwargs.get("scheduler_output", args[0] if args else None)))
    _wrap(V2_RUNNER, "finish_requests",
          lambda self, args, kwargs: finish_v2(self, kwargs.get("scheduler_output", args[0] if args else None)),
          before=True)
    _wrap(V2_RUNNER, "execute_model",
          lambda self, args, kwargs: None if kwargs.get("dummy_run") else after_execute_v2(self))


def _wrap(module_name: str, method: str, hook, before: bool = False) -> None:
    try:
        cls = importlib.import_module(module_name).GPUModelRunner
    except Exception as err:  # noqa: BLE001 - a runner this build does not have
        logger.debug("dsaindex: %s not wrapped (%s)", module_name, err)
        return
    original = getattr(cls, method, None)
    if original is None or getattr(original, "_dsaindex_capture", False):
        return

    @functools.wraps(original)
    def wrapped(self, *args, **kwargs):
        if before:
            _safely(hook, self, args, kwargs)
        result = original(self, *args, **kwargs)
        if not before:
            _safely(hook, self, args, kwargs)
        return result

    wrapped._dsaindex_capture = True  # type: ignore[attr-defined]
    wrapped.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(cls, method, wrapped)


def _safely(hook, self, args, kwargs) -> None:
    """The capture never stops serving: a failure in its part is logged (once per kind) and serving goes on."""
    try:
        hook(self, args, kwargs)
    except Exception as err:  # noqa: BLE001
        _log_failure("a runner hook", err)


def _log_failure(where: str, err: Exception) -> None:
    key = f"{where}: {type(err).__name__}: {err}"[:200]
    if key not in _failures:
        _failures.add(key)
        logger.error("dsaindex: the capture failed in %s (serving goes on): %s", where, key, exc_info=err)


_failures: set[str] = set()
