"""PQ codes kept beside an engine's paged index-K cache: which pages need codes, and their encoding,
each beside its torch reference (the spec). The jit code is in :mod:`dsaindex.kernels.paged_codes_kernel`.

An engine's index-K cache is rows of one 64-key page each, ``[P, 64 * (D + 4)]`` uint8 (64 x D FP8 e4m3
bytes then 64 float32 scales), possibly further apart than their width. Codes are kept per physical
page, ``[P + 1, 64, M]`` (the last page is scratch), with the signature each page's codes were made
from: ``SIGNATURE_WORDS`` int64 words of the page at fixed offsets (:func:`signature_words`).

* :func:`stale_pages`: for each request, its completed pages whose codes are missing or were made from
  other bytes; ``e`` of them listed (scratch past them) and the count.
* :func:`encode_pages`: codes of the listed pages read in place (the scratch page skipped), the subspace
  metric's whitening precomputed once (:func:`dsaindex.pq.whitening`), so nothing here synchronizes
  with the host or factorizes a matrix: both run inside a captured CUDA graph. An OPQ codec's rotation
  is folded into that whitening (:func:`whitened_codebooks`): subspace j's whitened coordinates of the
  rotated key are ``L_j^T R_j k``, with ``R_j`` the rotation's rows of subspace j, one [D/M, D] matrix
  per subspace, exact (the same product, associated differently).
"""

from __future__ import annotations

import torch

from dsaindex.kernels import checks
from dsaindex.pq import PQSpec, whitening

PAGE = 64
SIGNATURE_WORDS = 4
# warps of encode_pages' program (a page's 64 keys in one subspace). At 4 the GPU's Triton 3.6 compiles the
# serving form (D = 128, PQ32, signatures written) to 255 registers and 40 bytes of stack, at 8 to none
# (tools/step_launches.py); yet 8 is slower: at 8 / 32 x 1M the launch takes 1.93 / 3.98 us at 4 warps and
# 2.65 / 6.98 at 8 (H100, the plugins' grown step, tools/decode_suite.sh part "encode",
# docs/results/profile_encode_*_warps_h100.json)
ENCODE_WARPS = 4


