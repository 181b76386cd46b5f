"""PQ coarse-to-fine decode selection over SGLang's paged index-K cache.

SGLang 0.5.23 keeps one index-K buffer per layer, ``[num_pages, 64 * 132]`` uint8
(sglang/srt/mem_cache/index_key_cache.py:40-47 ``_buffer_shape``; the page layout is spelled out by
``IndexKeyCache.move``, lines 75-95): per 64-key page, the 64 x 128 FP8 e4m3 key bytes, then 64 float32
(ue8m0, power-of-two) scales. It is the layout :func:`dsaindex.kernels.fp8_score.paged_keys_reference`
reads. A request's pages are listed by the indexer metadata's ``get_page_table_64()`` [B, W] int32 and
its length by ``get_seqlens_int32()`` [B] (sglang/srt/layers/attention/dsa/dsa_indexer_metadata.py:22-33).

:class:`PagedPQSelector` keeps PQ codes per *physical* page of that buffer, ``[num_pages, 64, M]``
uint8, encoded (:func:`dsaindex.pq.encode`) the first time a page is seen complete. SGLang owns its
pages: one may be freed and handed to another request, or shared by requests through the prefix cache.
Each encoded page therefore records a fingerprint (the first 8 FP8 bytes of each of its 64 keys) and is
encoded again when the page's bytes no longer match it; pages shared through the prefix cache hold the
same keys and reuse their codes.

A step, per request (LeanSparse section 5, the coarse score of :mod:`dsaindex.runtime.pq_batch`):
stage 1 scores every code of the completed pages with the head-folded query, keeps ``prefilter * C``;
stage 2 scores those with every head (ReLU per head) on the decoded codes, keeps C; the C candidates, the
incomplete tail page and the model's forced init/local tokens are rescored exactly from the FP8 pages;
top-k. The scores are the engine's: ``sum_h w_h * relu(q_h . k)`` with q the FP8 query SGLang passes and
w its head weights (which already carry the query's FP8 scale and the softmax scale).

This is a torch implementation (the kernels' torch references of :mod:`dsaindex.kernels.pq_select` and
:mod:`dsaindex.kernels.fp8_score`); it synchronizes with the host (lengths, stale pages), so it does not
run inside a CUDA graph.
"""

from __future__ import annotations

import torch

from dsaindex.kernels.pq_select import pq_candidate_scores_reference, pq_linear_scores_reference
from dsaindex.kernels.select import topk_of_prefixes
from dsaindex.pq import PQCodec, encode

PAGE = 64
FINGERPRINT_BYTES = 8


