"""``DSAINDEX_CAPTURE``: SGLang's side of the engine capture (:mod:`dsaindex.runtime.engine_capture`).

Where SGLang 0.5.23 shows what the capture needs, and the hooks :func:`dsaindex_sglang.register` installs:

* the served model: AFTER ``ModelConfig.__init__`` (the hook the artifacts check already uses,
  :func:`dsaindex_sglang.hooks.validate_after_model_config`): the store is checked against the checkpoint's
  config in every process, so a store of another model or other settings stops startup;
* the step's queries and head weights: AROUND ``Indexer._get_topk_paged`` (also the selection's hook): in
  decode mode, the FP8 queries, weights and lengths of the step go to the capture's staging buffers (device
  copies, inside SGLang's decode CUDA graphs too);
* which request each row is: AFTER ``ModelRunner.forward`` (model_runner.py:1813, outside the graphs, where
  SGLang's own ``IndexerTopkCapturer.on_forward_end`` reads its graph-written buffer): ``forward_batch.rids``
  names the decode rows, and the sampled rows are copied to host memory on the forward stream;
* the finished request's pages: BEFORE ``sglang.srt.mem_cache.common.release_kv_cache`` (common.py:400),
  the one function every path that ends a request calls (decode results, aborts, retractions, PD transfers)
  while ``req.kv.req_pool_idx`` still maps its positions to KV slots and before the slots go back to the
  allocator. It runs on the scheduler thread under its schedule stream, which SGLang's forward stream waits
  on before each batch (scheduler.py:4672), so the copy is ordered before any reuse of the pages.

Only a finished, not aborted request is written; one released unfinished (a retraction) drops its samples.
On a PD prefill node nothing is written (the decode node holds the whole sequence).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

logger = logging.getLogger("dsaindex_sglang")


class CaptureState:
    """Per process: the capture's settings, the manifest of the served model (set by the ModelConfig hook),
    and the :class:`EngineCapture`, built at the first hook call of a scheduler (TP rank 0 writes)."""

    def __init__(self) -> None:
        self.path: str | None = None
        self.capacity = 0
        self.queries = 0
        self.manifest = None
        self.engine = None  # EngineCapture, on the writer rank
        self.role: str | None = None  # None until decided; "writer" or why this process does not write
        self.warned = False

    @property
    def on(self) -> bool:
        return self.path is not None

    def configure(self, settings: Any) -> None:
        self.path, self.capacity, self.queries = settings.capture, settings.capture_queue, settings.capture_queries

    def prepare(self, model_config: Any, checkpoint_config: Any) -> None:
        """The served model's manifest, and the startup check of the store against it (every process, read
        only): a store of another model or other settings raises StoreMismatchError, naming DSAINDEX_CAPTURE."""
        from dsaindex.runtime.engine_capture import check_store, engine_fingerprint, engine_manifest
        from dsaindex.runtime.settings import engine_settings

        model = engine_fingerprint(checkpoint_config, str(model_config.model_path))
        manifest = engine_manifest(model, "sglang", engine_settings("sglang").basis, self.queries)
        existed = check_store(self.path, manifest)
        self.manifest = manifest
        logger.info("dsaindex: capture store %s %s.", self.path, "checked: appended to" if existed else "to be created")

    def writer(self):
        """The EngineCapture of this process where it writes, else None (decided once, at the first call)."""
        if self.role is None:
            self.role = self._decide()
            if self.role == "writer":
                from dsaindex.runtime.engine_capture import EngineCapture

                self.engine = EngineCapture(self.path, self.manifest, self.capacity, self.queries)
            else:
                logger.info("dsaindex: this process does not write the capture (%s).", self.role)
        return self.engine

    def _decide(self) -> str:
        if self.manifest is None:
            return "the served model's config was never seen (no ModelConfig hook ran)"
        rank, pp, mode = parallel_place()
        if pp > 1:
            from dsaindex.errors import DsaIndexError

            raise DsaIndexError(f"DSAINDEX_CAPTURE with pipeline parallelism ({pp} stages): each stage holds "
                                "only its layers' index keys, and the capture writes every layer from one rank.",
                                "capture with tensor parallelism only (--pp-size 1), or unset DSAINDEX_CAPTURE.")
        if mode == "prefill":
            return "a PD prefill node: the decode node captures the whole sequence"
        return "writer" if rank == 0 else f"tensor-parallel rank {rank}: rank 0 writes"

    def reset(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.__init__()


CAPTURE = CaptureState()


def parallel_place() -> tuple[int, int, str]:
    """(tensor-parallel rank, pipeline stages, disaggregation mode) from SGLang's published runtime context
    (0, 1, "null" where none is published: one process)."""
    try:
        from sglang.srt.runtime_context import get_disagg, get_parallel

        parallel = get_parallel()
        rank, pp = int(parallel.tp_rank or 0), int(parallel.pp_size or 1)
    except Exception:  # noqa: BLE001 - no context published (a single process, tests)
        return 0, 1, "null"
    try:
        mode = str(get_disagg().disaggregation_mode)
    except Exception:  # noqa: BLE001
        mode = "null"
    return rank, pp, mode


def safely(hook):
    """The capture never stops serving: a failure in its part of a hook is logged (once per kind) and the
    engine goes on (a startup refusal, raised by :meth:`CaptureState.writer`, is not caught)."""

    @functools.wraps(hook)
    def guarded(*args: Any, **kwargs: Any) -> None:
        from dsaindex.errors import DsaIndexError

        try:
            hook(*args, **kwargs)
        except DsaIndexError:
            raise
        except Exception as err:  # noqa: BLE001
            key = f"{hook.__name__}: {type(err).__name__}: {err}"[:200]
            if key not in _failures:
                _failures.add(key)
                logger.exception("dsaindex: the capture failed in %s (serving goes on)", hook.__name__)
        return None

    return guarded


_failures: set[str] = set()


@safely
def stage(forward_batch: Any, layer_id: int, q_fp8: Any, weights: Any, metadata: Any) -> None:
    """From the AROUND hook on ``Indexer._get_topk_paged``: a decode step's queries, weights and lengths to
    the staging buffers (device copies only: SGLang's decode graphs capture them)."""
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is None or not mode.is_decode():
        return
    capture = CAPTURE.writer()
    if capture is None:
        return
    capture.stage(int(layer_id), q_fp8, weights, metadata.get_seqlens_int32())


@safely
def after_forward(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on ``ModelRunner.forward``: the decode rows' request ids (``forward_batch.rids``) pick the
    sampled rows; they are copied to host memory on the current (forward) stream, without waiting."""
    if not CAPTURE.on or getattr(self, "is_draft_worker", False):
        return None
    batch = kwargs.get("forward_batch", args[0] if args else None)
    mode = getattr(batch, "forward_mode", None)
    rids = getattr(batch, "rids", None)
    if mode is None or not mode.is_decode() or not rids:
        return None
    capture = CAPTURE.writer()
    if capture is not None:
        capture.decode_step(rids)
    return None


@safely
def before_release(req: Any, tree_cache: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook on ``release_kv_cache(req, tree_cache, checkpoint=...)``: a finished request's keys, read
    from its index-K pages while its row still maps them; any other release forgets its samples."""
    if not CAPTURE.on:
        return None
    capture = CAPTURE.writer()
    if capture is None:
        return None
    rid = str(req.rid)
    kv = getattr(req, "kv", None)
    pool_idx = getattr(kv, "req_pool_idx", None) if kv is not None else getattr(req, "req_pool_idx", None)
    if not req.finished() or _aborted(req) or pool_idx is None:
        capture.discard(rid)
        return None
    prompt, output = list(req.origin_input_ids), list(req.output_ids)
    keys = len(prompt) + len(output) - 1  # the newest token's key is never written
    committed = getattr(kv, "kv_committed_len", None)
    if committed is not None:
        keys = min(keys, int(committed))
    allocator = tree_cache.token_to_kv_pool_allocator
    pool = allocator.get_kvcache()
    if (getattr(pool, "index_page_size", None) != 64 or getattr(pool, "index_kpool", 1) != 1
            or getattr(allocator, "page_size", 64) != 64):
        _warn_once("the index-K pages are not plain 64-key pages of the KV allocator's 64-token pages")
        capture.discard(rid)
        return None
    width = -(-max(keys, 0) // 64)
    row = tree_cache.req_to_token_pool.req_to_token[pool_idx]
    pages = row[0 : width * 64 : 64].long() // 64  # index-K page of each 64-token page (as the pool's set_index_k)
    caches = {layer: pool.get_index_k_with_scale_buffer(layer) for layer in capture.layers}
    capture.finish(rid, (prompt + output)[: max(keys, 0)], caches, pages, keys)
    return None


def _aborted(req: Any) -> bool:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return isinstance(getattr(req, "finished_reason", None), FINISH_ABORT)


def _warn_once(why: str) -> None:
    if not CAPTURE.warned:
        CAPTURE.warned = True
        logger.warning("dsaindex: the capture skips requests where %s.", why)
