"""Capture from inside a serving engine: what the SGLang and vLLM plugins write with ``DSAINDEX_CAPTURE``.

The engine-independent part. The plugins say where a request's pages are and when it finishes; this module
keeps the per-request query samples, copies pages and samples off the device without waiting for them,
holds them in a queue bounded in bytes, and writes them from one background thread into a capture store
(:mod:`dsaindex.artifacts.capture_store`, the format ``dsaindex train pq`` reads):

* **keys**: when a request finishes, the engine's index-K pages of every indexer layer (``[pages,
  64 * (D + 4)]`` uint8: 64 x D FP8 e4m3 key bytes, then 64 float32 ue8m0 scales, the layout both engines
  keep) are gathered and copied to host memory, then dequantized by the writer
  (:func:`dsaindex.kernels.fp8_score.paged_keys_reference`, then ``code * scale``) into the store's key dtype.
  An FP8 value times a power of two is exact in bfloat16, so the store holds exactly the keys the engine
  scores, and :meth:`CaptureStore.engine_keys` (the FP8 round trip every trainer reads through) returns them
  unchanged;
* **queries**: at every indexer call of a decode step the plugin hands :meth:`EngineCapture.stage` the
  step's FP8 queries ``[rows, H, D]``, head weights ``[rows, H]`` (the engines fold the query's FP8 scale
  and the softmax scale into them, so ``sum_h w_h relu(q_h . k)`` is the engine's score) and key counts
  ``[rows]``; they are copied into fixed device buffers (device ops only, so a CUDA graph captures them and
  every replay refreshes them). After the step, :meth:`EngineCapture.decode_step` (host side, outside any
  graph) takes the rows its per-request sampling picks and copies them to host memory;
* **when full**: every copy first reserves its bytes against ``capacity_bytes``; a finished request (or a
  query sample) that does not fit is dropped and counted, so the serving thread never waits for the writer.

Nothing here synchronizes the serving thread with the device: copies are ``non_blocking`` into pinned
memory and the writer thread waits on their CUDA events. They are issued on the stream that is current
where the plugin calls in, before the engine can reuse the pages (both engines order the next forward
after that stream; see the plugins' READMEs).

One writer per tensor-parallel group: the plugins build an :class:`EngineCapture` with ``writing=True`` on
rank 0 only; elsewhere every method returns at once.
"""

from __future__ import annotations

import atexit
import collections
import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dsaindex.errors import DsaIndexError, StoreMismatchError

if TYPE_CHECKING:
    import torch

    from dsaindex.artifacts.capture_store import CaptureManifest, CaptureStore
    from dsaindex.artifacts.fingerprint import ModelFingerprint

logger = logging.getLogger("dsaindex.capture")

PAGE = 64  # keys per index-K page in both engines
MIN_STAGE_ROWS = 256  # decode rows the staging buffers hold at least (rows past them are not sampled)
WEIGHTS_DIGEST = "engine-unhashed"  # an engine has no transformers module to hash; see engine_fingerprint
BATCH_BYTES = 256 << 20  # the writer appends once this much has been drained (or the queue is empty)
LOG_EVERY = 60.0  # seconds between the counters' log lines


def engine_fingerprint(config: Any, name: str) -> ModelFingerprint:
    """The fingerprint of a served model from its transformers config: the config the plugins check bundles
    against (:func:`dsaindex.artifacts.compat.check_bundle_for_model` computes the same geometry and config
    digest from it). The indexer-weights digest is :data:`WEIGHTS_DIGEST`: an engine holds its own,
    sharded, often FP8 form of the weights, not the transformers modules a capture hashes. The plugins
    compare bundles by the config digest, so a bundle trained on an engine capture serves there; the
    transformers runtime (which hashes the weights) refuses it unless told ``allow_other_weights``."""
    from dsaindex.artifacts.fingerprint import ModelFingerprint, config_digest, config_fields
    from dsaindex.geometry import geometry_from_config

    geometry = geometry_from_config(config)
    dtype = (config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict)
             else getattr(config, "dtype", None)) or "bfloat16"
    return ModelFingerprint(name=name, family=geometry.family, geometry=geometry,
                            config_digest=config_digest(config) or "unknown", config_fields=config_fields(config),
                            weights_digest=WEIGHTS_DIGEST, dtype=str(dtype).replace("torch.", ""))


