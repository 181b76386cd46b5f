"""Exact indexer scores of FP8 keys on Triton, batched over requests.

* :func:`fp8_topk` is what a server runs without an index: exact scores of every key of every request
  with the top-k selection fused (sampled threshold + append, :mod:`dsaindex.kernels.select`); it is
  the baseline of ``dsaindex bench decode``.
* :func:`fp8_gather_scores` rescores gathered rows (the candidates of the coarse stage) exactly.

:func:`fp8_scores_reference` is the spec both are checked against. Keys are the engines' layout: FP8
e4m3 bits as uint8 [.., D] and one ue8m0 scale per key; queries are bf16 (the kernels multiply bf16
on tensor cores; the reference does the same products in float32).
"""

from __future__ import annotations

import torch

from dsaindex.kernels import checks, select


def fp8_scores_reference(keys_fp8: torch.Tensor, scales: torch.Tensor, queries: torch.Tensor,
                         head_weights: torch.Tensor) -> torch.Tensor:
    """Exact scores [B, N] float32 of ``keys_fp8`` [B, N, D] uint8 with ``scales`` [B, N], for
    ``queries`` [B, H, D] and ``head_weights`` [B, H]."""
    keys = keys_fp8.view(torch.float8_e4m3fn).float() * scales.float().unsqueeze(-1)
    q = queries.to(torch.bfloat16).float()
    dots = torch.einsum("bnd,bhd->bnh", keys, q)
    return (torch.relu(dots) * head_weights.float().unsqueeze(1)).sum(-1)


