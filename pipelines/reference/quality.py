"""What selection does to the model's output: held-out negative log-likelihood and KL, runtime vs exact.

Recall of the exact top-k says how many of the model's own keys a selector keeps, not what the model
then predicts. This module measures the prediction: the same held-out document is fed to the model
twice, token by token (teacher forcing), once with the model's own DSA selection (its indexer's exact
score and top-k: **exact**) and once with the runtime's selection installed (a
:class:`~dsaindex.runtime.serving.ServedIndex`: PQ decode selection, IVF prefill selection where a
bundle has IVF layers: **runtime**). At every scored position it records both next-token
negative log-likelihoods and the KL divergence ``KL(p_exact || p_runtime)`` of the runtime's next-token
distribution from the exact one.

How the runtime is driven: **as a server serves a request**. The document's first ``min_prefix - 1``
tokens are the prompt, prefilled in chunks of the server's size (through the IVF index where the
bundles have one, the model's own selection elsewhere); every later token is one decode step, fed the
real next token instead of a sampled one, and the step's logits score the token after it. The other
variant, one forward in which each query's keys come from the selector, does not exist for PQ: the
transformers adapter replaces the indexer's top-k through the PQ decode group only on decode steps
(one new token), and that group's state (pages encoded as they complete, the exact tail, the device
cache of exact keys and its misses) evolves step by step. A forward over many queries would run the
prefill path instead and measure a selection no server runs at decode. So each scored position costs
one decode step of each run; both runs advance in lockstep over their own KV caches (the runtime's
hooks are switched off for the exact step), so no per-position distribution has to be kept. IVF
prefill selection reaches the scored positions through the prompt's KV cache (the prompt positions
themselves are not scored): a larger ``min_prefix`` gives it a longer prompt to act on.

Documents are whole held-out documents (the held-out split of the checkpoint's corpus, documents
separated by its end token) of at least the evaluated length, each cut to that length: the begin
token, then the document's first ``length - 1`` tokens. Results are aggregated per evaluated length,
per prefix band within it (doubling bands from ``min_prefix``), and over everything
(:func:`summarize`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsaindex.errors import DsaIndexError


@dataclass
class HeldoutDocument:
    """One held-out document cut to an evaluated length: ``tokens`` [length] int64 (the begin token first),
    its place among the held-out documents (``index``, 0-based, in split order), its full length in tokens
    and its title where the corpus records one."""

    index: int
    tokens: Any
    full_tokens: int
    title: str | None = None


@dataclass
class PositionScores:
    """Per scored position of one document: ``prefix`` (tokens before the predicted one), ``nll_exact``,
    ``nll_runtime`` (nats) and ``kl`` (``KL(p_exact || p_runtime)``, nats)."""

    prefix: list[int] = field(default_factory=list)
    nll_exact: list[float] = field(default_factory=list)
    nll_runtime: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)

    def extend(self, other: PositionScores) -> None:
        for name in ("prefix", "nll_exact", "nll_runtime", "kl"):
            getattr(self, name).extend(getattr(other, name))


def split_documents(stream: Any, eos: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each document of a held-out token stream (documents joined with ``eos`` after
    each), ``end`` exclusive and without the end token; empty documents are left out."""
    import numpy as np

    stream = np.asarray(stream)
    ends = np.flatnonzero(stream == eos).tolist()
    if not ends or ends[-1] != stream.size - 1:
        ends.append(stream.size)  # a stream cut by a token budget: its last document runs to the end
    spans, start = [], 0
    for end in ends:
        if end > start:
            spans.append((start, end))
        start = end + 1
    return spans


def heldout_titles(corpus: Path | None) -> list[str] | None:
    """The titles of a ``dsaindex reference corpus`` folder's held-out documents in split order (its
    ``heldout.jsonl``), or None where it has no such file."""
    import json

    path = None if corpus is None else Path(corpus) / "heldout.jsonl"
    if path is None or not path.is_file():
        return None
    titles = []
    for line in path.read_text().splitlines():
        if line.strip():
            doc = json.loads(line)
            titles.append(f"{doc.get('source', '')}: {doc.get('title', '')}".strip(": "))
    return titles


HELDOUT_TOKENS = 8_000_000  # the held-out split read at most (v2's corpus holds about 1M held-out tokens)