def engine_manifest(model: ModelFingerprint, engine: str, basis: str, queries_per_request: int,
                    key_dtype: str = "bfloat16") -> CaptureManifest:
    """The manifest of an engine capture. Its settings and corpus say what shaped the store (a resumed
    capture must have the same): sequences are whole requests (``seq_len`` 0), the sampling is
    :class:`DecodeSampling`'s over decode steps, the keys are in the engine's ``basis``."""
    from dsaindex.artifacts.capture_store import CaptureSettings, QuerySampling, new_manifest

    window = queries_per_request // 2
    sampling = QuerySampling(scattered=queries_per_request - window, windows=1 if window else 0,
                             window_len=window, seed=0)
    settings = CaptureSettings(seq_len=0, chunk_len=0, basis=basis, key_dtype=key_dtype, sampling=sampling)
    corpus = {"source": "engine", "engine": engine,
              "queries": "decode steps: the first window_len as window 0, then up to `scattered` evenly spread"}
    return new_manifest(model, settings, corpus, model.name)


def _mismatch(err: StoreMismatchError, where: str) -> StoreMismatchError:
    return StoreMismatchError(
        err.problem,
        f"point {where} at a new path (a store holds one model, engine and sampling), or serve the model and "
        "settings the store was captured with (`dsaindex store info STORE` shows them).")


def check_store(path: str, manifest: CaptureManifest, where: str = "DSAINDEX_CAPTURE") -> bool:
    """Refuse, at startup and without writing, a store path the capture cannot use: an existing store of
    another model or other settings (:class:`StoreMismatchError` naming ``where``), or a location where no
    store can be created. Returns whether the store exists (it is then appended to)."""
    from dsaindex.artifacts.capture_store import CaptureStore

    if not CaptureStore.exists(path):
        CaptureStore.check_location(path)
        return False
    store = CaptureStore.open(path)
    try:
        store._check_matches(manifest)  # the store's own rule for a resume, without its writer lock
    except StoreMismatchError as err:
        raise _mismatch(err, where) from None
    return True


def open_store(path: str, manifest: CaptureManifest, where: str = "DSAINDEX_CAPTURE") -> CaptureStore:
    """The store to write: created if absent, else opened for append (its writer lock taken, rows past the
    committed counts cut away: the store's resume rule)."""
    from dsaindex.artifacts.capture_store import CaptureStore

    if not CaptureStore.exists(path):
        CaptureStore.check_location(path)
        CaptureStore.create(path, manifest)
    try:
        return CaptureStore.open_for_append(path, manifest)
    except StoreMismatchError as err:
        raise _mismatch(err, where) from None


# ---- per-request query sampling ------------------------------------------------------------------------
@dataclass
class _Block:
    """One step's sampled rows on the host: queries [L, k, H * D] uint8 (FP8 bytes), weights [L, k, H]
    float32, key counts [k] int32, and the event after which they are there (None: already there)."""

    queries: Any
    weights: Any
    lengths: Any
    event: Any


@dataclass
class _Sample:
    block: _Block
    row: int
    window: int  # 0: the decode window, -1: a scattered step


