"""PQ coarse selection on Triton, batched over requests: the two coarse stages of the decode path and
page encoding, each beside its torch reference.

Stage 1, :func:`pq_linear_topc`: the head-folded score ``(sum_h w_h q_h) . k`` of every PQ-coded key,
one [M, K] lookup table per request (32 lookups per key for PQ32, against 2048 for the 64-head score),
with the top-C1 selection fused (sampled threshold + append, :mod:`dsaindex.kernels.select`). With int8
tables the scores are integers in [-127 M, 127 M], so the sampling pass counts them in a histogram and
reads the threshold off it in the same launch (the rank of
:func:`~dsaindex.kernels.select.thresholds_from_samples`, exactly): no threshold kernel in between. The fold
drops the ReLU, so it is only a pre-filter: C1 is a few times C.

Stage 2, :func:`pq_candidate_scores`: the full coarse score ``sum_h w_h relu(q_h . k_hat)`` of the
C1 survivors, their keys decoded from the codes into a bf16 tile and scored on tensor cores; the
caller keeps the top C for the exact rerank.

:func:`pq_encode`: nearest centroid per subspace for newly completed pages; its reference
:func:`pq_encode_reference` is the core codec's :func:`dsaindex.pq.encode`.

Residual codes (RQ, ``PQCodec(residual=True)``): ``codebooks`` [M, K, D] of whole-key codewords instead of
[M, K, D/M] slices (told apart by shape against the queries' D, :func:`is_residual`; with M = 1 the two
forms are one). Stage 1 is unchanged but for its tables (the folded query against whole codewords);
stage 2 decodes a candidate as the sum of its M codewords (M rows of D values read, where a product code
reads D values in all); pages are encoded by beam search (:func:`rq_encode`, one launch; its reference is
the core codec's :func:`dsaindex.pq.residual_encode`), not by :func:`pq_encode`.

OPQ codecs (:attr:`dsaindex.pq.PQCodec.rotation`): the coarse stages score codes straight from the
codebooks, so they take queries already in the code space (the caller rotates them once per step,
:func:`dsaindex.pq.rotate`); :func:`pq_encode` takes the rotation and rotates the keys.

Each Triton wrapper ``X`` has its torch reference ``X_reference`` (the spec: same data arguments, same
return) in this module; the jit code is in :mod:`dsaindex.kernels.pq_select_kernel`.
"""

from __future__ import annotations

import torch

from dsaindex.coarse import STAGE1_OVERSAMPLE, stage1_kept_counts
from dsaindex.kernels import checks, select
from dsaindex.kernels.pq_fold_cuda import fold_topc_reference, pq_fold_topc
from dsaindex.kernels.pq_scan_cuda import pq_scan_select, resolve_scan
from dsaindex.kernels.pq_stage2_cuda import int8_scores_reference, resolve_stage2
from dsaindex.kernels.pq_stage2_cuda import score_bound as score_bound  # the bins' scale, beside score_bins
from dsaindex.kernels.select import grown_counts
from dsaindex.pq import (
    PQSpec,
    encode,
    residual_encode,
    residual_whitening,
    rotate,
    split_subspaces,
    whitening,
)


def is_residual(codebooks: torch.Tensor, dim: int) -> bool:
    """Whether ``codebooks`` [M, K, d] are a residual code's whole-key codewords (d == D, M > 1) rather than
    a product code's [M, K, D/M] slices, for keys of ``dim`` = D dims."""
    return codebooks.shape[0] > 1 and codebooks.shape[2] == dim


