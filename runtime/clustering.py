"""Size-capped k-means for the causal IVF index: bound-accelerated Lloyd iterations, warm-startable
across refits, and a vectorized capacity step. Torch only; the same code runs on CPU and GPU.

Bounds in the style of Hamerly and Yinyang k-means: one upper bound on the distance to the assigned
center, and one lower bound per group of ``GROUP`` consecutive centers on the distance to every
other center of the group. An iteration skips every point whose bounds prove its nearest center
unchanged; a group's bounds loosen only by the largest move within that group, so the newest centers
(which move most) do not unsettle every point. The bounds survive between refits of the causal index
(:class:`Bounds`): a refit computes distances for keys added since the last one, for old keys against
the centers added since, and for the points the bounds no longer certify.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsaindex.errors import DsaIndexError

_CHUNK_ELEMENTS = 1 << 26  # points x centers per distance block (256 MiB of float32)
GROUP = 256  # centers per lower-bound group


@dataclass
class Bounds:
    """Bound state of points against a set of centers: nearest center, an upper bound on the distance
    to it, and per group of ``GROUP`` centers a lower bound on the distance to the group's other
    centers (Euclidean, not squared)."""

    nearest: torch.Tensor  # [N] int64
    upper: torch.Tensor  # [N]
    lower: torch.Tensor  # [N, groups]


@dataclass
class KMeansStats:
    """How much assignment work the bounds saved: point-center distances computed vs a plain Lloyd's."""

    computed: int = 0
    plain: int = 0

    @property
    def saved(self) -> float:
        return 1.0 - self.computed / self.plain if self.plain else 0.0



def counts_of(index: torch.Tensor, size: int) -> torch.Tensor:
    """How many times each of ``0 .. size - 1`` occurs in ``index`` (int64 [size]). ``torch.bincount`` on
    CUDA reads the largest value back to the host first (a synchronization per call); this does not."""
    return torch.zeros(size, dtype=torch.long, device=index.device).index_add_(0, index, torch.ones_like(index))