def fp8_topk_reference(keys_fp8: torch.Tensor, scales: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor,
                       head_weights: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request, the top ``k`` rows among its first ``lengths[b]`` keys: (scores [B, k] float32, rows
    [B, k] int64; -inf / -1 past a short request's end). The spec of :func:`fp8_topk`."""
    return select.topk_of_prefixes(fp8_scores_reference(keys_fp8, scales, queries, head_weights), lengths, k)


def fp8_gather_scores_reference(keys_fp8: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor,
                                queries: torch.Tensor, head_weights: torch.Tensor) -> torch.Tensor:
    """Exact scores [B, R] of the pool rows ``rows`` [B, R] (-1 = none: -inf): the spec of
    :func:`fp8_gather_scores`."""
    b, r = rows.shape
    safe = rows.clamp_min(0).long()
    picked = keys_fp8.gather(1, safe.unsqueeze(-1).expand(b, r, keys_fp8.shape[2]))
    scores = fp8_scores_reference(picked, scales.gather(1, safe), queries, head_weights)
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
            strides=None, n_keys=None, table=None):
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
    work = n if mode == 1 else n_out
    grid = (max(1, triton.cdiv(work, block_n * iters)), b)
    fp8_score_kernel[grid](
        keys_fp8, scales, lengths if lengths is not None else dummy_i,
        queries.to(torch.bfloat16).contiguous(), head_weights.float().contiguous(),
        rows if rows is not None else dummy_i, thr if thr is not None else dummy_f,
        out_score, out_pos if out_pos is not None else dummy_i, counts if counts is not None else dummy_i,
        *strides, table if table is not None else dummy_i, table.shape[1] if table is not None else 0, n_out, stride,
        HAS_TABLE=table is not None, N_HEADS=h, H_PAD=max(16, triton.next_power_of_2(h)), D=d, BLOCK_N=block_n, ITERS=iters,
        CAPACITY=capacity, MODE=mode, F32=select.interpreted(), num_warps=num_warps,
    )


def fp8_topk(keys_fp8: torch.Tensor, scales: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor,
             head_weights: torch.Tensor, k: int, capacity: int = 16384, target: int = 8192,
             block_n: int = 64, iters: int = 4, num_warps: int = 4, return_counts: bool = False,
             ) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact top-k per request with the selection fused into the scoring pass.

    Parameters
    ----------
    keys_fp8 : [B, N, D] uint8 FP8 e4m3 bits, D a power of two >= 16; scales : [B, N] float32;
        lengths : [B] int32 valid keys per request (copied to the keys' device if elsewhere);
        queries : [B, H, D] (read as bf16); head_weights : [B, H] effective weights; all but
        ``lengths`` on one device
    k : keys selected; capacity : candidate-buffer slots per request; target : keys the threshold aims
        to pass (at least ``k``); block_n, iters, num_warps : launch shape (keys per tile, tiles per
        program, warps per program)

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
                 num_warps, return_counts, None, n)


def _topk(keys, scales, lengths, queries, head_weights, k, capacity, target, block_n, iters, num_warps,
          return_counts, strides, n, table=None):
    """Sample pass, threshold, selecting pass, top-k of the buffer (:func:`fp8_topk`'s body, any layout)."""
    from dsaindex.kernels.topk import SMALL_TOPK_MAX, small_topk

    b = queries.shape[0]
    lengths = lengths.to(device=keys.device, dtype=torch.int32)
    stride = select.sample_stride(n)
    n_samples = -(-n // stride)
    samples = torch.empty(b, n_samples, dtype=torch.float32, device=keys.device)
    launch = dict(block_n=block_n, iters=iters, num_warps=num_warps, strides=strides, n_keys=n, table=table)
    _launch(0, keys, scales, lengths, queries, head_weights, out_score=samples, n_out=n_samples, stride=stride,
            **launch)
    thr = select.sample_thresholds(samples, lengths, stride, target, capacity)
    buf_scores, buf_pos, counts = select.new_buffers(b, capacity, keys.device)
    _launch(1, keys, scales, lengths, queries, head_weights, thr=thr, out_score=buf_scores, out_pos=buf_pos,
            counts=counts, capacity=capacity, **launch)
    if capacity <= SMALL_TOPK_MAX:  # in column order
        values, rows = small_topk(buf_scores, k, buf_pos)
    else:
        values, rows = select.top_of_buffer(buf_scores, buf_pos, k)
    return (values, rows, counts) if return_counts else (values, rows)


def fp8_topk_paged(pages: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor,
                   head_weights: torch.Tensor, k: int, capacity: int = 16384, target: int = 8192, block_n: int = 64,
                   iters: int = 4, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fp8_topk` over keys in the engines' paged layout (DeepGEMM's index-K cache): ``pages``
    [P, 64 * (D + 4)] uint8, each page 64 x D FP8 bytes then 64 float32 scales; ``block_table`` [B, W]
    int32, request b's i-th page. The fallback scorer where DeepGEMM does not import. Returns (scores
    [B, k], positions [B, k] int64), -inf / -1 past a short request."""
    checks.rank("pages", pages, 2, "P, 64 * (D + 4)")
    checks.dtype("pages (FP8 bits and scales)", pages, torch.uint8)
    d = queries.shape[2]
    checks.key_dim("queries.shape[2] (key dim D)", d)
    checks.shape("pages", pages, (None, 64 * (d + 4)), "P, 64 * (D + 4)")
    b = queries.shape[0]
    checks.shape("block_table", block_table, (b, None), "B, W")
    checks.dtype("block_table", block_table, torch.int32)
    checks.shape("lengths", lengths, (b,), "B")
    checks.shape("head_weights", head_weights, tuple(queries.shape[:2]), "B, H")
    checks.same_device(pages=pages, block_table=block_table, queries=queries, head_weights=head_weights)
    target = max(target, k)
    checks.at_least("capacity", capacity, 2 * target, f"twice the threshold's target max(target, k) = {target}")
    pages = pages.contiguous()
    width = pages.shape[1]
    scales = pages.view(torch.float32).view(-1)[16 * d :]  # page 0's scales; the page stride does the rest
    strides = (0, width, 0, width // 4)
    return _topk(pages, scales, lengths, queries, head_weights, k, capacity, target, block_n, iters, num_warps,
                 False, strides, block_table.shape[1] * 64, block_table.contiguous())


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
