"""Size-capped k-means for the causal IVF index: Hamerly-bounded Lloyd iterations, warm-startable
across refits, and a vectorized capacity step. Torch only; the same code runs on CPU and GPU.

Hamerly's bounds (one upper bound on the distance to the assigned center, one lower bound on the
distance to every other center) let an iteration skip every point whose bounds prove its nearest
center unchanged. The bounds survive between refits of the causal index (:class:`Bounds`): a refit
recomputes distances only for keys added since the last one, for old keys against the centers added
since, and for the points the drift of the centers unsettles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsaindex.errors import DsaIndexError

_CHUNK_ELEMENTS = 1 << 26  # points x centers per distance block (256 MiB of float32)


@dataclass
class Bounds:
    """Hamerly state of points against a set of centers: nearest center, an upper bound on the
    distance to it, a lower bound on the distance to any other center (Euclidean, not squared)."""

    nearest: torch.Tensor  # [N] int64
    upper: torch.Tensor  # [N] float32
    lower: torch.Tensor  # [N] float32


@dataclass
class KMeansStats:
    """How much assignment work the bounds saved: point-center distances computed vs a plain Lloyd's."""

    computed: int = 0
    plain: int = 0

    @property
    def saved(self) -> float:
        return 1.0 - self.computed / self.plain if self.plain else 0.0