def page_keys(cache: torch.Tensor, pages: torch.Tensor, dim: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 bits [n, 64, D] uint8 and scales [n, 64] float32 of pages ``pages`` of an index-K buffer."""
    rows = cache[pages.long()]
    keys = rows[:, : PAGE * dim].reshape(-1, PAGE, dim)
    scales = rows[:, PAGE * dim : PAGE * (dim + 4)].contiguous().view(torch.float32).reshape(-1, PAGE)
    return keys, scales


def gather_keys(cache: torch.Tensor, page_table: torch.Tensor, positions: torch.Tensor,
                dim: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys of logical ``positions`` [B, R] (int64, -1 = none -> row 0 of page 0, masked by the caller):
    FP8 bits [B, R, D] uint8 and scales [B, R] float32, read in place from the paged buffer."""
    safe = positions.clamp_min(0)
    # physical page of each position (entries past a request's pages may hold anything: clamped, masked later)
    page = page_table.long().gather(1, safe // PAGE).clamp(0, cache.shape[0] - 1)
    within = safe % PAGE
    flat = cache.view(-1)
    row_bytes = cache.shape[1]
    key_off = page * row_bytes + within * dim
    idx = key_off.unsqueeze(-1) + torch.arange(dim, device=cache.device)
    keys = flat[idx]
    scale_off = page * row_bytes + PAGE * dim + within * 4
    sidx = scale_off.unsqueeze(-1) + torch.arange(4, device=cache.device)
    scales = flat[sidx].contiguous().view(torch.float32).squeeze(-1)
    return keys, scales


def exact_scores(keys: torch.Tensor, scales: torch.Tensor, queries: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_h w_h relu(q_h . k)`` [B, R] float32 of FP8 keys [B, R, D] uint8 with scales [B, R]."""
    k = keys.view(torch.float8_e4m3fn).float() * scales.unsqueeze(-1)
    dots = torch.einsum("brd,bhd->brh", k, queries.float())
    return (torch.relu(dots) * weights.float().unsqueeze(1)).sum(-1)


class PagedPQSelector:
    """One layer's PQ decode selection over SGLang's paged index-K buffer (codes per physical page)."""

    def __init__(self, codec: PQCodec, candidates: int, prefilter: int = 4):
        self.codec = codec
        self.candidates, self.prefilter = candidates, prefilter
        self.codes: torch.Tensor | None = None  # [num_pages, 64, M] uint8
        self.fingerprint: torch.Tensor | None = None  # [num_pages, 64 * 8] uint8
        self.valid: torch.Tensor | None = None  # [num_pages] bool
        self.encoded_pages = 0  # pages encoded so far (a counter for tests and logs)
        self._device = None

    def _ensure(self, cache: torch.Tensor) -> None:
        n, dev = cache.shape[0], cache.device
        if self.codes is not None and self.codes.shape[0] == n and self._device == dev:
            return
        m = self.codec.codebooks.shape[0]
        self.codes = torch.zeros(n, PAGE, m, dtype=torch.uint8, device=dev)
        self.fingerprint = torch.zeros(n, PAGE * FINGERPRINT_BYTES, dtype=torch.uint8, device=dev)
        self.valid = torch.zeros(n, dtype=torch.bool, device=dev)
        self.codebooks = self.codec.codebooks.to(dev).float()
        self.metric = None if self.codec.metric is None else self.codec.metric.to(dev)
        self._device = dev

    def _page_fingerprint(self, cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        rows = cache[pages.long(), : PAGE * 128].view(-1, PAGE, 128)[:, :, :FINGERPRINT_BYTES]
        return rows.reshape(-1, PAGE * FINGERPRINT_BYTES)

    def refresh(self, cache: torch.Tensor, page_table: torch.Tensor, full_pages: torch.Tensor) -> None:
        """Encode the completed pages [b, :full_pages[b]] that hold no codes of their current keys."""
        self._ensure(cache)
        width = int(full_pages.max()) if full_pages.numel() else 0
        if width == 0:
            return
        cols = torch.arange(width, device=page_table.device)
        mask = cols[None, :] < full_pages[:, None].to(page_table.device)
        pages = torch.unique(page_table[:, :width][mask].long())
        fp = self._page_fingerprint(cache, pages)
        stale = ~self.valid[pages] | (fp != self.fingerprint[pages]).any(-1)
        todo = pages[stale]
        if todo.numel() == 0:
            return
        keys, scales = page_keys(cache, todo)
        exact = keys.reshape(-1, keys.shape[-1]).view(torch.float8_e4m3fn).float() * scales.reshape(-1, 1)
        self.codes[todo] = encode(exact, self.codebooks, self.metric).view(-1, PAGE, self.codes.shape[2])
        self.fingerprint[todo] = fp[stale]
        self.valid[todo] = True
        self.encoded_pages += int(todo.numel())

    def select(self, cache: torch.Tensor, page_table: torch.Tensor, seqlens: torch.Tensor, q_fp8: torch.Tensor,
               weights: torch.Tensor, topk: int, init_tokens: int = 0, local_tokens: int = 0) -> torch.Tensor:
        """Logical key positions [B, topk] int32 (-1 padded, in no particular order) for one query per
        request: ``q_fp8`` [B, H, D] (FP8 e4m3 or float), ``weights`` [B, H] float32."""
        dev = cache.device
        b = seqlens.shape[0]
        lengths = seqlens.to(dev).long()
        table = page_table.to(dev)
        q = q_fp8.float()
        w = weights.float()
        full = lengths // PAGE
        self.refresh(cache, table, full)
        n_coded = full * PAGE
        longest = int(n_coded.max()) if b else 0
        groups = []
        if longest:
            # a shorter request's columns past its pages are clamped here and masked by its length below
            cols = table[:, : longest // PAGE].long().clamp(0, cache.shape[0] - 1)
            codes = self.codes[cols].reshape(b, longest, -1)
            c1 = min(self.prefilter * self.candidates, longest)
            _, rows1 = topk_of_prefixes(pq_linear_scores_reference(codes, q, w, self.codebooks), n_coded, c1)
            coarse = pq_candidate_scores_reference(codes, rows1, q, w, self.codebooks)
            _, at = topk_of_prefixes(coarse, torch.full_like(n_coded, coarse.shape[1]), min(self.candidates, c1))
            cand = torch.where(at >= 0, rows1.gather(1, at.clamp_min(0)), torch.full_like(at, -1))
            groups.append(cand)
        # the tail: keys of the incomplete last page (never encoded)
        tail = n_coded[:, None] + torch.arange(PAGE, device=dev)[None, :]
        groups.append(torch.where(tail < lengths[:, None], tail, torch.full_like(tail, -1)))
        forced = self._forced(lengths, init_tokens, local_tokens)
        if forced is not None:
            groups.append(forced)
        positions = torch.cat(groups, dim=1)
        positions = _dedup(positions)
        keys, scales = gather_keys(cache, table, positions)
        scores = exact_scores(keys, scales, q, w).masked_fill(positions < 0, float("-inf"))
        if forced is not None:
            is_forced = (positions[:, :, None] == forced[:, None, :]).any(-1) & (positions >= 0)
            scores = scores.masked_fill(is_forced, float("inf"))
        k = min(topk, positions.shape[1])
        values, at = scores.topk(k, dim=1)
        picked = torch.where(torch.isfinite(values) | (values > 0), positions.gather(1, at), torch.full_like(at, -1))
        out = torch.full((b, topk), -1, dtype=torch.int32, device=dev)
        out[:, :k] = picked.to(torch.int32)
        return out

    @staticmethod
    def _forced(lengths: torch.Tensor, init_tokens: int, local_tokens: int) -> torch.Tensor | None:
        """The tokens SGLang's indexer always keeps (``_mask_init_and_local_tokens``,
        dsa_indexer.py:1185): the first ``init_tokens`` and the last ``local_tokens`` of each request."""
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
    """-1 in place of repeated positions of a row (sort, mark repeats, keep the row's length)."""
    srt, _ = positions.sort(dim=1)
    repeat = torch.zeros_like(srt, dtype=torch.bool)
    repeat[:, 1:] = srt[:, 1:] == srt[:, :-1]
    return torch.where(repeat, torch.full_like(srt, -1), srt)


def to_sglang_selection(positions: torch.Tensor, page_table: torch.Tensor, fused: bool) -> torch.Tensor:
    """The form SGLang's sparse attention consumes from ``Indexer._get_topk_paged``.

    * fused top-k (``SGLANG_DSA_FUSE_TOPK``, the default): page_size=1 KV slots,
      ``page_table[b, p // 64] * 64 + p % 64`` (the v2 kernel's contract,
      sglang/srt/layers/attention/dsa/dsa_topk_backend.py:312-330, and ``fast_topk_transform_fused`` /
      ``page_table_1`` on the legacy path, lines 198-210);
    * unfused: logical positions within the request (``_topk_unfused``, lines 272-309), which the
      attention backend maps through ``page_table_1`` itself.

    int32, -1 padded, in both cases."""
    if not fused:
        return positions.to(torch.int32)
    safe = positions.long().clamp_min(0)
    slots = page_table.long().gather(1, safe // PAGE) * PAGE + safe % PAGE
    return torch.where(positions >= 0, slots, torch.full_like(slots, -1)).to(torch.int32)
