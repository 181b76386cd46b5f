"""Exact indexer scores of FP8 keys on Triton, batched over requests.

* :func:`fp8_topk` is what a server runs without an index: exact scores of every key of every request
  with the top-k selection fused (sampled threshold + append, :mod:`dsaindex.kernels.select`); it is
  the baseline of ``dsaindex bench decode``.
* :func:`fp8_logits` / :func:`fp8_logits_paged` write every key's score (FP8 x FP8 products, as DeepGEMM's
  logits): with :func:`dsaindex.kernels.topk.rows_topk`, the portable exact scorer where DeepGEMM does
  not import (faster than the fused :func:`fp8_topk` on the H200).
* :func:`fp8_gather_scores` rescores gathered rows (the candidates of the coarse stage) exactly;
  :func:`fp8_host_select` rescores the direct step's candidates read straight from the pinned host store.

:func:`fp8_scores_reference` is the spec both are checked against. Keys are the engines' layout: FP8
e4m3 bits as uint8 [.., D] and one ue8m0 scale per key; queries are bf16 (the kernels multiply bf16
on tensor cores; the reference does the same products in float32).
"""

from __future__ import annotations

import torch

from dsaindex.kernels import checks, select


def fp8_scores_reference(keys_fp8: torch.Tensor, scales: torch.Tensor, queries: torch.Tensor,
                         head_weights: torch.Tensor, query_fp8: bool = False) -> torch.Tensor:
    """Exact scores [B, N] float32 of ``keys_fp8`` [B, N, D] uint8 with ``scales`` [B, N], for
    ``queries`` [B, H, D] (rounded to bf16, or with ``query_fp8`` to FP8 e4m3 as DeepGEMM's logits take
    them) and ``head_weights`` [B, H]."""
    keys = keys_fp8.view(torch.float8_e4m3fn).float() * scales.float().unsqueeze(-1)
    q = queries.to(torch.bfloat16)
    q = (q.to(torch.float8_e4m3fn) if query_fp8 else q).float()
    dots = torch.einsum("bnd,bhd->bnh", keys, q)
    return (torch.relu(dots) * head_weights.float().unsqueeze(1)).sum(-1)


