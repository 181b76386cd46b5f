"""PQ decode selection over an engine's own paged index-K cache: what the SGLang and vLLM plugins run.

Both engines keep one index-K cache per layer in the layout DeepGEMM reads: pages of 64 keys, each page
64 x D FP8 e4m3 bytes followed by 64 float32 (ue8m0) scales. SGLang stores it as ``[pages, 64 * (D + 4)]``
uint8, vLLM as ``[blocks, 64, D + 4]`` (a view into a larger allocation); :func:`page_rows` turns either
into rows of ``64 * (D + 4)`` bytes, read in place. A request's pages are listed by a page table
``[B, W]`` int32 and its keys counted by ``seqlens`` ``[B]``.

:class:`PagedCacheSelector` keeps PQ codes per *physical* page, ``[P + 1, 64, M]`` uint8 (the last page is
scratch), and a signature of each page's bytes (the first 8 bytes of keys 0, 31 and 63 and the last 8
bytes of the scales: 32 bytes of the page's 8,448). The engine owns its pages: it frees them, hands
them to other requests, shares them through its prefix cache. A completed page whose signature differs
from the one its codes were made from (or that has none) is *stale* and is encoded again.

A step (:meth:`PagedCacheSelector.select`) is a fixed sequence of launches whose shapes depend only on
the batch size and the page table's width, with no host synchronization, so an engine can capture it
in its decode CUDA graph:

1. catch-up: the signatures of every completed page in the table are checked and the first
   ``catch_up`` stale pages of each request encoded (a page completed by this step's key is one);
2. stage 1: the head-folded query against every code of the completed pages (int8 tables, the top
   ``prefilter * C`` kept by a sampled threshold, :func:`~dsaindex.kernels.pq_select.pq_linear_topc` through
   the page table);
3. stage 2: every head on the decoded codes of those, top C: on a small step the candidates above the C-th
   score's bin (:func:`~dsaindex.kernels.pq_select.keep_binned`, no top-C kernel), on a larger one by
   :func:`~dsaindex.kernels.topk.small_topk` (``top_c``);
4. the C candidates, the incomplete last page and the model's forced init/local tokens rescored exactly
   from the engine's FP8 pages (:func:`~dsaindex.kernels.fp8_score.fp8_gather_scores_paged`, FP8 queries
   as the engines' logits); top-k (:func:`~dsaindex.kernels.topk.final_topk`).

A small step is scored exactly instead (the *exact path*): when B times (the longest request's keys less
``exact_offset``, by default :data:`dsaindex.coarse.PAGED_EXACT_OFFSET` x the stage-1 width) is at most
``exact_below`` (:data:`dsaindex.coarse.PAGED_EXACT_BELOW`; ``DSAINDEX_EXACT_BELOW`` in the plugins),
stages 1-4 give way to what the engine runs without the plugin, DeepGEMM's ``fp8_paged_mqa_logits`` over the same pages (the Triton
:func:`~dsaindex.kernels.fp8_score.fp8_logits_paged` where DeepGEMM does not import) and the threshold
top-k :func:`~dsaindex.kernels.topk.rows_topk`; below that size the PQ step's fixed cost (a few dozen
launches) is more than the engine's whole step. The choice is made on the device: inside a captured CUDA
graph each path is a conditional node (CUDA 12.4's IF nodes, through
``torch.cuda.CUDAGraph.begin_capture_to_if_node``) and a replay runs only the one its step needs; eagerly
the host reads the lengths. The catch-up (1) runs on both paths, so a request's codes are current when
its batch grows past the bound; on a GPU it runs on a side stream beside the rest of the step, joined
before stage 1 reads the codes (inside a graph: a parallel branch).

Pages that complete outside decode steps (a prefill, a prefix-cache hit) are encoded by
:meth:`PagedCacheSelector.prepare`, which synchronizes and is called from the engine's eager prefill path
(or by ``select`` itself when it runs eagerly). Under a captured graph the catch-up alone encodes
``catch_up`` pages per request per step; ``stats.stale`` counts, per request, the pages still scored by
stale codes after it (zero in the steady state), so a missed ``prepare`` is visible, not silent.

An OPQ codec (:attr:`dsaindex.pq.PQCodec.rotation`) codes rotated keys: the page encoder folds the rotation
into its whitening and projects each whole FP8 key in the kernel (:func:`~dsaindex.kernels.paged_codes.whitened_codebooks`),
and each step rotates the queries once (one [B*H, D] x [D, D] product) for stages 1 and 2; the exact
rescoring reads the engine's queries and keys as they are.

Scores are the engines': ``sum_h w_h relu(q_h . k)`` with their FP8 queries and their head weights (which
carry the query's scale and the softmax scale). The torch references of the same kernels run the same
algorithm on a CPU (``use_triton=False``; the plugins' contract tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsaindex.coarse import (
    PAGED_EXACT_BELOW,
    PAGED_EXACT_OFFSET,
    PAGED_FOLDS_EXTRA_BELOW,
    PAGED_GROWN_EXTRA,
    PAGED_GROWN_OFFSET,
    PREFILTER,
    grown_offset_words,
)
from dsaindex.errors import DsaIndexError
from dsaindex.kernels import deepgemm
from dsaindex.kernels import select as select_kernels
from dsaindex.kernels.fp8_score import (
    fp8_gather_scores_paged,
    fp8_gather_scores_reference,
    fp8_logits_paged,
    fp8_scores_reference,
    paged_keys_reference,
)
from dsaindex.kernels.paged_codes import (
    encode_pages,
    encode_pages_reference,
    page_words,
    signature_words,
    stale_pages,
    stale_pages_reference,
    whitened_codebooks,
    with_tail,
    with_tail_reference,
)
from dsaindex.kernels.pq_fold_cuda import compiles as fold_compiles
from dsaindex.kernels.pq_fold_cuda import takes as fold_takes
from dsaindex.kernels.pq_scan_cuda import available, resolve_scan
from dsaindex.kernels.pq_select import (
    BIN_COUNT,
    boundary_of_bins,
    coarse_stages_reference,
    decoded_key_bound,
    grown_counts,
    grown_exact_rule,
    growth_of,
    keep_binned,
    keep_binned_reference,
    paged_codes_reference,
    pq_coarse_bins,
    pq_coarse_topc,
    score_bins,
    score_bound,
    step_growth,
)
from dsaindex.kernels.pq_stage2_cuda import CUDA_FROM_SLOTS as STAGE2_CUDA_FROM_SLOTS
from dsaindex.kernels.pq_stage2_cuda import STAGE2S, resolve_stage2
from dsaindex.kernels.pq_stage2_cuda import compiles as stage2_compiles
from dsaindex.kernels.topk import (
    SMALL_TOPK_MAX,
    final_takes_radix,
    final_topk,
    radix_scratch_words,
    rows_topk,
    rows_topk_reference,
    small_topk_reference,
)
from dsaindex.pq import PQCodec, group_codes, rotate, stage1_groups

PAGE = 64
CHECK_EVERY = 16  # a step checks one in this many of each request's older pages (PagedCacheSelector)
TOP_C = ("auto", "bins", "topk")  # PagedCacheSelector's ways to keep stage 2's candidates
# top_c="auto": a step whose requests' stage 1 keeps at most this many keys in all (B x P x C) keeps stage 2's
# candidates by bins, a larger one by top-k: 16 requests at C = 4,096 / 4 x C, 8 at 8 x C (H200, 1M keys: bins
# ahead up to 24 requests at 4 x C, by 1% from 17; at 8 x C ahead at 8, behind by 5% at 12)
BINS_UP_TO_KEYS = 16 * 16384
BIN_SLACK = 256  # candidate slots past C of a binned stage 2: its boundary bin's ties (0.2% wide)


def page_rows(cache: torch.Tensor, head_dim: int = 128) -> torch.Tensor:
    """An index-K cache as rows of one page each, ``[P, 64 * (D + 4)]`` uint8, without a copy: SGLang's
    ``[P, 64 * (D + 4)]`` as it is, vLLM's ``[P, 64, D + 4]`` (or ``[P, 1, 64, D + 4]``) viewed with its
    own page stride. Raises :class:`DsaIndexError` on any other layout."""
    width = PAGE * (head_dim + 4)
    if cache.dtype != torch.uint8:
        raise DsaIndexError(f"The index-K cache is {cache.dtype}; the PQ selection reads the FP8 byte layout "
                            "(uint8 pages of 64 x D FP8 bytes then 64 float32 scales).",
                            "pass the engine's uint8 index-K buffer for the layer.")
    pages = cache.shape[0]
    inner = cache[0] if pages else cache.new_empty(width)
    if inner.numel() != width or (pages and not inner.is_contiguous()):
        raise DsaIndexError(f"The index-K cache has shape {tuple(cache.shape)} and strides {tuple(cache.stride())}; "
                            f"expected pages of {width} contiguous bytes (64 keys of D={head_dim}).",
                            "pass the engine's index-K buffer of the layer (page size 64, FP8 keys).")
    return cache.as_strided((pages, width), (cache.stride(0), 1))


@dataclass
class PagedStats:
    """Device counters of the last :meth:`PagedCacheSelector.select` (reading them syncs): ``encoded`` [B]
    pages encoded by the step's catch-up, ``stale`` [B] stale pages its check found beyond those (0 unless
    :meth:`PagedCacheSelector.prepare` was skipped for a prefill; the check covers each request's newest
    pages and one in ``check_every`` of the older ones), ``stage1`` [B] keys stage 1
    passed to stage 2 (0 on the exact path). The first two are derived from ``found`` [B], the stale pages
    the catch-up found, when read: no kernel of the step computes them."""

    found: torch.Tensor
    catch_up: int
    stage1: torch.Tensor

    @property
    def encoded(self) -> torch.Tensor:
        return self.found.clamp_max(self.catch_up)

    @property
    def stale(self) -> torch.Tensor:
        return (self.found - self.catch_up).clamp_min(0)


def check_paged_codes(layers: dict) -> None:
    """Refuse served layers the paged selector cannot take: ``layers`` maps a layer id to its served object
    (a :class:`PQCodec` for ``pq`` layers; others are skipped). The engine plugins call this when they load
    a bundle, so a server with RQ codes fails at startup, not at its first decode step."""
    residual = sorted(str(layer) for layer, codec in layers.items() if isinstance(codec, PQCodec) and codec.residual)
    if residual:
        raise DsaIndexError(f"The bundle's layers {', '.join(residual)} hold residual codes (RQ); the engines' paged "
                            "selector encodes pages with product codes only (PQ, OPQ).",
                            "serve RQ bundles with `dsaindex serve` or the transformers adapter, or train a PQ or "
                            "OPQ bundle (`dsaindex train pq`, --quantizer pq) for SGLang and vLLM.")


class PagedCacheSelector:
    """One layer's PQ coarse-to-fine decode selection over an engine's paged index-K cache.

    Parameters
    ----------
    codec : the layer's PQ parameters (engine basis); num_pages : pages of the engine's cache for the layer
    topk : keys selected per query; candidates : C, the keys rescored exactly (at least ``topk``)
    prefilter : stage 1 keeps ``prefilter * C``; catch_up : stale pages encoded per request per step
    head_dim : D of the index keys; device : where the cache lives
    keys_on_host : the cache is host memory the GPU reads in place (``DSAINDEX_KEYS=host``). Each step then
        checks the signatures of only the last ``catch_up`` completed pages of a request (reading every
        page's each step would cost more than the step over the host link; pages that complete during
        decode are still caught, pages written otherwise, by a prefill, a transfer or another request,
        must go through :meth:`prepare`, as the engine plugins' prefill and transfer hooks do), and the
        exact rescoring reads 16 keys per program instead of 64 (more reads in flight: 1.4 ms instead of
        2.8 for 32 x 4,160 keys on the H200)
    use_triton : the Triton kernels (default: on CUDA, or under ``TRITON_INTERPRET=1``), else their torch
        references (the same algorithm on a CPU)
    check_every : a step checks the signatures of each request's last ``catch_up`` completed pages and of one
        in ``check_every`` of its older pages (a phase that turns each step), so a page changed outside
        decode without :meth:`prepare` is found within ``check_every`` steps; reading every page's each step
        cost 64 us of a 1.0 ms step at 32 x 1M keys on the H200. 1: every page, every step
    exact_below : a step of B requests whose longest has N keys, with B x (N - ``exact_offset``) at most
        this, is scored exactly, as the engine scores it without the plugin (the exact path; 0: never).
        Ignored with ``keys_on_host`` (exact scoring would read every key over the host link). With
        ``stage1="folds"`` the bound is this plus :data:`dsaindex.coarse.PAGED_FOLDS_EXTRA_BELOW` (the fold
        scan's fixed part of a step)
    exact_offset : keys a request's fixed share of the codes' step is worth (default
        :data:`dsaindex.coarse.PAGED_EXACT_OFFSET` x the stage-1 width, ``prefilter`` x C; where C grows by
        length, :data:`dsaindex.coarse.PAGED_GROWN_OFFSET` x that width); where C grows g x,
        ``exact_offset`` x g + ``grown_extra`` x (g - 1)
    grown_extra : keys a grown request's share gains for each C's worth of growth past its first (default
        :data:`dsaindex.coarse.PAGED_GROWN_EXTRA` x the stage-1 width; negative, it grows slower than g, down to
        ``-exact_offset``)
    top_c : how stage 2's candidates become the C rescored: ``"auto"`` (default) is ``"bins"`` for a step
        whose stage 1 keeps at most :data:`BINS_UP_TO_KEYS` keys in all (B x ``prefilter`` x C) and ``"topk"``
        above, the faster of the two on the H200 at 1M keys (stage 1 at 4 x 4,096: bins 1.34x / 1.55x of
        DeepGEMM at 8 / 16 requests against 1.17x / 1.49x, within 1% from 24; at 8 x 4,096: bins 1.09x at 8
        against 1.06x, top-k 1.21x / 1.28x at 12 / 16 against 1.15x / 1.19x), and ``"bins"`` at any batch
        where the CUDA stage 2 scores the step (:meth:`auto_top_c`); ``"topk"`` the exact top C by a
        one-program top-k
        of each request (34-40 us a step on the H200, whatever B); ``"bins"`` keeps every candidate whose
        score bin (0.2% wide, :func:`~dsaindex.kernels.pq_select.score_bins`) is above the C-th's, and those in
        that bin up to ``C + BIN_SLACK`` in all, from a histogram stage 2 builds as it scores (no top-C
        kernel; at least the top C, as far as bins resolve)
    codes : where the codes live, when the engine's pool holds them ([num_pages, 64, M] uint8, contiguous, on
        ``device``: the region an engine sized for the layer's codes instead of its keys, as the vLLM plugin's
        ``DSAINDEX_KEYS=host`` does). Default: the selector allocates [num_pages + 1, 64, M] itself.
    scan : stage 1's selecting kernel: ``"auto"`` (default: ``"cuda"`` where it runs, see
        :func:`stage1_scan`), ``"cuda"`` (int32 tables in shared memory, :mod:`dsaindex.kernels.pq_scan_cuda`;
        the same keys kept; 1.3x faster at 32-64 x 1M on the H200) or ``"triton"``
    stage2 : stage 2's kernel: ``"auto"`` (default: ``"int8"`` where it runs, 64 heads and PQ32 codes),
        ``"cuda"`` (codebooks and the score-bin histogram in shared memory, keys decoded into tensor-core
        fragments, :mod:`dsaindex.kernels.pq_stage2_cuda`), ``"int8"`` (the same kernel on 8-bit operands: the
        tensor cores' s8 form, half its ``mma``; 179 against 246 us at 32 x 1M on the H100, the same served
        recall) or ``"triton"``
    grow_band : > 0: C grows with a request's prefix past this many keys (the end of the longest prefix band
        the bundle measured its recall in): C and the stage-1 width double for each doubling of the prefix
        (2 x C up to twice the band, 4 x C up to four times), per request on the device, so a step's shapes
        still depend on the batch and the page table only. A fixed C served 4-7 points less recall at
        256K-512K prefixes than at 128K on the reference checkpoint; C = 16,384 there (4 x 4,096) served
        99.63% (docs/results.md). 0 (default): C fixed. Stage 2 then keeps its candidates by bins.
    grow_most : the most C grows by (a power of two; default and at most: the largest whose candidates, bin
        slack and open page fit the final top-k's one program, :data:`~dsaindex.kernels.topk.SMALL_TOPK_MAX`
        entries: 4 at C = 4,096, 8 at 2,048)
    stage1 : what stage 1 scores: ``"codes"`` (default: the keys' codes) or ``"groups"`` (each subspace's 256
        centroids put in 16 groups of 16, :func:`~dsaindex.pq.group_centroids`, and stage 1 scoring the keys'
        group codes, two groups a byte: 16 bytes a PQ32 key, half the bytes stage 1 reads, kept beside the
        codes, so the selector holds 48 bytes a key; stage 2 scores the codes as before) or ``"folds"`` (the codes
        scored by 16 folded queries, the request's heads grouped by the sign of their weight and the direction
        of their queries, each fold's ReLU kept: :mod:`~dsaindex.kernels.pq_fold_cuda`; PQ32 of 128 dims; no
        bytes beside the codes)
    """

    def __init__(self, codec: PQCodec, num_pages: int, topk: int, candidates: int | None = None,
                 prefilter: int = PREFILTER, catch_up: int = 2, head_dim: int = 128, device: str | torch.device = "cuda",
                 use_triton: bool | None = None, keys_on_host: bool = False, exact_below: int = PAGED_EXACT_BELOW,
                 check_every: int = CHECK_EVERY, codes: torch.Tensor | None = None, exact_offset: int | None = None,
                 grown_extra: int | None = None,
                 top_c: str = "auto", scan: str = "auto", grow_band: int = 0, grow_most: int | None = None,
                 stage2: str = "auto", stage1: str = "codes"):
        candidates = 2 * topk if candidates is None else candidates
        if top_c not in TOP_C:
            raise DsaIndexError(f"top_c {top_c!r} is not a way to keep stage 2's candidates.",
                                f"pass one of {', '.join(TOP_C)}.")
        if candidates < topk:
            raise DsaIndexError(f"candidates ({candidates}) must be at least topk ({topk}): the exact rescoring "
                                "chooses the top-k among the candidates.", f"pass candidates >= {topk}.")
        check_paged_codes({None: codec})
        m, _, d = codec.codebooks.shape
        if m * d != head_dim:
            raise DsaIndexError(f"The PQ codebooks cover D={m * d}, the engine's index keys have D={head_dim}.",
                                "load the artifacts trained for this model's indexer.")
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:  # the device tensors report: cuda:N
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.use_triton = (dev.type == "cuda" or select_kernels.interpreted()) if use_triton is None else use_triton
        if stage1 not in STAGE1S:
            raise DsaIndexError(f"stage1 {stage1!r} is not a stage-1 code.", f"pass one of {', '.join(STAGE1S)}.")
        self.stage1 = stage1
        if stage1 == "folds":
            check_folds(head_dim, m, codec.codebooks.shape[1], codec.residual, dev, self.use_triton)
        # stage1="groups": each key's group codes (16 bytes for PQ32) beside its codes, a page each, and their
        # pair codebooks; stage 1 scores those, stage 2 the codes
        self.groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if stage1 == "groups":
            assign, books, norms = stage1_groups(codec.codebooks.float())
            self.group_of = assign.to(dev)
            self.groups = (torch.zeros(num_pages + 1, PAGE, m // 2, dtype=torch.uint8, device=dev), books.to(dev),
                           norms.to(dev))
        try:
            self.scan = resolve_scan(scan, m if stage1 == "codes" else m // 2, codec.codebooks.shape[1], True, dev)
        except ValueError as err:
            raise DsaIndexError(f"scan {scan!r}: {err}.", "pass scan='auto' (the CUDA scan where it runs) or "
                                "'triton'.") from err
        if stage2 not in STAGE2S:
            raise DsaIndexError(f"stage2 {stage2!r} is not a stage-2 kernel.", f"pass one of {', '.join(STAGE2S)}.")
        self.stage2 = stage2
        self.topk, self.candidates, self.c1 = topk, candidates, prefilter * candidates
        self.grow_band, self.grow_most = _growth_setting(grow_band, grow_most, candidates, top_c)
        self.catch_up = max(1, catch_up)
        self.keys_on_host = keys_on_host
        self.exact_below = 0 if keys_on_host else max(0, int(exact_below))
        if self.exact_below and stage1 == "folds":  # the fold scan's fixed part: DeepGEMM's time for this many keys
            self.exact_below += PAGED_FOLDS_EXTRA_BELOW
        offset, extra = exact_shares(self.c1, grows=self.grow_band > 0)
        self.exact_offset = offset if exact_offset is None else max(0, int(exact_offset))
        # negative: shares grow slower than g; the default no lower than an offset given by hand allows
        self.grown_extra = max(extra, -self.exact_offset) if grown_extra is None else int(grown_extra)
        if self.exact_offset + self.grown_extra < 0:  # offset g + extra (g - 1) would fall below 0 as C grows
            raise DsaIndexError(f"grown_extra {self.grown_extra} with exact_offset {self.exact_offset}: a grown "
                                "request's share would turn negative as its C grows.",
                                f"give grown_extra of at least {-self.exact_offset} (-exact_offset).")
        self._warm: set[str] = set()  # the paths run eagerly at least once (compiled before any capture)
        # which completed pages a step checks: the last catch_up of each request (those decode completes), and
        # on the device one column in `sweep` of the older ones, turning each step (every page within sweep
        # steps); keys on the host: the window alone. check_every 1: every page, every step
        self.check_window = self.catch_up if keys_on_host or check_every > 1 else 0
        self.sweep = 0 if keys_on_host or check_every <= 1 else int(check_every)
        self._phase = torch.zeros(1, dtype=torch.int32, device=dev)  # the sweep's step counter
        self.gather_block = 16 if keys_on_host else 64
        self.head_dim = head_dim
        self.num_pages = num_pages
        self.codebooks = codec.codebooks.to(dev).float()
        self.codebooks_bf16 = self.codebooks.to(torch.bfloat16)
        self.centroid_norms = self.codebooks.norm(dim=2).amax(dim=1)
        self.top_c = top_c
        self.key_bound = decoded_key_bound(self.codebooks)  # the scale of stage 2's score bins
        self.kept_capacity = candidates + BIN_SLACK  # candidates a binned stage 2 keeps at most
        # one zeroed scratch per batch size, never freed: an engine captures a graph per batch size, and each
        # graph keeps the scratch it was captured with
        self._bin_scratch: dict[int, torch.Tensor] = {}
        self._radix_scratch: dict[int, torch.Tensor] = {}  # the final top-k's, per batch size (left zeroed)
        self.metric = None if codec.metric is None else codec.metric.to(dev)
        self.rotation = None if codec.rotation is None else codec.rotation.to(dev, torch.float32).contiguous()
        self.rotation_bf16 = None if self.rotation is None else self.rotation.to(torch.bfloat16)
        # once: no factorization in a graph (an OPQ rotation folded into the whitening: [M, D/M, D])
        self.whitened, self.transform = whitened_codebooks(self.codebooks, self.metric, self.rotation)
        if codes is None:  # + one scratch page, never read or written: the stale lists' filler
            codes = torch.zeros(num_pages + 1, PAGE, m, dtype=torch.uint8, device=dev)
        elif (tuple(codes.shape) != (num_pages, PAGE, m) or codes.dtype != torch.uint8 or not codes.is_contiguous()
              or codes.device != dev):
            raise DsaIndexError(f"The codes' storage is {tuple(codes.shape)} {codes.dtype} on {codes.device} "
                                f"(contiguous: {codes.is_contiguous()}); the layer needs a contiguous "
                                f"[{num_pages}, {PAGE}, {m}] uint8 on {dev}.",
                                "size the engine's region for the layer with the codes' bytes per key (M), "
                                "one page per cache page, or let the selector allocate its codes.")
        self.codes = codes
        self.signature = torch.zeros(num_pages + 1, len(signature_words(head_dim)), dtype=torch.int64, device=dev)
        self.valid = torch.zeros(num_pages + 1, dtype=torch.uint8, device=dev)  # 1: the page holds codes
        self._sig_words = torch.tensor(signature_words(head_dim), device=dev)
        self.stats: PagedStats | None = None
        # the catch-up's own stream on a GPU, beside the exact path (see _exact_beside_catch_up)
        self._side = torch.cuda.Stream(device=dev) if dev.type == "cuda" and self.use_triton else None
        self._no_stage1: dict[int, torch.Tensor] = {}  # the exact path's stage-1 counts, zeros per batch size
        self.encoded_pages = 0  # pages encoded by prepare() (a host counter, for logs and tests)

    # ---- codes of the engine's pages ----------------------------------------------------------------
    def _stale(self, rows: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor, e: int,
               window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(the first ``e`` stale completed pages of each request [B, e] int64, scratch past them; stale pages
        in all [B] int32), among the last ``window`` completed pages of each request (0: all)."""
        sweep = self.sweep if window else 0
        if self.use_triton:
            return stale_pages(rows, table, lengths, self.signature, self.valid, e, self.head_dim, window=window,
                               sweep=sweep, phase=self._phase)
        return stale_pages_reference(rows, table, lengths, self.signature, self.valid, e, self.head_dim, window,
                                     sweep, self._phase)

    def _encode_pages(self, rows: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor | None = None,
                      advance: bool = False) -> torch.Tensor | None:
        """Encode physical ``pages`` [n] int64 (``num_pages``, the scratch page, is skipped) and record the
        bytes their codes were made from. A step's bookkeeping in the same launch: with ``lengths`` [B] int32,
        returns the keys of each request's completed pages [B] int32; ``advance`` moves the sweep's phase on."""
        if self.use_triton:  # the signatures and flags written by the same launch
            coded = encode_pages(rows, pages, self.whitened, self.transform, self.codes, self.head_dim, self.signature,
                                 self.valid, lengths=lengths, phase=self._phase if advance else None)
            self._group_pages(pages)
            return coded
        encode_pages_reference(rows, pages, self.codebooks, self.metric, self.codes, self.head_dim, self.rotation)
        self._group_pages(pages)
        src = pages.clamp_max(max(0, self.num_pages - 1))
        self.signature[pages] = page_words(rows)[src.unsqueeze(-1), self._sig_words]
        self.valid.index_fill_(0, pages, 1)  # a fill kernel: no host-to-device copy inside a graph
        if advance:
            self._phase.add_(1)
        return None if lengths is None else torch.bitwise_and(lengths, -PAGE)

    def _group_pages(self, pages: torch.Tensor) -> None:
        """stage1="groups": the group codes of ``pages`` from their codes (the scratch page, where the engine's
        region has none, read as the last page: its own group codes again)."""
        if self.groups is not None:
            src = pages.clamp_max(self.codes.shape[0] - 1)
            self.groups[0][src] = group_codes(self.codes[src], self.group_of)

    def prepare(self, cache: torch.Tensor, page_table: torch.Tensor, seqlens: torch.Tensor,
                batch_pages: int = 4096) -> int:
        """Encode every stale completed page of the requests ``page_table`` [B, W] / ``seqlens`` [B] (an
        eager prefill's pages; synchronizes with the host). Returns the number of pages encoded."""
        rows = page_rows(cache, self.head_dim)
        self._check_cache(rows)
        if page_table.numel() == 0:
            return 0
        table = page_table.to(rows.device, torch.int32).contiguous()
        lengths = seqlens.reshape(-1).to(rows.device, torch.int32).contiguous()
        _, count = self._stale(rows, table, lengths, 1)
        most = int(count.max())  # the sync: how many pages a request lacks at most
        if most == 0:
            return 0
        pick, _ = self._stale(rows, table, lengths, most)
        todo = torch.unique(pick[pick != self.num_pages])
        for start in range(0, todo.numel(), batch_pages):
            self._encode_pages(rows, todo[start : start + batch_pages])
        self.encoded_pages += int(todo.numel())
        return int(todo.numel())

    def adopt(self, cache: torch.Tensor, pages: torch.Tensor, codes: torch.Tensor) -> None:
        """Give physical ``pages`` [n] codes made elsewhere, ``codes`` [n, 64, M] uint8 (an index restored
        with its cache, a benchmark's synthetic codes): they count as current for the pages' bytes now."""
        rows = page_rows(cache, self.head_dim)
        self._check_cache(rows)
        pages = pages.to(self.device, torch.int64).reshape(-1)
        if codes.shape != (pages.shape[0], PAGE, self.codes.shape[2]) or codes.dtype != torch.uint8:
            raise DsaIndexError(f"codes of shape {tuple(codes.shape)} ({codes.dtype}) for {pages.shape[0]} pages; "
                                f"expected [{pages.shape[0]}, {PAGE}, {self.codes.shape[2]}] uint8.",
                                "pass one page of PQ codes per page.")
        self.codes[pages] = codes.to(self.device)
        self._group_pages(pages)
        self.signature[pages] = page_words(rows)[pages.unsqueeze(-1), self._sig_words]
        self.valid.index_fill_(0, pages, 1)

    def _catch_up(self, rows: torch.Tensor, table: torch.Tensor,
                  lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode the first ``catch_up`` stale completed pages of each request; fixed shapes, no sync. The
        encoding launch also advances the sweep's phase (the next step checks the next column of each sweep)
        and gives the keys of the completed pages, which the codes' path reads. Returns (the stale pages found
        [B] int32 (:class:`PagedStats`), the keys of each request's completed pages [B] int32)."""
        pick, count = self._stale(rows, table, lengths, self.catch_up, self.check_window)
        coded = self._encode_pages(rows, pick.reshape(-1), lengths, advance=bool(self.sweep))
        return count, coded

    def _exact_beside_catch_up(self, rows: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor,
                               run) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``run()`` (the exact path, which reads no codes) with the catch-up beside it on the selector's side
        stream (on a GPU): forked from the step's start but queued after the exact path's kernels, so a graph
        launches the logits first and the check and encoding run beside them, joined at the end. Queued
        before them, the catch-up's small kernels delayed the logits by their whole chain (8.5 us of an
        88.7 us step at 1 x 1M keys on the H200). Returns (``run()``'s two tensors, stale pages [B])."""
        if self._side is None:
            found, _ = self._catch_up(rows, table, lengths)
            return (*run(), found)
        main = torch.cuda.current_stream(self.device)
        self._side.wait_stream(main)  # the fork: the side stream starts where the step starts
        out = run()
        with torch.cuda.stream(self._side):
            found, _ = self._catch_up(rows, table, lengths)
        main.wait_stream(self._side)
        return (*out, found)

    def _check_cache(self, rows: torch.Tensor) -> None:
        if rows.shape[0] != self.num_pages:
            raise DsaIndexError(f"The index-K cache has {rows.shape[0]} pages; this selector was built for "
                                f"{self.num_pages}.", "build the selector with the engine's page count for the layer.")
        if rows.device != self.device:
            raise DsaIndexError(f"The index-K cache is on {rows.device}, the selector on {self.device}.",
                                "build the selector on the cache's device.")

    # ---- selection ----------------------------------------------------------------------------------
    def select(self, cache: torch.Tensor, page_table: torch.Tensor, seqlens: torch.Tensor, queries: torch.Tensor,
               head_weights: torch.Tensor, init_tokens: int = 0, local_tokens: int = 0,
               eager_refresh: bool | None = None, schedule: torch.Tensor | None = None) -> torch.Tensor:
        """Request-local key positions [B, topk] int32 for one query per request: the selected keys first (in
        no particular order), then -1, so a request of n < topk keys has all n (its newest included) in its
        first n entries, the contract SGLang's decode backends read. ``queries`` [B, H, D] (FP8 e4m3 or
        float), ``head_weights`` [B, H] float32, ``seqlens`` [B] keys visible to each query (its own
        included), ``page_table`` [B, W] int32.

        ``init_tokens`` / ``local_tokens``: the first / last tokens of each request always selected (an
        engine's forced tokens). ``eager_refresh`` runs :meth:`prepare` first (a host sync); the default
        does so when no CUDA graph is being captured, so eager decoding never scores stale codes.
        ``schedule``: DeepGEMM's paged-logits metadata of these ``seqlens`` (one row each), as an engine
        computes it once per step for every layer (:func:`dsaindex.kernels.deepgemm.paged_schedule`; None:
        the exact path computes it)."""
        rows = page_rows(cache, self.head_dim)
        self._check_cache(rows)
        dev = rows.device
        b, w = page_table.shape
        table = page_table.to(dev, torch.int32).contiguous()
        lengths = seqlens.reshape(-1).to(dev, torch.int32).contiguous()
        if eager_refresh is None:
            eager_refresh = not (dev.type == "cuda" and torch.cuda.is_current_stream_capturing())
        if eager_refresh:
            self.prepare(cache, table, lengths)
        args = (rows, table, lengths, queries, head_weights, init_tokens, local_tokens, schedule)
        exact_width = self.exact_pages(b, w)  # pages the exact path reads at most
        if exact_width and self.always_exact(b, w):  # the shapes alone decide: exact, the catch-up beside
            out, stage1, found = self._exact_beside_catch_up(rows, table, lengths,
                                                             lambda: self._run("exact", *args, exact_width))
        elif not exact_width:  # the shapes alone decide: the codes, made current first
            found, coded = self._catch_up(rows, table, lengths)
            out, stage1 = self._run("pq", *args, exact_width, coded)
        else:
            # the catch-up on the step's stream: a conditional body cannot wait on another stream, and
            # forked, its join cost more than it hid (3.4-13 us of gaps at 1 x 1M keys on the H200)
            found, coded = self._catch_up(rows, table, lengths)  # on the device: no sync inside a graph
            graph = _capturing_graph(dev)
            capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
            band, most = self.growth(w)
            if capturing and graph is None:
                exact = codes_pred = None
            elif band:  # the offset grows with the longest request's stage-1 width: one kernel for both predicates
                exact, codes_pred = grown_exact_rule(lengths, self.exact_below // b, self.exact_offset, band, most,
                                                     self.use_triton, self.grown_extra, both=True)
            else:  # B x (N - offset) <= bound, as N <= bound // B + offset: two kernels, and none where unused
                exact = lengths.amax() <= min(self.exact_below // b + self.exact_offset, 2**31 - 1)
                codes_pred = exact.logical_not() if graph is not None else None
            if graph is not None:  # one conditional node per path: a replay runs the one its step needs
                # outlive the nodes; exactly one of them writes every entry, so no fill
                out = torch.empty((b, self.topk), dtype=torch.int32, device=dev)
                stage1 = torch.empty(b, dtype=torch.int32, device=dev)
                for path, pred in (("exact", exact), ("pq", codes_pred)):
                    graph.begin_capture_to_if_node(pred)
                    try:
                        picked, counts1 = self._run(path, *args, exact_width, coded)
                        out.copy_(picked)
                        stage1.copy_(counts1)
                    finally:
                        graph.end_capture_to_conditional_node()
            elif capturing:  # no conditional nodes: codes
                out, stage1 = self._run("pq", *args, exact_width, coded)
            else:  # eagerly: the host reads the choice; the first call runs both paths (compiled before a capture)
                chosen = "exact" if bool(exact) else "pq"
                if "exact" not in self._warm and chosen == "pq":  # compiled on lengths it can hold, result dropped
                    self._run("exact", *_exact_warm_up(args, exact_width))
                if "pq" not in self._warm and chosen == "exact":
                    self._run("pq", *args, exact_width, coded)
                out, stage1 = self._run(chosen, *args, exact_width, coded)
        self.stats = PagedStats(found, self.catch_up, stage1)
        return out

    def auto_top_c(self, batch: int, width: int = 0, heads: int | None = None) -> str:
        """What ``top_c="auto"`` takes for a step of ``batch`` requests over a page table ``width`` pages wide:
        ``"bins"`` while their stage 1 keeps at most :data:`BINS_UP_TO_KEYS` keys in all, where C can grow in
        the step (:meth:`growth`: a top-C kernel keeps one C for all), or where the CUDA stage 2 scores the step
        (:meth:`stage2_kernel` for ``heads`` query heads: its shared-memory histogram makes the bins cheaper than
        a top-C kernel, H100 32 x 1M 0.591 against 0.633 ms), else ``"topk"``."""
        if batch <= bins_batch_limit(self.c1) or self.growth(width)[0]:
            return "bins"
        return "bins" if heads is not None and self.stage2_kernel(batch, width, heads) != "triton" else "topk"

    def stage2_kernel(self, batch: int, width: int, heads: int) -> str:
        """Stage 2's kernel for a step of ``batch`` requests of ``heads`` heads over a page table ``width`` pages
        wide (:func:`~dsaindex.kernels.pq_stage2_cuda.resolve_stage2` of its stage-1 buffer's slots)."""
        m, k, _ = self.codebooks.shape
        slots = batch * 2 * self.c1 * self.growth(width)[1]
        return resolve_stage2(self.stage2, heads, self.head_dim, m, k, False, self.device, slots)

    def growth(self, width: int) -> tuple[int, int]:
        """(band, most) of a step over a page table ``width`` pages wide: C grows past ``grow_band`` keys by at
        most ``most``, no more than the table's keys need; (0, 1) where C stays fixed."""
        return step_growth(width * PAGE, self.grow_band, self.grow_most)

    def takes_exact(self, batch: int, longest: int) -> bool:
        """Whether a step of ``batch`` requests whose longest holds ``longest`` keys takes the exact path (with
        C grown by length, the offset grows with that request's stage-1 width)."""
        return takes_exact_path(batch, longest, self.exact_below, self.exact_offset, (self.grow_band, self.grow_most),
                                self.grown_extra)

    def _levels(self, width: int) -> list[tuple[int, int, int]]:
        """(first keys, last keys, offset) of each growth level of requests up to ``width`` pages long: one
        level of every length where C is fixed; the offset is constant within a level, so the exact path's
        rule is a bound on N there."""
        band, most = self.growth(width)
        top, levels, first, mult = width * PAGE, [], 1, 1
        while first <= top:
            last = top if mult >= most or not band else min(top, band * mult)
            levels.append((first, last, self.exact_offset * mult + self.grown_extra * (mult - 1)))
            first, mult = last + 1, mult * 2
        return levels

    def always_exact(self, batch: int, width: int) -> bool:
        """Whether every step of ``batch`` requests over a page table ``width`` pages wide takes the exact path
        (the shapes alone decide): the longest of each growth level's lengths does."""
        return self.exact_below > 0 and all(batch * (last - off) <= self.exact_below
                                            for _, last, off in self._levels(width))

    def exact_pages(self, batch: int, width: int) -> int:
        """Pages of a request the exact path reads at most, for a step of ``batch`` requests over a page table
        ``width`` pages wide (0: the step never takes it)."""
        if not self.exact_below:
            return 0
        most = max((min(last, self.exact_below // max(1, batch) + off) for first, last, off in self._levels(width)
                    if first <= self.exact_below // max(1, batch) + off), default=0)
        return min(width, -(-most // PAGE))

    def _kept_zeros(self, kept: dict[int, torch.Tensor], b: int, width: int | None,
                    dtype: torch.dtype) -> torch.Tensor:
        """``kept``'s zeroed tensor for a batch of ``b`` ([b] or [b, width]), made at its first step and never
        freed: an engine captures a graph per batch size, and each graph keeps what it was captured with. The
        kernels that use one leave it zeroed, so a step runs no fill kernel."""
        t = kept.get(b)
        if t is None:
            t = kept[b] = torch.zeros((b,) if width is None else (b, width), dtype=dtype, device=self.device)
        return t

    def _run(self, path: str, rows: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor,
             head_weights: torch.Tensor, init_tokens: int, local_tokens: int, schedule: torch.Tensor | None,
             exact_width: int, coded: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One path of a step: (positions [B, topk] int32, valid first then -1; stage-1 counts [B] int32).
        ``coded``: the keys of each request's completed pages [B] int32, as the catch-up gave them (None: here)."""
        self._warm.add(path)
        b = table.shape[0]
        wt = head_weights.reshape(b, -1).to(rows.device, torch.float32).contiguous()
        if path == "exact":
            picked = self._select_exact(rows, table, lengths, queries, wt, exact_width, init_tokens, local_tokens,
                                        schedule)
            counts1 = self._kept_zeros(self._no_stage1, b, None, torch.int32)  # never written
        else:
            picked, counts1 = self._select_pq(rows, table, lengths, queries, wt, init_tokens, local_tokens, coded)
        if picked.shape[1] < self.topk:  # fewer keys in the table than top-k
            picked = torch.cat([picked, picked.new_full((b, self.topk - picked.shape[1]), -1)], dim=1)
        return picked, counts1

    def _select_exact(self, rows: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor,
                      wt: torch.Tensor, width: int, init_tokens: int, local_tokens: int,
                      schedule: torch.Tensor | None = None) -> torch.Tensor:
        """The engine's own exact step over the first ``width`` pages of each request: FP8 logits of every
        key, the forced tokens lifted above all, top-k (valid entries first, -1 after)."""
        k = min(self.topk, width * PAGE)
        if self.use_triton and rows.is_cuda and deepgemm.unavailable() is None and deepgemm.supports_heads(wt.shape[1]):
            cache = rows.as_strided((rows.shape[0], PAGE, 1, self.head_dim + 4),
                                    (rows.stride(0), self.head_dim + 4, self.head_dim + 4, 1))
            logits = deepgemm.paged_logits(cache, table, lengths, queries, wt, width * PAGE, schedule=schedule,
                                           masked=False)
        elif self.use_triton:
            q = queries if queries.dtype == torch.float8_e4m3fn else queries.to(torch.bfloat16)
            logits = fp8_logits_paged(rows, table[:, :width].contiguous(), lengths, q.contiguous(), wt)
        else:
            keys, scales = paged_keys_reference(rows, table[:, :width], self.head_dim)
            logits = fp8_scores_reference(keys, scales, queries.float(), wt, query_fp8=True)
        forced = _forced(lengths, init_tokens, local_tokens)
        if forced is not None:  # forced tokens first, whatever they score (finite: the top-k's "nothing" is -inf)
            lift = torch.zeros_like(logits).scatter_reduce_(1, forced.clamp_min(0), (forced >= 0).float(), "amax")
            logits = torch.where(lift > 0, torch.finfo(torch.float32).max, logits)
        # each reads a row's first lengths[b] entries only, and gives -1 past a short row (its -inf)
        if self.use_triton:
            return rows_topk(logits, lengths, k, index_dtype=torch.int32)[1]
        return rows_topk_reference(logits, lengths, k)[1].to(torch.int32)

    def _select_pq(self, rows: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor,
                   wt: torch.Tensor, init_tokens: int, local_tokens: int,
                   coded: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Stages 2-4 of a step: (positions [B, k] int32, valid first; stage-1 counts [B] int32). ``coded``: the
        keys of each request's completed pages (None: computed here, a kernel)."""
        dev = rows.device
        b, w = table.shape
        q = queries.to(dev, torch.bfloat16).contiguous()  # FP8 e4m3 values are bf16 values: one cast, exact
        n_coded = torch.bitwise_and(lengths, -PAGE) if coded is None else coded  # keys of completed pages
        groups = []
        stage1 = None if w else self._kept_zeros(self._no_stage1, b, None, torch.int32)
        if w:  # the coarse stages score codes in the codebooks' space: OPQ queries rotated once
            q_code = q if self.rotation is None else rotate(q, self.rotation_bf16, torch.bfloat16)
            cand, stage1 = self._coarse(table, n_coded, q_code, wt)
            groups.append(cand)
        forced = _forced(lengths, init_tokens, local_tokens)
        if groups and forced is None and self.use_triton:  # the candidates, then the open page's keys
            positions = with_tail(groups[0], lengths, dtype=torch.int32)  # as the rescoring reads them
        else:
            positions = with_tail_reference(groups[0] if groups else lengths.new_empty(b, 0, dtype=torch.int64),
                                            lengths)
            if forced is not None:
                positions = _dedup(torch.cat([positions, forced], dim=1))
        if self.use_triton:
            exact = fp8_gather_scores_paged(rows, table, positions, q, wt, block_n=self.gather_block)
        else:
            keys, scales = paged_keys_reference(rows, table, self.head_dim)
            exact = fp8_gather_scores_reference(keys, scales, positions, q, wt, query_fp8=True)
        if forced is not None:  # forced tokens first, whatever they score
            is_forced = (positions[:, :, None] == forced[:, None, :]).any(-1) & (positions >= 0)
            exact = exact.masked_fill(is_forced, float("inf"))
        k = min(self.topk, positions.shape[1])
        # valid entries first, -1 after: both top-k's put -inf (nothing there) last with payload -1, and SGLang's
        # decode backends read the first min(n, topk) entries as KV slots, so a request shorter than top-k finds
        # all its keys there, its newest ones (the tail, after the candidate block) included
        if self.use_triton and positions.shape[1] <= SMALL_TOPK_MAX:
            scratch = None  # radix_topk leaves it zeroed: no fill kernel a step
            if final_takes_radix(b, positions.shape[1]):
                scratch = self._kept_zeros(self._radix_scratch, b, radix_scratch_words(), torch.int64)
            return final_topk(exact, k, positions, index_dtype=torch.int32, scratch=scratch)[1], stage1
        return small_topk_reference(exact, k, positions)[1].to(torch.int32), stage1

    def _coarse(self, table: torch.Tensor, n_coded: torch.Tensor, q: torch.Tensor,
                w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stages 1 and 2 over the completed pages: (C candidate positions [B, C] int64, -1 none; stage-1
        counts [B] int32)."""
        top_c = self.top_c if self.top_c != "auto" else self.auto_top_c(table.shape[0], table.shape[1], q.shape[1])
        band, most = self.growth(table.shape[1])
        capacity = self.candidates * most + BIN_SLACK  # the kept slots: the widest C of the step and its slack
        if self.use_triton and top_c == "topk":
            _, cand, counts1 = pq_coarse_topc(self.codes, n_coded, q, w, self.codebooks, self.c1, self.candidates,
                                              codebooks_bf16=self.codebooks_bf16, centroid_norms=self.centroid_norms,
                                              page_table=table, scan=self.scan, stage2=self.stage2,
                                              stage1=self.stage1_input)
            return cand, counts1
        if self.use_triton:
            b = table.shape[0]
            # stage 2 leaves it zeroed (keep_binned's counters, stage 2 of the next step)
            scratch = self._kept_zeros(self._bin_scratch, b, BIN_COUNT + 4, torch.int32)
            rows1, bins, counts1, sel = pq_coarse_bins(
                self.codes, n_coded, q, w, self.codebooks, self.c1, self.candidates, self.kept_capacity,
                self.key_bound, scratch, codebooks_bf16=self.codebooks_bf16, centroid_norms=self.centroid_norms,
                page_table=table, scan=self.scan, grow=(band, most), stage2=self.stage2, stage1=self.stage1_input)
            return keep_binned(rows1, bins, counts1, sel, scratch, capacity), counts1
        codes = paged_codes_reference(self.codes, table)
        groups = None if self.groups is None else (paged_codes_reference(self.groups[0], table), self.groups[1])
        rows1, counts1, coarse = coarse_stages_reference(codes, n_coded, q, w, self.codebooks, self.codebooks_bf16,
                                                         self.c1, (band, most), self.stage1, groups, self.stage2)
        if top_c == "topk":
            return small_topk_reference(coarse, self.candidates, rows1)[1], counts1
        bins = score_bins(coarse, score_bound(q, w, self.key_bound))
        live = (torch.arange(coarse.shape[1], device=coarse.device)[None, :] < counts1[:, None]) & (rows1 >= 0)
        c = grown_counts(self.candidates, n_coded, band, most)
        sel = boundary_of_bins(bins, live, c, c + self.kept_capacity - self.candidates)
        return keep_binned_reference(rows1.to(torch.int32), bins, counts1, sel, capacity), counts1

    @property
    def stage1_input(self):
        """What the coarse kernels' ``stage1`` argument takes for this selector: None (the codes), the group codes'
        (codes, codebooks, norms), or ``"folds"``."""
        return "folds" if self.stage1 == "folds" else self.groups

    def gpu_bytes(self) -> int:
        """Device bytes the selector holds beside the engine's cache (codes, group codes, signatures, flags)."""
        held = (self.codes, self.signature, self.valid) + (() if self.groups is None else (self.groups[0],))
        return sum(t.numel() * t.element_size() for t in held)


# what stage 1 scores: the keys' codes, their group codes (half the bytes), or the codes by 16 folded queries
STAGE1S = ("codes", "groups", "folds")


def fold_scan_unavailable(device: torch.device | str, use_triton: bool | None = None) -> str | None:
    """Why stage 1 by the fold scan cannot run on ``device`` (None: it can): a CUDA device where the kernel does
    not compile. Elsewhere (the CPU, or ``use_triton`` off) the torch path scores the folds."""
    device = torch.device(device)
    if device.type == "cuda" and use_triton is not False and not fold_compiles(device):
        return "the fold scan did not compile on this GPU (NVRTC through torch.cuda._compile_kernel)"
    return None


def check_folds(dim: int, subspaces: int, centroids: int, residual: bool, device: torch.device,
                use_triton: bool) -> None:
    """Refuse ``stage1="folds"`` at startup (:class:`DsaIndexError`, naming the way out) for codes the folds cannot
    score, or on a GPU where the fold scan does not compile."""
    why = fold_takes(2, dim, subspaces, centroids, residual)
    if why is not None:
        raise DsaIndexError(f"stage1 'folds': {why}.", "pass stage1='codes'.")
    why = fold_scan_unavailable(device, use_triton)
    if why is not None:
        raise DsaIndexError(f"stage1 'folds': {why}.", "set CUDA_HOME to the CUDA toolkit, or pass stage1='codes'.")


def _exact_warm_up(args: tuple, width: int) -> tuple:
    """A step's arguments for a run of the exact path that only compiles it (before a graph capture), on a
    step whose requests are longer than the ``width`` pages it reads: their lengths clamped to those pages
    and no schedule. DeepGEMM's paged logits write a column for every key of a request's length, so the
    real lengths would write past the ``width`` x 64 columns of its output."""
    rows, table, lengths, queries, head_weights, init_tokens, local_tokens, _ = args
    return (rows, table, lengths.clamp_max(width * PAGE), queries, head_weights, init_tokens, local_tokens, None,
            width)


def bins_batch_limit(stage1: int) -> int:
    """The most requests whose stage 2 keeps its candidates by score bins under ``top_c="auto"``, at a stage 1
    of ``stage1`` keys (P x C): their stage 1 keeps at most :data:`BINS_UP_TO_KEYS` keys in all."""
    return BINS_UP_TO_KEYS // max(1, stage1)


def growth_limit(candidates: int, forced: int = 128) -> int:
    """The most a C of ``candidates`` may grow by in the paged step (a power of two, at least 1): its grown
    candidates, their bin slack, the open page and ``forced`` tokens fit the final top-k's one program."""
    most = 1
    while candidates * most * 2 + BIN_SLACK + PAGE + forced <= SMALL_TOPK_MAX:
        most *= 2
    return most


def growth_setting(band: int, most: int | None, candidates: int) -> tuple[int, int]:
    """(band, most) of C grown past ``band`` keys by up to ``most`` x (default: :func:`growth_limit`),
    checked; (0, 1) where C stays fixed."""
    band = int(band)
    if band < 0:
        raise DsaIndexError(f"grow_band {band} is negative.", "pass 0 (a fixed C) or the keys past which C grows.")
    limit = growth_limit(candidates)
    most = limit if most is None else int(most)
    if most < 1 or most & (most - 1) or most > limit:
        raise DsaIndexError(f"grow_most {most}: C = {candidates:,} may grow by a power of two up to {limit} (the "
                            f"final top-k holds {SMALL_TOPK_MAX:,} entries).", f"pass a power of two up to {limit}.")
    return (band, most) if band and most > 1 else (0, 1)


def _growth_setting(band: int, most: int | None, candidates: int, top_c: str) -> tuple[int, int]:
    """(band, most) of a :class:`PagedCacheSelector`'s ``grow_band`` / ``grow_most``, checked."""
    band, most = growth_setting(band, most, candidates)
    if band and top_c == "topk":
        raise DsaIndexError("top_c='topk' keeps one C for every request of a step; a C grown by length needs bins.",
                            "pass top_c='auto' or 'bins', or grow_band=0.")
    return band, most


def stage1_scan(codecs, device: torch.device | None = None) -> str:
    """What stage 1's selecting pass runs for the served ``codecs`` (PQ codecs, or the layers' dict of them) on
    ``device`` (default: the current CUDA device, if any) under the default ``scan="auto"``, in words; with the
    CUDA scan, also where the default ``stage2="auto"`` runs the CUDA stage 2."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    chosen = {}
    for codec in (codecs.values() if isinstance(codecs, dict) else codecs):
        m, k = codec.codebooks.shape[:2]
        chosen[(m, k)] = resolve_scan("auto", m, k, True, device)
    if chosen and all(v == "cuda" for v in chosen.values()):
        said = "stage 1 looks codes up in shared memory (the CUDA scan)"
        if all(m == 32 and k == 256 for m, k in chosen) and stage2_compiles(device):
            form = "8-bit" if stage2_compiles(device, int8=True) else "bf16"
            said += (f"; stage 2 scores 64-head steps of at least {STAGE2_CUDA_FROM_SLOTS:,} candidate slots (B x 2 "
                     f"x P x C, C as grown) with codebooks in shared memory (the CUDA kernel, {form} operands) and keeps their "
                     "candidates by bins")
        return said
    no_gpu = device.type != "cuda" or not available()
    why = "no CUDA device with NVRTC here" if no_gpu else "codes of other than 32 subspaces of 256 centroids"
    if "cuda" in chosen.values():
        return f"stage 1 runs the CUDA scan on layers of 32 subspaces, the Triton scan on the others ({why})"
    return f"stage 1 runs the Triton scan ({why})"


def describe_step(exact_below: int, stage1: list[int] | set[int] | tuple[int, ...], scan: str = "",
                  grows: bool = False, folds: bool = False) -> str:
    """The paged step's own choices, for a server's startup log: which steps take the exact path
    (``exact_below``, 0: none), how stage 2 keeps its candidates at each of the served layers' stage-1
    widths ``stage1`` (P x C keys, the default ``top_c="auto"``; ``grows``: C grows by length on some layer,
    whose steps over page tables wider than its band keep them by bins), and ``scan`` (:func:`stage1_scan`'s
    words); ``folds``: some layer's stage 1 is the fold scan, whose bound is higher."""
    if exact_below > 0:
        share = (f"{grown_offset_words()} x P x C, g the growth of its C"
                 if grows else f"{PAGED_EXACT_OFFSET} x P x C")
        exact = (f"a decode step of B requests whose longest has N keys is scored exactly (the engine's logits + "
                 f"top-k) while B x (N - {share}) <= {exact_below:,} (DSAINDEX_EXACT_BELOW"
                 f"{f', plus {PAGED_FOLDS_EXTRA_BELOW:,} where stage 1 is the fold scan' if folds else ''}), "
                 "by the codes above")
    else:
        exact = "every decode step is selected by the codes (no exact path)"
    rules = []
    for width in sorted(set(stage1)):
        most = bins_batch_limit(width)
        rules.append(f"up to {most} requests at a stage 1 of {width:,} keys" if most else
                     f"no step at a stage 1 of {width:,} keys")
    kept = f"stage 2 keeps its candidates by score bins for {', '.join(rules)}, by a top-C kernel above"
    if grows:
        kept += " (by bins at any batch size where a request's C can grow: one C a step is what a top-C kernel keeps)"
    return f"{exact}; {scan + '; ' if scan else ''}{kept}"


def exact_shares(stage1: int, grows: bool = False) -> tuple[int, int]:
    """The exact-path rule's default (``exact_offset``, ``grown_extra``) of a selector whose stage 1 keeps
    ``stage1`` keys (P x C): :data:`~dsaindex.coarse.PAGED_EXACT_OFFSET` stage-1 widths, or where C grows by length
    (``grows``) :data:`~dsaindex.coarse.PAGED_GROWN_OFFSET`; and :data:`~dsaindex.coarse.PAGED_GROWN_EXTRA`."""
    return (PAGED_GROWN_OFFSET if grows else PAGED_EXACT_OFFSET) * stage1, int(PAGED_GROWN_EXTRA * stage1)


def takes_exact_path(batch: int, longest: int, exact_below: int, exact_offset: int,
                     grow: tuple[int, int] = (0, 1), grown_extra: int = 0) -> bool:
    """The exact-path rule of :class:`PagedCacheSelector`: B x (N - offset) at most the bound (0: never); with
    ``grow`` (band, most), the offset is ``exact_offset`` x g + ``grown_extra`` x (g - 1), g the longest
    request's growth (:func:`growth_of`)."""
    g = growth_of(longest, *grow)
    return exact_below > 0 and batch * (longest - exact_offset * g - grown_extra * (g - 1)) <= exact_below


def _capturing_graph(device: torch.device):
    """The CUDA graph being captured on ``device``'s current stream, where this torch can put conditional
    nodes in it (``begin_capture_to_if_node``); else None."""
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        return None
    current = getattr(torch.cuda.CUDAGraph, "get_currently_capturing_graph", None)
    graph = current() if current is not None else None
    return graph if graph is not None and hasattr(graph, "begin_capture_to_if_node") else None


def device_bytes_per_key(subspaces: int, head_dim: int = 128) -> float:
    """Device bytes :class:`PagedCacheSelector` keeps per key of the engine's cache: ``subspaces`` bytes of
    code, and per 64-key page its signature (8 bytes a word) and its valid flag."""
    return subspaces + (8 * len(signature_words(head_dim)) + 1) / PAGE


def _forced(lengths: torch.Tensor, init_tokens: int, local_tokens: int) -> torch.Tensor | None:
    """The tokens an engine's indexer always keeps: the first ``init_tokens`` and the last ``local_tokens``
    of each request ([B, init + local] int64, -1 where a request is shorter)."""
    if init_tokens <= 0 and local_tokens <= 0:  # no kernel where nothing is forced
        return None
    lengths = lengths.long()
    parts = []
    dev = lengths.device
    if init_tokens > 0:
        init = torch.arange(init_tokens, device=dev)[None, :].expand(lengths.shape[0], -1)
        parts.append(torch.where(init < lengths[:, None], init, torch.full_like(init, -1)))
    if local_tokens > 0:
        local = lengths[:, None] - 1 - torch.arange(local_tokens, device=dev)[None, :]
        parts.append(torch.where(local >= 0, local, torch.full_like(local, -1)))
    return torch.cat(parts, dim=1) if parts else None


def _dedup(positions: torch.Tensor) -> torch.Tensor:
    """-1 in place of repeated positions of a row (sort, mark repeats; the row keeps its length)."""
    srt, _ = positions.sort(dim=1)
    repeat = torch.zeros_like(srt, dtype=torch.bool)
    repeat[:, 1:] = srt[:, 1:] == srt[:, :-1]
    return torch.where(repeat, torch.full_like(srt, -1), srt)


def to_slots(positions: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """Request-local positions [B, k] (-1 = none) as page_size=1 KV slots, ``page_table[b, p // 64] * 64 +
    p % 64`` (int32, -1 kept): the form SGLang's fused top-k hands its sparse attention."""
    safe = positions.long().clamp_min(0)
    slots = page_table.long().gather(1, safe // PAGE) * PAGE + safe % PAGE
    return torch.where(positions >= 0, slots, torch.full_like(slots, -1)).to(torch.int32)