@dataclass
class DecodeSampling:
    """Which decode steps of one request get their queries recorded, with at most ``window + scattered``
    held at any time: steps 0 .. ``window`` - 1 (one window of consecutive steps, as warm-cache replays want
    them), then every ``stride``-th later step, the stride doubling (and every other held one let go)
    whenever more than ``scattered`` are held, so the kept ones stay evenly spread over the steps so far."""

    window: int
    scattered: int
    steps: int = 0
    stride: int = 1
    held: list[tuple[int, _Sample]] = field(default_factory=list)  # (step, sample)

    def next_step(self) -> int | None:
        """The window id if this decode step is to be recorded (0 window, -1 scattered), else None."""
        t = self.steps
        self.steps += 1
        if t < self.window:
            return 0
        if self.scattered and (t - self.window) % self.stride == 0:
            return -1
        return None

    def add(self, sample: _Sample) -> list[_Sample]:
        """Hold ``sample`` (of the step :meth:`next_step` just said yes to); returns the samples let go."""
        self.held.append((self.steps - 1, sample))
        scattered = [(t, s) for t, s in self.held if s.window < 0]
        if len(scattered) <= self.scattered:
            return []
        self.stride *= 2
        gone = [s for t, s in scattered if (t - self.window) % self.stride]
        self.held = [(t, s) for t, s in self.held if s.window >= 0 or (t - self.window) % self.stride == 0]
        return gone

    @property
    def samples(self) -> list[_Sample]:
        return [s for _, s in self.held]


# ---- the capture ---------------------------------------------------------------------------------------
@dataclass
class _Staging:
    """Device buffers one decode step's indexer calls write: queries [L, R, H * D] uint8, weights [L, R, H]
    float32, key counts [R] int32 (the same in every layer)."""

    queries: Any
    weights: Any
    lengths: Any

    @property
    def capacity(self) -> int:
        return self.queries.shape[1]


@dataclass
class _Finished:
    request_id: str
    pages: Any  # [L, W, 64 * (D + 4)] uint8, host
    tokens: Any  # [n] int32 (numpy, or a host tensor the event completes)
    keys: int
    samples: list[_Sample]
    event: Any
    nbytes: int


_STOP = object()


