"""A ``pq`` bundle's measured operating points as a typed table, read once from its recorded metrics.

``dsaindex train pq`` records, per layer and top-k, the held-out recall of the exact top-k at each
candidate count C: of the served step whose stage 1 keeps P x C keys (``layer{L}/k{topk}/prefilter{P}@{C}``)
and of the top-C by coarse score after exact rerank (``.../rerank@{C}``, an upper bound of the served
one, for bundles trained before the served recall was recorded), over every held-out query and per
prefix band (``layer{L}/k{topk}@{band}/...``, with the band's query count in ``.../queries``), and of the served
step whose stage 1 is the fold scan (``.../folds{P}@{C}``: the heads grouped by sign and direction, a ReLU per
group). Points of the two stage 1s are ranked against each other by their expected cost
(:func:`expected_step_us`). A stage 1 aiming at P x C keeps 1.5 P x C on average
(:func:`dsaindex.coarse.stage1_kept`); bundles trained since 2026-12-07 record the recall at that width, the
kernels' own, and older ones at exactly P x C, a lower bound of what the kernels serve.
:meth:`OperatingPoints.from_metrics` is the one reader of those names; the choosers in
:mod:`dsaindex.runtime.loader` pick from the typed table (the pattern of faiss contrib's
``OperatingPoints``: parameters -> measured recall, the cheapest point above a target).

A point's recall is the lower of its mean over every held-out query and its mean in the longest prefix
band with at least :data:`MIN_BAND_QUERIES` queries, so long requests, the ones C matters for, decide.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from dsaindex.coarse import COST_BAND, step_cost_us

MIN_BAND_QUERIES = 8  # a prefix band's recall counts with at least this many queries

_POINT = re.compile(r"^layer(\d+)/k(\d+)(?:@([^/]+))?/(rerank|prefilter(\d+)|folds(\d+))@(\d+)$")
_QUERIES = re.compile(r"^layer(\d+)/k(\d+)@([^/]+)/queries$")


@dataclass(frozen=True)
class OperatingPoint:
    """One measured decode setting of one layer: ``prefilter`` P (None: rerank of every key's coarse
    score), ``candidates`` C, what ``stage1`` scores (``codes``: the keys' codes by the head-weighted folded
    query; ``folds``: by the fold scan's grouped folds), and the held-out recall of the exact top-``topk`` it
    served: ``overall`` (every query), ``band_recall`` in the longest well-populated prefix ``band`` (None
    without one)."""

    layer: int
    topk: int
    prefilter: int | None
    candidates: int
    overall: float
    band: str | None = None
    band_recall: float | None = None
    stage1: str = "codes"

    @property
    def recall(self) -> float:
        """What a chooser compares with its target: the lower of the overall and the longest band's."""
        return self.overall if self.band_recall is None else min(self.overall, self.band_recall)

    @property
    def stage2_keys(self) -> int:
        """Keys the full coarse score reads per query (P x C): the step's cost, for ranking points."""
        return (self.prefilter or 0) * self.candidates

    @property
    def cost_us(self) -> float:
        """The served step's expected device time a query at 1M keys (:func:`expected_step_us`): what choosers
        rank points of different stage 1s by."""
        return expected_step_us(self.stage1, self.prefilter or 0, self.candidates)


def expected_step_us(stage1: str, prefilter: int, candidates: int, grow: tuple[int, int] | None = None) -> float:
    """The served step's expected device time a query at 1M keys (H100, :func:`dsaindex.coarse.step_cost_us`)
    at stage 1 ``stage1`` and ``prefilter`` x ``candidates``, C (and stage 1's target) grown at 1M as the step
    grows it past ``grow`` = (band, most) (band 0: C stays fixed). None: the band the cost was measured at,
    :data:`dsaindex.coarse.COST_BAND`, up to what the final top-k holds, which is how choosers rank points: so
    C = 2,048 and 4,096 at one P cost alike, both grown to 16,384 at 1M."""
    from dsaindex.kernels.pq_select import growth_of
    from dsaindex.runtime.paged_select import growth_limit

    band, most = (COST_BAND, growth_limit(candidates)) if grow is None else grow
    return step_cost_us(stage1, prefilter * candidates * growth_of(1 << 20, band, most))


def band_start(band: str) -> int:
    """Keys at the start of a prefix band named like ``64K-128K`` or ``1M-max`` (the names
    :func:`dsaindex.train.recall.prefix_band` gives)."""
    low = band.split("-", 1)[0]
    scale = {"K": 1 << 10, "M": 1 << 20}.get(low[-1:], 1)
    return int(float(low.rstrip("KM") or 0) * scale)


@dataclass(frozen=True)
class OperatingPoints:
    """Every recorded operating point of a bundle (:class:`OperatingPoint`)."""

    points: tuple[OperatingPoint, ...]

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, float]) -> OperatingPoints:
        """The table of a bundle's metrics dictionary (names as ``dsaindex train pq`` records them)."""
        longest: dict[tuple[int, int], str] = {}  # (layer, topk) -> its longest band with enough queries
        for name, count in metrics.items():
            found = _QUERIES.match(name)
            if found and count >= MIN_BAND_QUERIES:
                key, band = (int(found.group(1)), int(found.group(2))), found.group(3)
                if key not in longest or band_start(band) > band_start(longest[key]):
                    longest[key] = band
        overall: dict[tuple[int, int, str, int | None, int], float] = {}
        in_band: dict[tuple[int, int, str, int | None, int], float] = {}
        for name, value in metrics.items():
            found = _POINT.match(name)
            if not found:
                continue
            layer, topk, band = int(found.group(1)), int(found.group(2)), found.group(3)
            factor = found.group(5) or found.group(6)
            key = (layer, topk, "folds" if found.group(6) else "codes", int(factor) if factor else None,
                   int(found.group(7)))
            if band is None:
                overall[key] = float(value)
            elif band == longest.get((layer, topk)):
                in_band[key] = float(value)
        points = []
        for key in sorted(overall, key=lambda k: (k[0], k[1], k[2], k[3] or 0, k[4])):
            layer, topk, stage1, prefilter, candidates = key
            band = longest.get((layer, topk)) if key in in_band else None
            points.append(OperatingPoint(layer, topk, prefilter, candidates, overall[key], band, in_band.get(key),
                                         stage1))
        return cls(tuple(points))

    def of(self, layer: int, topk: int, prefilter: int | None = None, served: bool = True,
           stage1: str | None = "codes") -> list[OperatingPoint]:
        """The layer's points at ``topk``: with ``served`` those of the served step whose stage 1 scores
        ``stage1`` (None: either) at ``prefilter`` P (None: every P), else the rerank points."""
        return [p for p in self.points if p.layer == layer and p.topk == topk
                and ((p.prefilter is not None and (prefilter is None or p.prefilter == prefilter)
                      and (stage1 is None or p.stage1 == stage1)) if served else p.prefilter is None)]

    def prefilters(self, layer: int, topk: int, stage1: str = "codes") -> list[int]:
        """The stage-1 factors the layer's served recall was recorded at with ``stage1``, ascending."""
        return sorted({p.prefilter for p in self.of(layer, topk, stage1=stage1)})

    def recall(self, layer: int, topk: int, prefilter: int | None, stage1: str = "codes") -> dict[int, float]:
        """{C: recall} of the layer's points at ``prefilter`` P with ``stage1`` (P None: the rerank points)."""
        points = (self.of(layer, topk, prefilter, stage1=stage1) if prefilter is not None
                  else self.of(layer, topk, served=False))
        return {p.candidates: p.recall for p in points}
