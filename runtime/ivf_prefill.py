"""Prefill-time key selection for a chunk of queries: causal IVF routing + exact refine, or exhaustive.

:func:`select_chunk` is the batched form of :meth:`CausalIVF.select` for the queries of one prefill
chunk (their keys already appended): queries are grouped by the index version their position may
use; each group scores the version's representatives, ranks clusters, and fills a ``[Q, budget]``
candidate table (sinks, the open window, then the ranked clusters' members, as ``CausalIVF`` does);
the candidates are scored exactly and the top-k kept. On the GPU (``use_triton``) the candidate table
is one kernel (:func:`dsaindex.kernels.ivf_select.ivf_candidates`), the candidates' keys are read in
the engines' FP8 format (half the bytes of bf16) and scored with bf16 queries, and each row's top-k is
one program. :func:`exhaustive_chunk` scores every key of
each query's prefix: the baseline. Both score through :mod:`dsaindex.kernels.chunk_score`, the Triton
kernel on the GPU (``use_triton``) or its torch reference.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from dsaindex.kernels.chunk_score import chunk_scores, chunk_scores_reference
from dsaindex.kernels.fp8_score import fp8_gather_scores_shared
from dsaindex.kernels.ivf_select import ivf_candidates, ivf_candidates_reference
from dsaindex.kernels.topk import SMALL_TOPK_MAX, small_topk
from dsaindex.runtime.causal_ivf import CausalIVF, LearnedRepresentatives, Version


def _scores(use_triton: bool, keys, queries, weights, **kw) -> torch.Tensor:
    return (chunk_scores if use_triton else chunk_scores_reference)(keys, queries, weights, **kw)


def _top_rows(scores: torch.Tensor, rows: torch.Tensor | None, topk: int) -> torch.Tensor:
    """Top-k of each row of ``scores`` as key positions (``rows`` maps columns to positions); -1 where
    fewer than k keys were scorable."""
    k = min(topk, scores.shape[1])
    vals, idx = scores.topk(k, dim=1)
    pos = idx if rows is None else rows.gather(1, idx)
    pos = pos.masked_fill(torch.isinf(vals), -1).long()
    if k < topk:
        pos = torch.cat([pos, pos.new_full((pos.shape[0], topk - k), -1)], dim=1)
    return pos


def candidate_table(index: CausalIVF, version: Version | None, cluster_scores: torch.Tensor | None,
                    positions: torch.Tensor, budget: int) -> torch.Tensor:
    """[Q, budget] candidate positions (-1 = unused) of queries at ``positions`` that use ``version``:
    sinks and the open window first (the newest ``budget`` of them if they alone overflow), then the
    members of clusters in order of ``cluster_scores`` [Q, C], the last one cut at the budget
    (:func:`dsaindex.kernels.ivf_select.ivf_candidates_reference`)."""
    if version is None or version.clusters == 0:
        return ivf_candidates_reference(None, positions, None, None, version.upto if version else 0, index.sinks,
                                        budget)
    return ivf_candidates_reference(cluster_scores, positions, version.starts, version.order, version.upto,
                                    index.sinks, budget)


def select_chunk(index: CausalIVF, queries: torch.Tensor, head_weights: torch.Tensor, positions: torch.Tensor,
                 budget: int, topk: int, representatives: Callable[[Version], torch.Tensor] | None = None,
                 use_triton: bool = False, query_block: int = 1024) -> torch.Tensor:
    """Top-k key positions [Q, topk] (-1 padded) of prefill queries [Q, H, D] at ``positions`` (their
    keys already in ``index``), routed by the causal IVF within ``budget`` candidates and refined
    exactly. ``representatives(version)`` replaces the cluster means (learned routing)."""
    out = torch.full((queries.shape[0], topk), -1, dtype=torch.long, device=queries.device)
    uptos = [v.upto for v in index.versions]
    pos_list = positions.tolist()
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(pos_list):
        groups.setdefault(bisect.bisect_right(uptos, p + 1), []).append(i)
    keys = None  # the torch path's float keys, dequantized once (the Triton path reads the FP8 keys)
    for at, members in groups.items():
        version = index.versions[at - 1] if at else None
        reps = None
        if version is not None:
            reps = version.centers if representatives is None else representatives(version)
            reps = reps.to(torch.bfloat16) if use_triton else reps
        first, count = members[0], len(members)
        # a chunk's positions ascend, so a version's queries are a run of rows: slices (views, no index
        # tensor copied to the device, which waited for the device each time); any order still works
        run = members[-1] - first + 1 == count
        sel = None if run else torch.tensor(members, device=queries.device)
        for lo in range(0, count, query_block):
            rows = slice(first + lo, first + min(count, lo + query_block)) if run else sel[lo : lo + query_block]
            q, w, p = queries[rows], head_weights[rows], positions[rows]
            route = None
            if reps is not None:
                route = _scores(use_triton, reps, q, w,
                                lengths=torch.full_like(p, reps.shape[0], dtype=torch.int32))
            if use_triton:
                out[rows] = _select_triton(index, version, route, q, w, p, budget, topk)
                continue
            cand = candidate_table(index, version, route, p, budget)
            keys = index.keys if keys is None else keys
            exact = _scores(use_triton, keys, q, w, rows=cand)
            out[rows] = _top_rows(exact, cand, topk)
    return out


def _select_triton(index: CausalIVF, version: Version | None, route: torch.Tensor | None, q: torch.Tensor,
                   w: torch.Tensor, p: torch.Tensor, budget: int, topk: int) -> torch.Tensor:
    """The GPU path of one query group: candidate lists in one launch, their FP8 keys (the engines' index-K
    format: 132 bytes a key, half of bf16) scored with bf16 queries, the top-k of each row in one launch."""
    clustered = version is not None and version.clusters > 0
    if clustered and version.max_size is None:
        version.max_size = int(version.starts.diff().max())  # once per version (a host synchronization)
    cand = ivf_candidates(route if clustered else None, p, version.starts if clustered else None,
                          version.order if clustered else None, version.upto if version else 0, index.sinks,
                          budget, max_size=version.max_size if clustered else 1)
    keys8, scales8 = index.keys_fp8
    exact = fp8_gather_scores_shared(keys8, scales8, cand, q, w, query_fp8=False)
    if budget <= SMALL_TOPK_MAX:
        return small_topk(exact, topk, cand)[1]
    return _top_rows(exact, cand.long(), topk)


def exhaustive_chunk(keys: torch.Tensor, queries: torch.Tensor, head_weights: torch.Tensor, positions: torch.Tensor,
                     topk: int, use_triton: bool = False, query_block: int = 1024) -> torch.Tensor:
    """Top-k key positions [Q, topk] (-1 padded) over each query's whole causal prefix of ``keys``."""
    out = torch.full((queries.shape[0], topk), -1, dtype=torch.long, device=queries.device)
    keys = keys.to(torch.bfloat16) if use_triton else keys
    for lo in range(0, queries.shape[0], query_block):
        p = positions[lo : lo + query_block]
        n_out = int(p.max()) + 1
        scores = _scores(use_triton, keys, queries[lo : lo + query_block], head_weights[lo : lo + query_block],
                         lengths=(p + 1).to(torch.int32), n_out=n_out)
        out[lo : lo + query_block] = _top_rows(scores, None, topk)
    return out