def _record_event(device: torch.device) -> Any:
    import torch

    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory: a ``non_blocking`` copy into pinned memory from a device (complete once the
    event recorded after it is), ``t`` itself on the CPU."""
    import torch

    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


class EngineCapture:
    """The capture of one engine process (see the module doc).

    Parameters
    ----------
    path : the store (local path or ``s3://``); opened (created, or appended to) here when ``writing``
    manifest : :func:`engine_manifest` of the served model
    capacity_bytes : host bytes held at most (finished requests queued + query samples of running requests)
    queries_per_request : decode steps sampled per request (:class:`DecodeSampling`; 0: keys only)
    writing : False on every rank but the writer: nothing is opened, staged, copied or written
    where : the setting that names the store, for error messages
    """

    def __init__(self, path: str, manifest: CaptureManifest, capacity_bytes: int, queries_per_request: int,
                 writing: bool = True, where: str = "DSAINDEX_CAPTURE"):
        geometry = manifest.model.geometry
        if geometry.key_stride != 1:
            raise DsaIndexError(f"{manifest.model.name} keeps compressed keys (stride {geometry.key_stride}); the "
                                "engine capture reads one key per token from 64-key pages.",
                                f"unset {where} for this model, and capture with `dsaindex capture` instead.")
        self.path, self.manifest, self.where = path, manifest, where
        self.layers = list(geometry.indexer_layers)
        self.heads, self.dim = geometry.n_heads, geometry.head_dim
        self.page_bytes = PAGE * (self.dim + 4)
        self.sample_bytes = len(self.layers) * self.heads * (self.dim + 4) + 4
        self.capacity_bytes = int(capacity_bytes)
        self.window = queries_per_request // 2
        self.scattered = queries_per_request - self.window
        self.writing = writing
        self._slot = {layer: i for i, layer in enumerate(self.layers)}
        self._staging: _Staging | None = None
        self._requests: dict[str, DecodeSampling] = {}
        self._finished = collections.deque(maxlen=4096)  # ids whose capture is done: later steps are not sampled
        self._finished_set: set[str] = set()
        self._lock = threading.Lock()
        self._held = 0
        self._counters = dict.fromkeys(
            ("requests_queued", "requests_written", "requests_dropped", "requests_skipped", "requests_lost",
             "bytes_dropped", "queries_sampled", "queries_dropped", "queries_late", "keys_written",
             "write_errors", "bytes_held_peak"), 0)
        self._last_log = time.monotonic()
        self._last_drop_log = 0.0
        self.store: CaptureStore | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if not writing:
            return
        self.store = open_store(path, manifest, where)
        self._thread = threading.Thread(target=self._run, name="dsaindex-capture-writer", daemon=True)
        self._thread.start()
        atexit.register(self.close)
        logger.info("dsaindex: capturing into %s (%d sequences there already): keys of every finished request, "
                    "queries of %d decode steps per request; at most %.2f GB held in host memory.",
                    path, self.store.committed.sequences, queries_per_request, self.capacity_bytes / 1e9)

    # ---- counters -------------------------------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        """What the capture did so far (also logged every minute, and at each drop): requests queued,
        written, dropped (the queue was full), skipped (no keys, aborted), lost (a write failed); query samples
        taken, dropped (full), late (past the request's keys); keys written; bytes held now and at most."""
        with self._lock:
            return {**self._counters, "bytes_held": self._held}

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _reserve(self, nbytes: int) -> bool:
        with self._lock:
            if self._held + nbytes > self.capacity_bytes:
                return False
            self._held += nbytes
            self._counters["bytes_held_peak"] = max(self._counters["bytes_held_peak"], self._held)
            return True

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._held -= nbytes

    # ---- decode steps ---------------------------------------------------------------------------------
    def stage(self, layer: int, queries: torch.Tensor, weights: torch.Tensor, lengths: torch.Tensor) -> None:
        """One indexer call of a decode step: ``queries`` [rows, H, D] FP8 e4m3, ``weights`` [rows, H] or
        [rows, H, 1] float, ``lengths`` [rows] int (keys visible to each row, its own included) into the
        staging buffers, by device copies only (CUDA-graph safe). Rows past the buffers' capacity (at least
        :data:`MIN_STAGE_ROWS`, fixed at the first call) are not staged."""
        slot = self._slot.get(int(layer))
        if not self.writing or slot is None:
            return
        staging = self._staging or self._allocate(queries.device, queries.shape[0])
        rows = min(queries.shape[0], lengths.shape[0], staging.capacity)
        if rows == 0:
            return
        import torch

        staging.queries[slot, :rows].copy_(queries[:rows].reshape(rows, -1).view(torch.uint8))
        staging.weights[slot, :rows].copy_(weights[:rows].reshape(rows, -1))
        staging.lengths[:rows].copy_(lengths[:rows])

    def _allocate(self, device: torch.device, rows: int) -> _Staging:
        import torch

        capacity = max(rows, MIN_STAGE_ROWS)
        n = len(self.layers)
        self._staging = _Staging(torch.zeros(n, capacity, self.heads * self.dim, dtype=torch.uint8, device=device),
                                 torch.zeros(n, capacity, self.heads, dtype=torch.float32, device=device),
                                 torch.zeros(capacity, dtype=torch.int32, device=device))
        logger.info("dsaindex: capture staging for %d decode rows on %s (%.1f MB)", capacity, device,
                    capacity * self.sample_bytes / 1e6)
        return self._staging

    def decode_step(self, request_ids: Sequence[str | None]) -> int:
        """After a decode step whose row ``b`` belongs to ``request_ids[b]`` (None: padding): copy the rows
        the requests' sampling picks to host memory (no wait). Returns the rows taken."""
        staging = self._staging
        if not self.writing or staging is None:
            return 0
        picks = []
        for row, rid in enumerate(request_ids[: staging.capacity]):
            if rid is None or rid in self._finished_set:
                continue
            sampling = self._requests.get(rid)
            if sampling is None:
                sampling = self._requests[rid] = DecodeSampling(self.window, self.scattered)
            window = sampling.next_step()
            if window is None:
                continue
            if not self._reserve(self.sample_bytes):
                self._count("queries_dropped")
                continue
            picks.append((row, rid, window))
        if not picks:
            return 0
        import torch

        rows = torch.tensor([row for row, _, _ in picks], dtype=torch.long, device=staging.lengths.device)
        block = _Block(_host_copy(staging.queries.index_select(1, rows)),
                       _host_copy(staging.weights.index_select(1, rows)),
                       _host_copy(staging.lengths.index_select(0, rows)), None)
        block.event = _record_event(staging.lengths.device)
        for j, (_, rid, window) in enumerate(picks):
            gone = self._requests[rid].add(_Sample(block, j, window))
            self._release(len(gone) * self.sample_bytes)
        self._count("queries_sampled", len(picks))
        return len(picks)

    def discard(self, request_id: str) -> None:
        """Forget a request's samples (it left without finishing: retracted, aborted)."""
        sampling = self._requests.pop(request_id, None)
        if sampling is not None:
            self._release(len(sampling.samples) * self.sample_bytes)

    # ---- finished requests ----------------------------------------------------------------------------
    def finish(self, request_id: str, tokens: Any, caches: Mapping[int, torch.Tensor], pages: torch.Tensor,
               keys: int) -> bool:
        """A request finished with ``keys`` keys in the pages ``pages`` [>= ceil(keys / 64)] (page ids, on the
        caches' device) of each layer's index-K cache ``caches[layer]`` ([num_pages, ...], 64 * (D + 4) bytes
        a page), still unfreed; ``tokens`` its token ids ([>= keys], a list or a tensor). Gathers and copies the
        pages to host memory (no wait) and queues the request for the writer. Returns False where it was
        dropped (the queue full: counted) or skipped (no keys)."""
        sampling = self._requests.pop(request_id, None)
        samples = sampling.samples if sampling is not None else []
        sample_bytes = len(samples) * self.sample_bytes
        if not self.writing:
            return False
        if request_id not in self._finished_set:
            if len(self._finished) == self._finished.maxlen:
                self._finished_set.discard(self._finished[0])
            self._finished.append(request_id)
            self._finished_set.add(request_id)
        keys = int(keys)
        missing = [layer for layer in self.layers if layer not in caches]
        if missing:
            self._release(sample_bytes)
            self._count("requests_skipped")
            logger.warning("dsaindex: request %s not captured: no index-K cache of layers %s", request_id, missing)
            return False
        if keys <= 0:
            self._release(sample_bytes)
            self._count("requests_skipped")
            return False
        width = -(-keys // PAGE)
        nbytes = len(self.layers) * width * self.page_bytes + 4 * keys
        if not self._reserve(nbytes):
            self._release(sample_bytes)
            self._drop(request_id, nbytes + sample_bytes)
            return False
        import torch

        device = caches[self.layers[0]].device
        pages = pages[:width].to(device=device, dtype=torch.long)
        host_pages = torch.empty(len(self.layers), width, self.page_bytes, dtype=torch.uint8,
                                 pin_memory=device.type == "cuda")
        for i, layer in enumerate(self.layers):  # one layer's pages on the device at a time
            cache = caches[layer]
            host_pages[i].copy_(cache.view(cache.shape[0], -1).index_select(0, pages), non_blocking=True)
        if isinstance(tokens, torch.Tensor):
            host_tokens = _host_copy(tokens[:keys].to(torch.int32).clone())  # the engine's row is reused
        else:
            host_tokens = np.asarray(list(tokens[:keys]), dtype=np.int32)
        event = _record_event(device)
        self._queue.put(_Finished(request_id, host_pages, host_tokens, keys, samples, event, nbytes + sample_bytes))
        self._count("requests_queued")
        return True

    def _drop(self, request_id: str, nbytes: int) -> None:
        with self._lock:
            self._counters["requests_dropped"] += 1
            self._counters["bytes_dropped"] += nbytes
            now = time.monotonic()
            loud = now - self._last_drop_log >= LOG_EVERY
            if loud:
                self._last_drop_log = now
        if loud:
            logger.warning("dsaindex: capture queue full (%d of %d bytes held): request %s dropped; %s",
                           self._held, self.capacity_bytes, request_id, self.counters())

    # ---- the writer -----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            items, drained = [item], item.nbytes
            stop = False
            while drained < BATCH_BYTES:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:
                    stop = True
                    break
                items.append(more)
                drained += more.nbytes
            self._write(items)
            if stop:
                return

    def _write(self, items: list[_Finished]) -> None:
        try:
            batch, keys = self._batch(items)
            self.store.append(batch)
            with self._lock:
                self._counters["requests_written"] += len(items)
                self._counters["keys_written"] += keys
        except Exception:  # noqa: BLE001 - the serving process goes on; the loss is counted and logged
            logger.exception("dsaindex: writing %d captured requests to %s failed; they are lost", len(items),
                             self.path)
            with self._lock:
                self._counters["write_errors"] += 1
                self._counters["requests_lost"] += len(items)
        finally:
            self._release(sum(item.nbytes for item in items))
        if time.monotonic() - self._last_log >= LOG_EVERY:
            self._last_log = time.monotonic()
            logger.info("dsaindex: capture %s: %s", self.path, self.counters())

    def _batch(self, items: list[_Finished]):
        """The :class:`SequenceBatch` of finished requests (waits for their copies here, on the writer)."""
        import torch

        from dsaindex.artifacts.capture_store import SequenceBatch
        from dsaindex.kernels.fp8_score import paged_keys_reference
        from dsaindex.quant import bf16_to_bits

        key_dtype = self.manifest.settings.key_dtype

        def stored(values: torch.Tensor) -> np.ndarray:
            if key_dtype == "bfloat16":
                return bf16_to_bits(values).numpy().view(np.uint16)
            return values.float().numpy()

        batch = SequenceBatch()
        first = self.store.committed.sequences
        keys_total = 0
        for index, item in enumerate(items):
            for event in {id(e): e for e in [item.event] + [s.block.event for s in item.samples]
                          if e is not None}.values():
                event.synchronize()
            n, width = item.keys, item.pages.shape[1]
            table = torch.arange(width, dtype=torch.int32)[None]
            samples = sorted(item.samples, key=lambda s: int(s.block.lengths[s.row]))
            kept = [s for s in samples if 1 <= int(s.block.lengths[s.row]) <= n]
            self._count("queries_late", len(samples) - len(kept))
            positions = np.asarray([int(s.block.lengths[s.row]) - 1 for s in kept], dtype=np.int32)
            for i, layer in enumerate(self.layers):
                codes, scales = paged_keys_reference(item.pages[i], table, self.dim)
                values = codes[0, :n].view(torch.float8_e4m3fn).float() * scales[0, :n, None]
                batch.keys.setdefault(layer, []).append(stored(values))
                if kept:
                    q = torch.stack([s.block.queries[i, s.row] for s in kept]).view(torch.float8_e4m3fn)
                    w = torch.stack([s.block.weights[i, s.row] for s in kept])
                else:
                    q = torch.zeros(0, self.heads * self.dim, dtype=torch.float8_e4m3fn)
                    w = torch.zeros(0, self.heads)
                batch.queries.setdefault(layer, []).append(stored(q.float().view(-1, self.heads, self.dim)))
                batch.head_weights.setdefault(layer, []).append(w.float().numpy())
            tokens = np.asarray(item.tokens, dtype=np.int32)
            batch.sequence_tokens.append(n)
            batch.sequence_keys.append(n)
            batch.sequence_queries.append(len(kept))
            batch.tokens.append(tokens)
            batch.query_position.append(positions)
            batch.query_sequence.append(np.full(len(kept), first + index, dtype=np.int32))
            batch.query_window.append(np.asarray([s.window for s in kept], dtype=np.int32))
            keys_total += n
        return batch, keys_total

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until everything queued so far is written (or ``timeout`` passes); True if it was."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            c = self.counters()
            if c["requests_written"] + c["requests_lost"] >= c["requests_queued"]:
                return True
            time.sleep(0.01)
        return False

    def close(self, timeout: float = 60.0) -> None:
        """Write what is queued (up to ``timeout``), stop the writer, release the store's lock, log the counters."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._queue.put(_STOP)
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("dsaindex: the capture writer did not finish within %.0f s; requests still queued are "
                           "lost", timeout)
        if self.store is not None:
            self.store.close()
        logger.info("dsaindex: capture %s closed: %s", self.path, self.counters())
