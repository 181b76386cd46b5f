"""Serving settings, typed, with one set of defaults: what ``dsaindex serve``, ``runtime generate``,
:func:`dsaindex.runtime.serving.serve_index` and both engine plugins take.

* :class:`DecodeSettings`: the PQ decode step (C, stage 1, the miss filter, the direct path);
* :class:`PrefillSettings`: IVF prefill selection and streamed prefill;
* :class:`ServeSettings`: the two above plus what the whole runtime shares (basis, request slots,
  cross-layer reuse, the MLI lag);
* :data:`ENVIRONMENT`: every ``DSAINDEX_*`` variable the engine plugins read, declared once with its
  parser, default and meaning; :func:`engine_settings` reads them for a plugin and
  :func:`environment_markdown` writes the table the engines' READMEs show.

The numeric defaults are the core's measured constants (:mod:`dsaindex.coarse`: the kernels take them
too); every other default is a field default here. Commands take their option defaults from these
classes (``DecodeSettings().candidates``), and ``tests/test_settings.py`` checks each option against
them. Parsing the text forms (``"auto"``, ``"2048"``) happens here, so a CLI option and an environment
variable refuse the same bad value with the same message, naming the option or variable to fix.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from dsaindex.coarse import (
    DIRECT_UPTO,
    FILTER_WIDTH,
    PAGED_EXACT_BELOW,
    PAGED_EXACT_OFFSET,
    PREFILL_RECALL_TARGET,
    PREFILTER,
    RECALL_TARGET,
    grown_offset_words,
)
from dsaindex.errors import DsaIndexError

Auto = Literal["auto"]
PerLayer = Mapping[int, int]


def parse_candidates(value: Any, where: str = "--candidates", empty_ok: bool = True) -> int | Auto | None:
    """C as a server takes it: a positive count, ``auto`` (each layer's C from its bundle's recorded recall),
    or, with ``empty_ok``, none (empty, ``0``, None: the caller's default). ``where`` names the option or
    variable in the error."""
    text = "" if value is None else str(value).strip().lower()
    if text == "auto":
        return "auto"
    if text in ("", "0") and empty_ok:
        return None
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise DsaIndexError(f"{where} {value!r} is neither a positive count nor `auto`.",
                        f"set {where} to a number of keys (e.g. 2048) or `auto`.")


def parse_prefilter(value: Any, candidates: Any = None, where: str = "--prefilter",
                    empty_ok: bool = True) -> int | Auto:
    """Stage 1's factor: a positive integer, ``auto``, which chooses each layer's stage 1 together with its C
    and so needs ``candidates`` ``auto`` too, or, with ``empty_ok``, none (:data:`dsaindex.coarse.PREFILTER`)."""
    text = "" if value is None else str(value).strip().lower()
    if text == "auto":
        if candidates != "auto":
            raise DsaIndexError(f"{where} `auto` chooses each layer's stage 1 together with its C, and the "
                                f"candidate count is {candidates!r}.",
                                f"set the candidates to `auto` too, or {where} to a number (e.g. {PREFILTER}).")
        return "auto"
    if text == "" and empty_ok:
        return PREFILTER
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise DsaIndexError(f"{where} {value!r} is neither a positive factor nor `auto`.",
                        f"set {where} to a number (e.g. {PREFILTER}) or `auto`.")


STAGE1_KINDS = ("codes", "folds")  # what a served stage 1 scores, as bundles record its recall
STAGE1_SETTINGS = ("auto", *STAGE1_KINDS)


def parse_stage1(value: Any, where: str = "--stage1") -> str:
    """What stage 1 scores: ``auto`` (chosen with each layer's C and P where those are chosen, else the codes),
    ``codes`` (the keys' codes by the head-weighted folded query) or ``folds`` (the fold scan: the heads grouped
    by sign and direction, a ReLU per group); empty: ``auto``."""
    text = "" if value is None else str(value).strip().lower()
    if text == "":
        return "auto"
    if text not in STAGE1_SETTINGS:
        raise DsaIndexError(f"{where} {value!r} is not a stage 1.", f"set {where} to {', '.join(STAGE1_SETTINGS)}.")
    return text


def parse_fraction(value: Any, where: str = "--recall-target") -> float:
    """A recall target in (0, 1]."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not 0.0 < number <= 1.0:
        raise DsaIndexError(f"{where} {value!r} is not a recall between 0 and 1.",
                            f"set {where} to a fraction such as {RECALL_TARGET}.")
    return number


KEY_PLACES = ("device", "host")


def parse_keys(value: Any, where: str = "DSAINDEX_KEYS") -> str:
    """Where an engine's exact index keys live: ``device`` (the engine's HBM) or ``host`` (pinned host memory
    the GPU reads in place, so the engine's pool admits more tokens)."""
    text = "" if value is None else str(value).strip().lower()
    if text not in KEY_PLACES:
        raise DsaIndexError(f"{where} {value!r} is not a place for the exact index keys.",
                            f"set {where} to {' or '.join(KEY_PLACES)}.")
    return text


LONG_PREFIX = ("grow", "fixed")  # what C does past the prefixes a bundle measured its recall at


def parse_long_prefix(value: Any, where: str = "DSAINDEX_LONG_PREFIX") -> str:
    """What a decode layer's C does past the longest prefix band its bundle measured recall in: ``grow``
    (doubles with each doubling of the prefix) or ``fixed``."""
    text = "" if value is None else str(value).strip().lower()
    if text not in LONG_PREFIX:
        raise DsaIndexError(f"{where} {value!r} is not a rule for C past the measured prefixes.",
                            f"set {where} to {' or '.join(LONG_PREFIX)}.")
    return text


def parse_flag(value: Any, where: str) -> bool:
    """A yes/no setting: 1, true, yes, on / 0, false, no, off (any case) or empty (no)."""
    text = "" if value is None else str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("", "0", "false", "no", "off"):
        return False
    raise DsaIndexError(f"{where} {value!r} is not a yes/no value.", f"set {where} to 1 or 0.")


def parse_count(value: Any, where: str) -> int:
    """A count of zero or more (``2097152``, or with a binary suffix: ``2M``, ``512K``)."""
    text = "" if value is None else str(value).strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    digits = text[:-1] if scale > 1 else text
    if not digits.isdigit():
        raise DsaIndexError(f"{where} {value!r} is not a count of keys.",
                            f"set {where} to a whole number such as 2097152 or 2M (0 turns it off).")
    return int(digits) * scale


def parse_bytes(value: Any, where: str) -> int:
    """A size in bytes, with a binary suffix or without (``2147483648``, ``2G``, ``512M``); at least 1 MiB."""
    text = "" if value is None else str(value).strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(text[-1:], 1)
    digits = text[:-1] if scale > 1 else text
    if not digits.isdigit() or int(digits) * scale < 1 << 20:
        raise DsaIndexError(f"{where} {value!r} is not a size of at least 1 MiB.",
                            f"set {where} to a number of bytes such as 2G or 512M.")
    return int(digits) * scale


def parse_basis(value: Any, where: str = "--basis") -> str:
    text = str(value).strip().lower()
    if text not in ("hadamard", "raw"):
        raise DsaIndexError(f"{where} {value!r} is not a key basis.", f"set {where} to hadamard or raw.")
    return text


@dataclass(frozen=True)
class DecodeSettings:
    """The PQ decode step (:class:`dsaindex.runtime.pq_batch.PQDecodeGroup`), per served layer.

    candidates : C, keys reranked exactly per step: ``auto`` (the default: each layer's cheapest recorded
        operating point whose held-out served recall reaches ``recall_target``; a bundle where none does is
        refused, naming what would), a count, or a layer -> count mapping
    prefilter : stage 1 keeps ``prefilter`` x C keys by a folded score before the full coarse score: a
        factor, a layer -> factor mapping, or ``auto`` (with ``candidates="auto"``: chosen with each C);
        None (the default): ``auto`` where C is, else :data:`dsaindex.coarse.PREFILTER`
    stage1 : what stage 1 scores (:data:`STAGE1_KINDS`): ``auto`` (the default: with ``prefilter="auto"``, each
        layer's cheapest recorded point of either stage 1 that the layer and device serve; else the codes),
        ``codes``, ``folds`` or a layer -> one of them mapping
    recall_target : what ``auto`` must reach, over all held-out queries and in the longest prefix band
    cache_capacity : exact keys cached on the device per request (None: 2 x C)
    exact_below : requests of at most this many keys are scored exactly (0: never)
    pq_from : layer -> the first key position the code ranks (older keys only; None: all)
    filter_width : the miss filter's margin below the k-th coarse score, in standard deviations
    direct_upto : steps with at most this many live requests read candidates straight from the host (0: never)
    long_prefix : past the longest prefix band a bundle measured recall in, ``grow`` (C doubles with each
        doubling of a request's prefix; such a step rescores every candidate, with no miss filter, and its device
        cache is sized for the growth) or ``fixed``
    """

    candidates: int | Auto | PerLayer = "auto"
    prefilter: int | Auto | PerLayer | None = None
    stage1: str | Mapping[int, str] = "auto"
    recall_target: float = RECALL_TARGET
    cache_capacity: int | None = None
    exact_below: int = 0
    pq_from: Mapping[int, int] | None = None
    filter_width: float = FILTER_WIDTH
    direct_upto: int = DIRECT_UPTO
    long_prefix: str = "grow"

    def __post_init__(self) -> None:
        object.__setattr__(self, "long_prefix", parse_long_prefix(self.long_prefix, "long_prefix"))
        if isinstance(self.candidates, str) and self.candidates != "auto":
            object.__setattr__(self, "candidates", parse_candidates(self.candidates) or DecodeSettings.candidates)
        if self.prefilter is None:  # with C: chosen with it where it is chosen, else the runtime's factor
            object.__setattr__(self, "prefilter", "auto" if self.candidates == "auto" else PREFILTER)
        if isinstance(self.prefilter, str):
            object.__setattr__(self, "prefilter", parse_prefilter(self.prefilter, self.candidates))
        elif self.prefilter == "auto" and self.candidates != "auto":
            parse_prefilter("auto", self.candidates)
        parse_fraction(self.recall_target)
        if not isinstance(self.stage1, Mapping):
            object.__setattr__(self, "stage1", parse_stage1(self.stage1, "stage1"))

    @property
    def auto(self) -> bool:
        """Whether C (and maybe stage 1) is still to be chosen from a bundle's recorded recall."""
        return self.candidates == "auto" or self.prefilter == "auto"


@dataclass(frozen=True)
class PrefillSettings:
    """Prefill selection: ``ivf_budget`` candidates per prefill query from the IVF index (None: the smallest
    budget whose held-out recall, as the ivf bundle records it, reaches ``ivf_recall_target``; 8 x top-k for
    a bundle that records none);
    ``stream_prefix``: LeanSparse's layer-wise streamed prefill of the model's indexer keys (one request at
    a time: :class:`dsaindex.runtime.streaming.PrefixStreamer`); ``chunk``: prompt tokens a server prefills
    at once (None: :func:`dsaindex.runtime.server.prefill_chunk` of the model)."""

    ivf_budget: int | None = None
    ivf_recall_target: float = PREFILL_RECALL_TARGET
    stream_prefix: bool = False
    chunk: int | None = None


@dataclass(frozen=True)
class ServeSettings:
    """Everything a served runtime takes besides its artifacts.

    decode, prefill : the two phases' settings
    basis : the key basis the artifacts were trained in (the engines' Hadamard basis by default)
    slots : requests served at once (batch rows); max_keys : the longest request (None: the model's
        ``max_position_embeddings``)
    allow_other_weights : serve artifacts trained for another model of the same geometry
    tracking_uri : MLflow tracking URI for ``models:/`` bundles (None: ``MLFLOW_TRACKING_URI`` or the default)
    retention, reuse_method : with a ``reuse`` bundle, the plan to serve (``"1/4"``) and how it was chosen
    lag : the Multi-layer Indexer's schedule; side_stream : run a lagged kept layer's selection on a side
        stream (None: on CUDA with ``lag``)
    measure_recall : log how much of the model's own top-k each selection keeps
    use_triton : the Triton kernels (None: where they run)
    """

    decode: DecodeSettings = field(default_factory=DecodeSettings)
    prefill: PrefillSettings = field(default_factory=PrefillSettings)
    basis: str = "hadamard"
    slots: int = 1
    max_keys: int | None = None
    allow_other_weights: bool = False
    tracking_uri: str | None = None
    retention: str | None = None
    reuse_method: str = "optimal"
    lag: bool = False
    side_stream: bool | None = None
    measure_recall: bool = False
    use_triton: bool | None = None

    @classmethod
    def of(cls, **options: Any) -> ServeSettings:
        """Settings from flat keywords, each routed to :class:`DecodeSettings`, :class:`PrefillSettings` or
        this class by its name (``ServeSettings.of(candidates="auto", ivf_budget=16384, slots=4)``); an
        unknown name is a ``TypeError`` naming it."""
        names = {kind: {f.name for f in fields(kind)} for kind in (DecodeSettings, PrefillSettings, cls)}
        unknown = sorted(set(options) - set().union(*names.values()) | ({"decode", "prefill"} & set(options)))
        if unknown:
            raise TypeError(f"unknown serving settings {unknown}; known: {sorted(set().union(*names.values()))}")
        pick = {kind: {k: v for k, v in options.items() if k in names[kind]} for kind in names}
        return cls(decode=DecodeSettings(**pick[DecodeSettings]), prefill=PrefillSettings(**pick[PrefillSettings]),
                   **pick[cls])


# ---- the engine plugins' environment -----------------------------------------------------------------
ENGINES = ("sglang", "vllm")


@dataclass(frozen=True)
class EnvVar:
    """One ``DSAINDEX_*`` variable: ``field`` of :class:`EngineSettings` it sets, ``parse`` (text, the
    variable's name) -> value, ``default`` (one value, or one per engine), ``shown`` (the default as the
    README states it) and ``doc``."""

    name: str
    field: str
    parse: Callable[[str, str], Any]
    default: Any
    doc: str
    shown: str = ""

    def default_for(self, engine: str) -> Any:
        return self.default[engine] if isinstance(self.default, dict) else self.default


def _text(value: str, where: str) -> str | None:
    return value.strip() or None


ENVIRONMENT: tuple[EnvVar, ...] = (
    EnvVar("DSAINDEX_ARTIFACTS", "artifacts", _text, None,
           "A bundle path or `models:/NAME@alias` (or `/VERSION`). Unset or empty: the plugin does nothing "
           "and the engine keeps its own indexer.", "unset"),
    EnvVar("DSAINDEX_BASIS", "basis", parse_basis, {"sglang": "hadamard", "vllm": "raw"},
           "The key basis of the engine's index-K cache, which the artifacts must be trained in: SGLang "
           "rotates keys with a Hadamard matrix, vLLM 0.33 stores them unrotated.",
           "`hadamard` (SGLang), `raw` (vLLM)"),
    EnvVar("DSAINDEX_CANDIDATES", "candidates", lambda v, w: parse_candidates(v, w), "auto",
           "C, keys reranked exactly per decode query: `auto` (each layer's cheapest recorded operating point, "
           "C with its stage 1, whose held-out recall in the bundle reaches `DSAINDEX_RECALL_TARGET`; the "
           "engine refuses to start, naming what would, where none does) or a count.", "`auto`"),
    EnvVar("DSAINDEX_PREFILTER", "prefilter", lambda v, w: v, None,
           "Stage 1 keeps PREFILTER x C keys by a folded score; `auto` (with `DSAINDEX_CANDIDATES=auto`): "
           "each layer's stage 1 chosen with its C.", f"`auto` with `DSAINDEX_CANDIDATES=auto`, else {PREFILTER}"),
    EnvVar("DSAINDEX_STAGE1", "stage1", parse_stage1, "auto",
           "What stage 1 scores: `auto` (with `DSAINDEX_PREFILTER=auto`: each layer's cheapest recorded point, by "
           "the codes or by the fold scan's grouped folds where the layer's codes fit it and it compiles here; "
           "else the codes), `codes` or `folds`.", "`auto`"),
    EnvVar("DSAINDEX_RECALL_TARGET", "recall_target", parse_fraction, RECALL_TARGET,
           "The held-out recall of the exact top-k that `auto` must reach, per layer.", str(RECALL_TARGET)),
    EnvVar("DSAINDEX_EXACT_BELOW", "exact_below", parse_count, PAGED_EXACT_BELOW,
           "A decode step of B requests whose longest has N keys is scored exactly, as the engine scores it "
           f"without the plugin (DeepGEMM's logits + top-k), when B x (N - {PAGED_EXACT_OFFSET} x the layer's "
           "stage-1 width, PREFILTER x C) is at most this; where `DSAINDEX_LONG_PREFIX=grow` grows the longest "
           f"request's C g x, the offset is {grown_offset_words()} stage-1 widths; "
           "above it, by the codes. Inside a CUDA graph both paths "
           "are captured as conditional nodes and each replay runs one. 0: always the codes. Ignored with "
           f"`DSAINDEX_KEYS=host`.", f"`{PAGED_EXACT_BELOW >> 10}K` ({PAGED_EXACT_BELOW:,})"),
    EnvVar("DSAINDEX_LONG_PREFIX", "long_prefix", parse_long_prefix, "grow",
           "What a layer's C does for a request whose prefix is longer than the longest prefix band its bundle "
           "measured recall in (e.g. 64K-128K): `grow` doubles C and the stage-1 width for each doubling of the "
           "prefix, per request (a fixed C served 4-7 points less at 256K-512K than at 128K on the reference "
           "checkpoint; 4 x C there served 99.6%), up to what the final top-k holds; `fixed` keeps C.",
           "`grow`"),
    EnvVar("DSAINDEX_ALLOW_OTHER_WEIGHTS", "allow_other_weights", parse_flag, False,
           "`1` (or true/yes): serve artifacts trained for another model of the same geometry.", "0"),
    EnvVar("DSAINDEX_KEYS", "keys", parse_keys, "device",
           "Where the exact index keys of the layers the plugin serves live: `device` (the engine's HBM, as "
           "without the plugin) or `host` (pinned host memory the GPU reads in place; the KV pool is sized "
           "with the codes' bytes instead of the keys', so it admits more tokens, and each step reads its C "
           "candidates' keys over the host link. vLLM: the codes live in the pool's bytes for the layer; not "
           "with a KV connector or HiSparse, and with a layer-outer KV cache layout, vLLM's default).",
           "`device`"),
    EnvVar("DSAINDEX_CACHE_DIR", "cache_dir", _text, None,
           "Where `models:/` bundles are pulled to.", "the registry's cache (`~/.cache/dsaindex`)"),
    EnvVar("DSAINDEX_TRACKING_URI", "tracking_uri", _text, None,
           "The MLflow tracking server `models:/` URIs resolve against.",
           "`MLFLOW_TRACKING_URI`, else the local registry"),
    EnvVar("DSAINDEX_CAPTURE", "capture", _text, None,
           "A capture store (a local path or `s3://bucket/prefix`) the engine writes while it serves: each finished "
           "request's indexer keys, read from the engine's index-K cache (FP8, dequantized), and the queries and "
           "head weights of a sample of its decode steps, in the store format `dsaindex train pq` reads. Tensor "
           "parallel rank 0 writes, on a background thread; a store of this model and settings is appended to, "
           "another one stops startup. Works with or without `DSAINDEX_ARTIFACTS`. Unset: no capture.", "unset"),
    EnvVar("DSAINDEX_CAPTURE_QUEUE", "capture_queue", parse_bytes, 2 << 30,
           "Host memory the capture may hold (finished requests waiting for the writer, sampled queries of running "
           "requests); a finished request that does not fit is dropped and counted, never waited for.", "`2G`"),
    EnvVar("DSAINDEX_CAPTURE_QUERIES", "capture_queries", lambda v, w: parse_count(v, w), 32,
           "Decode steps per request whose queries and head weights are recorded: the first half as one window "
           "of consecutive steps, the rest spread evenly over the later steps. 0: keys only.", "32"),
)


@dataclass(frozen=True)
class EngineSettings:
    """An engine plugin's settings, as :func:`engine_settings` reads them from :data:`ENVIRONMENT`."""

    artifacts: str | None
    basis: str
    candidates: int | Auto | None
    prefilter: int | Auto
    stage1: str
    recall_target: float
    exact_below: int
    allow_other_weights: bool
    keys: str
    cache_dir: str | None
    tracking_uri: str | None
    capture: str | None = None
    capture_queue: int = 2 << 30
    capture_queries: int = 32
    long_prefix: str = "grow"

    def decode(self, topk: int) -> DecodeSettings:
        """The decode settings these give a model whose top-k is ``topk`` (C ``auto`` unless set; none at all:
        2 x top-k)."""
        return DecodeSettings(candidates=self.candidates or 2 * topk, prefilter=self.prefilter, stage1=self.stage1,
                              recall_target=self.recall_target)


def engine_settings(engine: str, environ: Mapping[str, str] | None = None) -> EngineSettings:
    """The ``DSAINDEX_*`` settings of the ``engine`` plugin (``sglang`` or ``vllm``) from ``environ``
    (default ``os.environ``): unset or empty variables take the table's default; a bad value raises
    :class:`DsaIndexError` naming the variable."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for var in ENVIRONMENT:
        raw = env.get(var.name, "")
        values[var.field] = var.default_for(engine) if not raw.strip() else var.parse(raw, var.name)
    if values["prefilter"] is None:  # unset: chosen with C where C is, else the runtime's default factor
        values["prefilter"] = "auto" if values["candidates"] == "auto" else PREFILTER
    values["prefilter"] = parse_prefilter(values["prefilter"], values["candidates"], "DSAINDEX_PREFILTER")
    return EngineSettings(**values)


def environment_markdown() -> str:
    """The table of :data:`ENVIRONMENT` as the engines' READMEs show it (generated, never edited by hand)."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{v.name}` | {v.shown} | {v.doc} |" for v in ENVIRONMENT]
    return "\n".join(rows) + "\n"
