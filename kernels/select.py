"""Threshold selection shared by the fused scoring kernels.

A full top-C over a request's whole history would need every score written out and a ``torch.topk``
over it, which costs more than a good scoring pass. The kernels instead take a per-request threshold
and append only the keys whose score reaches it (position + score) into a small candidate buffer of
``capacity`` slots; a ``torch.topk`` over that buffer finishes the selection.

The threshold comes from a cheap sampling pass: the same kernel scores a strided sample of each
request's keys (about ``SAMPLES`` per request), and the threshold is the sample score whose rank,
scaled to the request's length, matches ``oversample x target`` keys. With 8192 samples and a target
of 2048, the expected count of keys above the threshold is ``oversample x target`` with a relative
spread of about ``1 / sqrt(rank)``; :func:`check_counts` reports a request whose buffer overflowed or
holds fewer than the target (its selection is then not provably exact). The decode path does not
check it per step: at 1M keys an overflow is about a 3-sigma event (see docs/results.md).

Also here: :func:`gather_host_rows`, the kernel that copies exact keys from the pinned host pool into
the device pool, and its reference (and fallback) :func:`gather_host_rows_reference`.
"""

from __future__ import annotations

import math
import os

import torch

from dsaindex.coarse import STAGE1_OVERSAMPLE
from dsaindex.kernels import checks

SAMPLES = 8192


