"""``dsaindex bench decode``: one decode step's key selection, PQ coarse-to-fine against exact scoring.

Timing (synthetic keys, every request at the same length; medians of ``triton.testing.do_bench``):

* ``pq_warm``: a step of :class:`dsaindex.runtime.pq_batch.PQDecodeGroup` whose candidates are all in
  the device cache (consecutive decode steps ask for nearly the same keys);
* ``pq_cold``: the same step with an empty cache: every kept candidate is read from pinned host memory;
* ``triton_fp8_logits``: :func:`dsaindex.kernels.fp8_score.fp8_logits`, every FP8 key's score written
  (FP8 x FP8 products, as DeepGEMM's logits), the portable counterpart of ``deepgemm_logits``;
* ``exact_fp8_triton``: those logits and :func:`dsaindex.kernels.topk.rows_topk`, the exact path where
  DeepGEMM does not import (the runtime's fallback scorer);
* ``engine_paged``: :class:`dsaindex.runtime.paged_select.PagedCacheSelector`, the step the SGLang and
  vLLM plugins run over the engine's own paged index-K cache (codes per physical page, a signature
  check of every page, C candidates rescored from the FP8 pages in place; no host cache);
* ``torch_exact``: bf16 keys, batched matmul, ReLU, weighted head sum, ``torch.topk``;
* HBM floors: the bytes each path must read at about 3.77 TB/s (132 B per exact key, 32 B per PQ32 code).

Recall (``--recall-store`` with ``--artifacts``): held-out queries of a capture store, each one a
request holding its causal prefix, one cold step of the PQ path against exact FP8 top-k.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from dsaindex.coarse import DIRECT_UPTO, FILTER_WIDTH, PREFILTER
from dsaindex.console import at_least
from dsaindex.pipelines.bench.timing import graph_median_ms, kernel_profile, median_ms

HBM_BYTES_PER_S = 3.77e12  # read bandwidth measured on the H200 (DESIGN: 132 B/key -> ~35 us per 1M keys)


def synthetic_state(batch: int, keys: int, heads: int, subspaces: int, seed: int = 0, device: str = "cuda"):
    """Random FP8 keys [B, N, 128] uint8 + scales on ``device`` (the GPU by default), random PQ codes,
    codebooks, queries, weights."""
    import torch

    from dsaindex.quant import fp8_quantize

    g = torch.Generator(device=device).manual_seed(seed)
    dim = 128
    fp8 = torch.empty(batch, keys, dim, dtype=torch.uint8, device=device)
    scales = torch.empty(batch, keys, dtype=torch.float32, device=device)
    for b in range(batch):
        for start in range(0, keys, 1 << 20):
            n = min(1 << 20, keys - start)
            x = torch.randn(n, dim, device=device, generator=g)
            c, s = fp8_quantize(x)
            fp8[b, start : start + n] = c.view(torch.uint8)
            scales[b, start : start + n] = s.reshape(-1)
    codes = torch.randint(0, 256, (batch, keys, subspaces), device=device, generator=g, dtype=torch.int32).to(torch.uint8)
    codebooks = torch.randn(subspaces, 256, dim // subspaces, device=device, generator=g) * 0.5
    q = torch.randn(batch, heads, dim, device=device, generator=g).to(torch.bfloat16)
    w = torch.rand(batch, heads, device=device, generator=g) * heads**-0.5 * dim**-0.5
    return fp8, scales, codes, codebooks, q, w


def synthetic_rotation(dim: int = 128, seed: int = 0):
    """A random orthogonal [dim, dim] matrix (an OPQ codec's rotation, for timing)."""
    import torch

    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def pq_group_over(fp8, scales, codes, codebooks, topk, candidates, prefilter, cache, exact_below=0, rotation=None,
                  residual=False, *, codec=None, device: str = "cuda", host=None, grow_band: int = 0, **options):
    """A :class:`PQDecodeGroup` whose history is the given keys (host pages = the FP8 keys, codes as given;
    ``keys`` a whole number of 64-key pages), with the length policy at ``exact_below`` keys; a residual
    codec (RQ) when ``residual`` (``codebooks`` [M, K, D]). ``codec``: a trained codec to serve instead of
    one built from ``codebooks`` (a bundle's layer); ``host``: a host key store with room for the keys'
    pages (default: a new one; :meth:`PQDecodeGroup.free_all` gives the pages back); ``options``: further
    arguments of the group (``direct_upto``, ``filter_width``, ``use_triton``, ...); ``grow_band``: C grown past it
    (:meth:`PQDecodeGroup.grow_past`, before the keys are loaded: it sizes the device cache)."""
    from dsaindex.pq import PQCodec
    from dsaindex.runtime.host_store import HostKeyStore
    from dsaindex.runtime.pq_batch import PQDecodeGroup

    batch, keys, dim = fp8.shape
    host = HostKeyStore(batch * -(-keys // 64), dim) if host is None else host
    codec = PQCodec(codebooks.float().cpu(), rotation=rotation, residual=residual) if codec is None else codec
    group = PQDecodeGroup(codec, host, batch, keys, topk, candidates=candidates,
                          prefilter=prefilter, cache_capacity=cache, device=device, exact_below=exact_below, **options)
    if grow_band:
        group.grow_past(grow_band)
    for b in range(batch):
        group.admit(b)
        group.load_encoded(b, codes[b], fp8[b], scales[b])
    return group


LOGITS_CONFIGS = [dict(block_n=64, iters=4, num_warps=4), dict(block_n=128, iters=4, num_warps=4),
                  dict(block_n=64, iters=4, num_warps=4, num_stages=4)]
LINEAR_CONFIGS = [dict(), dict(block_n=128, iters=8, num_warps=4, stream=0), dict(block_n=512, iters=2, num_warps=8),
                  dict(block_n=256, iters=4, num_warps=4)]


CPU_REPEATS = 5  # synchronized calls whose median times a step on the CPU (the kernels' torch references)


def timed(fn: Callable[[], Any], graphs: bool, device: str = "cuda") -> tuple[float, str]:
    """Median ms of ``fn`` replayed from a CUDA graph (:func:`~dsaindex.pipelines.bench.timing.graph_median_ms`,
    what a decode server runs), or eagerly (:func:`~dsaindex.pipelines.bench.timing.median_ms`) where
    capture fails (the reason is returned). On a ``device`` other than CUDA: the median of
    :data:`CPU_REPEATS` synchronized calls after a warm-up call (mode ``eager``)."""
    import torch

    if not str(device).startswith("cuda"):
        return median_ms(fn, CPU_REPEATS, device=device), "eager"
    if graphs:
        try:
            return graph_median_ms(fn), "cuda-graph"
        except Exception as err:  # noqa: BLE001  (report it, time eagerly)
            torch.cuda.synchronize()
            reason = f"eager ({type(err).__name__}: {str(err)[:100]})"
            return median_ms(fn), reason
    return median_ms(fn), "eager"


def best_of(configs: list[dict], make_fn: Callable[[dict], Callable[[], Any]], graphs: bool,
            device: str = "cuda") -> tuple[float, dict, str]:
    """Fastest launch configuration: (ms, config, timing mode)."""
    results = [(*timed(make_fn(cfg), graphs, device), cfg) for cfg in configs]
    ms, mode, cfg = min(results, key=lambda r: r[0])
    return ms, cfg, mode


def pq_step_ms(group, queries, head_weights, graphs: bool, device: str = "cuda") -> tuple[float, dict, str]:
    """Median ms of a :class:`PQDecodeGroup`'s step for ``queries`` [B, H, D] and ``head_weights`` [B, H],
    timed after one step (compilation; a cached step's device cache filled, as consecutive decode steps
    find it), at the fastest stage-1 launch configuration of :data:`LINEAR_CONFIGS` (the torch references
    take none: timed once): (ms, configuration, timing mode). The group keeps that configuration."""

    def step(cfg):
        group.linear_config = cfg
        return lambda: group.select(queries, head_weights)

    group.select(queries, head_weights)  # compile, fill the cache
    ms, cfg, mode = best_of(LINEAR_CONFIGS if group.use_triton else [{}], step, graphs, device)
    group.linear_config = cfg
    return ms, cfg, mode


def triton_exact_ms(fp8, scales, lengths, queries, head_weights, topk: int, graphs: bool):
    """The exact FP8 path on Triton over keys ``fp8`` [B, N, D] uint8 + ``scales`` [B, N] (``lengths`` [B]
    int32): ``triton_fp8_logits`` (the fastest of :data:`LOGITS_CONFIGS`) and ``exact_fp8_triton`` (those
    logits + :func:`~dsaindex.kernels.topk.rows_topk`). Returns (median ms by name, timing mode by name,
    the logits' launch configuration, the threshold top-k's counts per request)."""
    from dsaindex.kernels.fp8_score import fp8_logits
    from dsaindex.kernels.topk import rows_topk

    ms: dict[str, float] = {}
    modes: dict[str, str] = {}

    def logits_step(cfg):
        return lambda: fp8_logits(fp8, scales, lengths, queries, head_weights, **cfg)

    ms["triton_fp8_logits"], exact_cfg, modes["triton_fp8_logits"] = best_of(LOGITS_CONFIGS, logits_step, graphs)
    ms["exact_fp8_triton"], modes["exact_fp8_triton"] = timed(
        lambda: rows_topk(fp8_logits(fp8, scales, lengths, queries, head_weights, **exact_cfg), lengths, topk), graphs)
    exact_counts = rows_topk(fp8_logits(fp8, scales, lengths, queries, head_weights, **exact_cfg), lengths, topk,
                             return_counts=True)[2].tolist()
    return ms, modes, exact_cfg, exact_counts


def deepgemm_ms(fp8, scales, lengths, queries, head_weights, topk: int, graphs: bool, profile: bool = False) -> dict:
    """The engines' exact indexer over the same keys in their paged layout (call it where
    :func:`dsaindex.kernels.deepgemm.unavailable` is None): DeepGEMM's logits alone (``deepgemm_logits``),
    with ``torch.topk`` (``deepgemm_logits_topk``), with the threshold top-k (``deepgemm_logits_fast_topk``)
    and the faster of those two (``deepgemm_best``). Returns {"ms": median ms by name, "modes": timing mode
    by name, "fast_counts": the threshold top-k's counts per request, "profile": the threshold path's
    kernel profile with ``profile``, else None}."""
    from dsaindex.kernels import deepgemm
    from dsaindex.kernels.topk import rows_topk

    keys = fp8.shape[1]
    cache_pages, table = deepgemm.paged_cache(fp8, scales)
    schedule = deepgemm.paged_schedule(lengths)

    def dg_logits(masked: bool = False):
        return deepgemm.paged_logits(cache_pages, table, lengths, queries, head_weights, keys, schedule, masked=masked)

    ms: dict[str, float] = {}
    modes: dict[str, str] = {}
    dg_logits()  # JIT compilation happens outside the timing
    ms["deepgemm_logits"], modes["deepgemm_logits"] = timed(dg_logits, graphs)
    ms["deepgemm_logits_topk"], modes["deepgemm_logits_topk"] = timed(
        lambda: dg_logits(masked=True).topk(topk, dim=1), graphs)
    ms["deepgemm_logits_fast_topk"], modes["deepgemm_logits_fast_topk"] = timed(
        lambda: rows_topk(dg_logits(), lengths, topk), graphs)
    fast_counts = rows_topk(dg_logits(), lengths, topk, return_counts=True)[2].tolist()
    profiled = kernel_profile(lambda: rows_topk(dg_logits(), lengths, topk)) if profile else None
    ms["deepgemm_best"] = min(ms["deepgemm_logits_topk"], ms["deepgemm_logits_fast_topk"])
    return {"ms": ms, "modes": modes, "fast_counts": fast_counts, "profile": profiled}


def torch_exact_step(fp8, scales, queries, head_weights, topk: int) -> Callable[[], Any]:
    """The ``torch_exact`` baseline's step over keys ``fp8`` [B, N, D] uint8 + ``scales`` [B, N], dequantized
    to bf16 once (the step holds them; the FP8 keys may be freed): :func:`torch_exact_scores`, then
    ``torch.topk``."""
    import torch

    keys = fp8.view(torch.float8_e4m3fn).to(torch.bfloat16) * scales.unsqueeze(-1).to(torch.bfloat16)
    return lambda: torch_exact_scores(keys, queries, head_weights).float().topk(topk, dim=1)


def torch_exact_scores(keys, queries, head_weights):
    """The ``torch_exact`` baseline's scores [B, N] (in the keys' dtype) of ``keys`` [B, N, D] for one query
    per request, ``queries`` [B, H, D] and ``head_weights`` [B, H]: one batched matmul, ReLU, the weighted
    head sum as a second matmul."""
    import torch

    # not dsaindex.score's fp32 score on purpose: a bf16 torch baseline is the fair one (tested against it)
    logits = torch.bmm(keys, queries.transpose(1, 2))  # [B, N, H]
    return (torch.relu(logits) @ head_weights.to(keys.dtype).unsqueeze(-1)).squeeze(-1)


def time_case(batch: int, keys: int, heads: int, topk: int, candidates: int, prefilter: int, cache: int,
              subspaces: int = 32, graphs: bool = True, profile: bool = False, exact_below: int = 0,
              pq_from: dict[int, int] | None = None, opq: bool = False, direct_upto: int = 0, rq: bool = False) -> dict:
    import torch

    from dsaindex.kernels import deepgemm

    fp8, scales, codes, codebooks, q, w = synthetic_state(batch, keys, heads, subspaces)
    lengths = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
    rotation = synthetic_rotation() if opq else None  # OPQ: one query rotation more per step
    group = pq_group_over(fp8, scales, codes, codebooks, topk, candidates, prefilter, cache, rotation=rotation)
    ms: dict[str, float] = {}
    modes: dict[str, str] = {}

    def warm_step(cfg):
        group.linear_config = cfg
        return lambda: group.select(q, w)

    def cold_step(cfg):
        group.linear_config = cfg

        def step():
            group.cache_pos.fill_(-1)
            return group.select(q, w)

        return step

    ms["pq_warm"], linear_cfg, modes["pq_warm"] = pq_step_ms(group, q, w, graphs)
    _, stats = warm_step(linear_cfg)()
    warm = stats.totals()
    profiles = {"pq_warm": kernel_profile(warm_step(linear_cfg))} if profile else {}
    ms["pq_cold"], modes["pq_cold"] = timed(cold_step(linear_cfg), graphs)
    _, stats = cold_step(linear_cfg)()
    cold_stats = stats.totals()
    host_reads = group.host_reads
    group.direct_upto = batch  # the same step with every candidate read straight from the host store
    ms["pq_direct"], modes["pq_direct"] = timed(warm_step(linear_cfg), graphs)
    _, stats = warm_step(linear_cfg)()
    direct_stats = stats.totals()
    if profile:
        profiles["pq_direct"] = kernel_profile(warm_step(linear_cfg))
    group.direct_upto = 0
    rq_stats = None
    if rq:  # the same codes read as a residual code's: whole-key codewords, summed in stage 2
        rq_stats = _time_residual(fp8, scales, codes, topk, candidates, prefilter, cache, q, w, linear_cfg, graphs,
                                  ms, modes, profiles if profile else None)

    exact_ms, exact_modes, exact_cfg, exact_counts = triton_exact_ms(fp8, scales, lengths, q, w, topk, graphs)
    ms |= exact_ms
    modes |= exact_modes
    deepgemm_note = deepgemm.unavailable()
    if deepgemm_note is None:  # the engines' exact indexer, in their paged layout
        dg = deepgemm_ms(fp8, scales, lengths, q, w, topk, graphs, profile)
        ms |= dg["ms"]
        modes |= dg["modes"]
        fast_counts = dg["fast_counts"]
        if profile:
            profiles["deepgemm_fast_topk"] = dg["profile"]
    ms["engine_paged"], modes["engine_paged"], paged_profile = engine_paged_step(
        fp8, scales, codes, codebooks, q, w, topk, candidates, prefilter, graphs, profile, rotation=rotation)
    if paged_profile is not None:
        profiles["engine_paged"] = paged_profile
    pq_cache_bytes = group.gpu_bytes()["cache"]
    group = None
    torch.cuda.empty_cache()
    # the length policy's exact path: the same group with every request below its length
    short_group = pq_group_over(fp8, scales, codes, codebooks, topk, candidates, prefilter, cache, exact_below=keys,
                                rotation=rotation)
    # the scheduling metadata depends only on the lengths: computed once per step for every layer, as
    # the engines do (and as the DeepGEMM baseline above is timed)
    exact_schedule = short_group.exact_schedule(heads)
    ms["exact_path"], modes["exact_path"] = timed(lambda: short_group.select(q, w, exact_schedule), graphs)
    exact_scorer = short_group.exact_scorer(heads)
    short_group = None
    torch.cuda.empty_cache()
    from dsaindex.runtime.pq_batch import pq_limit

    policy_path = "exact" if keys <= exact_below and keys < pq_limit(pq_from or {}, batch) else "pq"
    if policy_path == "pq" and batch <= direct_upto:
        policy_path = "pq-direct"
    ms["policy"] = {"exact": ms["exact_path"], "pq": ms["pq_warm"], "pq-direct": ms["pq_direct"]}[policy_path]
    torch_exact = torch_exact_step(fp8, scales, q, w, topk)
    group = fp8 = codes = None  # free the device memory the torch baseline needs
    torch.cuda.empty_cache()
    ms["torch_exact"], modes["torch_exact"] = timed(torch_exact, graphs)
    torch_exact = None
    torch.cuda.empty_cache()
    floors = {"exact_fp8": batch * keys * 132 / HBM_BYTES_PER_S * 1e3, "pq32": batch * keys * 32 / HBM_BYTES_PER_S * 1e3}
    return {
        "batch": batch, "keys": keys,
        "median_ms": {k: round(v, 4) for k, v in ms.items()},
        "timing": modes,
        "hbm_floor_ms": {k: round(v, 4) for k, v in floors.items()},
        "speedup_vs_exact_fp8": {"pq_warm": round(ms["exact_fp8_triton"] / ms["pq_warm"], 3),
                                 "pq_cold": round(ms["exact_fp8_triton"] / ms["pq_cold"], 3)},
        "policy": {"exact_below": exact_below, "pq_from": pq_from or {}, "direct_upto": direct_upto, "path": policy_path,
                   "exact_scorer": exact_scorer},
        "speedup_vs_deepgemm_topk": ({"pq_warm": round(ms["deepgemm_best"] / ms["pq_warm"], 3),
                                      "pq_direct": round(ms["deepgemm_best"] / ms["pq_direct"], 3),
                                      "engine_paged": round(ms["deepgemm_best"] / ms["engine_paged"], 3),
                                      "pq_cold": round(ms["deepgemm_best"] / ms["pq_cold"], 3),
                                      "exact_path": round(ms["deepgemm_best"] / ms["exact_path"], 3),
                                      "policy": round(ms["deepgemm_best"] / ms["policy"], 3)}
                                     | ({k: round(ms["deepgemm_best"] / ms[k], 3) for k in ("rq_warm", "rq_direct")}
                                        if rq else {})
                                     if deepgemm_note is None else None),
        "triton_logits_vs_deepgemm_logits": (round(ms["triton_fp8_logits"] / ms["deepgemm_logits"], 3)
                                             if deepgemm_note is None else None),
        "deepgemm": deepgemm_note or ("sgl-deep-gemm fp8_paged_mqa_logits (pages of 64, next_n 1); top-k: torch.topk "
                                      "and the threshold select of kernels/topk.py; deepgemm_best is the faster"),
        "deepgemm_fast_topk_counts_minmax": [min(fast_counts), max(fast_counts)] if deepgemm_note is None else None,
        "launch_configs": {"pq_stage1": linear_cfg, "triton_fp8_logits": exact_cfg},
        "pq_step_counts": {"warm": warm, "cold": cold_stats, "direct": direct_stats},
        "rq_step_counts": rq_stats,
        "pq_host_reads": host_reads,
        "profile": profiles or None,
        "exact_threshold_counts_minmax": [min(exact_counts), max(exact_counts)],
        "gpu_bytes_per_request": {"exact_fp8": keys * 132, "pq_index": keys * subspaces,
                                  "pq_cache_and_tail": pq_cache_bytes},
    }


def _time_residual(fp8, scales, codes, topk, candidates, prefilter, cache, q, w, linear_cfg, graphs, ms, modes,
                   profiles) -> dict:
    """Time the decode step with a residual codec (RQ, M whole-key codebooks of 256 codewords) over the same
    keys and codes as the PQ step, in its warm, cold and direct forms: ``ms["rq_warm"]`` etc. Returns the
    steps' counts."""
    import torch

    m, dim = codes.shape[2], fp8.shape[2]
    g = torch.Generator(device="cuda").manual_seed(1)
    books = torch.randn(m, 256, dim, device="cuda", generator=g) * m**-0.5  # decoded keys of about unit scale
    group = pq_group_over(fp8, scales, codes, books, topk, candidates, prefilter, cache, residual=True)
    group.linear_config = linear_cfg
    group.select(q, w)  # compile, fill the cache

    def cold():
        group.cache_pos.fill_(-1)
        return group.select(q, w)

    ms["rq_warm"], modes["rq_warm"] = timed(lambda: group.select(q, w), graphs)
    counts = {"warm": group.select(q, w)[1].totals()}
    if profiles is not None:
        profiles["rq_warm"] = kernel_profile(lambda: group.select(q, w))
    ms["rq_cold"], modes["rq_cold"] = timed(cold, graphs)
    counts["cold"] = cold()[1].totals()
    group.direct_upto = fp8.shape[0]
    ms["rq_direct"], modes["rq_direct"] = timed(lambda: group.select(q, w), graphs)
    counts["direct"] = group.select(q, w)[1].totals()
    # a completed page's encoding as the group runs it (once per 64 decode steps of a request): the beam
    # search kernel, against PQ's argmin kernel
    page = torch.randn(64, dim, device="cuda", generator=g)
    ms["rq_page_encode"], modes["rq_page_encode"] = median_ms(lambda: group.encode_keys(page)), "eager"
    from dsaindex.kernels.pq_select import pq_encode

    pq_books = torch.randn(m, 256, dim // m, device="cuda", generator=g)
    ms["pq_page_encode"], modes["pq_page_encode"] = median_ms(lambda: pq_encode(page, pq_books)), "eager"
    return counts


def engine_paged_step(fp8, scales, codes, codebooks, q, w, topk, candidates, prefilter, graphs,
                      profile: bool = False, rotation=None) -> tuple[float, str, Any]:
    """(median ms, timing mode, kernel profile or None) of the engine plugins' step over the engines' paged
    cache of the same keys and codes."""
    import torch

    from dsaindex.kernels import deepgemm
    from dsaindex.pq import PQCodec
    from dsaindex.runtime.paged_select import PagedCacheSelector

    batch, keys, _ = fp8.shape
    cache, table = deepgemm.paged_cache(fp8, scales)
    selector = PagedCacheSelector(PQCodec(codebooks.float().cpu(), rotation=rotation), cache.shape[0], topk,
                                  candidates=candidates,
                                  prefilter=prefilter, device="cuda")
    selector.adopt(cache, table.reshape(-1), codes.reshape(-1, 64, codes.shape[2]))
    lengths = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
    step = lambda: selector.select(cache, table, lengths, q, w, eager_refresh=False)  # noqa: E731
    step()
    ms, mode = timed(step, graphs)
    if int(selector.stats.stale.sum()) or int(selector.stats.encoded.sum()):
        raise RuntimeError("the paged selector found stale pages in the benchmark's adopted codes")
    return ms, mode, kernel_profile(step) if profile else None


STEP_MODES = ("filter", "rerank", "direct")  # the cold steps :func:`served_step` runs (see there)


def served_step(codec, prefixes: list, queries, head_weights, topk: int, candidates: int, prefilter: int, cache: int,
                mode: str, device: str, use_triton: bool | None = None, encoded: list | None = None, host=None,
                filter_width: float = FILTER_WIDTH, grow_band: int = 0, stage2: str = "auto", stage1: str = "codes"):
    """One cold decode step of the runtime's :class:`~dsaindex.runtime.pq_batch.PQDecodeGroup` for a batch of
    requests, each holding its causal prefix (``prefixes``: one [n_b, D] engine-key tensor a request) and
    asking with one query (``queries`` [B, H, D], ``head_weights`` [B, H]).

    ``mode``: ``filter`` (the cached step with the miss filter at ``filter_width``; the cache empty, so every
    candidate is a miss), ``rerank`` (the same without the filter: every candidate rescored) or ``direct``
    (candidates read straight from the host store). ``encoded``: per request (codes [n, M] uint8, FP8 bits
    [n, D] uint8, scales [n]) of its first n keys, n a whole number of pages, as a prefill that encoded them
    hands them over (the rest is appended); default: every key appended and its completed pages encoded
    by the group. ``host``: a host key store with room for the prefixes' pages (default: a new one); the
    pages are given back to it after the step. ``grow_band``: C grows with each request's prefix past this
    many keys (:meth:`~dsaindex.runtime.pq_batch.PQDecodeGroup.grow_past`; a step past it rescores every
    candidate, as the server runs it, whatever ``mode``); ``stage2``: stage 2's kernel on a GPU; ``stage1``: what
    stage 1 scores (codes or group codes). Returns
    (positions [B, topk] int64, the step's stats)."""
    from dsaindex.runtime.host_store import HostKeyStore
    from dsaindex.runtime.pq_batch import PQDecodeGroup

    lengths = [x.shape[0] for x in prefixes]
    own_host = host is None
    if own_host:
        host = HostKeyStore(sum(-(-n // 64) for n in lengths) + len(lengths), prefixes[0].shape[1])
    group = PQDecodeGroup(codec, host, len(lengths), max(lengths), topk, candidates=candidates,
                          prefilter=prefilter, cache_capacity=cache, miss_filter=mode == "filter",
                          device=device, use_triton=use_triton, filter_width=filter_width,
                          direct_upto=len(lengths) if mode == "direct" else 0, stage2=stage2, stage1=stage1)
    if grow_band:
        group.grow_past(grow_band)
    for slot, keys in enumerate(prefixes):
        group.admit(slot)
        done = 0
        if encoded is not None:
            codes, fp8, scales = encoded[slot]
            done = codes.shape[0]
            if done:
                group.load_encoded(slot, codes, fp8, scales)
        if done < keys.shape[0]:
            group.append(slot, keys[done:])
    picked, stats = group.select(queries, head_weights)
    if not own_host:
        group.free_all()
    return picked, stats


def exact_topk_of_prefixes(prefixes: list, queries, head_weights, topk: int, device: str):
    """The exact FP8 top-``topk`` positions [B, topk] int64 of each request's prefix (``prefixes``: one
    [n_b, D] tensor a request; keys FP8-quantized as the engines store them) for ``queries`` [B, H, D] and
    ``head_weights`` [B, H]: what :func:`served_step`'s selection is judged against."""
    import torch

    from dsaindex.kernels.fp8_score import fp8_topk_reference
    from dsaindex.quant import fp8_quantize

    lengths = [x.shape[0] for x in prefixes]
    fp8 = torch.zeros(len(lengths), max(lengths), prefixes[0].shape[1], dtype=torch.uint8, device=device)
    scales = torch.zeros(len(lengths), max(lengths), device=device)
    for slot, x in enumerate(prefixes):
        c, s = fp8_quantize(x.to(device))
        fp8[slot, : x.shape[0]], scales[slot, : x.shape[0]] = c.view(torch.uint8), s.reshape(-1)
    return fp8_topk_reference(fp8, scales, torch.tensor(lengths, device=device), queries, head_weights, topk)[1]


def shares_found(picked, truth) -> list[float]:
    """Per row, the share of ``truth``'s positions (rows of [B, k]) that ``picked`` (rows of [B, k']) holds."""
    return [len(set(a) & set(b)) / len(b) for a, b in zip(picked.tolist(), truth.tolist(), strict=True)]


def recall_on_store(store_path: Path, artifacts: Path, topk: int, candidates: int, prefilter: int, cache: int,
                    min_prefix: int, max_queries: int, device: str, use_triton: bool | None = None) -> dict:
    """Recall of one cold PQ step against exact FP8 top-k for held-out queries (per layer and mean): with the
    miss filter, reranking every candidate, and the direct step (candidates read straight from the host)."""
    from dsaindex.artifacts.bundle import read_bundle
    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.runtime.loader import place_layers
    from dsaindex.train.recall import held_out, split_sequences

    store = CaptureStore.open(store_path)
    geometry = store.manifest.model.geometry
    manifest, arrays = read_bundle(artifacts, verify=True)
    if manifest.lineage.capture_store_id != store.manifest.store_id:
        typer.echo(f"note: the artifacts were trained on store {manifest.lineage.capture_store_id}, "
                   f"recall is measured on {store.manifest.store_id}", err=True)
    loaded = place_layers(manifest, arrays, device)
    _, eval_seqs = split_sequences(len(store.array("sequence_keys")))
    per_layer = {}
    for layer_id, layer in loaded.items():
        data = held_out(store, layer_id, eval_seqs, min_prefix, geometry.key_format, max_queries=max_queries)
        nq = data.queries.shape[0]
        if nq == 0:
            continue
        hits = dict.fromkeys(STEP_MODES, 0.0)
        fetched = 0.0
        for mode in STEP_MODES:
            for start in range(0, nq, 8):
                rows = range(start, min(nq, start + 8))
                prefixes = [data.keys[int(data.key_start[i]) : int(data.key_start[i]) + int(data.visible[i])]
                            for i in rows]
                q = data.queries[list(rows)].to(device)
                w = data.head_weights[list(rows)].to(device)
                picked, stats = served_step(layer, prefixes, q, w, topk, candidates, prefilter, cache, mode, device,
                                            use_triton)
                for share in shares_found(picked, exact_topk_of_prefixes(prefixes, q, w, topk, device)):
                    hits[mode] += share
                if mode == "filter":
                    fetched += float(stats.fetched.sum()) / max(1.0, float(stats.candidates.sum())) * len(prefixes)
        per_layer[str(layer_id)] = {"queries": nq, "recall_filter": round(hits["filter"] / nq, 5),
                                    "recall_rerank": round(hits["rerank"] / nq, 5),
                                    "recall_direct": round(hits["direct"] / nq, 5),
                                    "fetch_share_cold": round(fetched / nq, 4),
                                    "mean_prefix": round(float(data.visible.float().mean()), 1)}
    mean = {k: round(sum(v[k] for v in per_layer.values()) / max(1, len(per_layer)), 5)
            for k in ("recall_filter", "recall_rerank", "recall_direct", "fetch_share_cold")}
    return {"store": str(store_path), "artifacts": str(artifacts), "topk": topk, "candidates": candidates,
            "prefilter": prefilter, "min_prefix": min_prefix, "per_layer": per_layer, "mean": mean}


def break_even(rows: list[dict]) -> dict[str, int | None]:
    """Per batch size, the shortest measured length from which the PQ step beats the exact path at every
    longer length measured (None: the exact path was faster everywhere)."""
    out: dict[str, int | None] = {}
    for b in sorted({r["batch"] for r in rows}):
        mine = sorted((r for r in rows if r["batch"] == b), key=lambda r: r["keys"])
        first = None
        for r in reversed(mine):
            if r["median_ms"]["pq_warm"] >= r["median_ms"]["exact_path"]:
                break
            first = r["keys"]
        out[str(b)] = first
    return out


def direct_break_even(rows: list[dict]) -> dict[str, int | None]:
    """Per history length, the largest measured batch size up to which the step that reads its candidates
    straight from the host store is faster than the cached step at every batch size measured (None: never)."""
    out: dict[str, int | None] = {}
    for n in sorted({r["keys"] for r in rows}):
        last = None
        for r in sorted((r for r in rows if r["keys"] == n), key=lambda r: r["batch"]):
            if r["median_ms"]["pq_direct"] >= r["median_ms"]["pq_warm"]:
                break
            last = r["batch"]
        out[str(n)] = last
    return out


def markdown_table(report: dict) -> str:
    lines = [
        "| B | keys/request | PQ step, warm cache (ms) | PQ step, cold cache (ms) | PQ step, direct host reads (ms) "
        "| DeepGEMM logits (ms) "
        "| DeepGEMM logits + torch.topk (ms) | DeepGEMM logits + threshold top-k (ms) "
        "| Triton FP8 logits (ms) | Triton FP8 logits + threshold top-k (ms) | torch exact (ms) "
        "| HBM floor exact / PQ (ms) | best DeepGEMM + top-k / PQ warm | exact FP8 / PQ warm "
        "| policy's exact path (ms) | policy: path, ms | best DeepGEMM + top-k / policy "
        "| engine plugins' paged step (ms) | best DeepGEMM + top-k / paged step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["rows"]:
        m, f = r["median_ms"], r["hbm_floor_ms"]
        dg = [f"{m[k]:.3f}" if k in m else "n/a"
              for k in ("deepgemm_logits", "deepgemm_logits_topk", "deepgemm_logits_fast_topk")]
        ratio = r.get("speedup_vs_deepgemm_topk")
        speedup = f"{ratio['pq_warm']:.2f}x" if ratio else "n/a"
        policy = f"{ratio['policy']:.2f}x" if ratio else "n/a"
        paged = f"{ratio['engine_paged']:.2f}x" if ratio else "n/a"
        lines.append(f"| {r['batch']} | {r['keys']:,} | {m['pq_warm']:.3f} | {m['pq_cold']:.3f} | {m['pq_direct']:.3f} | "
                     f"{dg[0]} | {dg[1]} | {dg[2]} | "
                     f"{m['triton_fp8_logits']:.3f} | {m['exact_fp8_triton']:.3f} | {m['torch_exact']:.3f} | {f['exact_fp8']:.3f} / {f['pq32']:.3f} | "
                     f"{speedup} | {r['speedup_vs_exact_fp8']['pq_warm']:.2f}x | {m['exact_path']:.3f} | "
                     f"{r['policy']['path']}, {m['policy']:.3f} | {policy} | {m['engine_paged']:.3f} | {paged} |")
    if any("rq_warm" in r["median_ms"] for r in report["rows"]):
        lines += ["", "| B | keys/request | PQ step, warm (ms) | RQ step, warm (ms) | RQ / PQ | PQ direct (ms) "
                  "| RQ direct (ms) | RQ cold (ms) | best DeepGEMM + top-k / RQ warm |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in report["rows"]:
            m, ratio = r["median_ms"], r.get("speedup_vs_deepgemm_topk")
            vs_deepgemm = f"{ratio['rq_warm']:.2f}x" if ratio else "n/a"
            lines.append(f"| {r['batch']} | {r['keys']:,} | {m['pq_warm']:.3f} | {m['rq_warm']:.3f} | "
                         f"{m['rq_warm'] / m['pq_warm']:.2f}x | {m['pq_direct']:.3f} | {m['rq_direct']:.3f} | "
                         f"{m['rq_cold']:.3f} | {vs_deepgemm} |")
    return "\n".join(lines) + "\n"


def check_recall_inputs(store_path: Path, artifacts: Path) -> None:
    """Refuse a recall store or bundle that cannot be used, before any timing: the store must open,
    the bundle must be a PQ bundle of the store's model and key basis."""
    from dsaindex.artifacts.bundle import read_manifest
    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.artifacts.compat import check_store_for_bundle
    from dsaindex.errors import DsaIndexError

    store = CaptureStore.open(store_path)
    manifest = read_manifest(artifacts)
    kinds = sorted({art.kind for art in manifest.layers.values()})
    if kinds != ["pq"]:
        raise DsaIndexError(f"{artifacts} holds {', '.join(kinds)} artifacts; the decode recall needs PQ codebooks.",
                            "pass --artifacts a bundle written by `dsaindex train pq` on that store.")
    check_store_for_bundle(store.manifest, manifest, str(store_path), str(artifacts))


def parse_batch_limits(text: str) -> dict[int, int]:
    """``'32:262144,64:131072'`` -> {32: 262144, 64: 131072} (the policy's ``pq_from``); '' -> {}."""
    from dsaindex.errors import DsaIndexError

    limits = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        batch, sep, keys = item.partition(":")
        if not sep or not batch.strip().isdigit() or not keys.strip().isdigit() or int(batch) < 1:
            raise DsaIndexError(f"--pq-from: {item!r} is not BATCH:KEYS (two positive integers).",
                                "write it as e.g. --pq-from 32:262144,64:131072, or '' for no per-batch rule.")
        limits[int(batch)] = int(keys)
    return limits


def bench_decode(
    batches: str = typer.Option("1,8,32", help="Comma-separated request counts B."),
    keys: str = typer.Option("65536,262144,1048576", help="Comma-separated keys per request and layer."),
    heads: int = typer.Option(64, callback=at_least(1), help="Indexer heads."),
    topk: int = typer.Option(512, callback=at_least(1), help="Keys selected per step."),
    candidates: int = typer.Option(2048, callback=at_least(1), help="C: candidates reranked exactly."),
    prefilter: int = typer.Option(PREFILTER, callback=at_least(1), help="Stage 1 keeps prefilter x C keys for the full "
                                                                 "coarse score."),
    cache: int = typer.Option(4096, callback=at_least(1), help="Exact keys cached on the GPU per request."),
    recall_store: Path = typer.Option(None, help="Capture store for the recall measurement (held-out queries)."),
    artifacts: Path = typer.Option(None, help="PQ bundle for the recall measurement (trained on that store)."),
    recall_min_prefix: int = typer.Option(8192, callback=at_least(1),
                                          help="Only queries with at least this many keys before them."),
    recall_queries: int = typer.Option(64, callback=at_least(1), help="Held-out queries per layer for recall."),
    graphs: bool = typer.Option(True, "--graphs/--eager", help="Time steps replayed from CUDA graphs (as servers run decode)."),
    recall_prefilters: str = typer.Option("4,8", help="Prefilter factors for the recall measurement."),
    exact_below: int = typer.Option(262144, callback=at_least(0),
                                    help="The length policy: requests of at most this many keys are scored "
                                         "exactly (0: never). Each case also times that exact path."),
    pq_from: str = typer.Option("32:262144", help="The policy per batch size, 'B:N,...': with at least B "
                                                 "requests, requests of N keys and more go through PQ even "
                                                 "below --exact-below ('' for none)."),
    direct_upto: int = typer.Option(DIRECT_UPTO, callback=at_least(0),
                                    help="The policy's PQ steps with at most this many requests read their "
                                         "candidates straight from the host store (no device cache; 0: never). "
                                         "Each case also times that path."),
    profile: bool = typer.Option(False, "--profile", help="Add each path's per-kernel device time of one step "
                                                           "(torch.profiler, eager) to the JSON."),
    out: Path = typer.Option(None, help="Also write the JSON result to this file."),
    markdown: Path = typer.Option(None, help="Also write the timing table as markdown to this file."),
    opq: bool = typer.Option(False, "--opq", help="Time the PQ paths with an OPQ codec (a rotation of the queries "
                                                  "before the coarse stages, one [B*H, D] x [D, D] product)."),
    rq: bool = typer.Option(False, "--rq", help="Also time the step with a residual code (RQ32: 32 whole-key "
                                                "codebooks, the bytes of PQ32; stage 2 sums 32 codewords per "
                                                "candidate) beside the PQ step, over the same keys, in the same run."),
    subspaces: int = typer.Option(32, callback=at_least(1),
                                  help="Bytes per key of the codes timed: PQ subspaces, and with --rq the residual "
                                       "code's codebooks (16: RQ16 beside PQ16). A power of two dividing the keys' "
                                       "128 dims."),
) -> None:
    """Decode-step selection latency: PQ coarse-to-fine vs exact FP8 (DeepGEMM's and Triton's logits with the
    threshold top-k) vs torch, per batch size and history length, with HBM floors, GPU bytes per request
    and recall on real keys. Needs a CUDA device."""
    import torch

    from dsaindex.console import parse_ints
    from dsaindex.errors import DsaIndexError

    # every input is checked before the first timing (the timings take minutes)
    key_counts = parse_ints(keys, "--keys", minimum=64)
    batch_sizes = parse_ints(batches, "--batches", minimum=1)
    prefilters = parse_ints(recall_prefilters, "--recall-prefilters", minimum=1)
    pq_limits = parse_batch_limits(pq_from)
    if subspaces & (subspaces - 1) or 128 % subspaces:
        raise DsaIndexError(f"--subspaces {subspaces} is not a power of two dividing the keys' 128 dims.",
                            "pass 8, 16, 32 or 64.")
    if (recall_store is None) != (artifacts is None):
        raise DsaIndexError("--recall-store and --artifacts go together (the recall needs both).",
                            "pass both (a capture store and a PQ bundle trained on it), or neither.")
    if recall_store is not None:
        check_recall_inputs(recall_store, artifacts)
    if not torch.cuda.is_available():
        raise DsaIndexError("bench decode needs a CUDA device (its kernels and CUDA graphs run only there).",
                            "run it on a GPU machine; `dsaindex eval pq` measures recall on the CPU.")
    from dsaindex.kernels import deepgemm

    if deepgemm.unavailable():
        typer.echo(f"note: no DeepGEMM baseline in this run: {deepgemm.unavailable()} "
                   "(pip install dsaindex[deepgemm] on a CUDA machine with nvcc).", err=True)
    rows = []
    for n in key_counts:
        for b in batch_sizes:
            row = time_case(b, n, heads, topk, candidates, prefilter, cache, graphs=graphs, profile=profile,
                            exact_below=exact_below, pq_from=pq_limits, opq=opq, direct_upto=direct_upto, rq=rq,
                            subspaces=subspaces)
            rows.append(row)
            typer.echo(json.dumps({k: row[k] for k in ("batch", "keys", "median_ms", "speedup_vs_exact_fp8")}), err=True)
            torch.cuda.empty_cache()
    report = {"device": torch.cuda.get_device_name(), "opq": opq, "rq": rq, "subspaces": subspaces, "heads": heads, "topk": topk, "candidates": candidates,
              "prefilter": prefilter, "cache_capacity": cache, "exact_below": exact_below, "pq_from": pq_limits,
              "direct_upto": direct_upto, "break_even_keys": break_even(rows),
              "direct_faster_upto_batch": direct_break_even(rows), "rows": rows}
    if recall_store is not None:
        report["recall"] = [recall_on_store(recall_store, artifacts, topk, candidates, p, cache,
                                            recall_min_prefix, recall_queries, "cuda")
                            for p in prefilters]
    from dsaindex.console import emit_report

    emit_report(report, out, markdown, markdown_table(report))
