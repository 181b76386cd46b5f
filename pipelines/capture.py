"""Capture: run a DSA model over a corpus and write what its indexers score into a capture store.

One sequence at a time (so a resumed run reproduces an uninterrupted one exactly), in chunks of
``chunk_len`` tokens through the model's own KV cache: transformers' indexer materializes a
[B, S, H, T] fp32 tensor, so a 32K sequence is never scored in one piece. Sequences are buffered and
appended to the store every ``flush_tokens`` tokens; each append is a commit point.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dsaindex.artifacts.capture_store import (
    CaptureSettings,
    CaptureStore,
    ModelFingerprint,
    QuerySampling,
    SequenceBatch,
    new_manifest,
)
from dsaindex.errors import DsaIndexError, EmptyCorpusError
from dsaindex.geometry import geometry_from_config
from dsaindex.indexer import cache_argument
from dsaindex.pipelines.corpus import CorpusSpec, iter_documents, pack_sequences
from dsaindex.pipelines.models import LoadedModel, load_model


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


def fingerprint(loaded: LoadedModel) -> ModelFingerprint:
    config = loaded.model.config
    geometry = geometry_from_config(config)
    dtype = str(next(loaded.model.parameters()).dtype).replace("torch.", "")
    return ModelFingerprint(
        name=loaded.name,
        family=geometry.family,
        geometry=geometry,
        config_digest=loaded.config_digest,
        weights_digest=loaded.weights_digest,
        dtype=dtype,
    )


@dataclass
class CaptureResult:
    store: Path
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


class SequenceCapturer:
    """Runs one sequence through the model in chunks and gathers per-layer keys, queries, weights."""

    def __init__(self, loaded: LoadedModel, settings: CaptureSettings, device: str):
        from dsaindex.pipelines.hooks import IndexerTap

        self.loaded = loaded
        self.settings = settings
        self.device = device
        self.geometry = geometry_from_config(loaded.model.config)
        self._records: list = []
        self.tap = IndexerTap(loaded.model, self.geometry, self._records.append)

    def __enter__(self) -> SequenceCapturer:
        self.tap.__enter__()
        return self

    def __exit__(self, *exc) -> None:
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
        for layer in self.geometry.indexer_layers:
            k = torch.cat(keys[layer])[:num_keys]
            if k.shape[0] != num_keys:
                raise RuntimeError(f"layer {layer}: captured {k.shape[0]} keys, expected {num_keys}")
            batch.keys.setdefault(layer, []).append(_encode_keys(k, s.basis, s.key_dtype))
            q = torch.cat(queries[layer])
            batch.queries.setdefault(layer, []).append(_encode_keys(q, s.basis, s.key_dtype))
            batch.head_weights.setdefault(layer, []).append(torch.cat(weights[layer]).float().cpu().numpy())
        batch.sequence_tokens.append(len(tokens))
        batch.sequence_keys.append(num_keys)
        batch.sequence_queries.append(len(positions))
        batch.tokens.append(np.asarray(tokens, dtype=np.int32))
        batch.query_position.append(positions.astype(np.int32))
        batch.query_sequence.append(np.full(len(positions), seq_index, dtype=np.int32))
        batch.query_window.append(windows)


def capture(
    store_path: str | Path,
    model_ref: str,
    corpus: CorpusSpec,
    settings: CaptureSettings,
    max_sequences: int,
    device: str = "cpu",
    dtype: str = "auto",
    flush_tokens: int = 65536,
    progress: Callable[[int, int], None] | None = None,
    loaded: LoadedModel | None = None,
) -> CaptureResult:
    """Capture until the store holds ``max_sequences`` sequences (resuming if it already holds some).

    ``progress(tokens_done, tokens_total)`` is called after every chunk.
    """
    if settings.chunk_len <= 0 or settings.seq_len <= 0:
        raise DsaIndexError("seq_len and chunk_len must be positive.", "pass --seq-len and --chunk-len > 0.")
    store_path = Path(store_path)
    loaded = loaded or load_model(model_ref, device=device, dtype=dtype)
    corpus_info = corpus.describe()
    tokenizer = loaded.tokenizer
    expected = new_manifest(fingerprint(loaded), settings, corpus_info, tokenizer.name)
    sequences = pack_sequences(iter_documents(corpus), tokenizer.encode, settings.seq_len, [tokenizer.eos_id])
    first = next(sequences, None)
    if first is None:  # checked before any store is created
        raise EmptyCorpusError(
            "The corpus yields no sequence (fewer than 16 tokens of text; JSONL records need the "
            f"{corpus.text_field!r} field).",
            "add text to the corpus, set --text-field, or leave --corpus out to use the built-in stdlib corpus.",
        )
    sequences = itertools.chain([first], sequences)
    if CaptureStore.exists(store_path):
        store = CaptureStore.open_for_append(store_path, expected)
    else:
        store = CaptureStore.create(store_path, expected)
        store = CaptureStore.open_for_append(store_path)
    t0 = time.perf_counter()
    resumed_from = store.committed.sequences
    added_seq = added_tok = added_keys = 0
    with store:
        todo = max(0, max_sequences - resumed_from)
        total_tokens = todo * settings.seq_len
        done_tokens = 0
        batch = SequenceBatch()
        with SequenceCapturer(loaded, settings, device) as capturer:
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

                capturer.run(tokens, seq_index, batch, on_chunk)
                if batch.num_tokens >= flush_tokens:
                    added_keys += sum(batch.sequence_keys)
                    added_seq += batch.num_sequences
                    added_tok += batch.num_tokens
                    store.append(batch)
                    batch = SequenceBatch()
            added_keys += sum(batch.sequence_keys)
            added_seq += batch.num_sequences
            added_tok += batch.num_tokens
            store.append(batch)
    return CaptureResult(store_path, added_seq, added_tok, added_keys, time.perf_counter() - t0, resumed_from)