def folded_lookup_tables(queries: torch.Tensor, head_weights: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
    """[B, H, D] queries, [B, H] weights, [M, K, D/M] codebooks (or a residual code's [M, K, D]) -> [B, M, K]
    float32 tables of the folded query ``sum_h w_h q_h`` (its m-th slice, or all of it) against every
    codeword."""
    m, _, d = codebooks.shape
    folded = torch.einsum("bh,bhd->bd", head_weights.float(), queries.float())
    if is_residual(codebooks, queries.shape[2]):
        return torch.einsum("bd,mkd->bmk", folded, codebooks.float()).contiguous()
    return torch.einsum("bmd,mkd->bmk", folded.view(folded.shape[0], m, d), codebooks.float()).contiguous()


TABLE_DTYPES = (torch.float32, torch.float16, torch.int8)


def lookup_tables(queries: torch.Tensor, head_weights: torch.Tensor, codebooks: torch.Tensor,
                  dtype: torch.dtype = torch.float32, centroid_norms: torch.Tensor | None = None,
                  zero: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`folded_lookup_tables` in one Triton launch: (tables [B, M, K] of ``dtype``, scale [B] or None).

    * float32: the tables themselves, scale None;
    * float16: divided by the norm of each request's folded query (``scale``): an entry is then at most
      its centroid's norm, well inside float16's range;
    * int8: rounded after division by ``scale`` = B / 127, where B bounds every entry of the request's
      table (the largest over subspaces of |folded query part| x largest centroid norm; each program
      knows it without the others). A lookup reads 1 byte; a sum of 32 entries has a rounding error of
      about 1.6 scale, against a score spread of hundreds of scales. ``centroid_norms`` [M] (the largest
      centroid norm per subspace) is computed here if not given (a caller that keeps the codebook passes it).
      For a residual code ([M, K, D] codebooks) B is |folded query| x the largest codeword norm.

    Scores summed from a scaled table come out divided by ``scale``. Inputs as
    :func:`folded_lookup_tables`, on one device, heads and D/M any size. ``zero`` [B, Z + M] int32
    (Z a power of two, at least M) is zeroed in the same launch: the stage-1 sampling pass's histogram
    and counters (:func:`pq_linear_topc`), so a step needs no memset of its own."""
    import triton

    from dsaindex.kernels.pq_select_kernel import lookup_table_kernel

    if dtype not in TABLE_DTYPES:
        raise ValueError(f"lookup table dtype {dtype} is not one of {TABLE_DTYPES}; pass one of them.")
    m, k, d = codebooks.shape
    b, h, dim = queries.shape
    dev = queries.device
    cb = codebooks.to(dev, torch.float32).contiguous()
    out = torch.empty(b, m, k, dtype=dtype, device=dev)
    scaled = dtype != torch.float32
    scale = torch.empty(b, dtype=torch.float32, device=dev) if scaled else None
    if b == 0:
        return out, scale
    int8 = dtype == torch.int8
    if int8 and centroid_norms is None:
        centroid_norms = cb.norm(dim=2).amax(dim=1)
    folded = None
    if zero is not None:
        checks.shape("zero", zero, (b, None), "B, Z + M")
        checks.dtype("zero", zero, torch.int32)
        z = zero.shape[1] - m
        if z < m or triton.next_power_of_2(z) != z:
            raise ValueError(f"zero.shape[1]: got {zero.shape[1]}, want Z + M with Z a power of two of at "
                             f"least M = {m}")
    whole = is_residual(codebooks, dim)
    if any(triton.next_power_of_2(x) != x for x in (d, dim, m, k)):  # odd shapes: the torch tables
        if zero is not None:
            zero.zero_()
        lut = folded_lookup_tables(queries, head_weights, codebooks.to(dev))
        if not scaled:
            return lut, None
        folded = torch.einsum("bh,bhd->bd", head_weights.float(), queries.float())
        if dtype == torch.float16:
            scale = folded.norm(dim=1).clamp_min(1e-30)
            return (lut / scale[:, None, None]).half(), scale
        if whole:
            parts = folded.norm(dim=1, keepdim=True) * centroid_norms.to(dev, torch.float32)[None, :]
        else:
            parts = folded.view(b, m, d).norm(dim=2) * centroid_norms.to(dev, torch.float32)[None, :]
        scale = parts.amax(dim=1).clamp_min(1e-30) / 127
        return torch.floor(lut / scale[:, None, None] + 0.5).to(torch.int8), scale
    norms = centroid_norms.to(dev, torch.float32).contiguous() if int8 else cb
    k_block = min(k, max(1, 4096 // d))  # a [k_block, D/M] tile per program: whole-key codewords split K
    lookup_table_kernel[(b, m, k // k_block)](
        queries.contiguous(), head_weights.float().contiguous(), cb, norms, out, scale if scaled else out,
        N_HEADS=h, H_PAD=max(2, triton.next_power_of_2(h)), D=dim, M=m, K=k, DSUB=d, HALF=dtype == torch.float16,
        INT8=int8, zero_ptr=zero, ZERO_N=0 if zero is None else zero.shape[1] - m, WHOLE=whole, K_BLOCK=k_block)
    return out, scale


def pq_linear_topc_reference(codes: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor,
                             head_weights: torch.Tensor, codebooks: torch.Tensor,
                             c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``c`` rows per request by the stage-1 score: (scores [B, c] float32, rows [B, c] int64; -inf / -1
    past a short request's end). The spec of :func:`pq_linear_topc`."""
    return select.topk_of_prefixes(pq_linear_scores_reference(codes, queries, head_weights, codebooks), lengths, c)


def coarse_stages_reference(codes: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor,
                            head_weights: torch.Tensor, codebooks: torch.Tensor, codebooks_bf16: torch.Tensor,
                            c1: int, grow: tuple[int, int], stage1: str = "codes", groups: tuple | None = None,
                            stage2: str = "bf16") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both coarse stages in torch, keeping what the kernels keep: each request's stage-1 target ``c1`` grown
    with its length (``grow``: (band, most), :func:`grown_counts`), of which :func:`stage1_kept_counts` rows
    (the kernels' threshold keeps that many on average), by the fold scan (``stage1="folds"``) or the codes'
    linear scores (``groups``: the group codes and codebooks, else ``codes`` and ``codebooks``). Returns
    (stage-1 rows [S, 2 c1 most] int64, -1 past a request's kept rows; their count [S] int32; the stage-2
    scores of those rows, ``stage2`` "int8" being the int8 kernel's own arithmetic)."""
    band, most = grow
    kept = stage1_kept_counts(grown_counts(c1, lengths, band, most), lengths)
    width = 2 * c1 * most
    if stage1 == "folds":
        _, rows1 = fold_topc_reference(codes, lengths, queries, head_weights, codebooks_bf16, width)
    else:
        codes1, books1 = (codes, codebooks) if groups is None else groups
        _, rows1 = pq_linear_topc_reference(codes1, lengths, queries, head_weights, books1, width)
    rows1 = torch.where(torch.arange(rows1.shape[1], device=rows1.device)[None, :] < kept[:, None], rows1, -1)
    counts1 = torch.minimum(lengths.long(), kept).to(torch.int32)
    return rows1, counts1, pq_candidate_scores_reference(codes, rows1, queries, head_weights, codebooks_bf16, stage2)


def growth_of(keys: int, band: int, most: int) -> int:
    """The factor :func:`grown_counts` gives a request of ``keys`` keys (a host integer)."""
    if band <= 0:
        return 1
    need, mult = max(1, -(-keys // band)), 1
    while mult < need and mult < most:
        mult *= 2
    return mult


def step_growth(keys: int, band: int, most: int) -> tuple[int, int]:
    """(band, factor) of a step whose longest request holds ``keys`` keys, C grown past ``band`` by up to
    ``most`` x: no more growth than those keys need, and (0, 1) where C stays fixed."""
    factor = growth_of(keys, band, most)
    return (band, factor) if factor > 1 else (0, 1)


def grown_exact_rule(lengths: torch.Tensor, per_request: int, offset: int, band: int, most: int,
                     use_triton: bool = True, extra: int = 0, both: bool = False) -> torch.Tensor:
    """The paged step's exact-path predicate where C grows by length, as a 0-d bool tensor on the lengths'
    device (no sync): the longest request's N takes the exact path when N <= ``per_request`` + ``offset`` x g
    + ``extra`` x (g - 1), g = :func:`growth_of` N (one launch: ``grown_exact_rule_kernel``; torch ops with
    ``use_triton`` off). ``both``: [2] bool, the predicate and its negation (from the same launch)."""
    import triton

    from dsaindex.kernels.pq_select_kernel import grown_exact_rule_kernel

    check_growth(band, most)
    per_request, offset = per_request - extra, offset + extra  # offset g + extra (g - 1) = (offset + extra) g - extra
    lengths = lengths.reshape(-1)
    if not use_triton:
        longest = lengths.long().amax()
        exact = longest <= per_request + offset * grown_counts(1, longest, band, most)[0]
        return torch.stack([exact, exact.logical_not()]) if both else exact
    out = torch.empty((2,) if both else (), dtype=torch.bool, device=lengths.device)
    grown_exact_rule_kernel[(1,)](lengths.to(torch.int32).contiguous(), lengths.numel(), out, int(per_request),
                                  int(offset), int(band), int(most), BLOCK=max(16, triton.next_power_of_2(lengths.numel())),
                                  BOTH=both)
    return out


def check_growth(band: int, most: int) -> None:
    """Raise ``ValueError`` unless (``band``, ``most``) is a growth the kernels take: ``band`` >= 0 keys and
    ``most`` a power of two from 1 to 2**15."""
    if band < 0 or most < 1 or most & (most - 1) or most > 1 << 15:
        raise ValueError(f"growth: got band {band} and most {most}; want band >= 0 and most a power of two "
                         "from 1 to 32768")


def pq_linear_scores_reference(codes: torch.Tensor, queries: torch.Tensor, head_weights: torch.Tensor,
                               codebooks: torch.Tensor) -> torch.Tensor:
    """Stage-1 scores [B, N] float32 of ``codes`` [B, N, M] uint8 for ``queries`` [B, H, D], ``head_weights``
    [B, H] and ``codebooks`` [M, K, D/M]: the score :func:`pq_linear_topc` selects by (no kernel returns
    it whole)."""
    lut = folded_lookup_tables(queries, head_weights, codebooks)  # [B, M, K]
    b, n, m = codes.shape
    gathered = lut.unsqueeze(1).expand(b, n, m, lut.shape[2]).gather(3, codes.long().unsqueeze(-1)).squeeze(-1)
    return gathered.sum(-1)


def pq_candidate_scores_reference(codes: torch.Tensor, rows: torch.Tensor, queries: torch.Tensor,
                                  head_weights: torch.Tensor, codebooks: torch.Tensor,
                                  stage2: str = "triton") -> torch.Tensor:
    """Stage-2 scores [B, R] float32 of candidate ``rows`` [B, R] (-1 = none: -inf); keys decoded in
    bf16 as the kernel does (a residual code's codewords summed in float32, then rounded to bf16),
    products in float32. ``stage2="int8"``: as the int8 kernel scores them instead
    (:func:`~dsaindex.kernels.pq_stage2_cuda.int8_scores_reference`, from the bf16 codebook it is given)."""
    if stage2 == "int8":
        return int8_scores_reference(codes, rows, queries, head_weights, codebooks.to(torch.bfloat16))
    m, k, d = codebooks.shape
    b, r = rows.shape
    safe = rows.clamp_min(0).long()
    cand_codes = codes.gather(1, safe.unsqueeze(-1).expand(b, r, m)).long()  # [B, R, M]
    cb = codebooks.to(torch.bfloat16).float()
    words = cb[torch.arange(m, device=codes.device), cand_codes]  # [B, R, M, d]
    if is_residual(codebooks, queries.shape[2]):
        keys = words.sum(2).to(torch.bfloat16).float()
    else:
        keys = words.reshape(b, r, m * d)
    dots = torch.einsum("brd,bhd->brh", keys, queries.to(torch.bfloat16).float())
    scores = (torch.relu(dots) * head_weights.float().unsqueeze(1)).sum(-1)
    return scores.masked_fill(rows < 0, float("-inf"))


def _check_codes_and_queries(codes, queries, head_weights, codebooks, page_table=None) -> None:
    """The preconditions both coarse stages share (:mod:`dsaindex.kernels.checks`). With a
    ``page_table`` [B, W] int32 the codes are kept per physical page, [P, 64, M]. ``codebooks`` [M, K, D/M]
    (product code) or [M, K, D] (residual code)."""
    checks.rank("codebooks", codebooks, 3, "M, K, D/M (or M, K, D for a residual code)")
    m, k, d = codebooks.shape
    checks.power_of_two("codebooks.shape[0] (subspaces M)", m)
    checks.power_of_two("codebooks.shape[1] (centroids K)", k)
    checks.dtype("codes", codes, torch.uint8)
    checks.rank("queries", queries, 3, "B, H, D")
    dim = d if is_residual(codebooks, queries.shape[2]) else m * d
    if page_table is None:
        checks.shape("codes", codes, (None, None, m), "B, N, M")
        checks.shape("queries", queries, (codes.shape[0], None, dim), "B, H, D")
    else:
        checks.shape("codes", codes, (None, 64, m), "P, 64, M (codes per physical page)")
        checks.shape("queries", queries, (None, None, dim), "B, H, D")
        checks.shape("page_table", page_table, (queries.shape[0], None), "B, W")
        checks.dtype("page_table", page_table, torch.int32)
        checks.same_device(codes=codes, page_table=page_table)
    checks.shape("head_weights", head_weights, tuple(queries.shape[:2]), "B, H")
    checks.same_device(codes=codes, queries=queries, head_weights=head_weights, codebooks=codebooks)


def _check_stream(stream: int) -> None:
    if stream not in (0, 1, 2):
        raise ValueError(f"stream: got {stream!r}, want 0 (codes cached in L1), 1 (read past L1) or 2 (evicted "
                         "first)")


def paged_codes_reference(codes: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """Codes kept per physical page [P, 64, M] seen through a page table [B, W] as per-request codes
    [B, W * 64, M] (the references' view of the paged kernels' input)."""
    b, w = page_table.shape
    return codes[page_table.long()].reshape(b, w * 64, codes.shape[2])


def pq_linear_topc(codes: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor, head_weights: torch.Tensor,
                   codebooks: torch.Tensor, c: int, capacity: int | None = None, max_len: int | None = None,
                   block_n: int = 256, iters: int = 8, num_warps: int = 4, return_counts: bool = False,
                   keep_all: bool = False, table_dtype: torch.dtype = torch.float32,
                   centroid_norms: torch.Tensor | None = None, page_table: torch.Tensor | None = None,
                   chunk: int | None = None, stream: int = 1, scan: str = "auto", grow: tuple[int, int] = (0, 1),
                   ) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1: top ``c`` rows per request by the folded score, selection fused into the scan.

    Parameters
    ----------
    codes : [B, N, M] uint8; lengths : [B] int valid rows per request (copied to the codes' device if
    elsewhere); queries : [B, H, D]; head_weights : [B, H]; codebooks : [M, K, D/M] float32, M and K
    powers of two; all but ``lengths`` on one device. c : candidates kept; capacity : buffer slots per
    request (default 3c, at least 2c); max_len : the longest request (default N; a smaller value, known
    on the host, shortens the scan of a preallocated code array)

    Returns
    -------
    (scores [B, c] float32, rows [B, c] int64; -inf / -1 where a request has fewer keys), and with
    ``return_counts`` the appended counts [B] (see :func:`dsaindex.kernels.select.check_counts`).
    ``keep_all`` returns the whole buffer instead ([B, capacity], rows int32: every key above the
    threshold, about 1.5 c, in no order; the slots past a request's count left unset (the count says how
    many are filled); scores divided by the table scale), saving the top-c sort when the next stage
    rescores them anyway. ``table_dtype`` float16 or int8 looks codes up in scaled tables of that type
    (:func:`lookup_tables`: fewer bytes per lookup; the selection differs only by rounding; the top-c
    scores are rescaled; ``centroid_norms`` as there). ``page_table`` [B, W] int32: the codes are kept
    per physical 64-key page, ``codes`` [P, 64, M], and request b's row r is row ``r % 64`` of page
    ``page_table[b, r // 64]`` (an engine's paged cache; N is then W * 64, and the reference reads
    :func:`paged_codes_reference`). The launch depends on shapes only, never on the lengths' values, so
    it can be captured in a CUDA graph. ``chunk``: code bytes of a row each lane loads at once (default
    16 where M is a multiple of 16, else M). With 16, one lane holds 16 codes of one row, so a warp's
    table lookups at a time all read one subspace's table (two cache lines) instead of several.
    ``stream`` 1 (the default) reads the codes past L1 (``.cg``) and keeps the tables there, 2 marks the
    codes first to be evicted, 0 leaves both to the cache; none changes the scores. The default launch
    (256-row tiles, 8 a program, 4 warps, ``stream`` 1) is the fastest measured on the H200 at 32 x 1M
    keys: 2.0x the bytes floor against 2.3x for 128-row tiles without ``stream`` (docs/results.md); a decode
    step over fewer key slots launches as :func:`stage1_launch` says (one 512-row tile a program, 8 warps).
    ``scan="cuda"`` (int8 tables, 256 centroids, 32 subspaces, a CUDA device) runs the selecting pass as
    the CUDA kernel of :mod:`dsaindex.kernels.pq_scan_cuda` (tables in shared memory; the tile options then
    apply to the sampling pass only): the same keys and scores, appended in another order; ``"auto"`` (the
    default) takes it where it runs, else ``"triton"``. ``grow`` (band, most), with ``keep_all`` and int8
    tables: each request aims at :func:`grown_counts` of ``c`` by its length instead of ``c`` (its C by its
    prefix length), and its capacity grows alike inside a buffer ``most`` times as wide.
    Raises ``ValueError`` on an input of the wrong dtype, shape or device.
    """
    import triton

    from dsaindex.kernels.pq_select_kernel import pq_linear_kernel

    _check_codes_and_queries(codes, queries, head_weights, codebooks, page_table)
    b, m = queries.shape[0], codes.shape[2]
    scan = resolve_scan(scan, m, codebooks.shape[1], table_dtype == torch.int8, codes.device)
    n_rows = codes.shape[1] if page_table is None else page_table.shape[1] * 64
    checks.shape("lengths", lengths, (b,), "B")
    n = n_rows if max_len is None else min(max_len, n_rows)
    k = codebooks.shape[1]
    capacity = 3 * c if capacity is None else capacity
    checks.at_least("capacity", capacity, 2 * c, "twice the candidates c")
    band, most = grow
    check_growth(band, most)
    if band and not (keep_all and table_dtype == torch.int8):
        raise ValueError("grow: a C grown by length needs keep_all and int8 tables (the decode step's stage 1)")
    width = capacity * (most if band else 1)  # buffer slots per request
    codes = codes.contiguous()
    lengths = lengths.to(device=codes.device, dtype=torch.int32)
    int_table = table_dtype == torch.int8
    # int8 tables give integer scores in [-127 M, 127 M]: the sampling pass counts them in a histogram
    # and its last program per request reads the threshold off it (no threshold kernel)
    n_bins = triton.next_power_of_2(2 * 127 * m + 1)
    hist = torch.empty(b, n_bins + m, dtype=torch.int32, device=codes.device) if int_table else None
    lut, scale = lookup_tables(queries, head_weights, codebooks, dtype=table_dtype, centroid_norms=centroid_norms,
                               zero=hist)
    stride = select.sample_stride(n)
    n_samples = -(-n // stride)
    samples = None if int_table else torch.empty(b, n_samples, dtype=torch.float32, device=codes.device)
    dummy_i = torch.empty(1, dtype=torch.int32, device=codes.device)
    dummy_f = torch.empty(1, dtype=torch.float32, device=codes.device)
    if keep_all:  # slots past the count are never read (the count travels with the buffer)
        buf_scores = torch.empty(b, width, dtype=torch.float32, device=codes.device)
        buf_pos = torch.empty(b, width, dtype=torch.int32, device=codes.device)
        counts = torch.empty(b, dtype=torch.int32, device=codes.device)
    else:
        buf_scores, buf_pos, counts = select.new_buffers(b, capacity, codes.device, zero_counts=False)
    table = dummy_i if page_table is None else page_table.contiguous()
    chunk = (16 if m % 16 == 0 else m) if chunk is None else chunk
    if chunk < 1 or m % chunk or triton.next_power_of_2(chunk) != chunk:
        raise ValueError(f"chunk: got {chunk}, want a power of two dividing the {m} subspaces")
    _check_stream(stream)
    paged = dict(HAS_TABLE=page_table is not None, CHUNK=chunk, STREAM=stream)
    thr = torch.empty(b, dtype=torch.float32, device=codes.device) if int_table else dummy_f
    # the sampling pass reads a few thousand scattered rows: one tile per program, so they run at once
    pq_linear_kernel[(max(1, triton.cdiv(n_samples, block_n)), b)](  # also zeroes the counts
        codes, lengths, lut, thr, dummy_f if int_table else samples, dummy_i, counts, table, table.shape[-1],
        n_rows, n_samples, stride, M=m, K=k, BLOCK_N=block_n, ITERS=1, CAPACITY=1, SAMPLE=True,
        INT_TABLE=int_table, num_warps=num_warps, hist_ptr=hist, target=c, capacity=capacity,
        oversample=STAGE1_OVERSAMPLE, HIST=int_table, NBINS=n_bins, band=band, most=most, **paged)
    if not int_table:
        thr = select.sample_thresholds(samples, lengths, stride, c, capacity)
    if scan == "cuda":
        pq_scan_select(codes, lengths, lut, thr, buf_scores, buf_pos, counts,
                       None if page_table is None else table, n)
    else:
        pq_linear_kernel[(max(1, triton.cdiv(n, block_n * iters)), b)](
            codes, lengths, lut, thr, buf_scores, buf_pos, counts, table, table.shape[-1], n_rows, 0, 1,
            M=m, K=k, BLOCK_N=block_n, ITERS=iters, CAPACITY=width, SAMPLE=False, INT_TABLE=int_table,
            num_warps=num_warps, **paged)
    if keep_all:  # the buffer as the kernel wrote it (a decode step rescores it in stage 2)
        values, rows = buf_scores, buf_pos
    else:
        values, rows = select.top_of_buffer(buf_scores, buf_pos, c)
        if scale is not None:
            values = values * scale[:, None]
    return (values, rows, counts) if return_counts else (values, rows)


def pq_candidate_scores(codes: torch.Tensor, rows: torch.Tensor, queries: torch.Tensor, head_weights: torch.Tensor,
                        codebooks: torch.Tensor, counts: torch.Tensor | None = None, block_n: int = 64,
                        iters: int = 1, page_table: torch.Tensor | None = None, stream: int = 0,
                        stage2: str = "auto") -> torch.Tensor:
    """Stage 2: scores [B, R] float32 of candidate ``rows`` [B, R] (-1 = none), like
    :func:`pq_candidate_scores_reference`. ``codebooks`` may be given in bf16 already (cast once at load).
    ``counts`` [B] int32 (optional): only the first ``counts[b]`` rows of a request can be filled (a
    stage-1 buffer), so tiles past it are skipped. ``iters`` tiles of ``block_n`` rows per program share
    one load of the queries. ``codes`` [B, N, M] uint8, ``queries`` [B, H, D] with
    D a power of two >= 16, ``head_weights`` [B, H], ``codebooks`` [M, K, D/M], all on one device;
    raises ``ValueError`` otherwise. ``page_table`` [B, W] int32: codes kept per physical page
    [P, 64, M], as in :func:`pq_linear_topc`. ``stream``: codes read past L1, codebooks kept there (Triton).
    ``stage2``: ``"triton"``, ``"cuda"`` (:mod:`dsaindex.kernels.pq_stage2_cuda`: codebooks in shared memory;
    ``counts`` needed), ``"int8"`` (the same on 8-bit operands) or ``"auto"`` (the default: the int8 CUDA kernel
    where it runs, for launches of at least :data:`~dsaindex.kernels.pq_stage2_cuda.CUDA_FROM_SLOTS` slots B x R,
    :func:`resolve_stage2`)."""
    import triton

    from dsaindex.kernels.pq_select_kernel import pq_candidate_kernel

    _check_codes_and_queries(codes, queries, head_weights, codebooks, page_table)
    b, m = queries.shape[0], codes.shape[2]
    n = codes.shape[1] if page_table is None else page_table.shape[1] * 64
    _, k, d = codebooks.shape
    h, dim = queries.shape[1], queries.shape[2]
    checks.key_dim("queries.shape[2] (key dim D)", dim)
    checks.shape("rows", rows, (b, None), "B, R")
    checks.dtype("rows", rows, torch.int32, torch.int64)
    if counts is not None:
        checks.shape("counts", counts, (b,), "B")
        checks.dtype("counts", counts, torch.int32)
    checks.same_device(codes=codes, rows=rows, counts=counts)
    _check_stream(stream)
    r = rows.shape[1]
    out = torch.empty(b, r, dtype=torch.float32, device=codes.device)
    if r == 0:
        return out
    table = codebooks.to(torch.bfloat16).contiguous()
    residual = is_residual(codebooks, dim)
    if stage2 in ("cuda", "int8") and counts is None:
        raise ValueError(f"stage2={stage2!r} scores a stage-1 buffer: pass its counts")
    kernel = resolve_stage2(stage2, h, dim, m, k, residual, codes.device, b * r) if counts is not None else "triton"
    if kernel != "triton":
        from dsaindex.kernels.pq_stage2_cuda import pq_stage2

        pq_stage2(codes.contiguous(), rows.to(torch.int32).contiguous(), counts, queries.to(torch.bfloat16).contiguous(),
                  head_weights.float().contiguous(), table, scores=out,
                  page_table=None if page_table is None else page_table.contiguous(), int8=kernel == "int8")
        return out
    wide = d == 4 and not residual  # one 8-byte load per subspace instead of four 2-byte ones
    pages = out if page_table is None else page_table.contiguous()
    pq_candidate_kernel[(triton.cdiv(r, block_n * iters), b)](
        codes.contiguous(), rows.to(torch.int32).contiguous(), table.view(torch.int64) if wide else table,
        queries.to(torch.bfloat16).contiguous(), head_weights.float().contiguous(), out,
        counts if counts is not None else out, pages, pages.shape[-1], n, r,
        N_HEADS=h, H_PAD=max(16, triton.next_power_of_2(h)), D=dim, M=m, K=k, BLOCK_N=block_n,
        F32=select.interpreted(), HAS_COUNTS=counts is not None, WIDE=wide, ITERS=iters,
        HAS_TABLE=page_table is not None, RESIDUAL=residual, STREAM=stream)
    return out


BIN_COUNT = 8192  # score bins of the direct step's candidate selection (0.2% wide, each sign)
BIN_OCTAVES, BIN_TOP = 12.0, 1.0  # the bins span 12 octaves, ending one octave above the score bound


def score_bins(scores: torch.Tensor, bound: torch.Tensor, n_bins: int = BIN_COUNT) -> torch.Tensor:
    """Bins [B, R] int32 of stage-2 ``scores`` [B, R] on a signed log scale relative to each request's
    ``bound`` [B]: the upper half of the ``n_bins`` bins holds positive scores (and zero), the lower half
    negative ones (head weights can be negative), each half log-spaced over [bound * 2**(BIN_TOP -
    BIN_OCTAVES), bound * 2**BIN_TOP]; smaller magnitudes next to zero, -inf in bin 0. The torch twin of
    the stage-2 kernel's ``score_bin``."""
    half = n_bins // 2
    ratio = (scores.abs() / bound[:, None]).clamp_min(1e-30)
    at = torch.floor((torch.log2(ratio) + (BIN_OCTAVES - BIN_TOP)) * (half / BIN_OCTAVES)).clamp(0, half - 1)
    return torch.where(scores >= 0, half + at, half - 1 - at).to(torch.int32)


def boundary_of_bins(bins: torch.Tensor, live: torch.Tensor, c: int | torch.Tensor, capacity: int | torch.Tensor,
                     n_bins: int = BIN_COUNT) -> torch.Tensor:
    """[B, 4] int32 (boundary bin, candidates above it, candidates kept, 0) of each request's ``live``
    candidates' ``bins`` [B, R]: the boundary is the highest bin whose suffix count reaches ``c`` (0 when
    fewer), everything above it is kept, and the candidates in it up to ``capacity`` in all. ``c`` and
    ``capacity``: one for all requests, or [B] each (a C grown by length, :func:`grown_counts`)."""
    rows = []
    per_c = torch.as_tensor(c).reshape(-1).expand(bins.shape[0]).tolist() if bins.shape[0] else []
    per_cap = torch.as_tensor(capacity).reshape(-1).expand(bins.shape[0]).tolist() if bins.shape[0] else []
    for b in range(bins.shape[0]):
        c, capacity = int(per_c[b]), int(per_cap[b])
        hist = torch.bincount(bins[b][live[b]].long(), minlength=n_bins)
        suffix = hist.flip(0).cumsum(0).flip(0)
        edge = max(int((suffix >= c).sum()) - 1, 0)
        above = int(suffix[edge + 1]) if edge + 1 < n_bins else 0
        rows.append([edge, above, min(int(suffix[edge]), capacity), 0])
    return torch.tensor(rows, dtype=torch.int32, device=bins.device).reshape(-1, 4)


def pq_candidate_bins(codes: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor, queries: torch.Tensor,
                      head_weights: torch.Tensor, codebooks: torch.Tensor, key_bound: float, c: int, capacity: int,
                      scratch: torch.Tensor, block_n: int = 128, page_table: torch.Tensor | None = None,
                      lengths: torch.Tensor | None = None, grow: tuple[int, int] = (0, 1), dedup: bool = True,
                      stage2: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 2 with the candidate selection folded in: the scores of :func:`pq_candidate_scores`, each
    candidate's :func:`score_bins` bin, and the request's (boundary bin, above, kept, 0) of
    :func:`boundary_of_bins`, read by a one-program-a-request launch off a histogram the scoring launch built
    with atomics (no top-C kernel). ``rows`` [B, R] int32 with ``counts`` [B] int32 filled (a stage-1
    buffer); ``key_bound``: the largest norm of a decoded key; ``scratch`` [B, BIN_COUNT + 4] int32 zeros,
    left zeroed (its two append counters zeroed for :func:`keep_binned`). ``page_table`` [B, W] int32: codes
    kept per physical page, as :func:`pq_candidate_scores`. ``grow`` (band, most) with ``lengths`` [B] int32:
    each request's ``c`` is :func:`grown_counts` of it by its length, its capacity that plus ``capacity - c``.
    ``dedup`` (default): a tile adds each distinct bin to the histogram once, with its count, instead of one
    atomic a candidate (the same histogram; fewer atomics on the bins a request's candidates crowd into). H100,
    32 x 1M, C1 = 64K (a grown C): 0.91 -> 0.81 ms (the scores alone 0.55), 2.20 -> 0.71 ms where every score
    crowds into a few bins; the plugins' grown step 1.33x -> 1.38x DeepGEMM at 32 x 1M
    (docs/results/stage2_bins_dedup_h100.json, paged_grown_dedup_{off,on}_h100.json). ``stage2``: the scoring
    launch's kernel, as :func:`pq_candidate_scores` (the CUDA one counts the bins in a shared-memory histogram of
    each block, added to the request's once a non-empty bin; ``dedup`` and ``block_n`` are the Triton one's).
    Returns (scores [B, R] float32, bins [B, R] int32 (set below each count), sel [B, 4] int32)."""
    import triton

    from dsaindex.kernels.pq_select_kernel import boundary_of_bins_kernel, pq_candidate_kernel

    _check_codes_and_queries(codes, queries, head_weights, codebooks, page_table)
    b, m = queries.shape[0], codes.shape[2]
    _, k, d = codebooks.shape
    checks.shape("rows", rows, (b, None), "B, R")
    checks.dtype("rows", rows, torch.int32)
    checks.shape("counts", counts, (b,), "B")
    checks.dtype("counts", counts, torch.int32)
    checks.shape("scratch", scratch, (b, BIN_COUNT + 4), "B, BIN_COUNT + 4")
    checks.dtype("scratch", scratch, torch.int32)
    checks.at_least("capacity", capacity, c, "the candidates wanted")
    checks.same_device(codes=codes, rows=rows, counts=counts, scratch=scratch)
    r = rows.shape[1]
    dev = codes.device
    out = torch.empty(b, r, dtype=torch.float32, device=dev)
    bins = torch.empty(b, r, dtype=torch.int32, device=dev)
    sel = torch.empty(b, 4, dtype=torch.int32, device=dev)
    table = codebooks.to(torch.bfloat16).contiguous()
    h, dim = queries.shape[1], queries.shape[2]
    residual = is_residual(codebooks, dim)
    wide = d == 4 and not residual
    pages = out if page_table is None else page_table.contiguous()
    kernel = resolve_stage2(stage2, h, dim, m, k, residual, dev, b * r)
    if kernel != "triton":
        from dsaindex.kernels.pq_stage2_cuda import pq_stage2

        pq_stage2(codes.contiguous(), rows.contiguous(), counts, queries.to(torch.bfloat16).contiguous(),
                  head_weights.float().contiguous(), table, scores=out, bins=bins, scratch=scratch,
                  page_table=None if page_table is None else pages, key_bound=float(key_bound), int8=kernel == "int8")
    else:
        pq_candidate_kernel[(max(1, triton.cdiv(r, block_n)), b)](
            codes.contiguous(), rows.contiguous(), table.view(torch.int64) if wide else table,
            queries.to(torch.bfloat16).contiguous(), head_weights.float().contiguous(), out, counts, pages,
            0 if page_table is None else page_table.shape[1], codes.shape[1], r, N_HEADS=h,
            H_PAD=max(16, triton.next_power_of_2(h)), D=dim, M=m, K=k, BLOCK_N=block_n, F32=select.interpreted(),
            HAS_COUNTS=True, WIDE=wide, ITERS=1, HAS_TABLE=page_table is not None, bins_ptr=bins,
            scratch_ptr=scratch, key_bound=float(key_bound), BINS=True, NBINS=BIN_COUNT, RESIDUAL=residual,
            DEDUP=dedup)
    band, most = grow
    check_growth(band, most)
    if band:
        if lengths is None:
            raise ValueError("grow: a C grown by length needs the requests' lengths")
        checks.shape("lengths", lengths, (b,), "B")
        checks.dtype("lengths", lengths, torch.int32)
    if b:
        boundary_of_bins_kernel[(b,)](scratch, sel, c, capacity, NBINS=BIN_COUNT, num_warps=8,
                                      lengths_ptr=lengths if band else sel, band=band, most=most)
    return out, bins, sel


def keep_binned_reference(rows: torch.Tensor, bins: torch.Tensor, counts: torch.Tensor, sel: torch.Tensor,
                          capacity: int) -> torch.Tensor:
    """The candidates a binned stage 2 keeps (the spec of :func:`keep_binned`): of each request's first
    ``counts[b]`` slots holding a key (``rows`` >= 0), every one whose bin is above the boundary ``sel[b,
    0]``, then those in it in slot order up to ``sel[b, 2]`` in all. Returns [B, capacity] int64 key
    positions (``rows``), -1 after."""
    b, n = rows.shape
    out = torch.full((b, capacity), -1, dtype=torch.int64, device=rows.device)
    live = (torch.arange(n, device=rows.device)[None, :] < counts[:, None].long()) & (rows >= 0)
    for i in range(b):
        edge, kept = int(sel[i, 0]), int(sel[i, 2])
        strict = rows[i][live[i] & (bins[i] > edge)].long()
        tied = rows[i][live[i] & (bins[i] == edge)].long()
        chosen = torch.cat([strict, tied])[:kept]
        out[i, : chosen.numel()] = chosen
    return out


def keep_binned(rows: torch.Tensor, bins: torch.Tensor, counts: torch.Tensor, sel: torch.Tensor,
                scratch: torch.Tensor, capacity: int, block_n: int = 1024) -> torch.Tensor:
    """:func:`keep_binned_reference` in one launch (the same set; slots in no particular order): the top-C
    step of a binned stage 2 (:func:`pq_candidate_bins`) without a top-C kernel. ``scratch``: the one
    :func:`pq_candidate_bins` just used (its two append counters, which it left zeroed)."""
    import triton

    from dsaindex.kernels.pq_select_kernel import keep_binned_kernel

    b, n = rows.shape
    checks.dtype("rows", rows, torch.int32)
    checks.shape("bins", bins, (b, n), "B, R")
    checks.shape("sel", sel, (b, 4), "B, 4")
    checks.shape("scratch", scratch, (b, BIN_COUNT + 4), "B, BIN_COUNT + 4")
    out = torch.empty(b, capacity, dtype=torch.int64, device=rows.device)
    if b:
        keep_binned_kernel[(triton.cdiv(n, block_n) + 1, b)](
            rows.contiguous(), bins, counts, sel, scratch[:, BIN_COUNT + 2 :], out, n, scratch.stride(0),
            CAPC=capacity, CAPC_PAD=triton.next_power_of_2(capacity), BLOCK_N=block_n)
    return out


def decoded_key_bound(codebooks: torch.Tensor, residual: bool = False) -> float:
    """A bound of the norm of a key decoded from ``codebooks`` [M, K, D/M] (as bf16, what stage 2 reads):
    the largest such norm; for a residual code's [M, K, D] (``residual``), the sum over codebooks of the
    largest codeword norm (the triangle inequality)."""
    norms = codebooks.to(torch.bfloat16).float().pow(2).sum(2).amax(1)  # [M] largest squared codeword norm
    return float(norms.sqrt().sum()) if residual else float(norms.sum().sqrt())


# stage 1 of a decode step over at most this many key slots (B x the longest a page table holds) is launched as
# one 512-row tile per program with 8 warps: four times the programs of the default launch (256 x 8 tiles,
# 4 warps), which fills the GPU where few requests leave its programs short of a wave. H200, paged codes, C1 = 16,384:
# 32.4 / 52.5 / 82.7 / 142.7 us at 1 / 2 / 4 / 8 x 1M against 45.6 / 60.6 / 88.7 / 152.3 us (docs/results.md)
STAGE1_WIDE_TILES_UPTO = 8 << 20
STAGE1_WIDE_TILES = dict(block_n=512, iters=1, num_warps=8)


def stage1_launch(batch: int, slots: int) -> dict:
    """The launch options of a decode step's stage 1 over ``batch`` requests of ``slots`` key slots each
    (shapes only, so a CUDA graph captures one launch for every length it replays)."""
    return dict(STAGE1_WIDE_TILES) if batch * slots <= STAGE1_WIDE_TILES_UPTO else {}


def _stage1(codes, lengths, queries, head_weights, codebooks, c1: int, centroid_norms, page_table, max_len,
            linear_config, scan: str = "auto", grow: tuple[int, int] = (0, 1),
            folds: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1 of both coarse forms: every key above a sampled threshold aiming at ``c1`` (int8 tables,
    up to 2 c1 kept; ``grow``: c1 grown by each request's length, :func:`pq_linear_topc`). ``linear_config``
    None: :func:`stage1_launch`; ``scan``: the selecting pass's kernel (:func:`pq_linear_topc`). Returns
    (rows [B, 2 c1 (x most)] int32, counts [B] int32). ``folds``: the keys scored by 16 folded queries instead
    (:func:`~dsaindex.kernels.pq_fold_cuda.pq_fold_topc`, ``codebooks`` its bf16 codebook)."""
    if folds:
        return pq_fold_topc(codes, lengths, queries, head_weights, codebooks, c1, 2 * c1, page_table, max_len, grow)
    if linear_config is None:
        slots = codes.shape[1] if page_table is None else page_table.shape[1] * 64
        linear_config = stage1_launch(queries.shape[0], slots if max_len is None else min(max_len, slots))
    linear_config = {"scan": scan, **linear_config}
    _, rows1, counts1 = pq_linear_topc(codes, lengths, queries, head_weights, codebooks, c1, capacity=2 * c1,
                                       max_len=max_len, return_counts=True, keep_all=True, table_dtype=torch.int8,
                                       centroid_norms=centroid_norms, page_table=page_table, grow=grow,
                                       **linear_config)
    return rows1, counts1


def _stage1_input(stage1, codes, codebooks, codebooks_bf16, centroid_norms) -> tuple:
    """(codes, codebooks, centroid norms, folds) stage 1 reads for a coarse step's ``stage1`` (None: the codes;
    a tuple: the group codes'; ``"folds"``: the codes, by folded queries through the bf16 codebook)."""
    if stage1 is None:
        return codes, codebooks, centroid_norms, False
    if isinstance(stage1, str):
        if stage1 != "folds":
            raise ValueError(f"stage1: got {stage1!r}, want None, a (codes, codebooks, norms) tuple or 'folds'")
        return codes, codebooks.to(torch.bfloat16) if codebooks_bf16 is None else codebooks_bf16, None, True
    return (*stage1, False)


def pq_coarse_bins(codes: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor, head_weights: torch.Tensor,
                   codebooks: torch.Tensor, c1: int, c: int, capacity: int, key_bound: float, scratch: torch.Tensor,
                   codebooks_bf16: torch.Tensor | None = None, centroid_norms: torch.Tensor | None = None,
                   max_len: int | None = None, linear_config: dict | None = None,
                   page_table: torch.Tensor | None = None, scan: str = "auto", grow: tuple[int, int] = (0, 1),
                   stage2: str = "auto",
                   stage1: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The coarse stages of a direct decode step: stage 1 as in :func:`pq_coarse_topc`, then
    :func:`pq_candidate_bins` (no top-C kernel). ``page_table``: codes kept per physical page; ``scan``: stage
    1's selecting kernel (:func:`pq_linear_topc`); ``grow`` (band, most): c1, c and the capacity's C grown by
    each request's length (:func:`grown_counts`; ``capacity`` less ``c`` is the slack kept); ``stage2``: stage 2's
    kernel (:func:`pq_candidate_bins`); ``stage1`` (codes, codebooks, centroid norms): stage 1 scores these
    codes instead (the keys' group codes, :func:`~dsaindex.pq.group_codes`, kept per physical page as
    ``codes`` are), stage 2 ``codes``; ``"folds"``: stage 1 scores the codes by 16 folded queries
    (:func:`~dsaindex.kernels.pq_fold_cuda.pq_fold_topc`). Returns (rows [B, 2 c1] int32 key positions, bins
    [B, 2 c1] int32, stage-1 counts [B] int32, sel [B, 4] int32)."""
    codes1, books1, norms1, folds = _stage1_input(stage1, codes, codebooks, codebooks_bf16, centroid_norms)
    rows1, counts1 = _stage1(codes1, lengths, queries, head_weights, books1, c1, norms1, page_table,
                             max_len, linear_config, scan, grow, folds)
    table = codebooks if codebooks_bf16 is None else codebooks_bf16
    _, bins, sel = pq_candidate_bins(codes, rows1, counts1, queries, head_weights, table, key_bound, c, capacity,
                                     scratch, page_table=page_table, lengths=lengths.to(torch.int32), grow=grow,
                                     stage2=stage2)
    return rows1, bins, counts1, sel


def pq_coarse_topc(codes: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor, head_weights: torch.Tensor,
                   codebooks: torch.Tensor, c1: int, c: int, codebooks_bf16: torch.Tensor | None = None,
                   centroid_norms: torch.Tensor | None = None, page_table: torch.Tensor | None = None,
                   max_len: int | None = None, linear_config: dict | None = None, one_program_max: int | None = None,
                   scan: str = "auto", stage2: str = "auto",
                   stage1: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decode step's two coarse stages and its top C, on Triton: stage 1 keeps every key above a
    sampled threshold aiming at ``c1`` (int8 tables, :func:`pq_linear_topc` with ``keep_all``), stage 2
    scores those with every head (:func:`pq_candidate_scores`), and the best ``c`` are kept
    (:func:`~dsaindex.kernels.topk.small_topk` reading only the filled slots, one program a row; stage-1
    buffers wider than ``one_program_max``, default :data:`~dsaindex.kernels.topk.SMALL_TOPK_MAX`, by the
    threshold top-k :func:`~dsaindex.kernels.topk.rows_topk`, which also reads only the filled slots).
    Inputs as :func:`pq_linear_topc` (``page_table``: codes kept per physical page; ``scan``: stage 1's
    selecting kernel; ``stage2``: stage 2's, :func:`pq_candidate_scores`; ``stage1``: as :func:`pq_coarse_bins`).
    Returns (scores [B, c] float32, rows [B, c] int64, -inf / -1 where fewer; stage-1 counts [B] int32)."""
    from dsaindex.kernels.topk import SMALL_TOPK_MAX, rows_topk, small_topk

    codes1, books1, norms1, folds = _stage1_input(stage1, codes, codebooks, codebooks_bf16, centroid_norms)
    rows1, counts1 = _stage1(codes1, lengths, queries, head_weights, books1, c1, norms1, page_table,
                             max_len, linear_config, scan, folds=folds)
    table = codebooks if codebooks_bf16 is None else codebooks_bf16
    coarse = pq_candidate_scores(codes, rows1, queries, head_weights, table, counts=counts1, block_n=128,
                                 page_table=page_table, stage2=stage2)
    c = min(c, coarse.shape[1])
    # slots past a row's count were never written: neither top-k reads them
    if coarse.shape[1] <= (SMALL_TOPK_MAX if one_program_max is None else one_program_max):
        scores, rows = small_topk(coarse, c, rows1, counts=counts1)
    else:  # a wide stage 1 (C1 = 8 x 4,096 keeps up to 65,536): sampled threshold, append, top C of that
        scores, cols = rows_topk(coarse, counts1, c)
        rows = torch.where(cols >= 0, rows1.gather(1, cols.clamp_min(0)).long(), -1)
    return scores, rows, counts1


def pq_encode_reference(keys: torch.Tensor, codebooks: torch.Tensor, metric: torch.Tensor | None = None,
                        rotation: torch.Tensor | None = None) -> torch.Tensor:
    """Codes [N, M] uint8 of ``keys`` [N, D] float: the nearest of the K centroids of ``codebooks``
    [M, K, D/M] in each subspace, under the per-subspace ``metric`` [M, D/M, D/M] if given (else
    Euclidean), of the keys rotated by ``rotation`` [D, D] first if given (OPQ). The spec of
    :func:`pq_encode`; it is the core codec's :func:`dsaindex.pq.encode`, to which it delegates (one
    encoder for training, evaluation and serving)."""
    return encode(keys, codebooks, metric, rotation=rotation)


def pq_encode(keys: torch.Tensor, codebooks: torch.Tensor, metric: torch.Tensor | None = None,
              block_n: int = 64, rotation: torch.Tensor | None = None) -> torch.Tensor:
    """Codes [N, M] uint8 of ``keys`` [N, D] float, like :func:`pq_encode_reference` (float ties aside).
    ``codebooks`` [M, K, D/M] (K a power of two, at most 256), ``metric`` [M, D/M, D/M] and ``rotation``
    [D, D] are moved to the keys' device, as the reference does. The rotation (one [N, D] x [D, D]
    product) and the whitening (a small batched matmul) run in torch; the kernel does the distance and
    argmin. Raises ``ValueError`` on an input of the wrong dtype or shape."""
    import triton

    from dsaindex.kernels.pq_select_kernel import pq_encode_kernel

    checks.rank("codebooks", codebooks, 3, "M, K, D/M")
    m, k, d = codebooks.shape
    checks.power_of_two("codebooks.shape[1] (centroids K)", k)
    checks.at_most("codebooks.shape[1] (centroids K)", k, 256, "codes are uint8")
    checks.floating("keys", keys)
    checks.shape("keys", keys, (None, m * d), "N, D")
    if metric is not None:
        checks.shape("metric", metric, (m, d, d), "M, D/M, D/M")
    if rotation is not None:
        checks.shape("rotation", rotation, (m * d, m * d), "D, D")
    spec = PQSpec.of(codebooks)
    white = whitening(metric, spec, keys.device)
    cb = codebooks.to(keys.device).float()
    x = split_subspaces(rotate(keys.float(), rotation), spec)  # [M, N, d]
    if white is not None:
        cb = torch.bmm(cb, white[0].transpose(1, 2))
        x = torch.bmm(x, white[0].transpose(1, 2))
    x = x.transpose(0, 1).contiguous()  # [N, M, d]
    codes = torch.empty(keys.shape[0], m, dtype=torch.uint8, device=keys.device)
    if keys.shape[0]:
        pq_encode_kernel[(triton.cdiv(keys.shape[0], block_n), m)](
            x, cb.contiguous(), codes, keys.shape[0], M=m, K=k, DSUB=d, BLOCK_N=block_n)
    return codes


def rq_encode_reference(keys: torch.Tensor, codebooks: torch.Tensor, metric: torch.Tensor | None = None,
                        beam: int = 5) -> torch.Tensor:
    """Codes [N, M] uint8 of ``keys`` [N, D] under a residual code's whole-key ``codebooks`` [M, K, D]: beam
    search of width ``beam``, under the full ``metric`` [1, D, D] if given. The spec of :func:`rq_encode`;
    it is the core codec's :func:`dsaindex.pq.residual_encode`."""
    return residual_encode(keys, codebooks, metric, beam)


def rq_whitened(codebooks: torch.Tensor, metric: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(codebooks [M, K, D] float32 mapped by the metric's whitening ``L``, ``L`` [D, D] or None): what
    :func:`rq_encode` searches in. A server computes it once per layer (a Cholesky factorization)."""
    books = codebooks.float()
    white = residual_whitening(metric, codebooks.shape[2], codebooks.device)
    return (books if white is None else books @ white).contiguous(), white


def rq_encode(keys: torch.Tensor, codebooks: torch.Tensor, metric: torch.Tensor | None = None, beam: int = 5,
              whitened: tuple[torch.Tensor, torch.Tensor | None] | None = None, programs: int = 2048,
              kc: int | None = None) -> torch.Tensor:
    """Codes [N, M] uint8 of ``keys`` [N, D] float, like :func:`rq_encode_reference` (float ties aside), in
    one launch: each program codes keys one at a time, its beams' errors against every codeword of a
    codebook in a scratch row of K x max(16, beam) floats. ``codebooks`` [M, K, D] on the keys' device (K a
    power of two, at most 256; D a power of two of at least 16); ``whitened``: :func:`rq_whitened`'s result,
    computed here from ``metric`` if not given; ``programs``: at most this many programs (the scratch is
    theirs). Raises ``ValueError`` on an input of the wrong dtype, shape or device."""
    import triton

    from dsaindex.kernels.pq_select_kernel import rq_encode_kernel

    checks.rank("codebooks", codebooks, 3, "M, K, D")
    m, k, d = codebooks.shape
    checks.power_of_two("codebooks.shape[1] (codewords K)", k)
    checks.at_most("codebooks.shape[1] (codewords K)", k, 256, "codes are uint8")
    checks.key_dim("codebooks.shape[2] (key dim D)", d)
    checks.floating("keys", keys)
    checks.shape("keys", keys, (None, d), "N, D")
    checks.at_least("beam", beam, 1, "one partial code kept")
    if metric is not None:
        checks.shape("metric", metric, (1, d, d), "1, D, D")
    books, white = rq_whitened(codebooks.to(keys.device), metric) if whitened is None else whitened
    checks.same_device(keys=keys, codebooks=books)
    x = keys.float() if white is None else keys.float() @ white
    n = keys.shape[0]
    codes = torch.empty(n, m, dtype=torch.uint8, device=keys.device)
    if n == 0:
        return codes
    bp = max(16, triton.next_power_of_2(beam))
    kc = (k if select.interpreted() else 64) if kc is None else kc  # the interpreter: fewer, larger steps
    grid = min(n, programs)
    scratch = torch.empty(grid, bp, k, dtype=torch.float32, device=keys.device)
    rq_encode_kernel[(grid,)](x.contiguous(), books, (books * books).sum(-1).contiguous(), scratch, codes, n, M=m,
                              MP=max(16, triton.next_power_of_2(m)), K=k, D=d, BEAM=beam, BP=bp, KC=min(kc, k))
    return codes
