"""Decode-time selection over vLLM's paged index-K cache, with PQ codes kept page by page beside it.

The engine's cache (vLLM's ``DeepseekV32IndexerCache``, bound per layer as ``[num_blocks, block_size,
D + 4]`` uint8) holds, per page of ``block_size`` = 64 keys, ``64 x D`` FP8 e4m3 bytes and then 64 float32
scales (the layout :func:`dsaindex.kernels.fp8_score.paged_keys_reference` reads). :class:`PagedCodes`
keeps the PQ codes of every completed page in the same page numbering, ``[num_blocks, 64, M]`` uint8
(M bytes per key instead of D + 4). Pages belong to the engine's block manager, which frees and reuses
them without telling the model; a page's codes are therefore tagged with a signature of the page's
bytes (its 64 scales and the first 4 bytes of each key) and encoded again when the page no longer
matches. That check reads 512 of the page's 8,448 bytes.

:func:`select_decode` is the coarse-to-fine step per decode query: stage 1 scores every code of the
request's completed pages with the head-folded query, keeps ``prefilter * candidates``; stage 2 scores
those with every head from the decoded codes and keeps ``candidates``; the candidates and the keys of
the incomplete last page are rescored exactly from the engine's FP8 pages, and the top-k written as
vLLM's decode path writes it: int32 request-local positions, ``-1`` past the request's keys.
These are the torch references of the project's kernels (``dsaindex.kernels.pq_select``,
``dsaindex.kernels.fp8_score``), so the step runs on any device; it is not the batched Triton path.
"""

from __future__ import annotations

import torch

from dsaindex.kernels.fp8_score import fp8_scores_reference
from dsaindex.kernels.pq_select import pq_candidate_scores_reference, pq_linear_scores_reference
from dsaindex.pq import PQCodec, encode

PAGE = 64  # keys per page of vLLM's index-K cache (cache_config.block_size for the indexer)
SIG_KEY_BYTES = 4


