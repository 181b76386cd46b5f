"""Causal IVF over one request's indexer keys (AttentionIndex), torch reference on CPU or GPU.

Keys enter an **open window** and are candidates of every later query at once. Every ``window``
keys the window is **sealed**: clustered by size-capped k-means into clusters of about
``cluster_size`` keys. Every ``refit_every`` keys the whole sealed prefix is **refit**: regrouped
with a warm start from the current centers (plus new centers drawn from the newest keys, so the
cluster count grows with the prefix). Each seal or refit creates a **version**; a query at position
``p`` uses the newest version built only from keys ``<= p``, so it never routes with information
from its future.

Selection for a query: the first ``sinks`` keys and the open window (keys after the version) take
reserved slots; clusters are ranked by the exact indexer score of their representative
(``sum_h w_h relu(q_h . r_c)``; the cluster mean, or a learned one); their members fill the rest of
the candidate budget in rank order; the candidates are scored exactly and the top-k returned.

Keys are kept in one of three forms (``key_storage``): ``float32`` (a float32 copy and an FP8 copy; what
training and evaluation use), ``fp8`` only, the engines' index-K format of 132 bytes a key (the
runtime's prefill index: a fifth of the device bytes), or ``streamed``: the FP8 bytes live in a buffer
the caller lends for the time of a chunk (:meth:`CausalIVF.attach`, a layer's device buffer of a
:class:`dsaindex.runtime.streaming.PrefixStreamer`, whose host copy holds them between chunks) and only
the scales stay with the index. In the ``fp8`` and ``streamed`` forms, clustering and learned
representatives read keys dequantized on demand: a seal the window it groups, a refit the sealed prefix,
:attr:`CausalIVF.keys` the whole prefix, kept until the next :meth:`CausalIVF.append` or
:meth:`CausalIVF.release_float`.

:class:`BlockIndex` is the contiguous-block baseline (HiSA): fixed blocks of ``cluster_size`` keys
in position order, represented by their mean, routed the same way.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsaindex.errors import DsaIndexError
from dsaindex.quant import fp8_dequantize, fp8_quantize
from dsaindex.runtime.clustering import (
    Bounds,
    KMeansStats,
    capped_kmeans,
    counts_of,
    nearest_bounds,
    seal_kmeans,
    warm_bounds,
)
from dsaindex.score import indexer_scores


@dataclass(eq=False)  # versions are compared by identity
class Version:
    """One immutable view of the index: keys ``[0, upto)`` grouped; ``members`` of cluster ``c`` are
    ``order[starts[c]:starts[c + 1]]``; ``centers`` [C, D] their means."""

    upto: int
    centers: torch.Tensor
    order: torch.Tensor
    starts: torch.Tensor
    max_size: int | None = None  # the largest cluster, once a reader needed it (a host synchronization)

    @property
    def clusters(self) -> int:
        return int(self.centers.shape[0])

    def members(self, c: int) -> torch.Tensor:
        return self.order[int(self.starts[c]) : int(self.starts[c + 1])]

    def member_clusters(self) -> torch.Tensor:
        """The cluster of each entry of ``order`` [M]."""
        return torch.repeat_interleave(torch.arange(self.clusters, device=self.order.device), self.starts.diff())

    def cluster_of(self, length: int) -> torch.Tensor:
        """The cluster of each key position ``< length`` [length], -1 for keys outside every cluster."""
        out = torch.full((length,), -1, dtype=torch.long, device=self.order.device)
        out[self.order] = self.member_clusters()
        return out


def _room(buf: torch.Tensor, used: int, need: int) -> torch.Tensor:
    """``buf`` if it holds ``need`` rows, else a new buffer of at least twice its rows with its first
    ``used`` rows copied (appends stay O(n))."""
    if need <= buf.shape[0]:
        return buf
    grown = buf.new_empty((max(need, 2 * buf.shape[0]), *buf.shape[1:]))
    grown[:used] = buf[:used]
    return grown


class _Growing:
    """Append-only rows that successive seal versions share: each version views a prefix of one buffer
    (grown by doubling; a version made before a growth keeps the old buffer), instead of a copy of all
    earlier clusters per seal."""

    def __init__(self, first: torch.Tensor):
        self.buf, self.n = first, first.shape[0]

    def extend(self, rows: torch.Tensor) -> torch.Tensor:
        need = self.n + rows.shape[0]
        self.buf = _room(self.buf, self.n, need)  # never writes into ``first`` or a buffer an older version outgrew
        self.buf[self.n : need] = rows
        self.n = need
        return self.buf[:need]


def _grouped(assign: torch.Tensor, positions: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Members of each cluster in one array: (order [N] positions sorted by cluster, starts [k + 1])."""
    by_cluster = assign.argsort(stable=True)
    counts = counts_of(assign, k)
    starts = torch.zeros(k + 1, dtype=torch.long, device=assign.device)
    starts[1:] = counts.cumsum(0)
    return positions[by_cluster], starts