def _groups(k: int) -> int:
    return -(-k // GROUP)


def _group_min(values: torch.Tensor, first: int, groups: int) -> torch.Tensor:
    """Per-group minimum of ``values`` [b, n] whose columns are centers ``first .. first + n - 1``."""
    b, n = values.shape
    lo = first // GROUP
    padded = torch.full((b, (groups - lo) * GROUP), float("inf"), dtype=values.dtype, device=values.device)
    padded[:, first - lo * GROUP : first - lo * GROUP + n] = values
    out = torch.full((b, groups), float("inf"), dtype=values.dtype, device=values.device)
    out[:, lo:] = padded.view(b, groups - lo, GROUP).amin(2)
    return out


def _sq_distances(xb: torch.Tensor, centers: torch.Tensor, c2: torch.Tensor) -> torch.Tensor:
    """Squared distances [b, k] of points ``xb`` to ``centers`` (``c2``: the centers' squared norms)."""
    return torch.addmm(c2.unsqueeze(0), xb, centers.t(), alpha=-2.0) + (xb * xb).sum(1, keepdim=True)


def nearest_bounds(x: torch.Tensor, centers: torch.Tensor, exclude: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(nearest index [P], its distance [P], per-group distance to the other centers [P, groups]) of
    each point, in blocks of points. ``exclude`` [k] bool marks centers no point may take."""
    k = centers.shape[0]
    c2 = (centers * centers).sum(1)
    if exclude is not None:
        c2 = c2.masked_fill(exclude, float("inf"))
    near = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    d1 = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
    lower = torch.empty(x.shape[0], _groups(k), dtype=x.dtype, device=x.device)
    step = max(1, _CHUNK_ELEMENTS // max(1, k))
    for lo in range(0, x.shape[0], step):
        xb = x[lo : lo + step]
        sq = _sq_distances(xb, centers, c2)
        best, idx = sq.min(1)
        near[lo : lo + step] = idx
        d1[lo : lo + step] = best
        lower[lo : lo + step] = _group_min(sq.scatter_(1, idx[:, None], float("inf")), 0, lower.shape[1])
    return near, d1.clamp_min(0).sqrt(), lower.clamp_min(0).sqrt()


def _exact_distance(x: torch.Tensor, centers: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
    return (x - centers[which]).norm(dim=1)


def _means(x: torch.Tensor, assign: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
    """Member means; an empty cluster keeps its center."""
    sums = torch.zeros_like(centers).index_add_(0, assign, x)
    counts = counts_of(assign, centers.shape[0]).unsqueeze(1)
    return torch.where(counts > 0, sums / counts.clamp_min(1), centers)


def _shift(bounds: Bounds, drift: torch.Tensor) -> None:
    """Loosen bounds after centers moved by ``drift`` [k]: the upper bound by its center's move, each
    group's lower bound by the largest move in that group."""
    bounds.upper += drift[bounds.nearest]
    if drift.numel():
        bounds.lower -= _group_min(-drift[None, :], 0, bounds.lower.shape[1]).neg()


def warm_bounds(x_old: torch.Tensor, old: Bounds, centers: torch.Tensor, m: int, stats: KMeansStats) -> Bounds:
    """Bounds of points that had ``old`` bounds against ``centers[:m]`` (unchanged since) after
    ``centers[m:]`` were added: only distances to the new centers are computed. A point a new center
    takes gets that center, its distance, and lower bounds of 0 (valid, certifying nothing)."""
    k = centers.shape[0]
    if k == m or x_old.shape[0] == 0:
        return old
    groups = _groups(k)
    new = centers[m:]
    lower = torch.cat([old.lower, old.lower.new_full((old.lower.shape[0], groups - old.lower.shape[1]),
                                                     float("inf"))], dim=1)
    n_d1 = torch.empty(x_old.shape[0], dtype=x_old.dtype, device=x_old.device)
    n_near = torch.empty(x_old.shape[0], dtype=torch.long, device=x_old.device)
    c2 = (new * new).sum(1)
    step = max(1, _CHUNK_ELEMENTS // new.shape[0])
    for lo in range(0, x_old.shape[0], step):
        xb = x_old[lo : lo + step]
        d = _sq_distances(xb, new, c2).clamp_min(0).sqrt()
        n_d1[lo : lo + step], n_near[lo : lo + step] = d.min(1)
        lower[lo : lo + step] = torch.minimum(lower[lo : lo + step], _group_min(d, m, groups))
    stats.computed += x_old.shape[0] * new.shape[0]
    upper = old.upper.clone()
    closer = n_d1 < upper  # a new center may win: tighten the upper bound, then compare exactly
    upper[closer] = _exact_distance(x_old[closer], centers, old.nearest[closer])
    stats.computed += int(closer.sum())
    wins = n_d1 < upper
    return Bounds(torch.where(wins, n_near + m, old.nearest), torch.where(wins, n_d1, upper),
                  lower.masked_fill(wins[:, None], 0.0))


def hamerly_lloyd(x: torch.Tensor, centers: torch.Tensor, iterations: int, bounds: Bounds | None = None,
                  stats: KMeansStats | None = None, trust_warm: bool = False) -> tuple[torch.Tensor, Bounds]:
    """Lloyd iterations from ``centers`` whose assignment step skips points the bounds settle.

    ``bounds`` (valid against ``centers``) replace the first full assignment: only the points they do
    not certify search all centers. Returns the centers after ``iterations`` mean updates and the
    bounds valid against them; the result equals plain Lloyd's (up to ties) because a point is
    skipped only when its nearest center provably stayed. ``trust_warm`` takes the warm bounds'
    assignment as it is for the first update (the incremental refit: cheaper, no longer plain Lloyd's).
    """
    stats = stats if stats is not None else KMeansStats()
    k = centers.shape[0]
    warm = bounds is not None
    if not warm:
        bounds = Bounds(*nearest_bounds(x, centers))
        stats.computed += x.shape[0] * k
    for it in range(iterations):
        if it or (warm and not trust_warm):  # re-assign the points the bounds do not settle
            cc = torch.cdist(centers, centers).fill_diagonal_(float("inf"))
            half = 0.5 * cc.min(1).values if k > 1 else torch.full((k,), float("inf"), device=x.device)
            gate = torch.maximum(bounds.lower.min(1).values, half[bounds.nearest])
            loose = (bounds.upper > gate).nonzero().squeeze(1)
            if loose.numel():
                bounds.upper[loose] = _exact_distance(x[loose], centers, bounds.nearest[loose])
                stats.computed += loose.numel()
                loose = loose[bounds.upper[loose] > gate[loose]]
            if loose.numel():
                bounds.nearest[loose], bounds.upper[loose], bounds.lower[loose] = nearest_bounds(x[loose], centers)
                stats.computed += loose.numel() * k
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
    counts = counts_of(target, room.numel())
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
    proposal = nearest if nearest is not None else nearest_bounds(x, centers)[0]
    for _ in range(max_rounds):
        if not pending.numel():
            return assign
        accept = _accept(_exact_distance(x[pending], centers, proposal), proposal, room)
        assign[pending[accept]] = proposal[accept]
        room -= counts_of(proposal[accept], k)
        pending = pending[~accept]
        if pending.numel():
            proposal = nearest_bounds(x[pending], centers, exclude=room == 0)[0]
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
    windows are sealed together. Returns (assignment [W, n], centers [W, k, D] = member means).

    On a CUDA device the whole computation (a few hundred small launches, none reading back to the
    host) is captured once per shape in a CUDA graph and replayed: a seal costs its kernels' time,
    not their launches' (:class:`_SealGraphs`)."""
    w, n, d = x.shape
    if k * (n // k) != n:
        raise DsaIndexError(f"a window of {n} keys does not split into {k} equal clusters.",
                            "pick a window that is a whole number of clusters.")
    picks = torch.stack([torch.randperm(n, generator=torch.Generator().manual_seed(s))[:k] for s in seeds])
    if x.device.type == "cuda" and torch.cuda.is_available():
        return _SEAL_GRAPHS.run(x, k, iterations, picks)
    return _seal_from(x, k, iterations, picks.to(x.device))


class _SealGraphs:
    """:func:`_seal_from` captured in a CUDA graph per (shape, k, iterations, device), replayed with the
    windows and seeds copied into the graph's inputs. A few shapes occur (windows per append), so the
    cache stays small; the oldest graph goes past ``limit``."""

    def __init__(self, limit: int = 8):
        self.limit = limit
        self.graphs: dict[tuple, tuple] = {}

    def run(self, x: torch.Tensor, k: int, iterations: int, picks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (tuple(x.shape), x.dtype, k, iterations, str(x.device))
        entry = self.graphs.get(key)
        if entry is None:
            static_x, static_picks = x.clone(), picks.to(x.device)
            side = torch.cuda.Stream(x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(side):  # warm-up outside the capture (allocations, library handles)
                _seal_from(static_x, k, iterations, static_picks)
            torch.cuda.current_stream(x.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = _seal_from(static_x, k, iterations, static_picks)
            if len(self.graphs) >= self.limit:
                del self.graphs[next(iter(self.graphs))]
            entry = self.graphs[key] = (graph, static_x, static_picks, out)
        graph, static_x, static_picks, out = entry
        static_x.copy_(x)
        static_picks.copy_(picks)
        graph.replay()
        return out[0].clone(), out[1].clone()


_SEAL_GRAPHS = _SealGraphs()


def _seal_from(x: torch.Tensor, k: int, iterations: int, picks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`seal_kmeans` from the initial centers' indices ``picks`` [W, k] (on ``x``'s device)."""
    w, n, d = x.shape
    cap = n // k
    centers = x.gather(1, picks[:, :, None].expand(w, k, d)).clone()
    offset = (torch.arange(w, device=x.device) * k)[:, None]

    def means(assign):
        flat = (assign + offset).reshape(-1)
        sums = torch.zeros(w * k, d, device=x.device, dtype=x.dtype).index_add_(0, flat, x.reshape(-1, d))
        counts = counts_of(flat, w * k).unsqueeze(1)
        return torch.where(counts > 0, sums / counts.clamp_min(1), centers.reshape(-1, d)).view(w, k, d)

    for _ in range(iterations):
        centers = means(torch.cdist(x, centers).argmin(2))
    dist = torch.cdist(x, centers)  # [W, n, k]
    assign = torch.full((w * n,), -1, dtype=torch.long, device=x.device)
    # the last entry: the sink placed points propose to; its room starts at 0 and only falls
    room = torch.cat([torch.full((w * k,), cap, dtype=torch.long, device=x.device),
                      torch.zeros(1, dtype=torch.long, device=x.device)])
    first = (torch.arange(w * n, device=x.device) // n) * k  # each point's window's first cluster
    # k + 1 rounds (every round closes a cluster or places every pending point), over every point: the
    # placed ones propose to a sink that takes nobody, so no round reads a count back to the host
    for _ in range(k + 1):
        pending = assign < 0
        closed = (room[:-1] == 0).view(w, k)
        local = dist.masked_fill(closed[:, None, :], float("inf")).reshape(w * n, k)
        best = local.argmin(1)
        proposal = torch.where(pending, best + first, w * k)
        accept = _accept(local.gather(1, best[:, None]).squeeze(1), proposal, room) & pending
        assign = torch.where(accept, best, assign)
        room -= counts_of(torch.where(accept, proposal, w * k), w * k + 1)
    assign = assign.view(w, n)
    return assign, means(assign)


def capped_kmeans(x: torch.Tensor, k: int, cap: int, iterations: int = 8, init: torch.Tensor | None = None,
                  seed: int = 0, bounds: Bounds | None = None, stats: KMeansStats | None = None,
                  trust_warm: bool = False) -> tuple[torch.Tensor, torch.Tensor, Bounds]:
    """k-means whose clusters hold at most ``cap`` points each.

    Bounded Lloyd iterations from ``init`` (or ``k`` points drawn with a fixed seed; ``bounds``
    optionally warm-start the first assignment; ``trust_warm`` as in :func:`hamerly_lloyd`), then
    :func:`capacity_assign`. Returns (assignment [N], member means [k, D], bounds valid against
    those means).
    """
    n = x.shape[0]
    if k * cap < n:
        raise DsaIndexError(f"{k} clusters of at most {cap} keys cannot hold {n} keys.", "raise k or the cap.")
    if init is None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        init = x[torch.randperm(n, generator=g)[:k].to(x.device)]
    stats = stats if stats is not None else KMeansStats()
    centers, bounds = hamerly_lloyd(x, init.clone(), iterations, bounds, stats, trust_warm)
    assign = capacity_assign(x, centers, cap, bounds.nearest, stats=stats)
    final = _means(x, assign, centers)
    _shift(bounds, (final - centers).norm(dim=1))
    return assign, final, bounds
