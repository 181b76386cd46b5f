"""Capture: run a DSA model over a corpus and write what its indexers score into a capture store.

One sequence at a time (so a resumed run reproduces an uninterrupted one exactly), in chunks of
``chunk_len`` tokens through the model's own KV cache: transformers' indexer materializes a
[B, S, H, T] fp32 tensor, so a 32K sequence is never scored in one piece. Each sequence is committed
to the store as soon as it is captured (``flush_tokens`` > 0 buffers that many tokens per commit instead);
a Ctrl-C first commits the whole sequences already captured, and never interrupts a commit. With a
:class:`PrefillRequest` (``--ivf-artifacts``) the runtime's IVF prefill selects for the model instead of its
own indexer (:func:`served_prefill`), so a chunk's selection costs the budget rather than the prefix.

Inputs are checked before any model loads: settings, the store location, the corpus files and the text of
the part of the corpus the run will read.
"""

from __future__ import annotations

import itertools
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from dsaindex.artifacts.capture_store import (
    CaptureSettings,
    CaptureStore,
    PrefillSelection,
    QuerySampling,
    SequenceBatch,
    new_manifest,
)
from dsaindex.artifacts.storage import ObjectLocation, location, remove_objects
from dsaindex.errors import DsaIndexError, WriterLockError
from dsaindex.geometry import IndexerGeometry, geometry_from_config
from dsaindex.indexer import cache_argument
from dsaindex.pipelines.capture.corpus import (
    CorpusSpec,
    check_text,
    iter_documents,
    no_sequence_error,
    pack_sequences,
    scan_files,
)
from dsaindex.pipelines.capture.models import LoadedModel, load_model


def sample_query_positions(seq_len: int, seq_index: int, sampling: QuerySampling) -> tuple[np.ndarray, np.ndarray]:
    """Positions of one sequence whose queries are recorded, and their decode-window ids.

    Depends only on (seed, sequence index, length), so it is identical in every layer and on resume.

    Returns
    -------
    (positions [s] int64 sorted unique, window [s] int32: window id, or -1 for scattered positions)
    """
    rng = np.random.default_rng([sampling.seed, seq_index])
    window_of: dict[int, int] = {}
    if sampling.windows and sampling.window_len and seq_len >= sampling.window_len:
        lo = seq_len // 2
        hi = max(lo, seq_len - sampling.window_len)
        for w in range(sampling.windows):
            start = int(rng.integers(lo, hi + 1))
            for p in range(start, start + sampling.window_len):
                window_of.setdefault(p, w)
    scattered = rng.choice(seq_len, size=min(sampling.scattered, seq_len), replace=False) if sampling.scattered else []
    positions = sorted(set(window_of) | {int(p) for p in scattered})
    windows = [window_of.get(p, -1) for p in positions]
    return np.asarray(positions, dtype=np.int64), np.asarray(windows, dtype=np.int32)


@dataclass
class CaptureResult:
    store: Path | ObjectLocation
    sequences_added: int
    tokens_added: int
    keys_added: int
    seconds: float
    resumed_from: int

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_added / self.seconds if self.seconds > 0 else 0.0


def _encode_keys(vectors, basis: str, key_dtype: str) -> np.ndarray:
    """[..., D] float tensor -> numpy in the store's basis and storage dtype (bf16 as uint16 bits)."""
    from dsaindex.quant import bf16_to_bits, to_basis

    vectors = to_basis(vectors, basis)
    if key_dtype == "bfloat16":
        return bf16_to_bits(vectors).cpu().numpy().view(np.uint16)
    return vectors.float().cpu().numpy()


@dataclass(frozen=True)
class PrefillRequest:
    """``capture --ivf-artifacts``: the captured model prefills through the runtime's IVF selection, as
    ``dsaindex serve`` prefills, instead of its own exact indexer. ``budget``: candidates a query (None: the
    smallest the bundle records at ``recall_target``, as the server chooses). Each chunk's selection then
    costs the budget, not the prefix, which is what makes 512K-1M-token captures affordable."""

    artifacts: str
    budget: int | None = None
    recall_target: float | None = None