def two_nearest(x: torch.Tensor, centers: torch.Tensor, exclude: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(nearest index, its distance, second-nearest distance) of each point, in blocks of points.

    ``exclude`` [k] bool marks centers no point may take (full clusters)."""
    k = centers.shape[0]
    c2 = (centers * centers).sum(1)
    if exclude is not None:
        c2 = c2.masked_fill(exclude, float("inf"))
    near = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    d1 = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
    d2 = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
    step = max(1, _CHUNK_ELEMENTS // max(1, k))
    for lo in range(0, x.shape[0], step):
        xb = x[lo : lo + step]
        sq = torch.addmm(c2.unsqueeze(0), xb, centers.t(), alpha=-2.0) + (xb * xb).sum(1, keepdim=True)
        if k > 1:
            vals, idx = sq.topk(2, dim=1, largest=False)
        else:
            vals, idx = torch.cat([sq, torch.full_like(sq, float("inf"))], 1), torch.zeros_like(sq, dtype=torch.long)
        near[lo : lo + step] = idx[:, 0]
        d1[lo : lo + step] = vals[:, 0]
        d2[lo : lo + step] = vals[:, 1]
    return near, d1.clamp_min(0).sqrt(), d2.clamp_min(0).sqrt()


def _exact_distance(x: torch.Tensor, centers: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
    return (x - centers[which]).norm(dim=1)


def _means(x: torch.Tensor, assign: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
    """Member means; an empty cluster keeps its center."""
    sums = torch.zeros_like(centers).index_add_(0, assign, x)
    counts = torch.bincount(assign, minlength=centers.shape[0]).unsqueeze(1)
    return torch.where(counts > 0, sums / counts.clamp_min(1), centers)


def _shift(bounds: Bounds, drift: torch.Tensor) -> None:
    """Loosen bounds after centers moved by ``drift`` [k] (Hamerly: the largest move for the lower)."""
    bounds.upper += drift[bounds.nearest]
    bounds.lower -= drift.max() if drift.numel() else 0.0


def warm_bounds(x_old: torch.Tensor, old: Bounds, centers: torch.Tensor, m: int, stats: KMeansStats) -> Bounds:
    """Bounds of points that had ``old`` bounds against ``centers[:m]`` (unchanged since) after
    ``centers[m:]`` were added: only distances to the new centers are computed."""
    new = centers[m:]
    if new.shape[0] == 0 or x_old.shape[0] == 0:
        return old
    n_near, n_d1, n_d2 = two_nearest(x_old, new)
    stats.computed += x_old.shape[0] * new.shape[0]
    closer = n_d1 < old.upper
    upper = old.upper.clone()
    # tighten the upper bound where a new center might win, then compare exactly
    upper[closer] = _exact_distance(x_old[closer], centers, old.nearest[closer])
    stats.computed += int(closer.sum())
    wins = n_d1 < upper
    nearest = torch.where(wins, n_near + m, old.nearest)
    lower = torch.where(wins, torch.minimum(torch.minimum(old.lower, upper), n_d2), torch.minimum(old.lower, n_d1))
    return Bounds(nearest, torch.where(wins, n_d1, upper), lower)


def hamerly_lloyd(x: torch.Tensor, centers: torch.Tensor, iterations: int, bounds: Bounds | None = None,
                  stats: KMeansStats | None = None) -> tuple[torch.Tensor, Bounds]:
    """Lloyd iterations from ``centers`` whose assignment step skips points the bounds settle.

    ``bounds`` (valid against ``centers``) replaces the first full assignment. Returns the centers
    after ``iterations`` mean updates and the bounds valid against them; the result equals plain
    Lloyd's (up to ties) because a point is skipped only when its nearest center provably stayed.
    """
    stats = stats if stats is not None else KMeansStats()
    k = centers.shape[0]
    if bounds is None:
        near, d1, d2 = two_nearest(x, centers)
        stats.computed += x.shape[0] * k
        bounds = Bounds(near, d1, d2)
    for it in range(iterations):
        if it:  # re-assign the points the bounds do not settle
            cc = torch.cdist(centers, centers).fill_diagonal_(float("inf"))
            half = 0.5 * cc.min(1).values if k > 1 else torch.full((k,), float("inf"), device=x.device)
            gate = torch.maximum(bounds.lower, half[bounds.nearest])
            loose = (bounds.upper > gate).nonzero().squeeze(1)
            if loose.numel():
                bounds.upper[loose] = _exact_distance(x[loose], centers, bounds.nearest[loose])
                stats.computed += loose.numel()
                loose = loose[bounds.upper[loose] > gate[loose]]
            if loose.numel():
                near, d1, d2 = two_nearest(x[loose], centers)
                stats.computed += loose.numel() * k
                bounds.nearest[loose], bounds.upper[loose], bounds.lower[loose] = near, d1, d2
        stats.plain += x.shape[0] * k
        moved = _means(x, bounds.nearest, centers)
        _shift(bounds, (moved - centers).norm(dim=1))
        centers = moved
    return centers, bounds


def _accept(dist: torch.Tensor, proposal: torch.Tensor, room: torch.Tensor) -> torch.Tensor:
    """One round of proposals: each cluster accepts its closest proposers (``dist`` to the proposed
    cluster ``proposal``) up to its ``room``. Returns the accepted mask (in the proposers' order)."""
    by = torch.argsort(dist)  # closest first, then stably by cluster
    by = by[torch.argsort(proposal[by], stable=True)]
    target = proposal[by]
    counts = torch.bincount(target, minlength=room.numel())
    first = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(by)
    rank[by] = torch.arange(by.numel(), device=by.device) - first[target]
    return rank < room[proposal]


def capacity_assign(x: torch.Tensor, centers: torch.Tensor, cap: int, nearest: torch.Tensor | None = None,
                    max_rounds: int = 64, stats: KMeansStats | None = None) -> torch.Tensor:
    """Assignment in which no cluster takes more than ``cap`` points (``k * cap >= N``).

    Rounds: every unplaced point proposes to its nearest cluster that still has room; each cluster
    accepts its closest proposers up to its room and closes when full; the rest propose again. Each
    round places every proposer or closes a cluster. ``nearest`` seeds the first proposals. After
    ``max_rounds`` the few points left take the open clusters' free slots in order.
    """
    n, k = x.shape[0], centers.shape[0]
    if k * cap < n:
        raise DsaIndexError(f"{k} clusters of at most {cap} keys cannot hold {n} keys.", "raise k or the cap.")
    assign = torch.full((n,), -1, dtype=torch.long, device=x.device)
    room = torch.full((k,), cap, dtype=torch.long, device=x.device)
    pending = torch.arange(n, device=x.device)
    proposal = nearest if nearest is not None else two_nearest(x, centers)[0]
    for _ in range(max_rounds):
        if not pending.numel():
            return assign
        accept = _accept(_exact_distance(x[pending], centers, proposal), proposal, room)
        assign[pending[accept]] = proposal[accept]
        room -= torch.bincount(proposal[accept], minlength=k)
        pending = pending[~accept]
        if pending.numel():
            proposal = two_nearest(x[pending], centers, exclude=room == 0)[0]
            if stats is not None:
                stats.computed += pending.numel() * k
    if pending.numel():  # the rest fill free slots in cluster order
        slots = torch.repeat_interleave(torch.arange(k, device=x.device), room)
        assign[pending] = slots[: pending.numel()]
    return assign


def seal_kmeans(x: torch.Tensor, k: int, iterations: int, seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Equal-size k-means of several windows at once: ``x`` [W, n, D] into ``k`` clusters of exactly
    ``n / k`` keys per window (Lloyd, then capacity rounds, all windows batched). Window ``w`` starts
    from ``k`` of its points drawn with ``seeds[w]``, so a window's clusters do not depend on which
    windows are sealed together. Returns (assignment [W, n], centers [W, k, D] = member means)."""
    w, n, d = x.shape
    cap = n // k
    if k * cap != n:
        raise DsaIndexError(f"a window of {n} keys does not split into {k} equal clusters.",
                            "pick a window that is a whole number of clusters.")
    picks = torch.stack([torch.randperm(n, generator=torch.Generator().manual_seed(s))[:k] for s in seeds])
    centers = x.gather(1, picks.to(x.device)[:, :, None].expand(w, k, d)).clone()
    offset = (torch.arange(w, device=x.device) * k)[:, None]

    def means(assign):
        flat = (assign + offset).reshape(-1)
        sums = torch.zeros(w * k, d, device=x.device, dtype=x.dtype).index_add_(0, flat, x.reshape(-1, d))
        counts = torch.bincount(flat, minlength=w * k).unsqueeze(1)
        return torch.where(counts > 0, sums / counts.clamp_min(1), centers.reshape(-1, d)).view(w, k, d)

    for _ in range(iterations):
        centers = means(torch.cdist(x, centers).argmin(2))
    dist = torch.cdist(x, centers)  # [W, n, k]
    assign = torch.full((w, n), -1, dtype=torch.long, device=x.device)
    room = torch.full((w * k,), cap, dtype=torch.long, device=x.device)
    for _ in range(k + 1):  # every round closes a cluster or places every pending point
        pending = (assign < 0).reshape(-1).nonzero().squeeze(1)
        if not pending.numel():
            break
        closed = (room == 0).view(w, k)
        local = dist.masked_fill(closed[:, None, :], float("inf")).reshape(w * n, k)[pending]
        best = local.argmin(1)
        proposal = best + (pending // n) * k
        accept = _accept(local.gather(1, best[:, None]).squeeze(1), proposal, room)
        assign.view(-1)[pending[accept]] = best[accept]
        room -= torch.bincount(proposal[accept], minlength=w * k)
    return assign, means(assign)


def capped_kmeans(x: torch.Tensor, k: int, cap: int, iterations: int = 8, init: torch.Tensor | None = None,
                  seed: int = 0, bounds: Bounds | None = None, stats: KMeansStats | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, Bounds]:
    """k-means whose clusters hold at most ``cap`` points each.

    Bounded Lloyd iterations from ``init`` (or ``k`` points drawn with a fixed seed; ``bounds``
    optionally warm-start the first assignment), then :func:`capacity_assign`; the centers returned
    are the member means. Returns (assignment [N], centers [k, D], bounds against those centers).
    """
    n = x.shape[0]
    if k * cap < n:
        raise DsaIndexError(f"{k} clusters of at most {cap} keys cannot hold {n} keys.", "raise k or the cap.")
    if init is None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        init = x[torch.randperm(n, generator=g)[:k].to(x.device)]
    stats = stats if stats is not None else KMeansStats()
    centers, bounds = hamerly_lloyd(x, init.clone(), iterations, bounds, stats)
    # exact nearest distances for the capacity ranking come from the bounds' assignment
    assign = capacity_assign(x, centers, cap, bounds.nearest, stats=stats)
    final = _means(x, assign, centers)
    _shift(bounds, (final - centers).norm(dim=1))
    return assign, final, bounds