class IVFPrefillIndexer:
    """Prefill-time selection of one request at one layer: a :class:`CausalIVF` fed chunk by chunk,
    routed with the layer's learned representatives when an ``ivf`` artifact is loaded.

    Parameters
    ----------
    dim : key dim; topk : keys selected per query; budget : candidates per query
    layer : an :class:`dsaindex.artifacts.kinds.IVFLayer` (encoder and the index settings it was
        trained with), or None for plain means
    settings : fields of :class:`dsaindex.artifacts.kinds.IVFIndexSettings` (window, cluster_size,
        refit_every, sinks) that override the layer's (or the defaults, without a layer)
    use_triton : score with the Triton kernels (default: on a CUDA device)
    key_storage : ``fp8`` (default: the keys in the engines' 132-byte format alone, float views
        dequantized while a chunk is processed and released after it) or ``float32`` (also a float32
        copy); see :class:`CausalIVF`
    """

    def __init__(self, dim: int, topk: int, budget: int, layer=None, device: str | torch.device = "cpu",
                 use_triton: bool | None = None, key_storage: str = "fp8", **settings):
        from pydantic import ValidationError

        from dsaindex.artifacts.kinds import IVFIndexSettings
        from dsaindex.errors import DsaIndexError

        base = layer.settings.model_dump() if layer is not None else {}
        try:
            chosen = IVFIndexSettings(**(base | settings))
        except ValidationError as err:
            raise DsaIndexError(f"Invalid IVF index settings {settings} ({err.errors()[0]['msg']}).",
                                "pass window, cluster_size, refit_every and sinks with window a multiple of "
                                "cluster_size.") from None
        if budget < topk:
            raise DsaIndexError(f"a candidate budget of {budget} cannot hold the top-{topk}.",
                                "pass a budget of at least top-k keys (4-32x top-k is usual).")
        self.index = CausalIVF(dim, device=device, key_storage=key_storage, **chosen.model_dump())
        self.topk, self.budget = topk, budget
        self.use_triton = torch.device(device).type == "cuda" if use_triton is None else use_triton
        self.representatives = LearnedRepresentatives(layer.params, self.index) if layer is not None else None

    def append(self, keys: torch.Tensor) -> None:
        """The chunk's keys [n, D] (before its queries select)."""
        self.index.append(keys)

    def select(self, queries: torch.Tensor, head_weights: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Top-k positions [Q, topk] (-1 padded) of the chunk's queries; versions no later query can
        use are dropped, with their cached representatives."""
        self.index.forget_before(int(positions.min()))
        if self.representatives is not None:
            self.representatives.keep(self.index.versions)
        picked = select_chunk(self.index, queries, head_weights, positions, self.budget, self.topk,
                              self.representatives, self.use_triton)
        self.index.release_float()  # between chunks the index holds its FP8 keys and versions only
        return picked

    def device_bytes(self) -> dict[str, int]:
        """What the index holds on its device now (:meth:`CausalIVF.device_bytes`)."""
        return self.index.device_bytes()