def heldout_stream(corpus: Path | None, vocab_size: int, tokenizer: Any = None) -> tuple[Any, int, int]:
    """(held-out tokens, begin token, end token) of the checkpoint's corpus, as ``runtime generate`` reads
    its prompts (:func:`~dsaindex.pipelines.capture.tokens.checkpoint_streams`): a ``dsaindex reference
    corpus`` folder in its own tokens, or without one the byte-token Python sources. A checkpoint with its
    own ``tokenizer`` (:class:`~dsaindex.pipelines.capture.models.HFTokenizer`) is refused without a corpus,
    and with a corpus tokenized by another vocabulary (its tokens would mean other text to the model)."""
    from dsaindex.pipelines.capture.models import ByteTokenizer
    from dsaindex.pipelines.capture.tokens import checkpoint_streams

    own = None if tokenizer is None or isinstance(tokenizer, ByteTokenizer) else tokenizer.name
    streams, vocab = checkpoint_streams("The model", own, corpus, vocab_size, 0, HELDOUT_TOKENS)
    if own is not None and vocab.tokenizer is not None and hasattr(tokenizer, "tok"):
        from tokenizers import Tokenizer

        if Tokenizer.from_file(str(vocab.tokenizer)).get_vocab() != tokenizer.tok.get_vocab():
            raise DsaIndexError(f"{corpus} is tokenized with another vocabulary than the model's own tokenizer.",
                                "pass the corpus the checkpoint was trained on (the folder `dsaindex reference "
                                "corpus` wrote for it).")
    return streams.heldout, vocab.bos, vocab.eos


def pick_documents(stream: Any, eos: int, bos: int, length: int, count: int,
                   titles: Sequence[str] | None = None) -> list[HeldoutDocument]:
    """The first ``count`` held-out documents (in split order) of at least ``length - 1`` tokens, each as
    the begin token and its first ``length - 1`` tokens. Raises :class:`DsaIndexError` where none is that
    long (naming the longest)."""
    import torch

    spans = split_documents(stream, eos)
    titles = titles if titles is not None and len(titles) == len(spans) else None
    picked = []
    for i, (start, end) in enumerate(spans):
        if end - start >= length - 1 and len(picked) < count:
            body = torch.as_tensor(stream[start : start + length - 1]).long()
            picked.append(HeldoutDocument(i, torch.cat([torch.tensor([bos]), body]), end - start,
                                          titles[i] if titles else None))
    if not picked:
        longest = max((end - start for start, end in spans), default=0)
        raise DsaIndexError(f"No held-out document has the {length - 1:,} tokens a length of {length:,} needs "
                            f"(the longest of the {len(spans)} held-out documents has {longest + 1:,} with its "
                            "begin token).",
                            f"pass --lengths of at most {longest + 1:,}, or a corpus with longer held-out documents.")
    return picked


def teacher_forced_scores(model: Any, runtime: Any, tokens: Any, min_prefix: int, prefill_chunk: int,
                          progress: Callable[[int], None] | None = None) -> PositionScores:
    """Next-token NLL of exact and runtime selection and their KL at every position of ``tokens`` whose
    prefix holds at least ``min_prefix`` tokens.

    Parameters
    ----------
    model : a transformers DSA model (V3.2 / GLM-5 classes), fp32 for a clean comparison
    runtime : the runtime's selection for ``model``, attached (a
        :class:`~dsaindex.runtime.serving.ServedIndex` inside its ``with``); its hooks are switched off
        (``enabled``) for the exact run's forwards and on for its own
    tokens : [L] int64, the begin token first
    min_prefix : the first scored target is ``tokens[min_prefix]`` (2 <= min_prefix < L); the prompt is
        ``tokens[:min_prefix - 1]``, prefilled ``prefill_chunk`` tokens at a time, and each later token is
        a decode step (module docstring)
    progress : called with the number of positions scored so far, after each

    Returns
    -------
    :class:`PositionScores` of the ``L - min_prefix`` scored positions.
    """
    import torch

    from dsaindex.indexer import cache_argument

    length = int(tokens.numel())
    if not 2 <= min_prefix < length:
        raise DsaIndexError(f"A prefix of {min_prefix} tokens leaves nothing to score in {length} tokens (or no "
                            "prompt to prefill).", f"pass a minimum prefix from 2 to {length - 1}.")
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    cache_kw = cache_argument(model)
    caches: dict[bool, Any] = {False: None, True: None}  # runtime selection on? -> that run's KV cache

    def forward(ids: Any, selected: bool) -> Any:
        runtime.enabled = selected
        kw = {} if caches[selected] is None else {cache_kw: caches[selected]}
        out = model(input_ids=ids.view(1, -1), use_cache=True, **kw)
        caches[selected] = getattr(out, cache_kw) if cache_kw == "cache" else out.past_key_values
        return out.logits[0, -1].float()

    scores = PositionScores()
    try:
        with torch.no_grad():
            prompt = tokens[: min_prefix - 1]
            for selected in (False, True):
                for lo in range(0, prompt.numel(), prefill_chunk):
                    forward(prompt[lo : lo + prefill_chunk], selected)
            for t in range(min_prefix, length):  # feed tokens[t - 1]; predict tokens[t] from t tokens
                exact = torch.log_softmax(forward(tokens[t - 1], False), -1)
                served = torch.log_softmax(forward(tokens[t - 1], True), -1)
                target = tokens[t]
                scores.prefix.append(t)
                scores.nll_exact.append(float(-exact[target]))
                scores.nll_runtime.append(float(-served[target]))
                scores.kl.append(float((exact.exp() * (exact - served)).sum().clamp_min(0.0)))
                if progress is not None:
                    progress(len(scores.prefix))
    finally:
        runtime.enabled = True
    return scores


