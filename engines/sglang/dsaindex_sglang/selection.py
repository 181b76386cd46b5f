"""SGLang's side of the PQ decode selection: where its index-K pages and selections are, in its terms.

SGLang 0.5.23 keeps one index-K buffer per layer, ``[num_pages, 64 * 132]`` uint8
(sglang/srt/mem_cache/index_key_cache.py:40-47 ``_buffer_shape``; the page layout is spelled out by
``IndexKeyCache.move``, lines 75-95): per 64-key page, the 64 x 128 FP8 e4m3 key bytes, then 64 float32
(ue8m0) scales, the layout DeepGEMM reads. A request's pages are listed by the indexer metadata's
``get_page_table_64()`` [B, W] int32 and its length by ``get_seqlens_int32()`` [B]
(sglang/srt/layers/attention/dsa/dsa_indexer_metadata.py:22-33).

The selection itself is :class:`dsaindex.runtime.paged_select.PagedCacheSelector` (the same one the vLLM
plugin runs): PQ codes per physical page of that buffer, encoded when pages complete, a step with no
host synchronization that SGLang's decode CUDA graph can capture. :class:`LayerSelection` builds it
when the buffer is first seen (its page count and device are known then).
"""

from __future__ import annotations

import torch

from dsaindex.coarse import PAGED_EXACT_BELOW
from dsaindex.pq import PQCodec
from dsaindex.runtime.paged_select import PagedCacheSelector, to_slots


class LayerSelection:
    """One layer's PQ artifact and its selector over SGLang's index-K buffer."""

    def __init__(self, codec: PQCodec, candidates: int, prefilter: int, keys_on_host: bool = False,
                 exact_below: int = PAGED_EXACT_BELOW, grow_band: int = 0, stage1: str = "codes"):
        self.codec, self.candidates, self.prefilter = codec, candidates, prefilter
        self.stage1 = stage1  # what stage 1 scores: the codes, or the fold scan's grouped folds
        self.grow_band = grow_band  # DSAINDEX_LONG_PREFIX=grow: C grows with the prefix past these keys (0: fixed)
        self.exact_below = exact_below  # DSAINDEX_EXACT_BELOW: small steps scored as SGLang scores them
        self.keys_on_host = keys_on_host  # DSAINDEX_KEYS=host: the buffer is host memory read in place
        self.selector: PagedCacheSelector | None = None

    def over(self, cache: torch.Tensor, topk: int) -> PagedCacheSelector:
        """The selector for ``cache`` (built again if SGLang's buffer changed size or device)."""
        sel = self.selector
        if sel is None or sel.num_pages != cache.shape[0] or sel.device != cache.device or sel.topk != topk:
            sel = PagedCacheSelector(self.codec, cache.shape[0], topk, candidates=max(self.candidates, topk),
                                     prefilter=self.prefilter, stage1=self.stage1, device=cache.device, keys_on_host=self.keys_on_host,
                                     exact_below=self.exact_below, grow_band=self.grow_band)
            self.selector = sel
        return sel

    @property
    def encoded_pages(self) -> int:
        """Pages encoded outside decode steps so far (prefills, eager steps)."""
        return 0 if self.selector is None else self.selector.encoded_pages


def to_sglang_selection(positions: torch.Tensor, page_table: torch.Tensor, fused: bool) -> torch.Tensor:
    """The form SGLang's sparse attention consumes from ``Indexer._get_topk_paged``.

    * fused top-k (``SGLANG_DSA_FUSE_TOPK``, the default): page_size=1 KV slots,
      ``page_table[b, p // 64] * 64 + p % 64`` (the v2 kernel's contract,
      sglang/srt/layers/attention/dsa/dsa_topk_backend.py:312-330, and ``fast_topk_transform_fused`` /
      ``page_table_1`` on the legacy path, lines 198-210);
    * unfused: logical positions within the request (``_topk_unfused``, lines 272-309), which the
      attention backend maps through ``page_table_1`` itself.

    int32, -1 padded, in both cases."""
    return to_slots(positions, page_table) if fused else positions.to(torch.int32)