def served_prefill(loaded: LoadedModel, request: PrefillRequest, settings: CaptureSettings, device: str) -> Any:
    """The runtime's prefill selection for ``loaded`` (a :class:`dsaindex.runtime.serving.ServedIndex`, not
    attached), loaded and validated as a server loads it. Refuses a bundle that does not select prefill
    (pq codes, reuse plans): a capture records keys, it serves no decode step."""
    from dsaindex.runtime.serving import serve_index
    from dsaindex.runtime.settings import DecodeSettings, PrefillSettings, ServeSettings

    prefill = PrefillSettings(ivf_budget=request.budget)
    if request.recall_target is not None:
        prefill = replace(prefill, ivf_recall_target=request.recall_target)
    # decode fixed (not chosen from a bundle's recall): a pq bundle passed here is refused below, not sized
    decode = DecodeSettings(candidates=geometry_from_config(loaded.model.config).topk, prefilter=1)
    index = serve_index(request.artifacts, loaded.model,
                        ServeSettings(decode=decode, prefill=prefill, basis=settings.basis,
                                      max_keys=settings.seq_len + 1),
                        name=loaded.name, device=device, served=loaded.fingerprint)
    if index.decode_layers or index.reuse or not index.prefill_layers:
        held = ([f"decode codes for layers {sorted(index.decode_layers)}"] if index.decode_layers else []) + (
            ["a cross-layer reuse plan"] if index.reuse else [])
        raise DsaIndexError(f"--ivf-artifacts {request.artifacts} is not an ivf bundle alone: it holds "
                            f"{' and '.join(held) or 'no prefill routing'}.",
                            "pass the ivf bundle of `dsaindex train ivf` (pq codes and reuse plans serve decode "
                            "and attention, not a capture's prefill).")
    return index


class SequenceCapturer:
    """Runs one sequence through the model in chunks and gathers per-layer keys, queries, weights.
    ``selection``: the runtime's prefill selection installed in the model while it runs (None: the model's
    own indexer selects)."""

    def __init__(self, loaded: LoadedModel, settings: CaptureSettings, device: str, selection: Any = None):
        from dsaindex.pipelines.capture.tap import IndexerTap

        self.loaded = loaded
        self.settings = settings
        self.device = device
        self.geometry = geometry_from_config(loaded.model.config)
        self._records: list = []
        self.tap = IndexerTap(loaded.model, self.geometry, self._records.append)
        self.selection = selection

    def __enter__(self) -> SequenceCapturer:
        self.tap.__enter__()
        if self.selection is not None:
            try:
                self.selection.__enter__()
            except BaseException:
                self.tap.__exit__(None, None, None)
                raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.selection is not None:
                self.selection.__exit__(*exc)
        finally:
            self.tap.__exit__(*exc)

    def run(self, tokens: list[int], seq_index: int, batch: SequenceBatch,
            on_chunk: Callable[[int], None] | None = None) -> None:
        import torch

        s = self.settings
        positions, windows = sample_query_positions(len(tokens), seq_index, s.sampling)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device).unsqueeze(0)
        keys: dict[int, list] = {layer: [] for layer in self.geometry.indexer_layers}
        queries: dict[int, list] = {layer: [] for layer in self.geometry.indexer_layers}
        weights: dict[int, list] = {layer: [] for layer in self.geometry.indexer_layers}
        self.tap.new_sequence()
        cache = None
        base = self.loaded.model.base_model
        cache_kw = cache_argument(base)
        with torch.inference_mode():
            for start in range(0, len(tokens), s.chunk_len):
                end = min(start + s.chunk_len, len(tokens))
                in_chunk = positions[(positions >= start) & (positions < end)] - start
                self.tap.query_rows = torch.as_tensor(in_chunk, dtype=torch.long)
                self._records.clear()
                out = base(input_ids=ids[:, start:end], use_cache=True, **{cache_kw: cache})
                cache = getattr(out, cache_kw) if cache_kw == "cache" else out.past_key_values
                for rec in self._records:
                    keys[rec.layer].append(rec.keys[0])
                    queries[rec.layer].append(rec.queries[0])
                    weights[rec.layer].append(rec.head_weights[0])
                if on_chunk:
                    on_chunk(end - start)
        del cache
        num_keys = self.geometry.keys_for_tokens(len(tokens))
        per_layer = {}
        for layer in self.geometry.indexer_layers:
            k = torch.cat(keys[layer])[:num_keys]
            if k.shape[0] != num_keys:
                raise RuntimeError(f"layer {layer}: captured {k.shape[0]} keys, expected {num_keys}")
            per_layer[layer] = (_encode_keys(k, s.basis, s.key_dtype),
                                _encode_keys(torch.cat(queries[layer]), s.basis, s.key_dtype),
                                torch.cat(weights[layer]).float().cpu().numpy())
        with interrupts_deferred():  # the batch gets all of the sequence or none of it
            for layer, (k, q, w) in per_layer.items():
                batch.keys.setdefault(layer, []).append(k)
                batch.queries.setdefault(layer, []).append(q)
                batch.head_weights.setdefault(layer, []).append(w)
            batch.sequence_tokens.append(len(tokens))
            batch.sequence_keys.append(num_keys)
            batch.sequence_queries.append(len(positions))
            batch.tokens.append(np.asarray(tokens, dtype=np.int32))
            batch.query_position.append(positions.astype(np.int32))
            batch.query_sequence.append(np.full(len(positions), seq_index, dtype=np.int32))
            batch.query_window.append(windows)