def page_bytes(kv_cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Pages ``blocks`` [n] of a bound index-K cache [num_blocks, 64, D + 4] uint8 as [n, 64 * (D + 4)]
    (a copy: vLLM's per-layer cache is a strided view into one allocation)."""
    n = blocks.shape[0]
    return kv_cache[blocks.long()].reshape(n, -1)


def split_pages(pages: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages [n, 64 * (D + 4)] uint8 -> keys [n, 64, D] uint8 (FP8 bits) and scales [n, 64] float32."""
    n = pages.shape[0]
    keys = pages[:, : PAGE * d].reshape(n, PAGE, d)
    scales = pages[:, PAGE * d :].contiguous().view(torch.float32).reshape(n, PAGE)
    return keys, scales


def signature(pages: torch.Tensor, d: int) -> torch.Tensor:
    """[n, 64 * (4 + SIG_KEY_BYTES)] uint8: the bytes a page's codes are tagged with."""
    n = pages.shape[0]
    heads = pages[:, : PAGE * d].reshape(n, PAGE, d)[:, :, :SIG_KEY_BYTES].reshape(n, -1)
    return torch.cat([pages[:, PAGE * d :], heads], dim=1)


class PagedCodes:
    """PQ codes of one layer's completed pages, numbered as the engine's index-K cache pages."""

    def __init__(self, codec: PQCodec, num_blocks: int, head_dim: int, device: torch.device | str):
        self.codec = codec.to(device)
        self.d = head_dim
        m = codec.codebooks.shape[0]
        self.codes = torch.zeros(num_blocks, PAGE, m, dtype=torch.uint8, device=device)
        self.sig = torch.zeros(num_blocks, PAGE * (4 + SIG_KEY_BYTES), dtype=torch.uint8, device=device)
        self.valid = torch.zeros(num_blocks, dtype=torch.bool, device=device)
        self.encoded_pages = 0  # pages encoded so far (a counter for logs and tests)

    def refresh(self, kv_cache: torch.Tensor, blocks: torch.Tensor) -> None:
        """Encode those of the completed pages ``blocks`` whose codes are missing or stale."""
        if blocks.numel() == 0:
            return
        blocks = torch.unique(blocks.long())
        pages = page_bytes(kv_cache, blocks)
        sig = signature(pages, self.d)
        stale = ~self.valid[blocks] | (self.sig[blocks] != sig).any(dim=1)
        if not bool(stale.any()):
            return
        todo = blocks[stale]
        keys, scales = split_pages(pages[stale], self.d)
        exact = keys.view(torch.float8_e4m3fn).float() * scales.unsqueeze(-1)
        codes = encode(exact.reshape(-1, self.d), self.codec.codebooks, self.codec.metric)
        self.codes[todo] = codes.reshape(todo.shape[0], PAGE, -1).to(torch.uint8)
        self.sig[todo] = sig[stale]
        self.valid[todo] = True
        self.encoded_pages += int(todo.shape[0])


def exact_scores_at(kv_cache: torch.Tensor, table_row: torch.Tensor, positions: torch.Tensor,
                    query: torch.Tensor, weights: torch.Tensor, d: int) -> torch.Tensor:
    """Exact scores [R] of the request-local ``positions`` [R] (int64, all valid) for one query [H, D]
    (FP8 or float) with effective head weights [H]: vLLM's logits, sum_h w_h relu(q_h . k)."""
    blocks = table_row[positions // PAGE].long()
    slots = positions % PAGE
    uniq, inverse = torch.unique(blocks, return_inverse=True)
    keys, scales = split_pages(page_bytes(kv_cache, uniq), d)
    k = keys[inverse, slots]  # [R, D]
    s = scales[inverse, slots]  # [R]
    q = query.float() if query.dtype == torch.float8_e4m3fn else query
    return fp8_scores_reference(k.unsqueeze(0), s.unsqueeze(0), q.unsqueeze(0), weights.unsqueeze(0))[0]


def select_decode(codes: PagedCodes, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  queries: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, topk: int, candidates: int,
                  prefilter: int = 4) -> dict[str, int]:
    """Fill ``out`` [B, >= topk] int32 with each decode query's top-k request-local key positions.

    kv_cache : the layer's bound index-K cache [num_blocks, 64, D + 4] uint8; block_table : [B, W] int32
    (vLLM's ``DeepSeekV32IndexerDecodeMetadata.block_table``); seq_lens : [B] or [B, 1] keys visible to
    each query, its own key included; queries : [B, H, D] FP8 e4m3 (``q_fp8``); weights : [B, H] float32
    (head weights with vLLM's q scale and softmax scale folded in). Returns counts for logs: keys,
    candidates rescored.
    """
    d = codes.d
    lens = seq_lens.reshape(seq_lens.shape[0], -1)[:, -1].tolist()
    out[: len(lens), :topk] = -1
    stats = {"keys": 0, "rescored": 0}
    cb = codes.codec.codebooks
    for b, n in enumerate(lens):
        n = int(n)
        if n <= 0:
            continue
        full = n // PAGE
        row = block_table[b]
        q = queries[b].float()
        w = weights[b].float()
        parts = []
        if full:
            pages = row[:full].long()
            codes.refresh(kv_cache, pages)
            history = codes.codes[pages].reshape(1, full * PAGE, -1)
            if full * PAGE > candidates:
                stage1 = pq_linear_scores_reference(history, q[None], w[None], cb)[0]
                c1 = min(prefilter * candidates, stage1.shape[0])
                rows1 = stage1.topk(c1).indices
                stage2 = pq_candidate_scores_reference(history, rows1[None], q[None], w[None], cb)[0]
                parts.append(rows1[stage2.topk(min(candidates, c1)).indices])
            else:  # every completed key is a candidate
                parts.append(torch.arange(full * PAGE, device=q.device))
        parts.append(torch.arange(full * PAGE, n, device=q.device))  # the incomplete page, exactly
        cand = torch.cat(parts)
        exact = exact_scores_at(kv_cache, row, cand, q, w, d)
        k = min(topk, cand.shape[0])
        top = exact.topk(k).indices
        out[b, :k] = cand[top].to(torch.int32)
        stats["keys"] += n
        stats["rescored"] += int(cand.shape[0])
    return stats