def fp8_topk_reference(keys_fp8: torch.Tensor, scales: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor,
                       head_weights: torch.Tensor, k: int, query_fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request, the top ``k`` rows among its first ``lengths[b]`` keys: (scores [B, k] float32, rows
    [B, k] int64; -inf / -1 past a short request's end). The spec of :func:`fp8_topk`."""
    scores = fp8_scores_reference(keys_fp8, scales, queries, head_weights, query_fp8)
    return select.topk_of_prefixes(scores, lengths, k)


def fp8_gather_scores_reference(keys_fp8: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor,
                                queries: torch.Tensor, head_weights: torch.Tensor,
                                query_fp8: bool = False) -> torch.Tensor:
    """Exact scores [B, R] of the pool rows ``rows`` [B, R] (-1 = none: -inf): the spec of
    :func:`fp8_gather_scores`. A pool of one request shared by every query may be given as [N, D] / [N]
    (the spec of :func:`fp8_gather_scores_shared`)."""
    b, r = rows.shape
    if keys_fp8.dim() == 2:
        keys_fp8, scales = keys_fp8.expand(b, *keys_fp8.shape), scales.expand(b, *scales.shape)
    safe = rows.clamp_min(0).long()
    picked = keys_fp8.gather(1, safe.unsqueeze(-1).expand(b, r, keys_fp8.shape[2]))
    scores = fp8_scores_reference(picked, scales.gather(1, safe), queries, head_weights, query_fp8)
    return scores.masked_fill(rows < 0, float("-inf"))


def _check_keys_and_queries(keys_fp8, scales, queries, head_weights) -> None:
    """The preconditions both wrappers share (:mod:`dsaindex.kernels.checks`)."""
    checks.rank("keys_fp8", keys_fp8, 3, "B, N, D")
    b, n, d = keys_fp8.shape
    checks.dtype("keys_fp8 (FP8 e4m3 bits)", keys_fp8, torch.uint8)
    checks.key_dim("keys_fp8.shape[2] (key dim D)", d)
    checks.shape("scales", scales, (b, n), "B, N")
    checks.floating("scales", scales)
    checks.shape("queries", queries, (b, None, d), "B, H, D")
    checks.shape("head_weights", head_weights, tuple(queries.shape[:2]), "B, H")
    checks.same_device(keys_fp8=keys_fp8, scales=scales, queries=queries, head_weights=head_weights)


def _launch(mode, keys_fp8, scales, lengths, queries, head_weights, rows=None, thr=None, out_score=None,
            out_pos=None, counts=None, n_out=0, stride=1, capacity=1, block_n=64, iters=4, num_warps=4,
            strides=None, n_keys=None, table=None, query_fp8=False, num_stages=None):
    """One kernel launch. ``keys_fp8`` [B, N, D] / ``scales`` [B, N] contiguous, or (``strides`` = key slot,
    key page, scale slot, scale page strides in elements, ``n_keys`` = N) any paged layout, its pages
    looked up in ``table`` [B, width] int32 if given."""
    import triton

    from dsaindex.kernels.fp8_score_kernel import fp8_score_kernel

    if strides is None:
        b, n, d = keys_fp8.shape
        scales = scales.float().contiguous()
        strides = (n * d, 64 * d, n, 64)
    else:
        b, d, n = queries.shape[0], queries.shape[2], n_keys
    h = queries.shape[1]
    dummy_i = torch.empty(1, dtype=torch.int32, device=keys_fp8.device)
    dummy_f = torch.empty(1, dtype=torch.float32, device=keys_fp8.device)
    if query_fp8 and select.interpreted():
        # the CPU interpreter rounds to e4m3 unlike the GPU (and torch) near subnormals: round here, so the
        # kernel's own rounding of already-representable values is exact
        queries = queries.to(torch.float8_e4m3fn).to(torch.bfloat16)
    work = n if mode == 1 else n_out
    grid = (max(1, triton.cdiv(work, block_n * iters)), b)
    fp8_score_kernel[grid](
        keys_fp8, scales, lengths if lengths is not None else dummy_i,
        queries.to(torch.bfloat16).contiguous(), head_weights.float().contiguous(),
        rows if rows is not None else dummy_i, thr if thr is not None else dummy_f,
        out_score, out_pos if out_pos is not None else dummy_i, counts if counts is not None else dummy_i,
        *strides, table if table is not None else dummy_i, table.shape[1] if table is not None else 0, n_out, stride,
        HAS_TABLE=table is not None, N_HEADS=h, H_PAD=max(16, triton.next_power_of_2(h)), D=d, BLOCK_N=block_n, ITERS=iters,
        CAPACITY=capacity, MODE=mode, F32=select.interpreted(), FP8_DOT=query_fp8, num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}),
    )