def prefix_bands(min_prefix: int, length: int) -> list[tuple[int, int]]:
    """Doubling prefix bands ``[lo, hi)`` covering the scored prefixes ``min_prefix .. length - 1``:
    ``[min_prefix, next power of two)``, then powers of two, the last one ending at ``length``."""
    edges = [min_prefix]
    edge = 1 << max(0, math.ceil(math.log2(min_prefix + 1)))
    while edge < length:
        if edge > edges[-1]:
            edges.append(edge)
        edge *= 2
    edges.append(length)
    return list(zip(edges[:-1], edges[1:], strict=True))


def band_summary(scores: PositionScores, lo: int = 0, hi: int | None = None) -> dict[str, Any]:
    """Means over the positions whose prefix is in ``[lo, hi)``: ``positions``, ``nll_exact``,
    ``nll_runtime`` (nats per token), ``nll_delta_pct`` (100 x (runtime - exact) / exact), ``kl`` (nats)
    and ``kl_max``; the NLL and KL entries are None where no position falls in the band."""
    rows = [i for i, p in enumerate(scores.prefix) if p >= lo and (hi is None or p < hi)]
    out: dict[str, Any] = {"positions": len(rows)}
    if not rows:
        return out | dict.fromkeys(("nll_exact", "nll_runtime", "nll_delta_pct", "kl", "kl_max"))
    exact = math.fsum(scores.nll_exact[i] for i in rows) / len(rows)
    served = math.fsum(scores.nll_runtime[i] for i in rows) / len(rows)
    return out | {"nll_exact": exact, "nll_runtime": served,
                  "nll_delta_pct": 100.0 * (served - exact) / exact if exact > 0 else None,
                  "kl": math.fsum(scores.kl[i] for i in rows) / len(rows),
                  "kl_max": max(scores.kl[i] for i in rows)}


def summarize(per_length: dict[int, PositionScores], min_prefix: int) -> dict[str, Any]:
    """``{"lengths": [{"length", "bands": [{"prefix": [lo, hi], ...}], "all": {...}}], "overall": {...}}``
    from the positions scored at each evaluated length (:func:`band_summary` entries)."""
    lengths, everything = [], PositionScores()
    for length, scores in sorted(per_length.items()):
        bands = [{"prefix": [lo, hi], **band_summary(scores, lo, hi)} for lo, hi in prefix_bands(min_prefix, length)]
        lengths.append({"length": length, "bands": bands, "all": band_summary(scores)})
        everything.extend(scores)
    return {"lengths": lengths, "overall": band_summary(everything)}


def measure_quality(model: Any, runtime: Any, documents: dict[int, list[HeldoutDocument]], min_prefix: int,
                    prefill_chunk: int, progress: Callable[[int, int, str], None] | None = None) -> dict[str, Any]:
    """:func:`teacher_forced_scores` of every document at each evaluated length, summarized.

    Parameters
    ----------
    model : the served model; runtime : its runtime selection, not yet attached
        (:class:`~dsaindex.runtime.serving.ServedIndex`, sized for the longest document; with
        ``measure_recall`` its per-layer recall of the model's own top-k is reported per length)
    documents : evaluated length -> its documents (:func:`pick_documents`)
    progress : ``progress(positions scored, positions in all, what runs now)``

    Returns
    -------
    :func:`summarize`'s dict; each length's entry also holds its ``documents`` (index, title, tokens of the
    whole document) and, where the runtime measured it, ``selection_recall`` (phase -> layer -> share).
    """
    from dsaindex.runtime.serving import ServingLog

    total = sum(len(docs) * (length - min_prefix) for length, docs in documents.items())
    done = 0
    per_length: dict[int, PositionScores] = {}
    recall: dict[int, dict] = {}
    with runtime:
        for length, docs in sorted(documents.items()):
            runtime.log = ServingLog()
            scores = PositionScores()
            for n, doc in enumerate(docs):
                what = f"length {length:,}, document {n + 1}/{len(docs)}"
                before = done

                def tick(scored: int, before: int = before, what: str = what) -> None:
                    if progress is not None:
                        progress(before + scored, total, what)

                tick(0)
                scores.extend(teacher_forced_scores(model, runtime, doc.tokens, min_prefix, prefill_chunk, tick))
                done += length - min_prefix
            per_length[length] = scores
            recall[length] = {phase: {str(layer): share for layer, share in layers.items()}
                              for phase, layers in runtime.log.recall().items() if layers}
    result = summarize(per_length, min_prefix)
    for entry in result["lengths"]:
        length = entry["length"]
        entry["documents"] = [{"index": d.index, "title": d.title, "tokens": d.full_tokens} for d in documents[length]]
        if recall[length]:
            entry["selection_recall"] = recall[length]
    return result
