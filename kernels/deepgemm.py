"""The exact indexer the engines run: DeepGEMM's FP8 MQA logits, as the baseline every benchmark compares with.

SGLang and vLLM score DSA indexer keys with DeepGEMM's ``fp8_paged_mqa_logits`` (decode) and
``fp8_mqa_logits`` (prefill), then take a top-k. These wrappers call them with the engines' layouts:

* decode: the paged index-K cache, pages of 64 keys, each page ``64 x D`` FP8 e4m3 bytes followed by the
  64 fp32 scales (``[pages, 64, 1, D + 4]`` uint8, 132 bytes per key for D = 128), a block table per
  request, and the metadata DeepGEMM's scheduler wants;
* prefill: one request's FP8 keys ``[N, D]`` with their fp32 scales, and per query the key range it sees.

Queries are cast to FP8 e4m3 as the engines do (their query scale is folded into the head weights);
DeepGEMM leaves entries past a context length unwritten, so the wrappers mask them to -inf before any
top-k. Each wrapper has its torch reference (``X_reference``): the exact score of the FP8 keys with the
FP8-rounded queries, masked the same way.

DeepGEMM is optional (``pip install dsaindex[deepgemm]``: ``sgl-deep-gemm`` and ``apache-tvm-ffi``, CUDA
with ``nvcc`` for its JIT; set ``CUDA_HOME`` and ``DG_JIT_CACHE_DIR``). :func:`unavailable` says why it
cannot run here, or returns None.
"""

from __future__ import annotations

import functools

import torch

from dsaindex.kernels import checks
from dsaindex.kernels.fp8_score import fp8_scores_reference

PAGE = 64


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """None where DeepGEMM imports and a CUDA device is present, else the reason (one line)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import deep_gemm  # noqa: F401
    except Exception as err:  # noqa: BLE001 - an ImportError, or its JIT setup failing at import
        return f"deep_gemm does not import ({type(err).__name__}: {str(err)[:160]})"
    return None


def supports_heads(n_heads: int) -> bool:
    """Whether DeepGEMM's paged logits take ``n_heads`` query heads on this GPU (SM90: 32 or 64; SM100:
    8, 16, 32 or 64)."""
    major = torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 0
    return n_heads in ((32, 64) if major == 9 else (8, 16, 32, 64) if major >= 10 else ())


def paged_cache(keys_fp8: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The engines' paged index-K cache of every request's keys.

    keys_fp8 : [B, N, D] uint8 FP8 e4m3 bits; scales : [B, N] float32 (N a multiple of 64)

    Returns
    -------
    (cache [B * N / 64, 64, 1, D + 4] uint8: each page 64 x D key bytes then 64 fp32 scales,
    block_table [B, N / 64] int32: request b's pages, in order)
    """
    checks.rank("keys_fp8", keys_fp8, 3, "B, N, D")
    b, n, d = keys_fp8.shape
    checks.dtype("keys_fp8 (FP8 bits)", keys_fp8, torch.uint8)
    checks.shape("scales", scales, (b, n), "B, N")
    if n % PAGE:
        checks.fail("keys_fp8.shape[1] (N)", n, f"a multiple of the page size {PAGE}")
    pages = n // PAGE
    cache = torch.empty(b * pages, PAGE * (d + 4), dtype=torch.uint8, device=keys_fp8.device)
    cache[:, : PAGE * d] = keys_fp8.reshape(b * pages, PAGE * d)
    cache[:, PAGE * d :] = scales.float().contiguous().view(torch.uint8).reshape(b * pages, PAGE * 4)
    table = torch.arange(b * pages, dtype=torch.int32, device=keys_fp8.device).view(b, pages)
    return cache.view(b * pages, PAGE, 1, d + 4), table


