"""Batched PQ coarse-to-fine decode selection on Triton kernels: the serving path.

One :class:`PQDecodeGroup` holds a fixed set of request slots of one indexer layer, all state as
device tensors so a step is a fixed sequence of kernel launches with no host synchronization:

* ``codes`` [S, max_keys, M] uint8: PQ codes of every completed 64-key page (the history);
* ``pool_fp8`` / ``pool_scales`` [S, R, D] / [S, R]: exact FP8 keys on the device, rows
  ``[0, cache_capacity)`` the cache, one trash row, the tail (the incomplete page), then spill rows;
* ``cache_pos`` / ``cache_stamp`` [S, cache_capacity]: position held by each cache row (-1 empty) and
  the step of its last use. The cache is set-associative (sets of 4 rows; a key at position p only in
  set p % sets), so a lookup reads 4 rows instead of sorting the cache (:mod:`dsaindex.kernels.decode_plan`);
* the host store (:class:`HostKeyStore`, pinned) with every completed page, and a device page table.

A step (LeanSparse §5 with a two-stage coarse score, see :mod:`dsaindex.kernels.pq_select`):
int8 lookup tables (one kernel); stage 1 folded-query scan of all codes, keeping the keys above a
sampled threshold (sample pass, which also reads the threshold off a histogram of its integer scores;
select pass); stage 2 full coarse score of those,
top-C (:func:`dsaindex.kernels.topk.small_topk`, no sort); one plan kernel: miss filter, cache lookup,
rows for the kept misses (least recently used of their set, or a spill row); host rows of the kept
misses copied in by one kernel reading pinned memory; exact FP8 rescoring of the kept candidates and
the tail; top-k (``small_topk``). 9 kernels in all, no host synchronization.

With at most ``direct_upto`` live requests the step is the direct one, 6 kernels: stage 2 also bins its
scores (:func:`dsaindex.kernels.pq_select.pq_candidate_bins`) and its last program per request reads the
top C's boundary bin off the histogram, so no top-C kernel runs; one kernel
(:func:`dsaindex.kernels.fp8_score.fp8_host_select`) reads the candidates above the boundary, and the
boundary bin's up to C + ``direct_slack``, straight from their pinned host pages and rescores them with the
tail; top-k. No cache lookup, miss filter or copy kernel: at one or two requests that bookkeeping costs
more than the host reads it saves.

A residual codec (RQ, :attr:`PQCodec.residual`) is served by the same kernels (see
:mod:`dsaindex.kernels.pq_select`); its completed pages are encoded by beam search
(:func:`~dsaindex.kernels.pq_select.rq_encode`).

An OPQ codec (:attr:`PQCodec.rotation`) codes rotated keys: completed pages are encoded through its
rotation, and each step rotates the queries once (one [S*H, D] x [D, D] product, :func:`dsaindex.pq.rotate`)
before the coarse stages build their tables; the exact rescoring reads the raw queries and exact keys.

:class:`RequestGroups` runs several groups' steps on separate CUDA streams, so one group's host reads
overlap another group's scoring. ``PQDecodeIndexer`` in ``tests/pq_decode_reference.py`` is the
per-request torch reference of the same algorithm (tests only: no server imports it); its cache is a
fully associative LRU, which changes which keys are read from the host, never which are selected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsaindex.coarse import FILTER_WIDTH, PREFILTER, check_filter_width
from dsaindex.errors import DsaIndexError
from dsaindex.kernels import deepgemm, select
from dsaindex.kernels.checks import KernelInputError
from dsaindex.kernels.decode_plan import WAYS, decode_plan, decode_plan_reference
from dsaindex.kernels.fp8_score import (
    fp8_gather_scores,
    fp8_gather_scores_reference,
    fp8_host_select,
    fp8_host_select_reference,
    fp8_logits_paged,
    fp8_topk_reference,
    paged_keys_reference,
)
from dsaindex.kernels.pq_select import (
    BIN_COUNT,
    boundary_of_bins,
    coarse_stages_reference,
    decoded_key_bound,
    grown_counts,
    growth_of,
    keep_binned,
    keep_binned_reference,
    pq_coarse_bins,
    pq_coarse_topc,
    pq_encode,
    rq_encode,
    rq_whitened,
    score_bins,
    score_bound,
    step_growth,
)
from dsaindex.kernels.pq_stage2_cuda import STAGE2S
from dsaindex.kernels.topk import SMALL_TOPK_MAX, rows_topk, small_topk, small_topk_reference
from dsaindex.pq import PQCodec, encode, group_codes, rotate, stage1_groups
from dsaindex.quant import fp8_quantize
from dsaindex.runtime.host_store import HostKeyStore
from dsaindex.runtime.paged_select import STAGE1S, check_folds, growth_setting


@dataclass
class StepStats:
    """Per-request counts of the last step, device tensors as the kernels wrote them (read them only when
    needed: a sync). ``counts`` [S, 4] int32: candidates, hits, fetched, dropped; ``stage1`` [S] int32:
    keys stage 1 kept. The named views are int64 [S]."""

    counts: torch.Tensor
    stage1: torch.Tensor

    @classmethod
    def zeros(cls, slots: int, device: torch.device) -> StepStats:
        return cls(torch.zeros(slots, 4, dtype=torch.int32, device=device),
                   torch.zeros(slots, dtype=torch.int32, device=device))

    candidates = property(lambda self: self.counts[:, 0].long())
    hits = property(lambda self: self.counts[:, 1].long())
    fetched = property(lambda self: self.counts[:, 2].long())
    dropped = property(lambda self: self.counts[:, 3].long())
    stage1_counts = property(lambda self: self.stage1.long())

    def totals(self) -> dict[str, int]:
        return {k: int(getattr(self, k).sum()) for k in ("candidates", "hits", "fetched", "dropped")}


def pq_limit(pq_from: dict[int, int], live: int) -> float:
    """The length policy per batch size: keys from which short requests go through PQ with ``live``
    requests in the batch (the entry of the largest batch size not above ``live``; none: never)."""
    return next((keys for batch, keys in sorted(pq_from.items(), reverse=True) if batch <= live), float("inf"))


class PQDecodeGroup:
    """Decode-time top-k selection for ``slots`` requests of one layer.

    Parameters
    ----------
    layer : the layer's PQ parameters; host : the shared host key store; n_heads : indexer heads
    max_keys : keys per request the group is sized for; topk : keys selected per step
    candidates : C, the keys reranked exactly; prefilter : stage 1 keeps ``prefilter * C``
    cache_capacity : exact keys cached on the device per request (at least C)
    miss_filter : drop weak cache misses before the host reads (LeanSparse's filter); filter_width : its
        margin below the k-th coarse score, in standard deviations (wider: more fetches, less recall lost)
    linear_config : launch shape of the stage-1 kernel (``block_n``, ``iters``, ``num_warps`` of
        :func:`pq_linear_topc`; default :func:`~dsaindex.kernels.pq_select.stage1_launch`, by the step's size)
    stage2 : stage 2's kernel on a GPU (:func:`~dsaindex.kernels.pq_select.pq_candidate_scores`): ``"auto"``
        (the default), ``"cuda"``, ``"int8"`` (8-bit operands; what ``"auto"`` runs for large steps where it
        compiles) or ``"triton"``; without the kernels (``use_triton`` off) ``"int8"`` scores with its arithmetic
        (:func:`~dsaindex.kernels.pq_stage2_cuda.int8_scores_reference`), the others with the bf16 reference
    stage1 : what stage 1 scores: ``"codes"`` (default), ``"groups"`` (the keys' group codes, half the bytes,
        kept beside the codes) or ``"folds"`` (the codes by 16 folded queries):
        :class:`~dsaindex.runtime.paged_select.PagedCacheSelector`'s option
    use_triton : run the Triton kernels (default: on CUDA, or under ``TRITON_INTERPRET=1``); otherwise
        their torch references run the same algorithm (CPU serving of small models, tests)
    exact_below : the length policy. A request of at most this many keys also keeps its exact FP8 keys
        on the device, in the engines' paged layout, and is scored exactly with FP8-rounded queries, as the
        engines' indexer does (DeepGEMM's paged logits where DeepGEMM imports and takes the head count, else
        :func:`~dsaindex.kernels.fp8_score.fp8_logits_paged`; then
        :func:`~dsaindex.kernels.topk.rows_topk`): below the break-even length ``bench decode``
        measures, exact scoring is faster than the PQ step. Past it the request's pages go back to the
        pool and it is served by PQ (its codes and host pages are kept all along). 0 turns the policy off.
    exact_pages : pages of 64 keys in the group's exact pool (default: every slot at ``exact_below``); a
        request that finds the pool empty is served by PQ from then on
    pq_from : the policy per batch size, ``{B: N}``: with at least B live requests, a step whose short
        requests reach N keys runs them through PQ too (their codes are always there). ``bench decode``
        reports this break-even per batch size (``break_even_keys``): at 32 requests and more, PQ
        overtakes exact scoring at shorter lengths than for one request. The largest B not above the
        live count applies; none: ``exact_below`` alone decides.
    """

    def __init__(self, layer: PQCodec, host: HostKeyStore, slots: int, max_keys: int, topk: int,
                 candidates: int = 2048, prefilter: int = PREFILTER, cache_capacity: int = 4096, miss_filter: bool = True,
                 device: str | torch.device = "cuda", use_triton: bool | None = None,
                 linear_config: dict | None = None, exact_below: int = 0, exact_pages: int | None = None,
                 pq_from: dict[int, int] | None = None, filter_width: float = FILTER_WIDTH, direct_upto: int = 0,
                 stage2: str = "auto", stage1: str = "codes"):
        if candidates < topk:
            raise DsaIndexError(f"candidates ({candidates}) must be at least topk ({topk}): the exact rerank "
                                "chooses the top-k among the candidates.", f"pass candidates >= {topk}.")
        if cache_capacity < candidates:
            raise DsaIndexError(f"cache_capacity {cache_capacity} is below the candidate count {candidates}.",
                                "give the cache at least as many rows as candidates.")
        if max_keys >= 2**31:
            raise DsaIndexError(f"max_keys {max_keys:,} is not below 2**31: the decode plan holds key positions as "
                                "int32.", "serve contexts of fewer than 2**31 keys per request and layer.")
        if cache_capacity % WAYS:
            raise DsaIndexError(f"cache_capacity {cache_capacity} is not a multiple of {WAYS}: the cache is "
                                f"{WAYS}-way set-associative.", f"pass a multiple of {WAYS} (4096 is the default).")
        dev = torch.device(device)
        self.use_triton = (dev.type == "cuda" or select.interpreted()) if use_triton is None else use_triton
        self.layer, self.host, self.device = layer, host, dev
        self.topk, self.candidates, self.c1 = topk, candidates, prefilter * candidates
        self.cache_capacity, self.miss_filter = cache_capacity, miss_filter
        self.direct_upto = max(0, direct_upto)
        if stage2 not in STAGE2S:
            raise DsaIndexError(f"stage2 {stage2!r} is not a stage-2 kernel.", f"pass one of {', '.join(STAGE2S)}.")
        self.stage2 = stage2  # stage 2's kernel on the GPU (pq_candidate_scores); the torch reference elsewhere
        self.direct_slack = 256  # a direct step's candidate slots past C: the boundary bin's ties (0.2% wide)
        self.grow_band, self.grow_most = 0, 1  # C grown by the prefix (grow_past)
        try:
            self.filter_width = check_filter_width(filter_width)
        except ValueError as err:
            raise DsaIndexError(f"The miss filter's width is wrong: {err}.",
                                "pass a width of at least 0 standard deviations (1 is the default).") from None
        self.linear_config = None if linear_config is None else dict(linear_config)  # None: by the step's size
        self.page = host.page_size
        m = layer.subspaces
        self.dim = layer.dim
        self.residual = layer.residual  # RQ: codebooks [M, K, D], pages encoded by the codec's beam search
        self.codec = layer.to(dev)
        self.rq_search = rq_whitened(self.codec.codebooks, self.codec.metric) if self.residual else None  # once
        self.codebooks = self.codec.codebooks.float()
        self.codebooks_bf16 = self.codebooks.to(torch.bfloat16)
        self.centroid_norms = self.codebooks.norm(dim=2).amax(dim=1)  # the int8 stage-1 tables' bound
        self.key_bound = decoded_key_bound(self.codebooks, self.residual)  # the direct step's score bins' scale
        self.metric = None if layer.metric is None else layer.metric.to(dev)
        self.rotation = None if layer.rotation is None else layer.rotation.to(dev, torch.float32).contiguous()
        self.rotation_bf16 = None if self.rotation is None else self.rotation.to(torch.bfloat16)
        self.slots, self.max_keys = slots, max_keys
        max_pages = -(-max_keys // self.page)
        self.codes = torch.zeros(slots, max_pages * self.page, m, dtype=torch.uint8, device=dev)
        # stage1="groups": stage 1 scores each key's group codes, kept beside its codes (paged_select's option)
        if stage1 not in STAGE1S:
            raise DsaIndexError(f"stage1 {stage1!r} is not a stage-1 code.", f"pass one of {', '.join(STAGE1S)}.")
        self.stage1 = stage1
        if stage1 == "folds":
            check_folds(self.dim, m, self.codebooks.shape[1], self.residual, dev, self.use_triton)
        self.groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if stage1 == "groups":
            assign, books, norms = stage1_groups(self.codebooks, self.residual)
            self.group_of = assign
            self.groups = (torch.zeros(slots, max_pages * self.page, m // 2, dtype=torch.uint8, device=dev), books,
                           norms)
        self.base_cache = cache_capacity  # the cache of a fixed C; a grown C's scales with its growth (grow_past)
        self._allocate_cache(cache_capacity, max(64, candidates // 8))
        self.page_table = torch.zeros(slots, max_pages, dtype=torch.int32, device=dev)
        self.n_encoded = torch.zeros(slots, dtype=torch.int32, device=dev)
        self.tail_len = torch.zeros(slots, dtype=torch.int32, device=dev)
        # host-side mirrors (known without a sync: appends happen on the host)
        self.pages: list[list[int] | None] = [None] * slots
        self.encoded_host = [0] * slots
        self.tail_host = [0] * slots
        self.step = torch.zeros(slots, dtype=torch.long, device=dev)  # on the device: steps replay in CUDA graphs
        self.bin_scratch = torch.zeros(slots, BIN_COUNT + 4, dtype=torch.int32, device=dev)  # direct steps' histogram
        # the length policy: short requests' exact keys in a shared pool of engine-layout pages
        self.exact_below = max(0, exact_below)
        self.pq_from = dict(sorted((pq_from or {}).items()))
        width = -(-self.exact_below // self.page)
        n_pool = slots * width if exact_pages is None else exact_pages
        self.exact_pool = torch.zeros(n_pool if width else 0, self.page * (self.dim + 4), dtype=torch.uint8, device=dev)
        self.exact_table = torch.zeros(slots, max(1, width), dtype=torch.int32, device=dev)
        self.exact_len = torch.zeros(slots, dtype=torch.int32, device=dev)  # 0 for a request served by PQ
        self.short = torch.zeros(slots, dtype=torch.bool, device=dev)
        self.exact_free = list(range(n_pool if width else 0))
        self.exact_owned: list[list[int]] = [[] for _ in range(slots)]
        self.short_host = [False] * slots
        self._no_stats = StepStats.zeros(slots, dev)  # an exact-only step's stats: no launch per step
        self.host_reads = "unified-addressing kernel"
        self._host_pinned = host.fp8.is_pinned()

    def _allocate_cache(self, capacity: int, spill: int) -> None:
        """The device cache of ``capacity`` rows a request and the pool behind it: the cache rows, a trash row,
        the tail (the open page), then ``spill`` rows for misses whose cache set is full."""
        dev, slots = self.device, self.slots
        self.cache_capacity, self.spill = capacity, spill
        self.pool_rows = capacity + 1 + self.page + spill
        self.pool_fp8 = torch.zeros(slots, self.pool_rows, self.dim, dtype=torch.uint8, device=dev)
        self.pool_scales = torch.zeros(slots, self.pool_rows, dtype=torch.float32, device=dev)
        self.cache_pos = torch.full((slots, capacity), -1, dtype=torch.long, device=dev)
        self.cache_stamp = torch.zeros(slots, capacity, dtype=torch.long, device=dev)
        self.set_count = torch.zeros(slots, capacity // WAYS, dtype=torch.int32, device=dev)

    # ---- request lifecycle ------------------------------------------------------------------------
    def admit(self, slot: int) -> None:
        if self.pages[slot] is not None:
            raise DsaIndexError(f"Slot {slot} already holds a request.", "free it first, or use another slot.")
        self.pages[slot] = []
        self.encoded_host[slot] = self.tail_host[slot] = 0
        self.n_encoded[slot] = 0
        self.tail_len[slot] = 0
        self.cache_pos[slot] = -1
        self.cache_stamp[slot] = 0
        self._set_short(slot, self.exact_below > 0)

    def free(self, slot: int) -> None:
        pages = self._pages(slot)
        self.host.release(pages)
        self.pages[slot] = None
        self.encoded_host[slot] = self.tail_host[slot] = 0
        self.n_encoded[slot] = 0
        self.tail_len[slot] = 0
        self._set_short(slot, False)

    def free_all(self) -> None:
        """Free every slot that holds a request (a server shutting down, a hook set detaching)."""
        for slot, pages in enumerate(self.pages):
            if pages is not None:
                self.free(slot)

    # ---- the length policy ----------------------------------------------------------------------------
    def _set_short(self, slot: int, short: bool) -> None:
        """Serve ``slot`` exactly (``short``) or by PQ; a request leaving the exact path returns its pages."""
        if not short:
            self.exact_free.extend(self.exact_owned[slot])
            self.exact_owned[slot] = []
        self.short_host[slot] = short
        self.short[slot] = short
        self.exact_len[slot] = self.length(slot) if short else 0

    def _write_exact(self, slot: int, start: int, fp8: torch.Tensor, scales: torch.Tensor) -> None:
        """Keep keys ``start ..`` of a short request (FP8 bits [n, D], scales [n]) in its exact pages, or
        move it to PQ when it passes ``exact_below`` or the pool runs dry."""
        if not self.short_host[slot]:
            return
        end = start + fp8.shape[0]
        need = -(-end // self.page) - len(self.exact_owned[slot])
        if end > self.exact_below or need > len(self.exact_free):
            self._set_short(slot, False)
            return
        if need > 0:
            new = [self.exact_free.pop() for _ in range(need)]
            first = len(self.exact_owned[slot])
            self.exact_table[slot, first : first + need] = torch.tensor(new, dtype=torch.int32)
            self.exact_owned[slot] += new
        if end > start:
            pos = torch.arange(start, end)
            pages = torch.tensor(self.exact_owned[slot], dtype=torch.long)[pos // self.page].to(self.device)
            within = (pos % self.page).to(self.device)
            keys = self.exact_pool[:, : self.page * self.dim].view(-1, self.page, self.dim)
            key_scales = self.exact_pool[:, self.page * self.dim :].view(torch.float32)
            keys[pages, within] = fp8.to(self.device)
            key_scales[pages, within] = scales.to(self.device, torch.float32)
        self.exact_len[slot] = end

    def exact_scorer(self, n_heads: int = 64) -> str:
        """What scores the policy's short requests here, for queries of ``n_heads`` heads."""
        if (self.use_triton and self.device.type == "cuda" and deepgemm.unavailable() is None
                and deepgemm.supports_heads(n_heads)):
            return "DeepGEMM fp8_paged_mqa_logits + rows_topk"
        return "Triton fp8_logits_paged + rows_topk" if self.use_triton else "torch reference"

    def exact_schedule(self, n_heads: int = 64) -> torch.Tensor | None:
        """DeepGEMM's scheduling metadata for this step's short requests (None where DeepGEMM does not
        score them). It depends only on the requests' lengths, so a server computes it once per step and
        passes it to every layer's :meth:`select`, as the engines do."""
        if not self.exact_scorer(n_heads).startswith("DeepGEMM"):
            return None
        return deepgemm.paged_schedule(self.exact_len)

    def _select_exact(self, q: torch.Tensor, w: torch.Tensor, schedule: torch.Tensor | None = None) -> torch.Tensor:
        """Top-k positions [S, topk] of the short requests, scored exactly (-1 rows for the others)."""
        longest = max((self.length(s) for s in range(self.slots) if self.short_host[s]), default=1)
        width = -(-longest // self.page)  # pages of the longest short request: the logits' width
        if self.exact_scorer(q.shape[1]).startswith("DeepGEMM"):
            cache = self.exact_pool.view(-1, self.page, 1, self.dim + 4)
            # unmasked: rows_topk reads only each row's first exact_len entries
            logits = deepgemm.paged_logits(cache, self.exact_table, self.exact_len, q, w, width * self.page,
                                           schedule=schedule, masked=False)
            return rows_topk(logits, self.exact_len, self.topk)[1]
        if self.use_triton:
            logits = fp8_logits_paged(self.exact_pool, self.exact_table[:, :width], self.exact_len, q, w)
            return rows_topk(logits, self.exact_len, self.topk)[1]
        keys, scales = paged_keys_reference(self.exact_pool, self.exact_table[:, :width], self.dim)
        return fp8_topk_reference(keys, scales, self.exact_len, q.float(), w, self.topk, query_fp8=True)[1]

    def _pq_limit(self, live: int) -> float:
        return pq_limit(self.pq_from, live)

    def _pages(self, slot: int) -> list[int]:
        pages = self.pages[slot]
        if pages is None:
            raise DsaIndexError(f"Slot {slot} holds no request (never admitted, or already freed).",
                                "admit a request into the slot first; free each request exactly once.")
        return pages

    def length(self, slot: int) -> int:
        return self.encoded_host[slot] + self.tail_host[slot]

    def append(self, slot: int, keys: torch.Tensor) -> None:
        """Append keys [n, D] (engine basis) to a request. Completed pages are written to the host and
        encoded; a full host store raises :class:`HostMemoryError` before anything changes."""
        self._pages(slot)  # a slot without a request raises
        n_tail = self.tail_host[slot]
        total = n_tail + keys.shape[0]
        if self.encoded_host[slot] + total > self.codes.shape[1] + self.page:
            raise DsaIndexError(f"Slot {slot} would hold {self.encoded_host[slot] + total} keys; the group is "
                                f"sized for {self.max_keys}.", "size the group for the longest request.")
        full = total // self.page
        new_pages = self.host.allocate_many(full) if full else []
        fp8, scales = fp8_quantize(keys.to(self.device).float())
        fp8 = fp8.view(torch.uint8)
        scales = scales.reshape(-1)
        self._write_exact(slot, self.length(slot), fp8, scales)
        tail_rows = slice(self.cache_capacity + 1, self.cache_capacity + 1 + n_tail)
        all_fp8 = torch.cat([self.pool_fp8[slot, tail_rows], fp8])
        all_scales = torch.cat([self.pool_scales[slot, tail_rows], scales])
        if full:
            done = full * self.page
            page_fp8 = all_fp8[:done].view(full, self.page, self.dim)
            page_scales = all_scales[:done].view(full, self.page)
            exact = page_fp8.reshape(done, self.dim).view(torch.float8_e4m3fn).float() * page_scales.reshape(done, 1)
            self._commit_pages(slot, new_pages, page_fp8, page_scales, self.encode_keys(exact))
            all_fp8, all_scales = all_fp8[done:], all_scales[done:]
        rest = all_fp8.shape[0]
        self.pool_fp8[slot, self.cache_capacity + 1 : self.cache_capacity + 1 + rest] = all_fp8
        self.pool_scales[slot, self.cache_capacity + 1 : self.cache_capacity + 1 + rest] = all_scales
        self.tail_host[slot] = rest
        self.n_encoded[slot] = self.encoded_host[slot]
        self.tail_len[slot] = rest

    def load_encoded(self, slot: int, codes: torch.Tensor, fp8: torch.Tensor, scales: torch.Tensor) -> None:
        """Give an empty request a history that is already encoded: ``codes`` [n, M] uint8, ``fp8``
        [n, D] uint8 (FP8 bits), ``scales`` [n] float32, with ``n`` a whole number of pages (a prefill
        that encoded its own pages, or a restored request). Nothing is encoded again."""
        pages = self._pages(slot)
        n = codes.shape[0]
        if pages or self.tail_host[slot] or n % self.page or n > self.codes.shape[1]:
            raise DsaIndexError(f"Slot {slot} cannot take {n} encoded keys (it must be empty, and the keys whole "
                                f"pages, at most {self.codes.shape[1]}).", "admit a fresh request; append the rest.")
        full = n // self.page
        new_pages = self.host.allocate_many(full)
        self._write_exact(slot, 0, fp8.reshape(n, self.dim), scales.reshape(n))
        self._commit_pages(slot, new_pages, fp8.view(full, self.page, self.dim),
                           scales.reshape(full, self.page), codes.to(self.device))
        self.n_encoded[slot] = self.encoded_host[slot]

    def _commit_pages(self, slot: int, new_pages: list[int], page_fp8: torch.Tensor, page_scales: torch.Tensor,
                      codes: torch.Tensor) -> None:
        """Completed pages of a request: FP8 keys to the host pages, codes and page table on the device."""
        self.host.write_fp8_pages(new_pages, page_fp8, page_scales)
        start = self.encoded_host[slot]
        self.codes[slot, start : start + codes.shape[0]] = codes
        if self.groups is not None:
            self.groups[0][slot, start : start + codes.shape[0]] = group_codes(codes, self.group_of)
        first = start // self.page
        self.page_table[slot, first : first + len(new_pages)] = torch.tensor(new_pages, dtype=torch.int32)
        self._pages(slot).extend(new_pages)
        self.encoded_host[slot] = start + codes.shape[0]

    def encode_keys(self, exact: torch.Tensor) -> torch.Tensor:
        """Codes [n, M] uint8 of exact keys [n, D] on the group's device, as completed pages are encoded."""
        if self.residual:  # beam search over whole-key codebooks
            # (the CPU interpreter runs the search's kernel a key at a time: minutes for a few pages, so its
            # reference codes there; tests check the kernel against it directly)
            if self.use_triton and not select.interpreted():
                return rq_encode(exact, self.codec.codebooks, beam=self.codec.beam, whitened=self.rq_search)
            return self.codec.encode(exact)
        if self.use_triton:
            return pq_encode(exact, self.codebooks, self.metric, rotation=self.rotation)
        return encode(exact, self.codebooks, self.metric, rotation=self.rotation)

    def _code_queries(self, q: torch.Tensor) -> torch.Tensor:
        """Queries [S, H, D] bf16 in the codes' space: rotated (OPQ, one product; shapes fixed, no sync) or as
        they are."""
        return q if self.rotation is None else rotate(q, self.rotation_bf16, torch.bfloat16)

    @property
    def stage1_input(self):
        """What the coarse kernels' ``stage1`` argument takes for this group: None (the codes), the group codes'
        (codes, codebooks, norms), or ``"folds"``."""
        return "folds" if self.stage1 == "folds" else self.groups

    def gpu_bytes(self) -> dict[str, int]:
        """Device bytes per request: the index (codes of ``max_keys``) and the fixed cache + tail state."""
        per_slot = lambda t: t.numel() * t.element_size() // self.slots  # noqa: E731
        return {"index": per_slot(self.codes) + (0 if self.groups is None else per_slot(self.groups[0])),
                "cache": per_slot(self.pool_fp8) + per_slot(self.pool_scales) + per_slot(self.cache_pos)
                + per_slot(self.cache_stamp) + per_slot(self.set_count) + per_slot(self.page_table),
                "exact_pool": self.exact_pool.numel() // max(1, self.slots)}

    # ---- selection --------------------------------------------------------------------------------
    def select(self, queries: torch.Tensor, head_weights: torch.Tensor,
               exact_schedule: torch.Tensor | None = None) -> tuple[torch.Tensor, StepStats]:
        """Top-k key positions of every slot for one query each.

        queries : [S, H, D] (engine basis); head_weights : [S, H] effective weights; exact_schedule :
        :meth:`exact_schedule` of this step, shared by the layers (computed here when None). Returns
        positions [S, topk] int64 (-1 past a short request's keys; empty slots select nothing) and the
        step's stats (of the PQ path; zeros when every request is under the length policy and scored
        exactly).
        """
        q = queries.to(self.device, torch.bfloat16).contiguous()
        w = head_weights.to(self.device, torch.float32).contiguous()
        live = [slot for slot in range(self.slots) if self.pages[slot] is not None]
        short = [slot for slot in live if self.short_host[slot]]
        if short and max(self.length(s) for s in short) >= self._pq_limit(len(live)):
            short = []  # a batch this large is faster through PQ at these lengths
        if short and len(short) == len(live):  # every request is below the policy's length: exact only
            return self._select_exact(q, w, exact_schedule), self._no_stats
        picked, stats = self._select_pq(q, w)
        if short:  # a mixed batch runs both paths; each request takes its own
            picked = torch.where(self.short[:, None], self._select_exact(q, w, exact_schedule), picked)
        return picked, stats

    def _coarse(self, q: torch.Tensor, w: torch.Tensor, longest: int) -> tuple[torch.Tensor, ...]:
        """The coarse stages: (scores [S, C], positions [S, C] int64, stage-1 counts [S])."""
        q_code = self._code_queries(q)  # the coarse stages score codes in the codebooks' space
        if self.use_triton:
            # stage 1 keeps every key above its threshold (about 1.5 x C1): no sort before stage 2
            return pq_coarse_topc(self.codes, self.n_encoded, q_code, w, self.codebooks, self.c1, self.candidates,
                                  codebooks_bf16=self.codebooks_bf16, centroid_norms=self.centroid_norms,
                                  max_len=longest, linear_config=self.linear_config, stage2=self.stage2,
                                  stage1=self.stage1_input)
        rows1, counts1, coarse = self._coarse_reference(q_code, w, longest)
        cand_scores, cand = small_topk_reference(coarse, min(self.candidates, coarse.shape[1]), rows1)
        return cand_scores, cand, counts1

    def _coarse_reference(self, q_code: torch.Tensor, w: torch.Tensor, longest: int,
                          grow: tuple[int, int] = (0, 1)) -> tuple[torch.Tensor, ...]:
        """Both coarse stages in torch: (stage-1 rows [S, C1] int64, their count [S] int32, stage-2 scores);
        ``grow`` (band, most): each request's C1 grown by its length (:func:`grown_counts`)."""
        codes = self.codes[:, :longest]
        groups = None if self.groups is None else (self.groups[0][:, :longest], self.groups[1])
        return coarse_stages_reference(codes, self.n_encoded, q_code, w, self.codebooks, self.codebooks_bf16, self.c1,
                                       grow, self.stage1, groups, self.stage2)

    def grow_past(self, band: int, most: int | None = None) -> tuple[int, int]:
        """Let C grow with each request's prefix past ``band`` keys (0: fixed), doubling with each doubling of
        the prefix up to ``most`` x (default and at most :func:`~dsaindex.runtime.paged_select.growth_limit`:
        what the final top-k's one program holds), as the engine plugins' step does. A step of more than
        ``direct_upto`` requests stays a cached one: stage 2 keeps each request's grown C by score bins, and
        its device cache scales with the most C grows for the group's ``max_keys`` (:attr:`cache_capacity`,
        ``gpu_bytes``), so hits are not read from the host again. Such a step keeps every candidate (no miss
        filter: at 256K-512K prefixes the filter served 98.40% against 99.63% with every candidate rescored,
        docs/results.md), so it selects what the direct step selects. Called before any request is admitted
        (the cache is sized here). Returns the (band, most) in effect, (0, 1) for a fixed C."""
        grow = growth_setting(band, most, self.candidates)
        factor = growth_of(self.max_keys, *grow)
        capacity, spill = self.base_cache * factor, max(64, self.candidates * factor // 8)
        if (capacity, spill) != (self.cache_capacity, self.spill):
            if any(pages is not None for pages in self.pages):
                raise DsaIndexError("C cannot start growing while the group holds requests: the device cache is "
                                    "sized for the growth.", "call grow_past before admitting requests.")
            self._allocate_cache(capacity, spill)
        self.grow_band, self.grow_most = grow
        return self.grow_band, self.grow_most

    def _growth(self, longest: int) -> tuple[int, int]:
        """(band, most) of a direct step whose longest request has ``longest`` coded keys: no more growth than
        its keys need."""
        return step_growth(longest, self.grow_band, self.grow_most)

    def _select_direct(self, q: torch.Tensor, w: torch.Tensor, longest: int) -> tuple[torch.Tensor, StepStats]:
        """A PQ step whose candidates are read straight from the host store (``direct_upto``): stage 2 bins
        its scores and picks the boundary bin of the top C on the fly; one kernel reads the candidates
        above it (and in it, while room is left) from their host pages and scores them."""
        if self.device.type == "cuda" and not self._host_pinned:
            raise DsaIndexError("The host key store is not pinned; the device cannot read it directly.",
                                "create the HostKeyStore with pin=True (the default where CUDA is present).")
        q_code = self._code_queries(q)
        band, most = self._growth(longest)  # C grown by each request's prefix (grow_past), or fixed
        capacity = self.candidates + self.direct_slack  # a request's kept slots before its growth
        width = self.candidates * most + self.direct_slack  # the widest request's
        if self.use_triton:
            rows1, bins, counts1, sel = pq_coarse_bins(
                self.codes, self.n_encoded, q_code, w, self.codebooks, self.c1, self.candidates, capacity,
                self.key_bound, self.bin_scratch, codebooks_bf16=self.codebooks_bf16,
                centroid_norms=self.centroid_norms, max_len=longest, linear_config=self.linear_config,
                grow=(band, most), stage2=self.stage2, stage1=self.stage1_input)
            exact, positions, counts = fp8_host_select(
                self.host.fp8, self.host.scales, self.page_table, rows1, bins, counts1, sel, self.bin_scratch,
                self.pool_fp8, self.pool_scales, self.tail_len, self.n_encoded, self.cache_capacity + 1, q, w, width)
        else:
            rows1, counts1, coarse = self._coarse_reference(q_code, w, longest, (band, most))
            bins = score_bins(coarse, score_bound(q_code, w, self.key_bound))
            live = torch.arange(rows1.shape[1], device=self.device)[None, :] < counts1[:, None]
            c = grown_counts(self.candidates, self.n_encoded, band, most)
            sel = boundary_of_bins(bins, live, c, c + self.direct_slack)
            exact, positions, counts = fp8_host_select_reference(
                self.host.fp8, self.host.scales, self.page_table, rows1.to(torch.int32), bins, counts1, sel,
                self.pool_fp8, self.pool_scales, self.tail_len, self.n_encoded, self.cache_capacity + 1, q, w, width)
        k = min(self.topk, exact.shape[1])
        top = small_topk if self.use_triton and exact.shape[1] <= SMALL_TOPK_MAX else small_topk_reference
        return top(exact, k, positions)[1], StepStats(counts, counts1.to(torch.int32))

    def _grown_coarse(self, q: torch.Tensor, w: torch.Tensor, longest: int,
                      grow: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        """The coarse stages of a cached step whose C grows (``grow``: (band, most)): each request's grown C kept
        by score bins, as the direct step keeps them. Returns (scores [S, W] float32, all 0 and -inf where no
        candidate: the plan reads them for its miss filter only, off on these steps; positions [S, W] int64, -1
        after a request's kept candidates; stage-1 counts [S]), W = C x most + the boundary bin's slack."""
        q_code = self._code_queries(q)
        band, most = grow
        capacity = self.candidates + self.direct_slack
        width = self.candidates * most + self.direct_slack
        if self.use_triton:
            rows1, bins, counts1, sel = pq_coarse_bins(
                self.codes, self.n_encoded, q_code, w, self.codebooks, self.c1, self.candidates, capacity,
                self.key_bound, self.bin_scratch, codebooks_bf16=self.codebooks_bf16,
                centroid_norms=self.centroid_norms, max_len=longest, linear_config=self.linear_config, grow=grow,
                stage2=self.stage2, stage1=self.stage1_input)
            cand = keep_binned(rows1, bins, counts1, sel, self.bin_scratch, width)
        else:
            rows1, counts1, coarse = self._coarse_reference(q_code, w, longest, grow)
            bins = score_bins(coarse, score_bound(q_code, w, self.key_bound))
            live = torch.arange(rows1.shape[1], device=self.device)[None, :] < counts1[:, None]
            c = grown_counts(self.candidates, self.n_encoded, band, most)
            sel = boundary_of_bins(bins, live, c, c + self.direct_slack)
            cand = keep_binned_reference(rows1.to(torch.int32), bins, counts1, sel, width)
        scores = torch.where(cand >= 0, 0.0, float("-inf"))
        return scores, cand, counts1

    def _select_pq(self, q: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, StepStats]:
        s, dev = self.slots, self.device
        longest = max(self.encoded_host) if self.slots else 0
        live = sum(pages is not None for pages in self.pages)
        if longest and live <= self.direct_upto:
            return self._select_direct(q, w, longest)
        plan = decode_plan if self.use_triton else decode_plan_reference
        if longest:
            grow = self._growth(longest)  # a grown C: kept by bins, every candidate rescored (no miss filter)
            grown = grow[1] > 1
            cand_scores, cand, counts1 = self._grown_coarse(q, w, longest, grow) if grown else self._coarse(q, w, longest)
            src, dst, rows, positions, counts = plan(cand, cand_scores, self.cache_pos, self.cache_stamp, self.step,
                                                     self.n_encoded, self.tail_len, self.topk, self.page,
                                                     self.miss_filter and not grown, spill=self.spill,
                                                     set_count=self.set_count, filter_width=self.filter_width)
            self._read_host(src, dst)
            stats = StepStats(counts, counts1.to(torch.int32))
        else:
            empty = torch.empty(s, 0, dtype=torch.long, device=dev)
            # no candidates: only the tail is rescored, and the cache is left as it is
            _, _, rows, positions, _ = decode_plan_reference(empty, empty.float(), self.cache_pos, self.cache_stamp,
                                                             self.step, self.n_encoded, self.tail_len, self.topk,
                                                             self.page)
            stats = StepStats.zeros(s, dev)
        rescore = fp8_gather_scores if self.use_triton else fp8_gather_scores_reference
        exact = rescore(self.pool_fp8, self.pool_scales, rows, q, w)  # raw queries against exact keys
        k = min(self.topk, exact.shape[1])
        top = small_topk if self.use_triton and exact.shape[1] <= SMALL_TOPK_MAX else small_topk_reference
        _, picked = top(exact, k, positions)
        return picked, stats

    def _read_host(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy host rows ``src`` (positions, -1 = none) into pool rows ``dst`` of each slot."""
        host_fp8 = self.host.fp8
        if self.device.type == "cuda" and not self._host_pinned:
            raise DsaIndexError("The host key store is not pinned; the device cannot read it directly.",
                                "create the HostKeyStore with pin=True (the default where CUDA is present).")
        args = (host_fp8, self.host.scales, self.page_table, src, dst, self.pool_fp8, self.pool_scales)
        if self.use_triton and self.host_reads == "unified-addressing kernel":
            try:
                select.gather_host_rows(*args)
                return
            except KernelInputError:
                raise  # a bug in the caller, not a device that cannot read pinned memory
            except (RuntimeError, ValueError) as err:  # a device/driver that cannot address pinned memory
                self.host_reads = f"staged copy ({type(err).__name__}: {str(err)[:80]})"
        select.gather_host_rows_reference(*args)


class RequestGroups:
    """Steps several :class:`PQDecodeGroup` on separate CUDA streams (round robin), so one group's host
    reads overlap another group's scoring; on the CPU the groups run one after another."""

    def __init__(self, groups: list[PQDecodeGroup], streams: int = 2):
        self.groups = groups
        cuda = bool(groups) and groups[0].device.type == "cuda"
        self.streams = [torch.cuda.Stream(device=groups[0].device) for _ in range(streams)] if cuda else []

    def select(self, queries: list[torch.Tensor], head_weights: list[torch.Tensor]) -> list[torch.Tensor]:
        """Positions [S_g, topk] for each group, given each group's queries and weights."""
        if not self.streams:
            return [g.select(q, w)[0] for g, q, w in zip(self.groups, queries, head_weights, strict=True)]
        main = torch.cuda.current_stream(self.groups[0].device)
        out = []
        for i, (g, q, w) in enumerate(zip(self.groups, queries, head_weights, strict=True)):
            stream = self.streams[i % len(self.streams)]
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                picked, _ = g.select(q, w)
            out.append(picked)
        for stream in self.streams:
            main.wait_stream(stream)
        return out