KEY_STORAGE = ("float32", "fp8", "streamed")


# past 16 x refit_every keys (256K at the defaults), a refit waits for 1/16 of the sealed prefix: at 1M keys one
# every 64K instead of every 16K (H200: a refit of 1M keys took 56-78 ms, 14 of the 16.7 ms of maintenance a
# 4,096-key chunk paid at a fixed 16K). The schedule up to 256K is the fixed one, so the recall measured on
# 128K captures holds as it was; past it, at most 1/16 of the keys wait for a regrouping, as at 256K
REFIT_FRACTION = 0.0625


class CausalIVF:
    """The causal IVF index of one request and layer.

    Parameters
    ----------
    dim : key dim; window : keys per seal; cluster_size : target keys per cluster (the cap of a seal;
    refits allow a quarter more); refit_every : keys between refits (0 = never); refit_fraction : past
    ``refit_every / refit_fraction`` sealed keys, a refit waits for that share of the sealed prefix instead
    (:meth:`refit_interval`; 0: every ``refit_every`` keys at any length); sinks : first keys always kept;
    iterations : Lloyd iterations of a seal; refit_iterations : of a refit
    refit_search : how a refit's first assignment treats keys the previous refit grouped:
        ``incremental`` keeps each one's center unless a new center is closer (distance work for new
        keys x all centers + old keys x new centers; not plain Lloyd's), ``exact`` also re-searches
        every key the bounds do not certify (plain Lloyd's result)
    key_storage : ``float32`` (float32 and FP8 copies), ``fp8`` (FP8 alone, 132 bytes a key; float
        views dequantized when clustering needs them) or ``streamed`` (FP8 bytes in a buffer lent per chunk
        by :meth:`attach`); module docstring
    """

    def __init__(self, dim: int, window: int = 1024, cluster_size: int = 128, refit_every: int = 16384,
                 sinks: int = 4, iterations: int = 8, refit_iterations: int = 1, refit_search: str = "incremental",
                 device: str | torch.device = "cpu", key_storage: str = "float32",
                 refit_fraction: float = REFIT_FRACTION):
        if window % cluster_size:
            raise DsaIndexError(f"window {window} is not a multiple of cluster_size {cluster_size}.",
                                "pick a window that is a whole number of clusters (1024 and 128, say).")
        self.dim, self.window, self.cluster_size = dim, window, cluster_size
        self.refit_every, self.sinks, self.iterations = refit_every, sinks, iterations
        if not 0 <= refit_fraction < 1:
            raise DsaIndexError(f"refit_fraction {refit_fraction} is not a share of the prefix.",
                                "pass a fraction in [0, 1) (0: a refit every refit_every keys).")
        self.refit_fraction = float(refit_fraction)
        if refit_search not in ("incremental", "exact"):
            raise DsaIndexError(f"unknown refit search {refit_search!r}.", "pass 'incremental' or 'exact'.")
        self.refit_iterations, self.refit_search = refit_iterations, refit_search
        if key_storage not in KEY_STORAGE:
            raise DsaIndexError(f"unknown key storage {key_storage!r}.", f"pass one of {', '.join(KEY_STORAGE)}.")
        self.key_storage = key_storage
        self.device = torch.device(device)
        # grows by doubling: appends stay O(n); none in the fp8 form
        self._keys = torch.empty(window if key_storage == "float32" else 0, dim, device=self.device)
        self._float: torch.Tensor | None = None  # the fp8 form's dequantized prefix, while a reader needs it
        # the same keys in the engines' FP8 format (e4m3 bits + one power-of-two scale each): what the
        # Triton prefill path scores, as DeepGEMM scores the engines' index-K cache
        self._fp8: torch.Tensor | None = None
        if key_storage != "streamed":
            self._fp8 = torch.empty(window, dim, dtype=torch.uint8, device=self.device)
        self._scales = torch.empty(window, device=self.device)
        self._length = 0
        self.versions: list[Version] = []
        self.sealed = sinks  # keys [sinks, sealed) are clustered
        self.last_refit = 0
        self.refits = 0
        self._bounds: Bounds | None = None  # Hamerly bounds of keys [sinks, last_refit) against the refit's centers
        self._refit_k = 0
        self.refit_stats: list[KMeansStats] = []
        self._copy_stream = None  # (streamed, CUDA) parks the refit bounds on the host
        self._shared: tuple[_Growing, _Growing, _Growing] | None = None  # the seal versions' buffers
        self._shared_by: Version | None = None  # the version that last extended them

    @property
    def length(self) -> int:
        return self._length

    @property
    def keys(self) -> torch.Tensor:
        """Every key appended so far, [length, D] float32: a view, or in the ``fp8`` form the keys
        dequantized (kept until the next append or :meth:`release_float`)."""
        if self.key_storage == "float32":
            return self._keys[: self._length]
        if self._float is None or self._float.shape[0] != self._length:
            self._float = self._rows(0, self._length)
        return self._float

    def _rows(self, lo: int, hi: int) -> torch.Tensor:
        """Keys ``[lo, hi)`` as float32 [hi - lo, D] (dequantized from FP8 in the ``fp8`` and ``streamed`` forms)."""
        if self.key_storage == "float32":
            return self._keys[lo:hi]
        if self._float is not None and self._float.shape[0] >= hi:
            return self._float[lo:hi]
        return fp8_dequantize(self._fp8_rows()[lo:hi].view(torch.float8_e4m3fn), self._scales[lo:hi, None])

    def _fp8_rows(self) -> torch.Tensor:
        if self._fp8 is None:
            raise DsaIndexError("This streamed index has no key buffer attached: its keys are on the host now.",
                                "attach() the layer's streamed buffer (holding the index's keys) before "
                                "appending or selecting, and detach() it after.")
        return self._fp8

    def attach(self, buffer: torch.Tensor) -> None:
        """Lend a ``streamed`` index its FP8 bytes for one chunk: ``buffer`` [capacity, D] uint8 on the index's
        device, whose first :attr:`length` rows are the index's keys (a streamed layer buffer). Appends write
        the new keys' bytes into it behind them; the caller writes them back to the host."""
        if self.key_storage != "streamed":
            raise DsaIndexError(f"attach() lends key bytes to a streamed index; this one keeps its own "
                                f"({self.key_storage}).", "create the index with key_storage='streamed'.")
        if buffer.dtype != torch.uint8 or buffer.dim() != 2 or buffer.shape[1] != self.dim \
                or buffer.shape[0] < self._length or buffer.device.type != self.device.type \
                or None not in (buffer.device.index, self.device.index) and buffer.device.index != self.device.index:
            raise DsaIndexError(f"A streamed key buffer must be uint8 [>= {self._length}, {self.dim}] on "
                                f"{self.device}; got {tuple(buffer.shape)} {buffer.dtype} on {buffer.device}.",
                                "pass the layer's streamer buffer, sized for the longest request.")
        self._fp8 = buffer

    def detach(self) -> None:
        """Take the lent buffer back (a ``streamed`` index between chunks keeps no key bytes on the device)."""
        if self.key_storage == "streamed":
            self._fp8 = None
            self._float = None

    def release_float(self) -> None:
        """Drop the ``fp8`` form's dequantized prefix (the index keeps 132 bytes a key again)."""
        self._float = None

    def device_bytes(self) -> dict[str, int]:
        """Bytes the index holds now: ``keys`` (its key storage, allocated capacity included),
        ``float_view`` (the ``fp8`` form's dequantized prefix, while kept), ``versions`` (their centers,
        member lists and offsets) and ``bounds`` (the refit's per-key bounds)."""
        def size(*tensors: torch.Tensor | None) -> int:
            return sum(t.numel() * t.element_size() for t in tensors if t is not None)

        storages: dict[int, int] = {}  # versions share buffers: each counted once, at its allocated size
        for v in self.versions:
            for t in (v.centers, v.order, v.starts):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        bounds = self._bounds if self._bounds is not None and not self._parked() else None
        owned = None if self.key_storage == "streamed" else self._fp8  # a lent buffer is its lender's
        return {"keys": size(self._keys, owned, self._scales), "float_view": size(self._float),
                "versions": sum(storages.values()),
                "bounds": size(bounds.nearest, bounds.upper, bounds.lower) if bounds is not None else 0}

    @property
    def keys_fp8(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every key as FP8 e4m3 bits [length, D] uint8 and its scale [length] float32 (views)."""
        return self._fp8_rows()[: self._length], self._scales[: self._length]

    def append(self, keys: torch.Tensor) -> None:
        """Add keys [n, D]; seals (and refits) happen as whole windows complete. A ``streamed`` index
        writes the new keys' FP8 bytes into its attached buffer (rows ``[length, length + n)``)."""
        end = self._length + keys.shape[0]
        self._float = None
        fp8 = self._fp8_rows()
        if self.key_storage == "streamed" and end > fp8.shape[0]:
            raise DsaIndexError(f"The streamed key buffer holds {fp8.shape[0]} keys; appending makes {end}.",
                                "size the streamer for the longest request (prefix + chunk).")
        if self.key_storage == "float32":
            self._keys = _room(self._keys, self._length, end)
        if self.key_storage != "streamed":
            self._fp8 = _room(self._fp8, self._length, end)
        self._scales = _room(self._scales, self._length, end)
        new = keys.to(self.device, torch.float32)
        if self.key_storage == "float32":
            self._keys[self._length : end] = new
        codes, scales = fp8_quantize(new)
        self._fp8[self._length : end] = codes.view(torch.uint8)
        self._scales[self._length : end] = scales.reshape(-1)
        self._length = end
        windows = (self.length - self.sealed) // self.window
        if not windows:
            return
        starts = [self.sealed + i * self.window for i in range(windows)]
        x = self._rows(self.sealed, self.sealed + windows * self.window).view(windows, self.window, self.dim)
        assign, centers = self._group_windows(x, starts)  # every completed window at once
        first = 0
        for i in range(windows):  # the windows up to each refit sealed together, then the refit
            sealed = self.sealed + (i + 1 - first) * self.window
            due = self.refit_every and sealed - self.last_refit >= self.refit_interval(sealed)
            if due or i + 1 == windows:
                self._seal(assign[first : i + 1], centers[first : i + 1])
                first = i + 1
                if due:
                    self._refit()

    def refit_interval(self, sealed: int) -> int:
        """Keys a refit waits for once ``sealed`` keys are sealed: ``refit_every``, or past ``refit_every /
        refit_fraction`` keys that share of them. A refit regroups the whole prefix, so its cost grows with
        the prefix; with the interval growing alike, its cost per key stays flat, and the share of keys
        not yet regrouped stays at most what it is where the growth starts (1/16 by default, from 256K keys:
        the schedule is the fixed one up to there, :data:`REFIT_FRACTION`)."""
        return max(self.refit_every, int(self.refit_fraction * sealed))

    def _group_windows(self, x: torch.Tensor, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Clusters of sealed windows ``x`` [W, window, D]: (assignment [W, window], centers [W, k, D])."""
        return seal_kmeans(x, self.window // self.cluster_size, self.iterations, seeds=starts)

    def _seal(self, assign: torch.Tensor, centers: torch.Tensor) -> None:
        """One version per window of ``assign`` [R, window] / ``centers`` [R, k, D] (consecutive windows), each
        adding its window's clusters to the version before it: on buffers shared with the seals since the
        last refit (each version views a prefix of them), grouped in one pass for all R windows (their
        cluster ids offset by window: one sort, not one per window, as the versions' contents are the same)."""
        r, k = centers.shape[0], centers.shape[1]
        lo, hi = self.sealed, self.sealed + r * self.window
        ids = assign + (torch.arange(r, device=assign.device) * k)[:, None]
        order, starts = _grouped(ids.reshape(-1), torch.arange(lo, hi, device=self.device), r * k)
        prev = self.versions[-1] if self.versions else None
        if self._shared is None or self._shared_by is not prev:  # after a refit, or the first seal
            base = ((prev.centers, prev.order, prev.starts) if prev is not None else
                    (centers[0, :0], order[:0], torch.zeros(1, dtype=starts.dtype, device=self.device)))
            self._shared = tuple(_Growing(t) for t in base)
        shared_centers, shared_order, shared_starts = self._shared
        n_centers, n_order, n_starts = shared_centers.n, shared_order.n, shared_starts.n
        offset = shared_starts.buf[n_starts - 1]
        shared_centers.extend(centers.reshape(r * k, -1))
        shared_order.extend(order)
        shared_starts.extend(starts[1:] + offset)
        for i in range(r):
            version = Version(lo + (i + 1) * self.window, shared_centers.buf[: n_centers + (i + 1) * k],
                              shared_order.buf[: n_order + (i + 1) * self.window],
                              shared_starts.buf[: n_starts + (i + 1) * k])
            self.versions.append(version)
        self._shared_by = self.versions[-1]
        self.sealed = hi

    def _refit(self) -> None:
        """Regroup every sealed key: warm start from the current means, one new center per
        ``cluster_size`` keys added since the last refit drawn from those keys. Keys grouped by the
        previous refit keep their bounds: new keys search every center, old keys only the new
        centers, and (``exact``) the keys the bounds no longer certify search again."""
        prev = self.versions[-1]
        x = self._rows(self.sinks, self.sealed)
        k = -(-x.shape[0] // self.cluster_size)
        init = prev.centers[:k]  # the last refit's means (its bounds hold against them), then the seals' means
        if init.shape[0] < k:
            g = torch.Generator(device="cpu").manual_seed(self.sealed)
            recent = x[(self.last_refit or self.sinks) - self.sinks :]
            pick = torch.randperm(recent.shape[0], generator=g)[: k - init.shape[0]].to(self.device)
            init = torch.cat([init, recent[pick]])
        stats = KMeansStats()
        bounds = None
        if self._bounds is not None:
            old = self._bounds.nearest.shape[0]
            kept = warm_bounds(x[:old], self._bounds_here(), init, self._refit_k, stats)
            near, d1, lower = nearest_bounds(x[old:], init)
            stats.computed += (x.shape[0] - old) * k
            bounds = Bounds(torch.cat([kept.nearest, near]), torch.cat([kept.upper, d1]), torch.cat([kept.lower, lower]))
        assign, centers, bounds = capped_kmeans(
            x, k, self.cluster_size + self.cluster_size // 4, self.refit_iterations, init=init, seed=self.sealed,
            bounds=bounds, stats=stats, trust_warm=self.refit_search == "incremental")
        self._bounds = self._park(bounds)
        self._refit_k = k
        self.refit_stats.append(stats)
        order, starts = _grouped(assign, torch.arange(self.sinks, self.sealed, device=self.device), k)
        self.versions.append(Version(self.sealed, centers, order, starts))
        self.last_refit = self.sealed
        self.refits += 1

    def _park(self, bounds: Bounds) -> Bounds:
        """Where the refit bounds wait for the next refit, the only reader: on the device, or for a
        ``streamed`` index on CUDA in pinned host memory. They grow with the cluster
        count (a lower bound per key and group of 256 centers: 140 B a key at 1M keys), so a streamed
        index would otherwise hold more per key than its lent keys."""
        if self.key_storage != "streamed" or self.device.type != "cuda":
            return bounds
        # on a copy stream of its own (147 MB a layer at 1M keys: the compute stream does not wait for it)
        main = torch.cuda.current_stream(self.device)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=self.device)
        self._copy_stream.wait_stream(main)  # the bounds are computed
        parked = []
        with torch.cuda.stream(self._copy_stream):
            for t in (bounds.nearest, bounds.upper, bounds.lower):
                parked.append(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True))
                t.record_stream(self._copy_stream)  # the device copy lives until the copy is done
        return Bounds(*parked)

    def _parked(self) -> bool:
        return self._bounds is not None and self._bounds.nearest.device.type != self.device.type

    def _bounds_here(self) -> Bounds:
        """The refit bounds on the index's device (copied in for a refit if parked on the host)."""
        b = self._bounds
        if not self._parked():
            return b
        torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)  # parked in full
        return Bounds(*(t.to(self.device, non_blocking=True) for t in (b.nearest, b.upper, b.lower)))

    def version_for(self, position: int) -> Version | None:
        """The newest version built only from keys ``<= position`` (None before the first seal)."""
        at = bisect.bisect_right([v.upto for v in self.versions], position + 1)  # upto never decreases
        return self.versions[at - 1] if at else None

    def forget_before(self, position: int) -> None:
        """Drop the versions no query at ``position`` or later can use (prefill moves forward): the
        newest one such a query may use and every later one stay."""
        at = bisect.bisect_right([v.upto for v in self.versions], position + 1)
        if at > 1:
            del self.versions[: at - 1]

    def candidates(self, query: torch.Tensor, head_weights: torch.Tensor, position: int, budget: int,
                   representatives: Callable[[Version], torch.Tensor] | None = None) -> torch.Tensor:
        """Candidate positions (<= ``budget``) for a query at ``position``: sinks, open window, then the
        members of the best-ranked clusters. ``representatives(version) -> [C, D]`` replaces the means."""
        visible = position + 1
        version = self.version_for(position)
        upto = version.upto if version is not None else min(visible, self.sinks)
        open_lo = max(upto, self.sinks)
        reserved = torch.cat([torch.arange(min(self.sinks, visible), device=self.device),
                              torch.arange(open_lo, max(open_lo, visible), device=self.device)])
        if version is None or reserved.numel() >= budget:
            return reserved[-budget:] if reserved.numel() > budget else reserved
        reps = version.centers if representatives is None else representatives(version)
        scores = indexer_scores(query.unsqueeze(0).float(), reps, head_weights.unsqueeze(0).float())[0]
        ranked = scores.argsort(descending=True)
        sizes = (version.starts[1:] - version.starts[:-1])[ranked]
        room = budget - reserved.numel()
        take = int((sizes.cumsum(0) <= room).sum())
        chosen = [version.members(int(c)) for c in ranked[:take].tolist()]
        if take < ranked.numel() and room - int(sizes[:take].sum()) > 0:  # a partial last cluster
            chosen.append(version.members(int(ranked[take]))[: room - int(sizes[:take].sum())])
        return torch.cat([reserved, *chosen])

    def select(self, query: torch.Tensor, head_weights: torch.Tensor, position: int, budget: int, topk: int,
               representatives: Callable[[Version], torch.Tensor] | None = None) -> torch.Tensor:
        """Top-k positions: exact scores of the candidates."""
        cand = self.candidates(query, head_weights, position, budget, representatives)
        exact = indexer_scores(query.unsqueeze(0).float(), self.keys[cand], head_weights.unsqueeze(0).float())[0]
        return cand[exact.topk(min(topk, cand.numel())).indices]


class BlockIndex(CausalIVF):
    """Contiguous-block routing (HiSA): blocks of ``cluster_size`` keys in position order, mean-pooled.
    Sealed as windows complete, like :class:`CausalIVF`, but never regrouped."""

    def __init__(self, dim: int, window: int = 1024, cluster_size: int = 128, sinks: int = 4,
                 device: str | torch.device = "cpu"):
        super().__init__(dim, window, cluster_size, refit_every=0, sinks=sinks, device=device)

    def _group_windows(self, x: torch.Tensor, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        w, k = x.shape[0], self.window // self.cluster_size
        assign = (torch.arange(self.window, device=self.device) // self.cluster_size).expand(w, -1)
        return assign, x.view(w, k, self.cluster_size, self.dim).mean(2)


def representatives(params: dict[str, torch.Tensor], keys: torch.Tensor, version: Version) -> torch.Tensor:
    """Learned routing representatives [C, D] of a version's clusters (the encoder of
    :mod:`dsaindex.train.ivf`, parameters :data:`dsaindex.artifacts.kinds.ENCODER_ARRAYS`); ``keys`` [N, D] hold its members:

        r_c = mean_c + out(gelu(hidden([mean_c, log n_c, meanpool phi(k), maxpool phi(k)]))),
        phi(k) = gelu(W k + b)
    """
    members = keys[version.order]  # [M, D], grouped by cluster
    sizes = (version.starts[1:] - version.starts[:-1]).clamp_min(1)
    cluster = version.member_clusters()
    c = version.clusters
    mean = torch.zeros(c, keys.shape[1], device=keys.device).index_add_(0, cluster, members) / sizes[:, None]
    feats = torch.nn.functional.gelu(members @ params["phi_weight"].t() + params["phi_bias"])
    f_mean = torch.zeros(c, feats.shape[1], device=keys.device).index_add_(0, cluster, feats) / sizes[:, None]
    f_max = torch.full((c, feats.shape[1]), -1e4, device=keys.device).scatter_reduce(
        0, cluster[:, None].expand_as(feats), feats, "amax")
    summary = torch.cat([mean, sizes.float().log()[:, None], f_mean, f_max], dim=1)
    hidden = torch.nn.functional.gelu(summary @ params["hidden_weight"].t() + params["hidden_bias"])
    return mean + hidden @ params["out_weight"].t() + params["out_bias"]


class LearnedRepresentatives:
    """``representatives(version)`` of one encoder over one index's keys, computed once per version.

    Pass it wherever a ``representatives`` callable is taken; :meth:`keep` drops the cached entries of
    versions the index no longer holds."""

    def __init__(self, params: dict[str, torch.Tensor], index: CausalIVF):
        self.params, self.index = params, index
        self._cache: dict[Version, torch.Tensor] = {}  # versions hash by identity

    def __call__(self, version: Version) -> torch.Tensor:
        if version not in self._cache:
            self._cache[version] = representatives(self.params, self.index.keys, version)
        return self._cache[version]

    def keep(self, versions: list[Version]) -> None:
        live = set(versions)
        self._cache = {v: r for v, r in self._cache.items() if v in live}