def signature_words(head_dim: int) -> list[int]:
    """Word offsets (int64) of a page's signature: the first 8 bytes of keys 0, 31 and 63, and the page's
    last 8 bytes (the scales of keys 62 and 63)."""
    width = PAGE * (head_dim + 4)
    return [0, 31 * head_dim // 8, 63 * head_dim // 8, width // 8 - 1]


def page_words(rows: torch.Tensor) -> torch.Tensor:
    """Page rows [P, width] uint8 (page stride a multiple of 8 bytes) as int64 words [P, width / 8]."""
    if rows.stride(0) % 8 or rows.stride(1) != 1:
        raise ValueError(f"index-K pages with strides {tuple(rows.stride())}: pages must be contiguous and start "
                         "on 8-byte boundaries.")
    if rows.is_contiguous():
        return rows.view(torch.int64)
    base = rows.as_strided((rows.shape[0] * rows.stride(0),), (1,)) if rows.shape[0] else rows.reshape(-1)
    return base.view(torch.int64).as_strided((rows.shape[0], rows.shape[1] // 8), (rows.stride(0) // 8, 1))


def stale_pages_reference(rows: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor, signature: torch.Tensor,
                          valid: torch.Tensor, e: int, head_dim: int, window: int = 0, sweep: int = 0,
                          phase: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(pick [B, e] int64: the first ``e`` stale completed pages of each request in table order, the scratch
    page ``P`` past them; count [B] int32: stale pages in all). A page is stale when it has no codes
    (``valid`` 0) or its signature words differ from ``signature``. ``window`` > 0 checks only the last
    ``window`` completed pages of each request (the ones a decode step can have just completed: where the
    pages live in host memory, reading every page's signature each step would cost more than the step);
    with ``sweep`` > 1 too, the older pages at table columns ``c % sweep == phase % sweep`` (``phase`` [1]
    int32 on the device: a step counter, so every page is checked once in ``sweep`` steps).
    The spec of :func:`stale_pages`, which lists the same pages when a request has at most ``e`` stale, else
    ``e`` of them in no set order."""
    b, w = table.shape
    n_pages = rows.shape[0]
    phys = table.long().clamp(0, max(0, n_pages - 1))
    cols = torch.arange(w, device=table.device)[None, :]
    full = (lengths.long() // PAGE)[:, None]
    checked = (cols >= full - window) if window > 0 else torch.ones_like(cols, dtype=torch.bool)
    if window > 0 and sweep > 1:
        checked = checked | (cols % sweep == phase.to(cols.device).long() % sweep)
    done = (cols < full) & checked
    offsets = torch.tensor(signature_words(head_dim), device=rows.device)
    now = page_words(rows)[phys.unsqueeze(-1), offsets]
    stale = done & ~((valid[phys] != 0) & (signature[phys] == now).all(-1))
    order = stale.long().cumsum(1) - 1
    take = stale & (order < e)
    pick = torch.full((b, e + 1), n_pages, dtype=torch.long, device=table.device)
    pick.scatter_(1, torch.where(take, order, e), torch.where(take, phys, n_pages))
    return pick[:, :e].contiguous(), stale.sum(1).to(torch.int32)


def stale_pages(rows: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor, signature: torch.Tensor,
                valid: torch.Tensor, e: int, head_dim: int, block: int = 256, window: int = 0, sweep: int = 0,
                phase: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`stale_pages_reference` in one Triton launch (and two fills), one program per request and
    ``block`` table columns. ``rows`` [P, 64 * (D + 4)]
    uint8 (pages 8-byte aligned), ``table`` [B, W] int32, ``lengths`` [B] int32, ``signature`` [P + 1, 4]
    int64, ``valid`` [P + 1] uint8; one device. Raises ``ValueError`` on bad input."""
    import triton

    from dsaindex.kernels.paged_codes_kernel import stale_pages_kernel

    checks.rank("table", table, 2, "B, W")
    checks.dtype("table", table, torch.int32)
    b = table.shape[0]
    checks.shape("lengths", lengths, (b,), "B")
    checks.dtype("lengths", lengths, torch.int32)
    checks.shape("signature", signature, (rows.shape[0] + 1, SIGNATURE_WORDS), "P + 1, 4")
    checks.dtype("valid", valid, torch.uint8)
    checks.same_device(rows=rows, table=table, lengths=lengths, signature=signature, valid=valid)
    words = page_words(rows)
    pick = torch.full((b, e), rows.shape[0], dtype=torch.long, device=rows.device)
    count = torch.zeros(b, dtype=torch.int32, device=rows.device)
    if b and table.shape[1]:
        w = signature_words(head_dim)
        swept = window > 0 and sweep > 1
        if swept:
            checks.shape("phase", phase, (1,), "1")
            checks.dtype("phase", phase, torch.int32)
        stale_pages_kernel[(b, triton.cdiv(table.shape[1], block))](
            words, words.stride(0), table.contiguous(), table.shape[1], lengths.contiguous(), signature, valid,
            pick, count, rows.shape[0], max(0, int(window)), max(1, int(sweep)), phase if swept else count, *w,
            E=e, BLOCK=block, SWEEP=swept)
    return pick, count


def whitened_codebooks(codebooks: torch.Tensor, metric: torch.Tensor | None,
                       rotation: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(codebooks [M, K, d] in the metric's whitened space, the keys' transform into that space): computed
    once, so encoding inside a CUDA graph never factorizes a matrix. The transform is None (Euclidean, no
    rotation), L^T [M, d, d] per subspace (a metric), or with a ``rotation`` R [D, D] the projection
    [M, d, D] of a whole key into each subspace's whitened coordinates, ``L_j^T R[j d : (j + 1) d]`` (R's
    rows alone without a metric)."""
    spec = PQSpec.of(codebooks)
    cb = codebooks.float()
    white = whitening(metric, spec, codebooks.device)
    if white is not None:
        cb = torch.bmm(cb, white[0].transpose(1, 2))
    if rotation is None:
        return cb.contiguous(), None if white is None else white[0].contiguous()
    rows = rotation.to(codebooks.device, torch.float32).reshape(spec.subspaces, spec.sub_dim, spec.dim)
    return cb.contiguous(), (rows if white is None else torch.bmm(white[0], rows)).contiguous()


def encode_pages_reference(rows: torch.Tensor, pages: torch.Tensor, codebooks: torch.Tensor,
                           metric: torch.Tensor | None, codes: torch.Tensor, head_dim: int,
                           rotation: torch.Tensor | None = None) -> None:
    """Write ``codes[p]`` [64, M] for every listed page ``p`` of ``pages`` [n] int64 other than the scratch
    page (``P``, the page count of ``rows``): the nearest centroid of each of the page's FP8 keys, rotated
    first by ``rotation`` [D, D] if given (:func:`dsaindex.pq.encode`). ``codes`` [P + 1, 64, M], or [P, 64, M]
    where they live in an engine's pool (the scratch page is never read or written). The spec of
    :func:`encode_pages`."""
    from dsaindex.kernels.fp8_score import paged_keys_reference
    from dsaindex.pq import encode

    real = pages[pages != rows.shape[0]]  # the scratch page
    if real.numel() == 0:
        return
    keys, scales = paged_keys_reference(rows, real[None].to(torch.int32), head_dim)
    exact = keys[0].view(torch.float8_e4m3fn).float() * scales[0, :, None]
    codes[real] = encode(exact, codebooks, metric, rotation=rotation).view(real.shape[0], PAGE, -1)


def encode_pages(rows: torch.Tensor, pages: torch.Tensor, whitened: torch.Tensor, transform: torch.Tensor | None,
                 codes: torch.Tensor, head_dim: int, signature: torch.Tensor | None = None,
                 valid: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
                 phase: torch.Tensor | None = None) -> torch.Tensor | None:
    """:func:`encode_pages_reference` in one Triton launch, one program per (page, subspace), reading the
    keys in place; ``whitened`` / ``transform`` from :func:`whitened_codebooks`. A transform of
    shape [M, d, D] (a rotation, the whitening folded in) projects each whole FP8 key (D a power of two)
    into the subspace's coordinates in the kernel; without one the kernel reads only the subspace's own
    d bytes of each key, as before. With ``signature`` [P + 1, 4] int64 and ``valid`` [P + 1] uint8, each
    encoded page's signature words (:func:`signature_words`) and valid flag are written in the same launch.
    A decode step's bookkeeping rides along, saving its launches: with ``lengths`` [B] int32 (at most as many
    requests as pages), returns the keys of each request's completed pages (``lengths // 64 * 64``, [B] int32; None
    without), and a ``phase`` [1] int32 counter is advanced by one. Raises ``ValueError`` on bad input."""
    from dsaindex.kernels.paged_codes_kernel import encode_pages_kernel

    checks.rank("whitened codebooks", whitened, 3, "M, K, D/M")
    m, k, d = whitened.shape
    checks.power_of_two("codebooks.shape[1] (centroids K)", k)
    checks.at_most("codebooks.shape[1] (centroids K)", k, 256, "codes are uint8")
    checks.shape("codes", codes, (None, PAGE, m), "P + 1, 64, M")
    if codes.shape[0] not in (rows.shape[0], rows.shape[0] + 1) or not codes.is_contiguous():
        raise ValueError(f"codes {tuple(codes.shape)} (contiguous: {codes.is_contiguous()}) for {rows.shape[0]} "
                         f"pages: expected a contiguous [{rows.shape[0] + 1} or {rows.shape[0]}, {PAGE}, {m}].")
    checks.dtype("pages", pages, torch.int64)
    checks.same_device(rows=rows, pages=pages, whitened=whitened, codes=codes)
    if m * d != head_dim:
        raise ValueError(f"codebooks cover D={m * d}; the pages hold keys of D={head_dim}.")
    rotate = transform is not None and transform.shape[-1] != d  # [M, d, D]: a rotation, whitening folded in
    if transform is not None:
        checks.shape("transform", transform, (m, d, head_dim if rotate else d), "M, D/M, D (rotation) or M, D/M, D/M")
        checks.same_device(rows=rows, transform=transform)
    if rotate:
        checks.power_of_two("head_dim (D, rotated keys are loaded whole)", head_dim)
    if rows.stride(1) != 1 or rows.stride(0) % 4:
        raise ValueError(f"index-K pages with strides {tuple(rows.stride())}: pages must be contiguous rows.")
    n = pages.numel()
    coded = None
    if lengths is not None:
        checks.rank("lengths", lengths, 1, "B")
        checks.dtype("lengths", lengths, torch.int32)
        checks.same_device(rows=rows, lengths=lengths)
        coded = torch.empty_like(lengths)
    if phase is not None:
        checks.shape("phase", phase, (1,), "1")
        checks.dtype("phase", phase, torch.int32)
    if n == 0 or rows.shape[0] == 0:  # no launch to ride along: the bookkeeping's own kernels
        if coded is not None:
            torch.bitwise_and(lengths, -PAGE, out=coded)
        if phase is not None:
            phase.add_(1)
        return coded
    if coded is not None:  # the launch's programs (one a page and subspace) write them
        checks.at_most("lengths.shape[0] (requests)", lengths.shape[0], n, "one program a page writes them")
    write_sig = signature is not None
    if write_sig:
        checks.shape("signature", signature, (rows.shape[0] + 1, SIGNATURE_WORDS), "P + 1, 4")
        checks.dtype("signature", signature, torch.int64)
        checks.shape("valid", valid, (rows.shape[0] + 1,), "P + 1")
        checks.dtype("valid", valid, torch.uint8)
        page_words(rows)  # pages 8-byte aligned: the signature is read as words
    scales = rows[0].view(torch.float32)[16 * head_dim :]
    encode_pages_kernel[(n, m)](rows, scales, rows.stride(0), pages.contiguous(), whitened,
                                transform if transform is not None else whitened, codes, rows.shape[0],
                                signature if write_sig else codes, valid if write_sig else codes,
                                *signature_words(head_dim),
                                D=head_dim, M=m, K=k, DSUB=d, HAS_METRIC=transform is not None and not rotate,
                                ROTATE=rotate, WRITE_SIG=write_sig, num_warps=ENCODE_WARPS,
                                lengths_ptr=lengths if coded is not None else pages,
                                coded_ptr=coded if coded is not None else pages,
                                phase_ptr=phase if phase is not None else pages,
                                n_requests=0 if coded is None else lengths.shape[0],
                                STEP=coded is not None or phase is not None, SWEEP=phase is not None)
    return coded


def with_tail_reference(cand: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A decode step's rescoring list: each request's candidates ``cand`` [B, C] int64 (-1 none), then the 64
    key positions of its open last page, ``64 * (lengths // 64) + j``, -1 at and past its length: [B, C + 64]
    int64. The spec of :func:`with_tail`."""
    tail = (lengths.long() // PAGE * PAGE)[:, None] + torch.arange(PAGE, device=cand.device)[None, :]
    tail = torch.where(tail < lengths.long()[:, None], tail, torch.full_like(tail, -1))
    return torch.cat([cand.long(), tail], dim=1)


def with_tail(cand: torch.Tensor, lengths: torch.Tensor, block: int = 1024,
              dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """:func:`with_tail_reference` in one launch (it replaced eight small torch kernels of a decode step).
    ``cand`` [B, C] int64, ``lengths`` [B] int32 or int64, one device. ``dtype``: the output's, int64 or int32
    (what the exact rescoring reads: no cast kernel between them)."""
    import triton

    from dsaindex.kernels.paged_codes_kernel import with_tail_kernel

    checks.rank("cand", cand, 2, "B, C")
    checks.dtype("cand", cand, torch.int64)
    b, c = cand.shape
    checks.shape("lengths", lengths, (b,), "B")
    checks.dtype("lengths", lengths, torch.int32, torch.int64)
    checks.same_device(cand=cand, lengths=lengths)
    if dtype not in (torch.int32, torch.int64):
        raise ValueError(f"dtype must be torch.int32 or torch.int64, got {dtype}")
    out = torch.empty(b, c + PAGE, dtype=dtype, device=cand.device)
    if b:
        with_tail_kernel[(triton.cdiv(c + PAGE, block), b)](cand.contiguous(), lengths.contiguous(), out, c,
                                                             PAGE=PAGE, BLOCK=block)
    return out