def score_tensor_bytes(chunk_len: int, n_heads: int, keys: int) -> int:
    """Bytes of the [1, chunk_len, n_heads, keys] fp32 score tensor transformers' indexer materializes for
    one chunk whose queries see ``keys`` keys."""
    return 4 * chunk_len * n_heads * keys


def out_of_memory_error(settings: CaptureSettings, geometry: IndexerGeometry, seq_index: int, seq_tokens: int,
                        committed: int, new_store: bool, free_bytes: int | None = None,
                        attention_heads: int | None = None) -> DsaIndexError:
    """The one-line error for a CUDA out-of-memory in capture: the score tensor of one chunk at the
    current ``--chunk-len`` and a smaller one to use (fitting half of ``free_bytes`` where known).
    ``committed``: sequences the store holds; ``new_store``: this run created it (and, holding nothing,
    removes it). ``attention_heads``: the runtime selects (``--ivf-artifacts``), so the largest tensor is the
    attention's [B, heads, S, T] scores, not the indexer's."""
    from dsaindex.console import human_bytes

    chunk = min(settings.chunk_len, seq_tokens)
    keys = geometry.keys_for_tokens(seq_tokens)
    heads, what = ((attention_heads, "attention's [B, heads, S, T]") if attention_heads
                   else (geometry.n_heads, "indexer's [B, S, H, T]"))
    need = score_tensor_bytes(chunk, heads, keys)
    smaller = 1 << max(0, (chunk // 4).bit_length() - 1)  # a power of two, at most a quarter
    if free_bytes:
        while smaller > 64 and score_tensor_bytes(smaller, heads, keys) > free_bytes // 2:
            smaller //= 2
    if committed:
        then = (f"capture into a new store path (this one keeps its {committed} committed sequences and its "
                "chunk length)")
    elif new_store:
        then = "run the command again (nothing was committed; the new store was removed)"
    else:
        then = "capture into a new store path (this one holds no sequence but keeps its chunk length)"
    shape = f"[1, {chunk}, {heads}, {keys}]" if not attention_heads else f"[1, {heads}, {chunk}, {keys}]"
    return DsaIndexError(
        f"CUDA ran out of memory capturing sequence {seq_index} ({seq_tokens} tokens) at --chunk-len "
        f"{settings.chunk_len}: the {what} = {shape} fp32 score tensor of one chunk alone needs ~{human_bytes(need)}.",
        f"lower --chunk-len, e.g. --chunk-len {smaller} "
        f"(~{human_bytes(score_tensor_bytes(smaller, heads, keys))} per chunk), and {then}.",
    )


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """A Ctrl-C (SIGINT) during the block takes effect when it ends: a commit is never left half-way.
    Only the main thread can handle signals; elsewhere, or under a handler not set from Python, the block
    runs as it is."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        if callable(previous):
            previous(signal.SIGINT, None)
        elif previous != signal.SIG_IGN:
            raise KeyboardInterrupt


def _commit(store: CaptureStore, batch: SequenceBatch) -> None:
    if batch.num_sequences:
        with interrupts_deferred():
            store.append(batch)


def _free_cuda_bytes(device: str) -> int | None:
    try:
        import torch

        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    except Exception:  # noqa: BLE001 - no CUDA here, or a device that cannot say
        return None


def capture(
    store_path: str | Path,
    model_ref: str,
    corpus: CorpusSpec,
    settings: CaptureSettings,
    max_sequences: int,
    device: str = "cpu",
    dtype: str = "auto",
    flush_tokens: int = 0,
    progress: Callable[[int, int], None] | None = None,
    loaded: LoadedModel | None = None,
    notice: Callable[[str], None] | None = None,
    prefill: PrefillRequest | None = None,
) -> CaptureResult:
    """Capture until the store holds ``max_sequences`` sequences (resuming if it already holds some).

    Every input is checked before a model loads or anything is written. Each sequence is committed once
    captured (``flush_tokens`` > 0: once that many tokens are buffered). On Ctrl-C the whole sequences
    captured so far are committed before the ``KeyboardInterrupt`` goes on. A CUDA out-of-memory becomes a
    :class:`DsaIndexError` naming the ``--chunk-len`` to use. ``progress(tokens_done, tokens_total)`` is
    called after every chunk; ``notice(message)`` receives remarks on the input (binary files skipped) and
    the prefill selection chosen. ``prefill``: select the model's keys during prefill with the runtime's IVF
    selection (:class:`PrefillRequest`; the bundle and budget are recorded in the store's settings, so a
    resume must use the same).
    """
    if settings.chunk_len <= 0 or settings.seq_len <= 0:
        raise DsaIndexError("seq_len and chunk_len must be positive.", "pass --seq-len and --chunk-len > 0.")
    if max_sequences <= 0:
        raise DsaIndexError(f"--sequences {max_sequences} asks for no sequence.", "pass --sequences 1 or more.")
    if flush_tokens < 0:
        raise DsaIndexError(f"--flush-tokens {flush_tokens} is negative.",
                            "pass 0 to commit every sequence, or a number of tokens to buffer per commit.")
    sampling = settings.sampling
    if min(sampling.scattered, sampling.windows, sampling.window_len, sampling.seed) < 0:
        raise DsaIndexError(f"Query sampling must not be negative ({sampling.model_dump()}).",
                            "pass --queries, --windows, --window-len and --seed of 0 or more.")
    store_path = location(store_path)  # a local Path, or an s3:// prefix (another scheme is refused here)
    CaptureStore.check_location(store_path)
    _, skipped = scan_files(corpus)
    if skipped and notice:
        names = ", ".join(f.name for f in skipped[:3]) + (", ..." if len(skipped) > 3 else "")
        notice(f"skipped {len(skipped)} binary file{'s' if len(skipped) > 1 else ''} of the corpus (NUL bytes "
               f"or invalid UTF-8): {names}")
    corpus_info = corpus.describe()
    check_text(corpus, max_sequences * settings.seq_len)
    if prefill is not None and not prefill.artifacts.startswith("models:/"):  # the registry resolves those later
        where = location(prefill.artifacts)
        if isinstance(where, Path) and not (where / "zarr.json").is_file():
            raise DsaIndexError(f"--ivf-artifacts {prefill.artifacts}: no bundle there.",
                                "pass the folder `dsaindex train ivf --out` wrote, s3://bucket/prefix or "
                                "models:/<name>@<alias>.")

    import torch

    loaded = loaded or load_model(model_ref, device=device, dtype=dtype)
    selection = None
    if prefill is not None:  # validated against the model before the store is created
        selection = served_prefill(loaded, prefill, settings, device)
        settings = settings.model_copy(update={"prefill_selection": PrefillSelection(
            bundle_id=next(iter(selection.bundles.values())), budget=selection.ivf_budget)})
        if notice:
            layers = sorted(selection.prefill_layers)
            exact = sorted(set(geometry_from_config(loaded.model.config).indexer_layers) - set(layers))
            notice(f"the model prefills through the runtime's IVF selection at layers {layers}, "
                   f"{selection.ivf_budget:,} candidates a query (bundle {settings.prefill_selection.bundle_id})"
                   + (f"; layers {exact} keep the model's own exact selection" if exact else ""))
    tokenizer = loaded.tokenizer
    expected = new_manifest(loaded.fingerprint, settings, corpus_info, tokenizer.name)
    sequences = pack_sequences(iter_documents(corpus), tokenizer.encode, settings.seq_len, [tokenizer.eos_id])
    first = next(sequences, None)
    if first is None:  # checked before any store is created
        raise no_sequence_error(corpus)
    sequences = itertools.chain([first], sequences)
    created = not CaptureStore.exists(store_path)
    existed = not isinstance(store_path, ObjectLocation) and store_path.exists()
    try:
        if created:
            CaptureStore.create(store_path, expected)
        store = CaptureStore.open_for_append(store_path, None if created else expected)
    except BaseException as err:
        if created and not isinstance(err, WriterLockError):  # never what another writer is making
            _remove_new_store(store_path, existed)
        raise
    t0 = time.perf_counter()
    resumed_from = store.committed.sequences
    added_seq = added_tok = added_keys = 0
    try:
        with store:
            todo = max(0, max_sequences - resumed_from)
            total_tokens = todo * settings.seq_len
            done_tokens = 0
            batch = SequenceBatch()
            with SequenceCapturer(loaded, settings, device, selection) as capturer:
                try:
                    for seq_index, tokens in enumerate(sequences):
                        if seq_index < resumed_from:
                            continue
                        if seq_index >= max_sequences:
                            break

                        def on_chunk(n: int) -> None:
                            nonlocal done_tokens
                            done_tokens += n
                            if progress:
                                progress(done_tokens, total_tokens)

                        if len(tokens) < settings.seq_len and notice:
                            notice(f"the corpus ends within sequence {seq_index}: it holds {len(tokens):,} tokens, "
                                   f"not {settings.seq_len:,}")
                        try:
                            capturer.run(tokens, seq_index, batch, on_chunk)
                        except torch.cuda.OutOfMemoryError:
                            _commit(store, batch)  # whole sequences captured before are kept
                            batch = SequenceBatch()
                            committed = store.committed.sequences
                            heads = None if selection is None else int(loaded.model.config.num_attention_heads)
                            raise out_of_memory_error(settings, capturer.geometry, seq_index, len(tokens), committed,
                                                      created and not committed, _free_cuda_bytes(device),
                                                      heads) from None
                        if batch.num_tokens >= flush_tokens:
                            with interrupts_deferred():  # a Ctrl-C here waits for the commit and the reset
                                store.append(batch)
                                added_keys += sum(batch.sequence_keys)
                                added_seq += batch.num_sequences
                                added_tok += batch.num_tokens
                                batch = SequenceBatch()
                except KeyboardInterrupt:
                    _commit(store, batch)  # whole sequences captured before the interruption are kept
                    raise
            added_keys += sum(batch.sequence_keys)
            added_seq += batch.num_sequences
            added_tok += batch.num_tokens
            _commit(store, batch)
    except DsaIndexError as err:
        if created and store.committed.sequences == 0 and not isinstance(err, WriterLockError):
            _remove_new_store(store_path, existed)
        raise
    return CaptureResult(store_path, added_seq, added_tok, added_keys, time.perf_counter() - t0, resumed_from)


def _remove_new_store(path: Path | ObjectLocation, existed: bool) -> None:
    """Remove a store this run created and committed nothing to (an empty folder given as the path stays)."""
    if isinstance(path, ObjectLocation):
        remove_objects(path)
        return
    shutil.rmtree(path, ignore_errors=True)
    if existed:
        path.mkdir(exist_ok=True)