def _mask_past(logits: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    cols = torch.arange(logits.shape[1], device=logits.device)[None, :]
    return logits.masked_fill(cols >= lengths.to(logits.device).long()[:, None], float("-inf"))


def paged_logits(cache: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor,
                 head_weights: torch.Tensor, max_len: int, schedule: torch.Tensor | None = None,
                 masked: bool = True) -> torch.Tensor:
    """One decode step's exact logits per request: DeepGEMM's ``fp8_paged_mqa_logits``.

    cache, block_table : from :func:`paged_cache`; lengths : [B] int32 keys per request; queries : [B, H, D]
    (cast to FP8); head_weights : [B, H] float32 effective weights; max_len : columns of the output;
    schedule : :func:`paged_schedule` of ``lengths`` (computed when None; a server computes it once per
    step for all layers)

    Returns [B, max_len] float32, -inf at and past each request's length (``masked=False``: those
    entries are left as DeepGEMM wrote them, for timing the kernel alone).
    """
    import deep_gemm

    checks.rank("queries", queries, 3, "B, H, D")
    checks.shape("head_weights", head_weights, tuple(queries.shape[:2]), "B, H")
    checks.shape("lengths", lengths, (queries.shape[0],), "B")
    checks.same_device(cache=cache, block_table=block_table, queries=queries, head_weights=head_weights)
    lengths = lengths.to(device=cache.device, dtype=torch.int32)
    if schedule is None:
        schedule = paged_schedule(lengths)
    q = queries.to(torch.float8_e4m3fn).unsqueeze(1).contiguous()  # [B, next_n = 1, H, D]
    logits = deep_gemm.fp8_paged_mqa_logits(q, cache, head_weights.float().contiguous(), lengths.view(-1, 1),
                                            block_table, schedule, max_len, clean_logits=False)
    logits = logits[:, :max_len]
    return _mask_past(logits, lengths) if masked else logits


def paged_schedule(lengths: torch.Tensor) -> torch.Tensor:
    """DeepGEMM's scheduling metadata for one decode step of requests with ``lengths`` [B] int32 keys (one
    query each: the context lengths go in as [B, next_n = 1], the form this DeepGEMM takes)."""
    import deep_gemm

    return deep_gemm.get_paged_mqa_logits_metadata(lengths.to(torch.int32).view(-1, 1).contiguous(), PAGE,
                                                   deep_gemm.get_num_sms())


def paged_logits_reference(keys_fp8: torch.Tensor, scales: torch.Tensor, lengths: torch.Tensor,
                           queries: torch.Tensor, head_weights: torch.Tensor, max_len: int) -> torch.Tensor:
    """The spec of :func:`paged_logits` on the unpaged keys ([B, N, D] uint8, [B, N]): exact scores with
    FP8-rounded queries, [B, max_len] float32, -inf at and past each length."""
    q = queries.to(torch.float8_e4m3fn).float()
    scores = fp8_scores_reference(keys_fp8[:, :max_len], scales[:, :max_len], q, head_weights)
    return _mask_past(scores, lengths)


def prefill_logits(keys_fp8: torch.Tensor, scales: torch.Tensor, queries: torch.Tensor, head_weights: torch.Tensor,
                   lengths: torch.Tensor, masked: bool = True) -> torch.Tensor:
    """A prefill chunk's exact logits: DeepGEMM's ``fp8_mqa_logits``.

    keys_fp8 : [N, D] uint8 FP8 bits of one request; scales : [N] float32; queries : [Q, H, D] (cast to
    FP8); head_weights : [Q, H] float32; lengths : [Q] keys each query sees (its causal prefix)

    Returns [Q, N] float32, -inf at and past each query's length (``masked=False``: left as DeepGEMM
    wrote them, for timing the kernel alone).
    """
    import deep_gemm

    checks.rank("keys_fp8", keys_fp8, 2, "N, D")
    checks.dtype("keys_fp8 (FP8 bits)", keys_fp8, torch.uint8)
    checks.shape("scales", scales, (keys_fp8.shape[0],), "N")
    checks.rank("queries", queries, 3, "Q, H, D")
    checks.shape("head_weights", head_weights, tuple(queries.shape[:2]), "Q, H")
    checks.same_device(keys_fp8=keys_fp8, scales=scales, queries=queries, head_weights=head_weights)
    starts = torch.zeros(queries.shape[0], dtype=torch.int32, device=keys_fp8.device)
    ends = lengths.to(device=keys_fp8.device, dtype=torch.int32)
    kv = (keys_fp8.view(torch.float8_e4m3fn), scales.float().contiguous())
    logits = deep_gemm.fp8_mqa_logits(queries.to(torch.float8_e4m3fn).contiguous(), kv,
                                      head_weights.float().contiguous(), starts, ends, clean_logits=False)
    return _mask_past(logits, ends) if masked else logits


def prefill_logits_reference(keys_fp8: torch.Tensor, scales: torch.Tensor, queries: torch.Tensor,
                             head_weights: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The spec of :func:`prefill_logits`: [Q, N] float32 exact scores with FP8-rounded queries."""
    q = queries.to(torch.float8_e4m3fn).float()
    keys = keys_fp8.view(torch.float8_e4m3fn).float() * scales.float()[:, None]
    scores = torch.einsum("qhd,nd->qnh", q, keys).relu_()
    return _mask_past((scores * head_weights.float()[:, None, :]).sum(-1), lengths)
