"""The artifact kinds a bundle layer can hold, registered in one place.

Each kind says what its parameters are (a pydantic model validated on write and on load), which arrays
a layer of that kind stores, how those arrays become the object the runtime serves with (placed on a
device) and how that object is summarized. The bundle writer, the loader, the registry and the CLI
dispatch through :func:`get_kind`, so a new kind (cross-layer reuse plans, say) is one
:func:`register_kind` call beside its parameters, not edits in five files.

Built in:

* ``pq``: per-layer PQ codebooks (:class:`dsaindex.pq.PQCodec`), arrays ``codebooks`` [M, K, D/M],
  for score-aware codebooks ``metric`` [M, D/M, D/M], and for OPQ codebooks (``params["rotate"]``)
  ``rotation`` [D, D] (orthogonal; the codes are of ``keys @ rotation.T``); residual codes
  (``params["quantizer"] == "rq"``) store whole-key ``codebooks`` [M, K, D] and a full ``metric`` [1, D, D];
* ``ivf``: a causal-IVF routing encoder (:class:`IVFLayer`): the encoder's arrays
  (:data:`ENCODER_ARRAYS`) and the index settings it was trained with (:class:`IVFIndexSettings`);
* ``reuse``: cross-layer top-k reuse plans (:class:`ReusePlans`), a model-level artifact: see
  :class:`ReuseParams` for how it sits in the per-layer bundle format.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dsaindex.errors import DsaIndexError

ENCODER_ARRAYS = ("phi_weight", "phi_bias", "hidden_weight", "hidden_bias", "out_weight", "out_bias")


@dataclass(frozen=True)
class ArtifactKind:
    """One kind of layer artifact.

    name : the ``kind`` string of a bundle layer
    params : pydantic model of the layer's ``params`` (extra keys allowed: training notes)
    arrays : array names every layer of the kind stores; optional_arrays : names it may store
    place : ``(params, {name: float32 tensor on the device}) -> served object``
    summary : ``served object -> dict`` (JSON-ready, with ``kind``); describe : ``-> one short line``
    role : what serving does with the placed object: ``decode`` (a layer's decode-step selection, e.g. a
        :class:`dsaindex.pq.PQCodec`), ``prefill`` (a layer's prefill selection, e.g. :class:`IVFLayer`) or
        ``model`` (a model-level plan, e.g. :class:`ReusePlans`); the runtime and the engine plugins
        dispatch on it, never on the kind's name
    """

    name: str
    params: type[BaseModel]
    arrays: tuple[str, ...]
    place: Callable[[Any, dict[str, Any]], Any]
    summary: Callable[[Any], dict[str, Any]]
    describe: Callable[[Any], str]
    optional_arrays: tuple[str, ...] = ()
    role: Literal["decode", "prefill", "model"] = "decode"

    def check_arrays(self, names: set[str], where: str) -> None:
        """Refuse a layer whose arrays are not this kind's (missing required ones, or unknown ones)."""
        missing = sorted(set(self.arrays) - names)
        unknown = sorted(names - set(self.arrays) - set(self.optional_arrays))
        if missing or unknown:
            raise DsaIndexError(
                f"{where}: a {self.name!r} layer stores {', '.join(self.arrays)}"
                + (f" (and optionally {', '.join(self.optional_arrays)})" if self.optional_arrays else "")
                + (f"; missing {', '.join(missing)}" if missing else "") + (f"; unknown {', '.join(unknown)}" if unknown else "")
                + ".",
                "write the layer's arrays under the kind's own names.",
            )


KINDS: dict[str, ArtifactKind] = {}


def register_kind(kind: ArtifactKind) -> ArtifactKind:
    """Add a kind to the registry (its name must be new)."""
    if kind.name in KINDS:
        raise ValueError(f"artifact kind {kind.name!r} is registered twice")
    KINDS[kind.name] = kind
    return kind


def get_kind(name: str) -> ArtifactKind:
    """The registered kind ``name``; an unknown one raises :class:`DsaIndexError` naming the known ones."""
    kind = KINDS.get(name)
    if kind is None:
        raise DsaIndexError(
            f"Artifact kind {name!r} is not one this dsaindex knows ({', '.join(sorted(KINDS))}).",
            "upgrade dsaindex to the version that wrote the bundle.",
        )
    return kind


# ---- pq --------------------------------------------------------------------------------------------
class PQParams(BaseModel):
    """Parameters of a ``pq`` layer; training notes (trainer, train_keys, ...) ride along as extras.
    ``rotate``: the codes are of rotated keys (OPQ) and the layer stores the ``rotation`` array.
    ``quantizer``: ``pq`` (product: a key is the concatenation of its M codewords) or ``rq`` (residual: the
    sum of M whole-key codewords, coded by beam search of width ``beam``)."""

    model_config = ConfigDict(extra="allow")
    subspaces: int
    centroids: int = 256
    score_aware: bool = False
    rotate: bool = False
    quantizer: Literal["pq", "rq"] = "pq"
    beam: int = Field(5, ge=1)


def _place_pq(params: PQParams, tensors: dict[str, Any]):
    from dsaindex.errors import CorruptBundleError
    from dsaindex.pq import PQCodec

    fix = ("train the layer again (`dsaindex train pq STORE`: OPQ by default, --no-rotate for plain PQ, "
           "--quantizer rq for a residual code).")
    rotation = tensors.get("rotation")
    if params.rotate and rotation is None:
        raise CorruptBundleError("The pq layer's params say its codes are of rotated keys (rotate=true, OPQ), but "
                                 "it stores no 'rotation' array: without it keys and queries would be coded in the "
                                 "wrong basis.", fix)
    if rotation is not None and not params.rotate:
        raise CorruptBundleError("The pq layer stores a 'rotation' array, but its params do not say rotate=true: "
                                 "whether its codes are of rotated keys is ambiguous.", fix)
    codebooks = tensors["codebooks"]
    residual = params.quantizer == "rq"
    if codebooks.dim() != 3 or codebooks.shape[0] != params.subspaces:
        raise CorruptBundleError(f"The pq layer's codebooks have shape {list(codebooks.shape)}; its params say "
                                 f"{params.subspaces} {'codebooks' if residual else 'subspaces'}.", fix)
    try:
        return PQCodec(codebooks, tensors.get("metric"), rotation, residual=residual, beam=params.beam)
    except DsaIndexError as err:  # a rotation of the wrong shape or not orthogonal; a metric of the wrong shape
        raise CorruptBundleError(err.problem, fix) from None


def _summarize_pq(codec) -> dict[str, Any]:
    return {"kind": "pq", "subspaces": codec.subspaces, "score_aware": codec.metric is not None,
            "rotate": codec.rotation is not None, "quantizer": "rq" if codec.residual else "pq"}


def _describe_pq(codec) -> str:
    return codec.label


# ---- ivf -------------------------------------------------------------------------------------------
class IVFIndexSettings(BaseModel):
    """How a causal IVF index groups keys: one type for training, the bundle and the runtime.

    window : keys per seal (the open window); cluster_size : keys per cluster (a seal's cap);
    refit_every : keys between refits of the whole prefix (0 = never); refit_fraction : past ``refit_every /
    refit_fraction`` sealed keys, a refit waits for that share of the prefix instead (0: a fixed interval;
    :meth:`dsaindex.runtime.causal_ivf.CausalIVF.refit_interval`); sinks : first keys always kept
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    window: int = 1024
    cluster_size: int = 128
    refit_every: int = 16384
    refit_fraction: float = 0.0625  # dsaindex.runtime.causal_ivf.REFIT_FRACTION (no runtime import here)
    sinks: int = 4

    @model_validator(mode="after")
    def _consistent(self) -> IVFIndexSettings:
        if self.cluster_size <= 0 or self.window <= 0 or self.window % self.cluster_size:
            raise ValueError(f"window {self.window} must be a positive multiple of cluster_size {self.cluster_size}")
        if self.refit_every < 0 or self.sinks < 0:
            raise ValueError("refit_every and sinks must not be negative")
        if not 0 <= self.refit_fraction < 1:
            raise ValueError(f"refit_fraction {self.refit_fraction} must be in [0, 1)")
        return self


class IVFParams(IVFIndexSettings):
    """Parameters of an ``ivf`` layer: the index settings, the encoder's widths, and training notes
    (steps, learning rate, the training summary) as extras."""

    model_config = ConfigDict(extra="allow", frozen=True)
    features: int = 64
    hidden: int = 256

    def index_settings(self) -> IVFIndexSettings:
        return IVFIndexSettings(**{k: getattr(self, k) for k in IVFIndexSettings.model_fields})


@dataclass
class IVFLayer:
    """One layer's causal-IVF routing encoder on the device: float32 ``params`` (:data:`ENCODER_ARRAYS`,
    the forward is :func:`dsaindex.runtime.causal_ivf.representatives`) and the index settings it was
    trained with."""

    params: dict[str, Any]
    settings: IVFIndexSettings

    @property
    def nbytes(self) -> int:
        return sum(int(t.numel()) * 4 for t in self.params.values())


def _place_ivf(params: IVFParams, tensors: dict[str, Any]) -> IVFLayer:
    return IVFLayer(tensors, params.index_settings())


def _summarize_ivf(layer: IVFLayer) -> dict[str, Any]:
    return {"kind": "ivf", **layer.settings.model_dump()}


def _describe_ivf(layer: IVFLayer) -> str:
    s = layer.settings
    grows = f", then 1/{1 / s.refit_fraction:g} of the prefix" if s.refit_fraction else ""
    return f"IVF routing (window {s.window}, clusters of {s.cluster_size}, refit every {s.refit_every}{grows})"


register_kind(ArtifactKind("pq", PQParams, ("codebooks",), _place_pq, _summarize_pq, _describe_pq,
                           optional_arrays=("metric", "rotation"), role="decode"))
register_kind(ArtifactKind("ivf", IVFParams, ENCODER_ARRAYS, _place_ivf, _summarize_ivf, _describe_ivf,
                           role="prefill"))


# ---- reuse -----------------------------------------------------------------------------------------
def retention_stride(retention: str) -> int:
    """``"1/4"`` -> 4 (keep every 4th indexer layer's worth); a malformed one raises ``ValueError``."""
    num, _, den = retention.partition("/")
    if num != "1" or not den.isdigit() or int(den) < 1:
        raise ValueError(f"retention {retention!r} is not of the form 1/N")
    return int(den)


def kept_count(num_layers: int, stride: int) -> int:
    """Indexer layers a retention of ``1/stride`` keeps out of ``num_layers`` (as many as the evenly
    spaced pattern ``layers[::stride]`` keeps)."""
    return -(-num_layers // stride)


def reuse_sources(layers: list[int], kept: list[int]) -> list[int]:
    """For every layer of ``layers`` (ascending), the layer whose top-k it uses: itself where it keeps
    its indexer, else the nearest kept layer before it (reuse runs forward, as the engines run it)."""
    out, current = [], None
    keep = set(kept)
    for layer in layers:
        if layer in keep:
            current = layer
        if current is None:
            raise ValueError(f"layer {layer} comes before every kept layer: nothing to reuse")
        out.append(current)
    return out


class ReusePlan(BaseModel):
    """One retention's plan: which indexer layers keep their indexer and where every layer's top-k comes from.

    retention : ``"1/N"``; kept : ascending layer ids that keep their indexer (the first indexer layer always,
    ``ceil(L / N)`` in all); sources : per layer of :attr:`ReuseParams.layers`, the kept layer whose
    selection it uses; method : ``optimal`` (the dynamic program) or ``even`` (every N-th layer); recall :
    mean retained recall over layers on the training queries (``overlap[source, layer]`` averaged)
    """

    model_config = ConfigDict(extra="forbid")
    retention: str
    method: str
    kept: list[int]
    sources: list[int]
    recall: float = Field(ge=0.0, le=1.0)


def lagged_sources(layers: list[int], kept: list[int]) -> list[int]:
    """The Multi-layer Indexer's lag: per layer of ``layers`` (ascending), the kept layer whose selection it
    attends when every kept indexer runs one layer early, on a side stream under its own layer's attention
    and feed-forward: the nearest kept layer strictly before it; the first kept layer (and any layer
    before it) attends its own. With every layer kept (MLI alone) layer ``l`` attends layer ``l - 1``'s
    selection; with an IndexCache plan the kept layer's selection serves the layers after it up to and
    including the next kept layer."""
    order = sorted(kept)
    out = []
    for layer in layers:
        earlier = [k for k in order if k < layer]
        out.append(earlier[-1] if earlier else layer)
    return out


class ReuseParams(BaseModel):
    """Parameters of a ``reuse`` layer.

    Cross-layer reuse is one decision over the whole model, but a bundle lists one artifact per indexer
    layer (the loader insists it covers exactly the model's indexer layers). So every indexer layer holds a
    ``reuse`` artifact, and all of them name the layer that holds the plans (``plans_in_layer``, the first
    indexer layer). That layer's artifact carries the plans here (``layers``, ``topk``, ``plans``) and the
    array ``overlap`` [L, L] float32 (``overlap[i, j]``: mean share of layer ``j``'s exact top-k that
    layer ``i``'s top-k holds, rows and columns in ``layers`` order); the others carry nothing else.

    Validation refuses a plan that the engines could not run or that contradicts itself: kept layers
    outside ``layers``, not ascending, not starting at the first layer, a count other than the retention's,
    or sources other than the nearest kept layer at or before each layer.
    """

    model_config = ConfigDict(extra="allow")
    plans_in_layer: int
    layers: list[int] = []
    topk: int | None = None
    plans: list[ReusePlan] = []

    @property
    def holds_plans(self) -> bool:
        return bool(self.layers)

    @model_validator(mode="after")
    def _consistent(self) -> ReuseParams:
        fix = "train the plans again (`dsaindex train reuse STORE`)."
        if not self.layers:
            if self.plans:
                raise DsaIndexError(f"A reuse artifact lists {len(self.plans)} plan(s) but no layers.", fix)
            return self
        layers = self.layers
        if layers != sorted(set(layers)):
            raise DsaIndexError(f"The reuse plans' layers {layers} are not ascending and distinct.", fix)
        if self.plans_in_layer != layers[0]:
            raise DsaIndexError(f"The reuse plans sit in layer {self.plans_in_layer}, not in the first indexer "
                                f"layer {layers[0]}.", fix)
        if self.topk is None or self.topk < 1:
            raise DsaIndexError(f"The reuse plans have top-k {self.topk}; it must be 1 or more.", fix)
        seen = set()
        for plan in self.plans:
            where = f"Reuse plan {plan.retention} ({plan.method})"
            try:
                stride = retention_stride(plan.retention)
            except ValueError as err:
                raise DsaIndexError(f"{where}: {err}.", fix) from None
            if (plan.retention, plan.method) in seen:
                raise DsaIndexError(f"{where} appears twice.", fix)
            seen.add((plan.retention, plan.method))
            if plan.method not in ("optimal", "even"):
                raise DsaIndexError(f"{where}: method {plan.method!r} is neither 'optimal' nor 'even'.", fix)
            stray = sorted(set(plan.kept) - set(layers))
            if stray:
                raise DsaIndexError(f"{where} keeps layers {stray}, which are not indexer layers {layers}.", fix)
            if plan.kept != sorted(set(plan.kept)) or not plan.kept or plan.kept[0] != layers[0]:
                raise DsaIndexError(f"{where} keeps {plan.kept}: kept layers must be ascending, distinct and start "
                                    f"with the first indexer layer {layers[0]} (it has nothing to reuse).", fix)
            want = kept_count(len(layers), stride)
            if len(plan.kept) != want:
                raise DsaIndexError(f"{where} keeps {len(plan.kept)} layers; a retention of {plan.retention} of "
                                    f"{len(layers)} layers keeps {want}.", fix)
            if plan.method == "even" and plan.kept != layers[::stride]:
                raise DsaIndexError(f"{where} keeps {plan.kept}, not every {stride}th layer {layers[::stride]}.", fix)
            expected = reuse_sources(layers, plan.kept)
            if plan.sources != expected:
                bad = next(i for i in range(len(layers))
                           if i >= len(plan.sources) or plan.sources[i] != expected[i])
                got = plan.sources[bad] if bad < len(plan.sources) else "nothing"
                raise DsaIndexError(f"{where}: layer {layers[bad]} reuses {got}, but the nearest kept layer at or "
                                    f"before it is {expected[bad]} (sources must list one kept layer per "
                                    f"indexer layer, {len(layers)} in all).", fix)
        return self


@dataclass
class ReusePlans:
    """The served form of the layer holding the plans: ``layers`` (ascending ids), ``topk``, ``plans``
    (:class:`ReusePlan`) and ``overlap`` [L, L] float32 on the device."""

    layers: list[int]
    topk: int
    plans: list[ReusePlan]
    overlap: Any

    @property
    def nbytes(self) -> int:
        return int(self.overlap.numel()) * 4

    def plan(self, retention: str, method: str = "optimal") -> ReusePlan:
        for p in self.plans:
            if p.retention == retention and p.method == method:
                return p
        raise DsaIndexError(f"The reuse plans hold no {method} plan for retention {retention} "
                            f"(they hold {', '.join(sorted({p.retention for p in self.plans})) or 'none'}).",
                            "pick one of those retentions.")


@dataclass
class ReuseRef:
    """The served form of every other layer of a ``reuse`` bundle: where the plans are."""

    plans_in_layer: int
    nbytes: int = 0


def _place_reuse(params: ReuseParams, tensors: dict[str, Any]) -> ReusePlans | ReuseRef:
    from dsaindex.errors import CorruptBundleError

    fix = "train the plans again (`dsaindex train reuse STORE`)."
    if not params.holds_plans:
        if tensors:
            raise CorruptBundleError(f"A reuse layer that refers to layer {params.plans_in_layer} stores arrays "
                                     f"({', '.join(sorted(tensors))}).", fix)
        return ReuseRef(params.plans_in_layer)
    overlap = tensors.get("overlap")
    n = len(params.layers)
    if overlap is None or tuple(overlap.shape) != (n, n):
        found = "no overlap array" if overlap is None else f"overlap {list(overlap.shape)}"
        raise CorruptBundleError(f"The reuse plans cover {n} layers but the bundle stores {found}; "
                                 f"it must be [{n}, {n}].", fix)
    return ReusePlans(list(params.layers), int(params.topk), list(params.plans), overlap)


def _summarize_reuse(served: ReusePlans | ReuseRef) -> dict[str, Any]:
    if isinstance(served, ReuseRef):
        return {"kind": "reuse", "plans_in_layer": served.plans_in_layer}
    plans: dict[str, Any] = {}
    for p in served.plans:
        entry = plans.setdefault(p.retention, {})
        prefix = "" if p.method == "optimal" else "even_"
        entry[f"{prefix}kept"] = p.kept
        entry[f"{prefix}recall"] = p.recall
    return {"kind": "reuse", "layers": served.layers, "topk": served.topk, "plans": plans}


def _describe_reuse(served: ReusePlans | ReuseRef) -> str:
    if isinstance(served, ReuseRef):
        return f"reuse (plans in layer {served.plans_in_layer})"
    retentions = sorted({p.retention for p in served.plans}, key=retention_stride)
    return f"reuse plans for {len(served.layers)} layers, top-{served.topk}, retentions {', '.join(retentions)}"


register_kind(ArtifactKind("reuse", ReuseParams, (), _place_reuse, _summarize_reuse, _describe_reuse,
                           optional_arrays=("overlap",), role="model"))