def sample_stride(max_len: int, samples: int = SAMPLES) -> int:
    """Row stride of the sampling pass: about ``samples`` rows of the longest request."""
    return max(1, -(-max_len // samples))


def thresholds_from_samples(sample_scores: torch.Tensor, lengths: torch.Tensor, stride: int, target: int,
                            capacity: int, oversample: float = STAGE1_OVERSAMPLE, grow: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """Per-request score thresholds [B] float32.

    Parameters
    ----------
    sample_scores : [B, S] float32 scores of rows ``0, stride, 2 * stride, ...`` (-inf past a request's end)
    lengths : [B] int keys per request; target : keys wanted above the threshold;
    capacity : candidate buffer slots (a request of at most ``capacity`` keys takes all of them: -inf)
    grow : (band, most): ``target`` and ``capacity`` grown by each request's length (:func:`grown_counts`)
    """
    checks.at_least("capacity", capacity, 2 * target, f"twice the target {target}")
    band, most = grow
    targets = grown_counts(target, lengths, band, most).to(lengths.device)
    n_sampled = torch.div(lengths + stride - 1, stride, rounding_mode="floor").clamp_min(1)
    rank = torch.ceil(oversample * targets.double() * n_sampled.double() / lengths.clamp_min(1).double()).long()
    rank = torch.minimum(rank.clamp_min(1), n_sampled)
    # bound known on the host (no synchronization; CUDA-graph safe): a request that uses its threshold
    # has length > capacity >= 2 * target (both grown alike), so rank <= oversample * target x most / stride + 1
    r_max = min(sample_scores.shape[1], math.ceil(oversample * target * (most if band else 1) / stride) + 1)
    top = sample_scores.topk(r_max, dim=1).values
    thr = top.gather(1, (rank.clamp_max(r_max) - 1).unsqueeze(1)).squeeze(1)
    capacities = grown_counts(capacity, lengths, band, most).to(lengths.device)
    return torch.where(lengths <= capacities, torch.full_like(thr, float("-inf")), thr)


def sample_thresholds(sample_scores: torch.Tensor, lengths: torch.Tensor, stride: int, target: int,
                      capacity: int, oversample: float = STAGE1_OVERSAMPLE, counts: torch.Tensor | None = None,
                      grow: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """:func:`thresholds_from_samples` in one Triton launch (one program per request, the samples in
    registers, the rank-th largest by bisection): a decode step's threshold without a sort.
    ``sample_scores`` [B, S] float32 with S at most 16384, any strides (a view ``scores[:, ::stride]`` of
    whole score rows is read in place; samples past a request's length are ignored, whatever they hold);
    ``lengths`` [B] int32 on its device. ``counts`` [B] int32, if given, is zeroed in the same launch (the
    appending pass that follows counts from zero). ``grow`` (band, most): ``target`` and ``capacity`` grown by each
    request's length (:func:`grown_counts`), as :func:`thresholds_from_samples` grows them."""
    import triton

    from dsaindex.kernels.topk_kernel import sample_threshold_kernel

    checks.at_least("capacity", capacity, 2 * target, f"twice the target {target}")
    checks.rank("sample_scores", sample_scores, 2, "B, S")
    checks.dtype("sample_scores", sample_scores, torch.float32)
    b, s = sample_scores.shape
    checks.at_most("sample_scores.shape[1] (samples)", s, 16384, "one program holds a row")
    checks.shape("lengths", lengths, (b,), "B")
    if counts is not None:
        checks.shape("counts", counts, (b,), "B")
        checks.dtype("counts", counts, torch.int32)
    thr = torch.empty(b, dtype=torch.float32, device=sample_scores.device)
    if b:
        block = max(16, triton.next_power_of_2(s))
        sample_threshold_kernel[(b,)](sample_scores, lengths.to(torch.int32).contiguous(), thr,
                                      counts if counts is not None else thr, s, sample_scores.stride(0),
                                      sample_scores.stride(1), stride, target, capacity, float(oversample),
                                      BLOCK=block, ZERO_COUNTS=counts is not None, band=int(grow[0]), most=int(grow[1]),
                                      num_warps=16 if block >= 8192 else 8 if block >= 2048 else 4)
    return thr


def check_counts(counts: torch.Tensor, lengths: torch.Tensor, target: int, capacity: int) -> torch.Tensor:
    """Requests [B] bool whose appended count overflowed ``capacity`` or fell below ``min(target, length)``.

    Such a request's buffer does not provably hold its top ``target``; callers rescore it exhaustively.
    """
    return (counts > capacity) | (counts < torch.minimum(lengths, torch.full_like(lengths, target)))


def new_buffers(batch: int, capacity: int, device: str | torch.device,
                zero_counts: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty candidate buffers: scores [B, capacity] (-inf), positions [B, capacity] int32 (-1), counts [B] int32
    (zeros; left unset with ``zero_counts=False``, for a kernel that zeroes them itself)."""
    scores = torch.full((batch, capacity), float("-inf"), dtype=torch.float32, device=device)
    positions = torch.full((batch, capacity), -1, dtype=torch.int32, device=device)
    counts = (torch.zeros if zero_counts else torch.empty)(batch, dtype=torch.int32, device=device)
    return scores, positions, counts


def topk_of_prefixes(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``k`` of each row's first ``lengths[b]`` scores: (scores [B, k], rows [B, k] int64; -inf / -1
    past a short row's end). The exhaustive selection the fused kernels are checked against."""
    n = scores.shape[1]
    scores = scores.masked_fill(torch.arange(n, device=scores.device)[None, :] >= lengths[:, None], float("-inf"))
    values, rows = scores.topk(min(k, n), dim=1)
    return values, torch.where(torch.isfinite(values), rows, torch.full_like(rows, -1))


def top_of_buffer(scores: torch.Tensor, positions: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``c`` entries of each buffer row: (scores [B, c], positions [B, c] int64; -1 where empty)."""
    c = min(c, scores.shape[1])
    values, at = scores.topk(c, dim=1)
    pos = positions.gather(1, at).long()
    return values, torch.where(torch.isfinite(values), pos, torch.full_like(pos, -1))


def interpreted() -> bool:
    """True under Triton's CPU interpreter (``TRITON_INTERPRET=1``), where bf16 dots are multiplied in float32."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def gather_host_rows(host_fp8: torch.Tensor, host_scales: torch.Tensor, page_table: torch.Tensor,
                     src_pos: torch.Tensor, dst_slot: torch.Tensor, pool_fp8: torch.Tensor,
                     pool_scales: torch.Tensor, block: int = 32) -> None:
    """Copy the keys at positions ``src_pos`` [B, n] (int64, -1 = none) of each request from the host
    pool into rows ``dst_slot`` [B, n] (int64) of the device pool, in one kernel; like
    :func:`gather_host_rows_reference`.

    host_fp8 : [P, PAGE, D] uint8 (D a power of two) and host_scales : [P, PAGE] float32, pinned: the
    kernel reads them through unified virtual addressing (no staging copy); page_table : [B, max_pages]
    int32 on the device; pool_fp8 : [B, R, D] uint8, pool_scales : [B, R] float32 on the device.

    Raises
    ------
    ValueError : an input of the wrong dtype, shape or device (checked first); also what Triton raises
        where the device cannot address the host tensors (then use :func:`gather_host_rows_reference`).
    """
    import triton

    from dsaindex.kernels.select_kernel import gather_host_rows_kernel

    checks.rank("src_pos", src_pos, 2, "B, n")
    b, n = src_pos.shape
    checks.shape("dst_slot", dst_slot, (b, n), "B, n")
    checks.shape("host_fp8", host_fp8, (None, None, None), "P, PAGE, D")
    p, page, d = host_fp8.shape
    checks.power_of_two("host_fp8.shape[2] (key dim D)", d)
    checks.shape("host_scales", host_scales, (p, page), "P, PAGE")
    checks.shape("page_table", page_table, (b, None), "B, max_pages")
    checks.shape("pool_fp8", pool_fp8, (b, None, d), "B, R, D")
    checks.shape("pool_scales", pool_scales, tuple(pool_fp8.shape[:2]), "B, R")
    checks.dtype("host_fp8 (FP8 bits)", host_fp8, torch.uint8)
    checks.dtype("pool_fp8 (FP8 bits)", pool_fp8, torch.uint8)
    checks.dtype("host_scales", host_scales, torch.float32)
    checks.dtype("pool_scales", pool_scales, torch.float32)
    checks.dtype("page_table", page_table, torch.int32, torch.int64)
    checks.dtype("src_pos", src_pos, torch.int32, torch.int64)
    checks.dtype("dst_slot", dst_slot, torch.int32, torch.int64)
    checks.same_device(host_fp8=host_fp8, host_scales=host_scales)
    checks.same_device(pool_fp8=pool_fp8, pool_scales=pool_scales, page_table=page_table, src_pos=src_pos,
                       dst_slot=dst_slot)
    if n == 0 or b == 0:
        return
    # 4-byte words: a third of the bus transactions of byte loads when the rows cross PCIe / C2C
    words = d % 4 == 0 and host_fp8.is_contiguous() and pool_fp8.is_contiguous()
    host_rows = host_fp8.view(torch.int32) if words else host_fp8
    pool_rows = pool_fp8.view(torch.int32) if words else pool_fp8
    gather_host_rows_kernel[(triton.cdiv(n, block), b)](
        host_rows, host_scales, page_table, src_pos.contiguous(), dst_slot.contiguous(), pool_rows, pool_scales,
        n, page_table.shape[1], pool_fp8.shape[1], PAGE=page, D=host_rows.shape[2], BLOCK=block)


def gather_host_rows_reference(host_fp8: torch.Tensor, host_scales: torch.Tensor, page_table: torch.Tensor,
                               src_pos: torch.Tensor, dst_slot: torch.Tensor, pool_fp8: torch.Tensor,
                               pool_scales: torch.Tensor) -> None:
    """:func:`gather_host_rows` without the kernel (same arguments, same effect): the spec, and the
    fallback where the device cannot address pinned memory directly (and on the CPU). The positions go
    to the host (a synchronization), the host gathers the rows and one copy per pool moves them; the
    host tensors need not be pinned."""
    page_size = host_fp8.shape[1]
    src = src_pos.cpu()
    b_idx, i_idx = (src >= 0).nonzero(as_tuple=True)
    if b_idx.numel() == 0:
        return
    pos = src[b_idx, i_idx]
    pages = page_table.cpu().long()[b_idx, pos // page_size]
    rows = host_fp8[pages, pos % page_size]
    scales = host_scales[pages, pos % page_size]
    dev = pool_fp8.device
    b_dev, dst = b_idx.to(dev), dst_slot[b_idx.to(dst_slot.device), i_idx.to(dst_slot.device)].to(dev)
    pool_fp8[b_dev, dst] = rows.to(dev, non_blocking=True)
    pool_scales[b_dev, dst] = scales.to(dev, non_blocking=True)


def grown_counts(count: int, lengths: torch.Tensor, band: int, most: int) -> torch.Tensor:
    """[B] int64: ``count`` times the power of two covering each request's ``lengths`` in units of ``band``
    keys (1 up to ``band``, 2 up to twice it, ...), at most ``most``; ``count`` where ``band`` is 0. A
    request's C by its prefix length, the spec of the kernels' ``grown``."""
    lengths = lengths.reshape(-1).long()
    if band <= 0:
        return torch.full_like(lengths, count)
    need = ((lengths + band - 1) // band).clamp_min(1)
    mult = torch.ones_like(lengths)
    for _ in range(16):
        mult = torch.where((mult < need) & (mult < most), mult * 2, mult)
    return count * mult
