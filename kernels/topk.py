"""Top-k of precomputed score rows (the exact path's logits), faster than ``torch.topk`` on long rows.

A strided sample of each row gives a threshold that about ``1.5 target`` entries reach (``target`` at
least k; :func:`dsaindex.kernels.select.thresholds_from_samples`); one pass of :func:`rows_topk` appends the
entries at or above it to a small buffer, and ``torch.topk`` of the buffer finishes. The pass reads each
score once (4 bytes) and writes only the survivors, where ``torch.topk`` of a million-entry row runs
several passes. :func:`rows_topk_reference` is the spec: the exhaustive top-k of each row's prefix.
"""

from __future__ import annotations

import torch

from dsaindex.kernels import checks, select


def rows_topk_reference(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``k`` of each row's first ``lengths[b]`` entries: (values [B, k], columns [B, k] int64; -inf / -1
    past a short row's end)."""
    return select.topk_of_prefixes(logits, lengths.to(logits.device), k)


def rows_topk(logits: torch.Tensor, lengths: torch.Tensor, k: int, target: int | None = None,
              capacity: int | None = None, block_n: int = 1024, iters: int = 4, num_warps: int = 4,
              return_counts: bool = False) -> tuple[torch.Tensor, ...]:
    """:func:`rows_topk_reference` by threshold selection on Triton.

    logits : [B, N] float32 (a row's entries past its length are ignored); lengths : [B] int; k : entries
    kept; target : entries the threshold aims to pass (default ``max(k, 4096)``: the threshold is the
    sample whose rank matches ``1.5 target``, and a rank of a few dozen keeps its spread small even when
    k is small against a long row); capacity : buffer slots per row (default ``4 target``)

    Returns (values [B, k], columns [B, k] int64), and with ``return_counts`` the appended counts [B]: a
    count outside ``[min(k, length), capacity]`` means that row's result is not provably exact
    (:func:`dsaindex.kernels.select.check_counts`), which a sampled threshold makes rare, not impossible.
    """
    import triton

    from dsaindex.kernels.topk_kernel import rows_above_kernel

    checks.rank("logits", logits, 2, "B, N")
    checks.dtype("logits", logits, torch.float32)
    b, n = logits.shape
    checks.shape("lengths", lengths, (b,), "B")
    checks.at_least("k", k, 1)
    target = max(k, 4096) if target is None else max(target, k)
    capacity = 4 * target if capacity is None else capacity
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    lengths = lengths.to(device=logits.device, dtype=torch.int32)
    stride = select.sample_stride(n)
    samples = logits[:, ::stride]
    past = torch.arange(samples.shape[1], device=logits.device)[None, :] * stride >= lengths[:, None]
    thr = select.thresholds_from_samples(samples.masked_fill(past, float("-inf")), lengths, stride, target, capacity)
    buf_scores, buf_pos, counts = select.new_buffers(b, capacity, logits.device)
    if b and n:
        rows_above_kernel[(triton.cdiv(n, block_n * iters), b)](
            logits, lengths, thr, buf_scores, buf_pos, counts, logits.stride(0),
            BLOCK_N=block_n, ITERS=iters, CAPACITY=capacity, num_warps=num_warps)
    values, columns = select.top_of_buffer(buf_scores, buf_pos, k)
    return (values, columns, counts) if return_counts else (values, columns)
