"""PQ coarse-to-fine decode selection (LeanSparse §5), reference implementation in torch.

Per request and layer the device holds PQ codes of every completed 64-key page, the exact keys of
the incomplete page (the tail) and a fixed-capacity cache of exact keys; the host holds every
completed page as FP8 + ue8m0 (:class:`HostKeyStore`). One decode step for a query:

1. coarse score of every encoded key from the codes (``sum_h w_h relu(sum_j q_hj . C_j[code_j])``);
2. top-C candidates by coarse score;
3. cache hits are kept; misses whose coarse score is below (k-th largest candidate coarse score -
   one sample std of the candidates' coarse scores) are dropped; the rest are read from the host and
   enter the cache (least recently used slots are replaced; the batched path's cache is
   set-associative instead, which changes host reads, not the selection);
4. exact scores of the kept candidates and the tail; the top-k positions are returned.

This is the per-request specification of the algorithm that :class:`dsaindex.runtime.pq_batch.PQDecodeGroup`
runs batched on Triton kernels; it loops over requests and lives with the tests (no server imports it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsaindex.coarse import miss_filter_keep
from dsaindex.errors import DsaIndexError
from dsaindex.pq import PQCodec
from dsaindex.quant import fp8_dequantize, fp8_quantize
from dsaindex.runtime.host_store import HostKeyStore
from dsaindex.score import indexer_scores


def pq_lookup_tables(queries: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
    """[H, D] queries and [M, K, D/M] codebooks -> [H, M, K] float32 tables of sub-dot-products."""
    m, _, d = codebooks.shape
    return torch.einsum("hmd,mkd->hmk", queries.float().view(queries.shape[0], m, d), codebooks.float()).contiguous()


def pq_coarse_scores(queries: torch.Tensor, head_weights: torch.Tensor, codes: torch.Tensor,
                     codebooks: torch.Tensor, block: int = 16384) -> torch.Tensor:
    """Coarse scores [N] float32 of PQ codes [N, M] uint8 for one query ([H, D], weights [H]), from
    per-head lookup tables; equal to the exact score of the decoded keys."""
    n_heads = queries.shape[0]
    m, k, _ = codebooks.shape
    lut = pq_lookup_tables(queries, codebooks).reshape(n_heads, m * k)
    offsets = torch.arange(m, device=codes.device) * k
    out = torch.empty(codes.shape[0], dtype=torch.float32, device=codes.device)
    for start in range(0, codes.shape[0], block):
        idx = codes[start : start + block].long() + offsets  # [n, M] rows of the flattened table
        dots = lut[:, idx].sum(-1)  # [H, n]
        out[start : start + block] = head_weights.float() @ torch.relu(dots)
    return out


@dataclass
class SelectStats:
    candidates: int = 0
    hits: int = 0
    fetched: int = 0
    dropped: int = 0
    host_bytes: int = 0


@dataclass
class _Request:
    pages: list
    codes: torch.Tensor  # [n_encoded, M] uint8
    tail: torch.Tensor  # [n_tail, D] float32 (exact keys of the incomplete page, FP8 round trip)
    cache_pos: torch.Tensor  # [cap] long, -1 = empty
    cache_keys: torch.Tensor  # [cap, D] float32
    cache_stamp: torch.Tensor  # [cap] long, step of last use
    step: int = 0

    @property
    def length(self) -> int:
        return self.codes.shape[0] + self.tail.shape[0]


class PQDecodeIndexer:
    """Decode-time selection for one indexer layer, over many requests.

    Parameters
    ----------
    layer : the layer's PQ codec (:class:`dsaindex.pq.PQCodec`)
    host : the shared host key store
    topk : keys selected per step; candidates : C of the coarse stage; cache_capacity : exact keys
    cached on the device per request; miss_filter : apply LeanSparse's filter to cache misses
    """

    def __init__(self, layer: PQCodec, host: HostKeyStore, topk: int, candidates: int = 2048,
                 cache_capacity: int = 4096, device: str | torch.device = "cpu", miss_filter: bool = True):
        self.layer = layer
        self.host = host
        self.topk = topk
        self.candidates = candidates
        self.cache_capacity = cache_capacity
        self.device = torch.device(device)
        self.miss_filter = miss_filter
        self.requests: dict[object, _Request] = {}
        self.dim = layer.codebooks.shape[0] * layer.codebooks.shape[2]

    # ---- request lifecycle ------------------------------------------------------------------------
    def admit(self, request_id) -> None:
        if request_id in self.requests:
            raise DsaIndexError(f"Request {request_id!r} is already admitted.", "use a new request id.")
        m = self.layer.codebooks.shape[0]
        dev = self.device
        self.requests[request_id] = _Request(
            pages=[],
            codes=torch.empty(0, m, dtype=torch.uint8, device=dev),
            tail=torch.empty(0, self.dim, device=dev),
            cache_pos=torch.full((self.cache_capacity,), -1, dtype=torch.long, device=dev),
            cache_keys=torch.zeros(self.cache_capacity, self.dim, device=dev),
            cache_stamp=torch.zeros(self.cache_capacity, dtype=torch.long, device=dev),
        )

    def _get(self, request_id) -> _Request:
        req = self.requests.get(request_id)
        if req is None:
            raise DsaIndexError(f"Request {request_id!r} is not admitted (never, or already freed).",
                                "admit it first; free each request exactly once.")
        return req

    def free(self, request_id) -> None:
        req = self._get(request_id)
        self.host.release(req.pages)
        del self.requests[request_id]

    def append(self, request_id, keys: torch.Tensor) -> None:
        """Append new keys [n, D] (engine basis). Each completed page is encoded and written to the host.

        A full host pool raises :class:`HostMemoryError`; keys appended before it stay valid.
        """
        req = self._get(request_id)
        size = self.host.page_size
        exact = fp8_dequantize(*fp8_quantize(keys.to(self.device)))
        tail = torch.cat([req.tail, exact])
        while tail.shape[0] >= size:
            page_keys, tail = tail[:size], tail[size:]
            page = self.host.allocate()
            self.host.write_page(page, page_keys)
            req.pages.append(page)
            new_codes = self.layer.encode(page_keys)
            req.codes = torch.cat([req.codes, new_codes])
            req.tail = tail  # keep state consistent if the next allocation fails
        req.tail = tail

    def gpu_bytes(self, request_id) -> int:
        """Device bytes of a request's index state: codes, tail keys and the exact-key cache."""
        req = self._get(request_id)
        return (req.codes.numel() + req.tail.numel() * 4 + req.cache_keys.numel() * 4
                + req.cache_pos.numel() * 8 + req.cache_stamp.numel() * 8)

    # ---- selection --------------------------------------------------------------------------------
    def select(self, request_id, query: torch.Tensor, head_weights: torch.Tensor) -> tuple[torch.Tensor, SelectStats]:
        """Top-k key positions [<= topk] long for one query ([H, D], weights [H]) of a request."""
        req = self._get(request_id)
        req.step += 1
        stats = SelectStats()
        q, w = query.to(self.device).float(), head_weights.to(self.device).float()
        n_encoded = req.codes.shape[0]
        positions, keys = [], []
        if n_encoded:
            # codes score against the codebooks: an OPQ codec's queries go into the code space first
            coarse = pq_coarse_scores(self.layer.rotate_queries(q), w, req.codes, self.layer.codebooks)
            c = min(self.candidates, n_encoded)
            cand_scores, cand = coarse.topk(c)
            stats.candidates = c
            slot = self._lookup(req, cand)
            hit = slot >= 0
            keep = hit.clone()
            if self.miss_filter and c > 1:
                keep |= miss_filter_keep(cand_scores[None], torch.ones_like(hit)[None], self.topk)[0]
            else:
                keep[:] = True
            miss_kept = keep & ~hit
            stats.hits = int(hit.sum())
            stats.fetched = int(miss_kept.sum())
            stats.dropped = c - int(keep.sum())
            fetched_pos = cand[miss_kept]
            page_ids = torch.tensor(req.pages, dtype=torch.long, device=fetched_pos.device)
            size = self.host.page_size
            fetched = self.host.read(page_ids[fetched_pos // size], fetched_pos % size, self.device) \
                if stats.fetched else torch.empty(0, self.dim, device=self.device)
            stats.host_bytes = stats.fetched * self.host.bytes_per_key
            hit_slots = slot[hit]
            req.cache_stamp[hit_slots] = req.step
            positions += [cand[hit], fetched_pos]
            keys += [req.cache_keys[hit_slots], fetched]
            self._insert(req, fetched_pos, fetched)
        if req.tail.shape[0]:
            positions.append(torch.arange(n_encoded, req.length, device=self.device))
            keys.append(req.tail)
        if not positions:
            return torch.empty(0, dtype=torch.long, device=self.device), stats
        positions_t, keys_t = torch.cat(positions), torch.cat(keys)
        exact = indexer_scores(q.unsqueeze(0), keys_t, w.unsqueeze(0))[0]
        best = exact.topk(min(self.topk, exact.numel())).indices
        return positions_t[best], stats

    def _lookup(self, req: _Request, positions: torch.Tensor) -> torch.Tensor:
        """Cache slot of each position, -1 for a miss."""
        order = torch.argsort(req.cache_pos)
        sorted_pos = req.cache_pos[order]
        at = torch.searchsorted(sorted_pos, positions).clamp_max(sorted_pos.numel() - 1)
        found = sorted_pos[at] == positions
        return torch.where(found, order[at], torch.full_like(positions, -1))

    def _insert(self, req: _Request, positions: torch.Tensor, keys: torch.Tensor) -> None:
        """Put fetched keys into the least recently used slots (at most the cache capacity)."""
        n = min(positions.numel(), self.cache_capacity)
        if n == 0:
            return
        # empty slots first (stamp 0, position -1), then the oldest
        priority = req.cache_stamp.clone()
        priority[req.cache_pos < 0] = -1
        protect = req.cache_stamp == req.step  # hits of this step stay
        priority[protect] = torch.iinfo(torch.long).max
        slots = priority.topk(n, largest=False).indices
        req.cache_pos[slots] = positions[:n]
        req.cache_keys[slots] = keys[:n]
        req.cache_stamp[slots] = req.step