def fp8_topk(keys_fp8: torch.Tensor, scales: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor,
             head_weights: torch.Tensor, k: int, capacity: int = 16384, target: int = 8192,
             block_n: int = 64, iters: int = 4, num_warps: int = 4, return_counts: bool = False,
             query_fp8: bool = False, num_stages: int | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact top-k per request with the selection fused into the scoring pass.

    Parameters
    ----------
    keys_fp8 : [B, N, D] uint8 FP8 e4m3 bits, D a power of two >= 16; scales : [B, N] float32;
        lengths : [B] int32 valid keys per request (copied to the keys' device if elsewhere);
        queries : [B, H, D] (read as bf16); head_weights : [B, H] effective weights; all but
        ``lengths`` on one device
    k : keys selected; capacity : candidate-buffer slots per request; target : keys the threshold aims
        to pass (at least ``k``); block_n, iters, num_warps, num_stages : launch shape (keys per tile,
        tiles per program, warps per program, software-pipeline stages; None: Triton's default)
    query_fp8 : round the queries to FP8 e4m3 and multiply on the FP8 tensor cores, as DeepGEMM's logits
        do (the spec is then :func:`fp8_topk_reference` with ``query_fp8=True``)

    Returns
    -------
    (scores [B, k] float32, rows [B, k] int64), like :func:`fp8_topk_reference`; with
    ``return_counts`` also the appended counts [B] (a count outside [min(k, length), capacity] means
    that request's buffer was not exact: :func:`dsaindex.kernels.select.check_counts`).

    Raises
    ------
    ValueError : an input of the wrong dtype, shape or device, or ``capacity < 2 * max(target, k)``.
    """
    _check_keys_and_queries(keys_fp8, scales, queries, head_weights)
    b, n, _ = keys_fp8.shape
    checks.shape("lengths", lengths, (b,), "B")
    target = max(target, k)
    checks.at_least("capacity", capacity, 2 * target, f"twice the threshold's target max(target, k) = {target}")
    return _topk(keys_fp8.contiguous(), scales, lengths, queries, head_weights, k, capacity, target, block_n, iters,
                 num_warps, return_counts, None, n, query_fp8=query_fp8, num_stages=num_stages)


def _topk(keys, scales, lengths, queries, head_weights, k, capacity, target, block_n, iters, num_warps,
          return_counts, strides, n, table=None, query_fp8=False, num_stages=None):
    """Sample pass, threshold, selecting pass, top-k of the buffer (:func:`fp8_topk`'s body, any layout)."""
    from dsaindex.kernels.topk import SMALL_TOPK_MAX, small_topk

    b = queries.shape[0]
    lengths = lengths.to(device=keys.device, dtype=torch.int32)
    stride = select.sample_stride(n)
    n_samples = -(-n // stride)
    samples = torch.empty(b, n_samples, dtype=torch.float32, device=keys.device)
    launch = dict(block_n=block_n, iters=iters, num_warps=num_warps, strides=strides, n_keys=n, table=table,
                  query_fp8=query_fp8, num_stages=num_stages)
    _launch(0, keys, scales, lengths, queries, head_weights, out_score=samples, n_out=n_samples, stride=stride,
            **launch)
    counts = torch.empty(b, dtype=torch.int32, device=keys.device)  # zeroed by the threshold's launch
    thr = select.sample_thresholds(samples, lengths, stride, target, capacity, counts=counts)
    buf_scores = torch.empty(b, capacity, dtype=torch.float32, device=keys.device)
    buf_pos = torch.empty(b, capacity, dtype=torch.int32, device=keys.device)
    _launch(1, keys, scales, lengths, queries, head_weights, thr=thr, out_score=buf_scores, out_pos=buf_pos,
            counts=counts, capacity=capacity, **launch)
    if capacity <= SMALL_TOPK_MAX:  # in column order, reading only the filled slots
        values, rows = small_topk(buf_scores, k, buf_pos, counts=counts)
    else:
        filled = torch.arange(capacity, device=keys.device)[None, :] < counts[:, None]
        values, rows = select.top_of_buffer(buf_scores.masked_fill(~filled, float("-inf")), buf_pos, k)
    return (values, rows, counts) if return_counts else (values, rows)


def fp8_logits(keys_fp8: torch.Tensor, scales: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor,
               head_weights: torch.Tensor, query_fp8: bool = True, block_n: int = 64, iters: int = 4,
               num_warps: int = 4, num_stages: int | None = None) -> torch.Tensor:
    """Every key's exact score, written out: [B, N] float32, -inf at and past each request's length. The
    Triton counterpart of DeepGEMM's logits (:func:`dsaindex.kernels.deepgemm.paged_logits`), for
    :func:`~dsaindex.kernels.topk.rows_topk` to select from: on the H200 the two launches beat the fused
    :func:`fp8_topk` (the appending pass costs more than writing and re-reading 4 bytes a key).
    ``query_fp8`` (the default) multiplies FP8 x FP8 on tensor cores with FP8-rounded queries, as DeepGEMM
    does (spec: :func:`fp8_scores_reference` with ``query_fp8=True``). Inputs as :func:`fp8_topk`."""
    _check_keys_and_queries(keys_fp8, scales, queries, head_weights)
    b, n, _ = keys_fp8.shape
    checks.shape("lengths", lengths, (b,), "B")
    return _logits(keys_fp8.contiguous(), scales, lengths, queries, head_weights, n, None, None, query_fp8, block_n,
                   iters, num_warps, num_stages)


def _logits(keys, scales, lengths, queries, head_weights, n, strides, table, query_fp8, block_n, iters, num_warps,
            num_stages):
    lengths = lengths.to(device=keys.device, dtype=torch.int32)
    out = torch.empty(queries.shape[0], n, dtype=torch.float32, device=keys.device)
    if n:
        _launch(0, keys, scales, lengths, queries, head_weights, out_score=out, n_out=n, stride=1, block_n=block_n,
                iters=iters, num_warps=num_warps, strides=strides, n_keys=n, table=table, query_fp8=query_fp8,
                num_stages=num_stages)
    return out


def fp8_logits_paged(pages: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor,
                     head_weights: torch.Tensor, query_fp8: bool = True, block_n: int = 64, iters: int = 4,
                     num_warps: int = 4, num_stages: int | None = None) -> torch.Tensor:
    """:func:`fp8_logits` over keys in the engines' paged layout (inputs as :func:`fp8_topk_paged`):
    [B, W * 64] float32, -inf at and past each length. With :func:`~dsaindex.kernels.topk.rows_topk`, the
    exact scorer where DeepGEMM does not import."""
    pages, scales, strides = _paged_layout(pages, block_table, queries, head_weights, lengths)
    return _logits(pages, scales, lengths, queries, head_weights, block_table.shape[1] * 64, strides,
                   block_table.contiguous(), query_fp8, block_n, iters, num_warps, num_stages)


def _paged_layout(pages, block_table, queries, head_weights, lengths=None):
    """Check the engines' pages and block table; (pages, the scales' base view, the kernel's strides).
    Pages may sit further apart than their width (a cache that is a strided view of a larger allocation),
    each page contiguous; they are read in place."""
    checks.rank("pages", pages, 2, "P, 64 * (D + 4)")
    checks.dtype("pages (FP8 bits and scales)", pages, torch.uint8)
    checks.rank("queries", queries, 3, "B, H, D")
    d = queries.shape[2]
    checks.key_dim("queries.shape[2] (key dim D)", d)
    checks.shape("pages", pages, (None, 64 * (d + 4)), "P, 64 * (D + 4)")
    b = queries.shape[0]
    checks.shape("block_table", block_table, (b, None), "B, W")
    checks.dtype("block_table", block_table, torch.int32)
    if lengths is not None:
        checks.shape("lengths", lengths, (b,), "B")
    checks.shape("head_weights", head_weights, tuple(queries.shape[:2]), "B, H")
    checks.same_device(pages=pages, block_table=block_table, queries=queries, head_weights=head_weights)
    if pages.stride(1) != 1 or pages.stride(0) % 4:
        pages = pages.contiguous()
    stride = pages.stride(0)
    scales = pages[0].view(torch.float32)[16 * d :] if pages.shape[0] else pages.new_empty(0).view(torch.float32)
    return pages, scales, (0, stride, 0, stride // 4)  # page 0's scales; the page stride reaches the others


def fp8_topk_paged(pages: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor,
                   head_weights: torch.Tensor, k: int, capacity: int = 16384, target: int = 8192, block_n: int = 64,
                   iters: int = 4, num_warps: int = 4, query_fp8: bool = False,
                   num_stages: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fp8_topk` over keys in the engines' paged layout (DeepGEMM's index-K cache): ``pages``
    [P, 64 * (D + 4)] uint8, each page 64 x D FP8 bytes then 64 float32 scales; ``block_table`` [B, W]
    int32, request b's i-th page. Returns (scores [B, k], positions [B, k] int64), -inf / -1 past a short
    request."""
    pages, scales, strides = _paged_layout(pages, block_table, queries, head_weights, lengths)
    target = max(target, k)
    checks.at_least("capacity", capacity, 2 * target, f"twice the threshold's target max(target, k) = {target}")
    return _topk(pages, scales, lengths, queries, head_weights, k, capacity, target, block_n, iters, num_warps,
                 False, strides, block_table.shape[1] * 64, block_table.contiguous(), query_fp8, num_stages)


def paged_keys_reference(pages: torch.Tensor, block_table: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the engines' pages [P, 64 * (D + 4)] uint8 of each request's ``block_table`` [B, W] into keys
    [B, W * 64, D] uint8 and scales [B, W * 64] float32 (the reference's view of :func:`fp8_topk_paged`'s
    input)."""
    b, w = block_table.shape
    mine = pages[block_table.long()]  # [B, W, 64 * (D + 4)]
    keys = mine[:, :, : 64 * d].reshape(b, w * 64, d)
    scales = mine[:, :, 64 * d :].contiguous().view(torch.float32).reshape(b, w * 64)
    return keys, scales


def fp8_gather_scores(keys_fp8: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, queries: torch.Tensor,
                      head_weights: torch.Tensor, block_n: int = 64) -> torch.Tensor:
    """Exact scores [B, R] float32 of the rows ``rows`` [B, R] (int32 or int64, -1 = none: -inf) of each
    request's key pool ``keys_fp8`` [B, P, D] uint8 / ``scales`` [B, P] float32, for ``queries`` [B, H, D]
    and ``head_weights`` [B, H]; all on one device. Like :func:`fp8_gather_scores_reference`; raises
    ``ValueError`` on an input of the wrong dtype, shape or device."""
    _check_keys_and_queries(keys_fp8, scales, queries, head_weights)
    checks.shape("rows", rows, (keys_fp8.shape[0], None), "B, R")
    checks.dtype("rows", rows, torch.int32, torch.int64)
    checks.same_device(keys_fp8=keys_fp8, rows=rows)
    b, r = rows.shape
    out = torch.empty(b, r, dtype=torch.float32, device=keys_fp8.device)
    if r == 0:
        return out
    _launch(2, keys_fp8.contiguous(), scales, None, queries, head_weights, rows=rows.to(torch.int32).contiguous(),
            out_score=out, n_out=r, block_n=block_n, iters=1)
    return out


def fp8_host_select_reference(host_fp8: torch.Tensor, host_scales: torch.Tensor, page_table: torch.Tensor,
                              rows: torch.Tensor, bins: torch.Tensor, counts: torch.Tensor, sel: torch.Tensor,
                              pool_fp8: torch.Tensor, pool_scales: torch.Tensor, tail_len: torch.Tensor,
                              n_encoded: torch.Tensor, tail_row0: int, queries: torch.Tensor,
                              head_weights: torch.Tensor, capacity: int,
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The spec of :func:`fp8_host_select` (same arguments and return); the candidates in the boundary
    bin take the room left in slot order, and the kept candidates sit in slot order (the kernel's order
    depends on its programs' atomics; the set is the same unless the boundary bin overflows)."""
    b, n_in = rows.shape
    page = host_fp8.shape[1]
    dev = pool_fp8.device
    width = capacity + page
    scores = torch.full((b, width), float("-inf"), device=dev)
    positions = torch.full((b, width), -1, dtype=torch.int64, device=dev)
    sel_c, counts_c = sel.cpu(), counts.cpu()
    for i in range(b):
        edge, above, kept = (int(x) for x in sel_c[i, :3])
        live = (torch.arange(n_in) < min(int(counts_c[i]), n_in)) & (rows[i].cpu() >= 0)  # empty slots: no bin
        bin_i = bins[i].cpu()
        strict = live & (bin_i > edge)
        tied = (live & (bin_i == edge)).nonzero().squeeze(1)[: kept - above]
        pick = torch.cat([strict.nonzero().squeeze(1), tied]).sort().values
        pos = rows[i].cpu()[pick].long()
        host_page = page_table[i].cpu().long()[pos // page]
        keys = host_fp8[host_page, pos % page].to(dev)[None]
        key_scales = host_scales[host_page, pos % page].to(dev)[None]
        scores[i, : pick.numel()] = fp8_scores_reference(keys, key_scales, queries[i : i + 1], head_weights[i : i + 1])[0]
        positions[i, : pick.numel()] = pos.to(dev)
    j = torch.arange(page, device=dev)
    live = j[None, :] < tail_len.to(dev)[:, None]
    tail = fp8_scores_reference(pool_fp8[:, tail_row0 : tail_row0 + page], pool_scales[:, tail_row0 : tail_row0 + page],
                                queries, head_weights)
    scores[:, capacity:] = tail.masked_fill(~live, float("-inf"))
    positions[:, capacity:] = torch.where(live, n_encoded.to(dev).long()[:, None] + j[None, :], -1)
    kept = sel[:, 2].to(dev, torch.int32)
    stats = torch.stack([kept, torch.zeros_like(kept), kept, torch.zeros_like(kept)], dim=1)
    return scores, positions, stats


def fp8_host_select(host_fp8: torch.Tensor, host_scales: torch.Tensor, page_table: torch.Tensor, rows: torch.Tensor,
                    bins: torch.Tensor, counts: torch.Tensor, sel: torch.Tensor, scratch: torch.Tensor,
                    pool_fp8: torch.Tensor, pool_scales: torch.Tensor, tail_len: torch.Tensor, n_encoded: torch.Tensor,
                    tail_row0: int, queries: torch.Tensor, head_weights: torch.Tensor, capacity: int,
                    block_n: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rescoring of a direct decode step, in one kernel: of each request's stage-2 candidates (``rows``
    [B, R] int32 key positions with their score ``bins`` [B, R] int32, ``counts`` [B] int32 filled, and
    ``sel`` [B, 4] int32 from :func:`~dsaindex.kernels.pq_select.pq_candidate_bins`), the ones above the
    boundary bin and those in it up to ``capacity`` in all are read straight from the pinned host store
    and scored exactly; the tail is scored from the device pool. No top-C kernel, no cache, no copy kernel.

    host_fp8 [P, PAGE, D] uint8 / host_scales [P, PAGE] float32 (pinned); page_table [B, W] int32;
    scratch: the stage-2 scratch [B, BIN_COUNT + 4] int32 (its two append counters, zeroed by stage 2);
    pool_fp8 [B, R', D] uint8 / pool_scales [B, R'] with the tail at rows ``tail_row0 ..``; tail_len,
    n_encoded [B] int32; queries [B, H, D], head_weights [B, H].

    Returns (scores [B, capacity + PAGE] float32, positions [B, capacity + PAGE] int64, stats [B, 4] int32):
    the kept candidates in the first ``sel[:, 2]`` slots (in no particular order), -inf / -1 up to
    ``capacity``, then the tail; stats: candidates kept, hits (0), rows read from the host (the candidates),
    dropped (0), as the cached step's plan counts them. Raises ``ValueError`` on bad input."""
    import triton

    from dsaindex.kernels.fp8_score_kernel import fp8_host_select_kernel

    checks.rank("host_fp8", host_fp8, 3, "P, PAGE, D")
    p, page, d = host_fp8.shape
    checks.dtype("host_fp8 (FP8 bits)", host_fp8, torch.uint8)
    checks.key_dim("host_fp8.shape[2] (key dim D)", d)
    checks.power_of_two("host_fp8.shape[1] (PAGE)", page)
    checks.shape("host_scales", host_scales, (p, page), "P, PAGE")
    checks.dtype("host_scales", host_scales, torch.float32)
    checks.rank("rows", rows, 2, "B, R")
    b, n_in = rows.shape
    for name, t in (("rows", rows), ("bins", bins)):
        checks.shape(name, t, (b, n_in), "B, R")
        checks.dtype(name, t, torch.int32)
    checks.shape("counts", counts, (b,), "B")
    checks.dtype("counts", counts, torch.int32)
    checks.shape("sel", sel, (b, 4), "B, 4")
    checks.dtype("sel", sel, torch.int32)
    checks.rank("scratch", scratch, 2, "B, BIN_COUNT + 4")
    checks.shape("scratch", scratch, (b, None), "B, BIN_COUNT + 4")
    checks.dtype("scratch", scratch, torch.int32)
    checks.shape("page_table", page_table, (b, None), "B, W")
    checks.dtype("page_table", page_table, torch.int32)
    checks.shape("pool_fp8", pool_fp8, (b, None, d), "B, R, D")
    checks.dtype("pool_fp8 (FP8 bits)", pool_fp8, torch.uint8)
    checks.shape("pool_scales", pool_scales, tuple(pool_fp8.shape[:2]), "B, R")
    checks.at_most("tail_row0 + PAGE", tail_row0 + page, pool_fp8.shape[1], "the pool's rows")
    checks.shape("queries", queries, (b, None, d), "B, H, D")
    checks.shape("head_weights", head_weights, tuple(queries.shape[:2]), "B, H")
    checks.same_device(host_fp8=host_fp8, host_scales=host_scales)
    checks.same_device(rows=rows, bins=bins, counts=counts, sel=sel, scratch=scratch, page_table=page_table,
                       pool_fp8=pool_fp8, queries=queries)
    dev = pool_fp8.device
    width = capacity + page
    scores = torch.empty(b, width, dtype=torch.float32, device=dev)
    positions = torch.empty(b, width, dtype=torch.int64, device=dev)
    stats = torch.empty(b, 4, dtype=torch.int32, device=dev)
    if b == 0:
        return scores, positions, stats
    h = queries.shape[1]
    ctr = scratch[:, scratch.shape[1] - 2 :]  # the two append counters (the histogram's scratch row ends with them)
    fp8_host_select_kernel[(triton.cdiv(n_in, block_n) + 1, b)](
        host_fp8, host_scales, page_table.contiguous(), rows.contiguous(), bins.contiguous(),
        counts.contiguous(), sel.contiguous(), ctr, pool_fp8.contiguous(), pool_scales.contiguous(),
        tail_len.to(torch.int32).contiguous(), n_encoded.to(torch.int32).contiguous(),
        queries.to(torch.bfloat16).contiguous(), head_weights.float().contiguous(), scores, positions, stats,
        page_table.shape[1], n_in, pool_fp8.shape[1], tail_row0, scratch.stride(0),
        N_HEADS=h, H_PAD=max(16, triton.next_power_of_2(h)), D=d, PAGE=page, BLOCK_N=block_n, CAPC=capacity,
        CAPC_PAD=max(16, triton.next_power_of_2(capacity)), F32=select.interpreted())
    return scores, positions, stats


def fp8_gather_scores_shared(keys_fp8: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor,
                             queries: torch.Tensor, head_weights: torch.Tensor, query_fp8: bool = True,
                             block_n: int = 128, iters: int = 2, num_warps: int = 4) -> torch.Tensor:
    """Exact scores [Q, R] float32 of rows ``rows`` [Q, R] (int32 or int64, -1 = none: -inf) of ONE key
    array ``keys_fp8`` [N, D] uint8 / ``scales`` [N] float32 for each of ``queries`` [Q, H, D] (a prefill
    chunk's candidates: every query reads its own rows of the same keys). FP8 x FP8 products with
    FP8-rounded queries by default, as DeepGEMM's prefill logits (``query_fp8=False``: bf16). The spec is
    :func:`fp8_gather_scores_reference` with the [N, D] pool. Raises ``ValueError`` on bad input."""
    checks.rank("keys_fp8", keys_fp8, 2, "N, D")
    checks.dtype("keys_fp8 (FP8 e4m3 bits)", keys_fp8, torch.uint8)
    n, d = keys_fp8.shape
    checks.key_dim("keys_fp8.shape[1] (key dim D)", d)
    checks.shape("scales", scales, (n,), "N")
    checks.dtype("scales", scales, torch.float32)
    checks.rank("queries", queries, 3, "Q, H, D")
    checks.shape("queries", queries, (None, None, d), "Q, H, D")
    checks.shape("head_weights", head_weights, tuple(queries.shape[:2]), "Q, H")
    checks.shape("rows", rows, (queries.shape[0], None), "Q, R")
    checks.dtype("rows", rows, torch.int32, torch.int64)
    checks.same_device(keys_fp8=keys_fp8, scales=scales, rows=rows, queries=queries, head_weights=head_weights)
    q, r = rows.shape
    out = torch.empty(q, r, dtype=torch.float32, device=keys_fp8.device)
    if r == 0 or q == 0:
        return out
    _launch(2, keys_fp8.contiguous(), scales.contiguous(), None, queries, head_weights,
            rows=rows.to(torch.int32).contiguous(), out_score=out, n_out=r, block_n=block_n, iters=iters,
            num_warps=num_warps, strides=(0, 64 * d, 0, 64), n_keys=n, query_fp8=query_fp8)
    return out


def fp8_gather_scores_paged(pages: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
                            queries: torch.Tensor, head_weights: torch.Tensor, query_fp8: bool = True,
                            block_n: int = 64, num_warps: int = 4) -> torch.Tensor:
    """Exact scores [B, R] float32 of request-local key ``positions`` [B, R] (int32 or int64, -1 = none:
    -inf) read in place from an engine's paged index-K cache: ``pages`` [P, 64 * (D + 4)] uint8 (each page
    64 x D FP8 bytes then 64 float32 scales; pages may sit further apart than their width, as in a cache
    that is a strided view of a larger allocation), ``block_table``
    [B, W] int32 (request b's i-th page). FP8 x FP8 products with FP8-rounded queries by default, the
    engines' logits (``query_fp8=False``: bf16). The spec is :func:`fp8_gather_scores_reference` over
    :func:`paged_keys_reference`. Raises ``ValueError`` on bad input."""
    pages, scales, strides = _paged_layout(pages, block_table, queries, head_weights)
    b = queries.shape[0]
    checks.shape("positions", positions, (b, None), "B, R")
    checks.dtype("positions", positions, torch.int32, torch.int64)
    checks.same_device(pages=pages, positions=positions)
    r = positions.shape[1]
    out = torch.empty(b, r, dtype=torch.float32, device=pages.device)
    if r == 0 or b == 0:
        return out
    _launch(2, pages, scales, None, queries, head_weights, rows=positions.to(torch.int32).contiguous(),  # int32: no copy
            out_score=out, n_out=r, block_n=block_n, iters=1, num_warps=num_warps, strides=strides, n_keys=r,
            table=block_table.contiguous(), query_fp8=query_fp8)
    return out
