"""Residual and additive quantizers at a PQ code's bytes, trained for comparison with PQ.

A PQ code gives each of its M bytes a slice of the key (D/M dimensions). A residual quantizer (RQ) gives
each byte a codebook of whole D-dimensional vectors, coded one after another on what the earlier ones
left (beam search over partial codes); local search quantization (LSQ) learns all M codebooks jointly
and encodes by iterated local search. Both decode a key as the sum of its M codewords, so at equal
bytes they can fit keys that PQ's independent slices cannot. Their score against a query is still a sum
of M table lookups (one table of query . codeword per codebook), the form the decode runtime's coarse
stages read. An RQ code is served as a residual :class:`dsaindex.pq.PQCodec` (:meth:`AdditiveCodec.served`):
``dsaindex train pq --quantizer rq`` writes it as a bundle. LSQ codes are compared only
(``dsaindex eval pq-compare``): their encoder is an iterated local search no server runs.

The codebooks are faiss's (``faiss.ResidualQuantizer``, ``faiss.LocalSearchQuantizer``), or for RQ this
module's own :class:`TorchRQ` (``trainer="torch"``: k-means and beam search in torch, on any device, so a
GPU trains a layer in seconds where faiss's CPU build takes minutes). The score-aware
form trains them on keys mapped by the Cholesky factor of the full D x D score-gradient metric (a PQ
spec of one subspace, :func:`dsaindex.train.codebooks.score_gradient_metric`) and maps the decoded keys back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dsaindex.pq import PQCodec, PQSpec, beam_search, residual_decode, whitening

QUANTIZERS = ("rq", "lsq")


def full_spec(dim: int, centroids: int) -> PQSpec:
    """The one-subspace spec whose score-gradient metric is the full [1, D, D] one an additive code needs."""
    return PQSpec(dim=dim, subspaces=1, centroids=centroids)


def check_codebook_size(centroids: int) -> None:
    """Refuse a codebook size an RQ / LSQ code cannot have (a power of two from 2 to 256: one byte or less
    per codebook)."""
    from dsaindex.errors import DsaIndexError

    if centroids < 2 or centroids > 256 or centroids & (centroids - 1):
        raise DsaIndexError(f"{centroids} centroids per codebook is not a power of two from 2 to 256.",
                            "pass 256 (8-bit codes) or 16 (4-bit codes).")


class TorchRQ:
    """A residual quantizer held as torch tensors: ``codebooks`` [M, K, D] whole-key codewords, coded one
    after another on what the earlier ones left, by beam search of width ``beam`` (the ``beam`` best partial
    codes kept at each codebook, the best whole code returned). Codes are [N, M] uint8 (K at most 256)."""

    def __init__(self, codebooks: torch.Tensor, beam: int = 5):
        self.codebooks = codebooks
        self.beam = beam

    @property
    def M(self) -> int:  # noqa: N802  (faiss's name, which AdditiveCodec reads)
        return int(self.codebooks.shape[0])

    def encode(self, keys: torch.Tensor, block: int = 16384) -> torch.Tensor:
        """Codes [N, M] uint8 of ``keys`` [N, D] (moved to the codebooks' device), in blocks of rows."""
        x = keys.to(self.codebooks.device, torch.float32)
        out = [beam_search(x[i : i + block], self.codebooks, self.beam)[0][:, 0] for i in range(0, x.shape[0], block)]
        return torch.cat(out).to(torch.uint8) if out else torch.empty(0, self.M, dtype=torch.uint8)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Keys [N, D] float32: the sum of each code's codewords."""
        return residual_decode(codes.to(self.codebooks.device), self.codebooks)


def train_rq_torch(x: torch.Tensor, codebooks: int, centroids: int, iterations: int = 20, beam: int = 5,
                   seed: int = 0, device: str = "cpu", block: int = 16384) -> TorchRQ:
    """Train a residual quantizer on ``x`` [N, D]: codebook m is k-means (``iterations`` Lloyd rounds) on
    the residuals the beam search over codebooks 0 .. m-1 leaves on its best path; the beam's state is
    carried from one codebook to the next, so each training key is coded once per codebook. (Fitting all
    codebooks at once to the codes by least squares afterwards lowered the training error but not the
    held-out one, so it is not done.)"""
    from dsaindex.train.codebooks import _lloyd_torch

    x = x.to(device, torch.float32)
    n, d = x.shape
    books = torch.zeros(0, centroids, d, device=device)
    states: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * -(-n // block)
    residual = x
    for m in range(codebooks):
        book = _lloyd_torch(residual[None], centroids, iterations, seed + m)[0]
        books = torch.cat([books, book[None]])
        for i, start in enumerate(range(0, n, block)):
            states[i] = beam_search(x[start : start + block], books, beam, states[i])
        residual = torch.cat([st[1][:, 0] for st in states if st is not None])  # the best path's residuals
    return TorchRQ(books, beam)


@dataclass
class AdditiveCodec:
    """A trained RQ or LSQ code of M codebooks of K = 2**bits whole-key codewords (a faiss quantizer, or a
    :class:`TorchRQ`). ``whiten`` / ``unwhiten`` [D, D] (score-aware): codes are of ``keys @ whiten`` and
    decode through ``@ unwhiten``."""

    kind: str
    quantizer: Any
    bits: int
    whiten: torch.Tensor | None = None
    unwhiten: torch.Tensor | None = None

    @property
    def codebooks(self) -> int:
        return int(self.quantizer.M)

    @property
    def bytes_per_key(self) -> float:
        return self.codebooks * self.bits / 8

    def encode(self, keys: torch.Tensor) -> np.ndarray | torch.Tensor:
        """Codes of ``keys`` [N, D]: faiss's packed [N, bytes] uint8, or [N, M] uint8 for a :class:`TorchRQ`."""
        if isinstance(self.quantizer, TorchRQ):
            x = keys.float().to(self.quantizer.codebooks.device)
            return self.quantizer.encode(x @ self.whiten.to(x.device) if self.whiten is not None else x)
        x = keys.float().cpu()
        if self.whiten is not None:
            x = x @ self.whiten
        return self.quantizer.compute_codes(np.ascontiguousarray(x.numpy(), dtype=np.float32))

    def decode(self, codes: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Keys [N, D] float32 (on the CPU) back from :meth:`encode`'s codes (the sum of their codewords)."""
        if isinstance(self.quantizer, TorchRQ):
            y = self.quantizer.decode(codes).cpu()
        else:
            y = torch.from_numpy(self.quantizer.decode(codes))
        return y @ self.unwhiten if self.unwhiten is not None else y

    def relative_mse(self, keys: torch.Tensor) -> float:
        """Plain (Euclidean) reconstruction error of ``keys`` over their mean squared norm, as
        :meth:`dsaindex.pq.PQCodec.relative_mse` reports it for PQ."""
        x = keys.float().cpu()
        err = ((self.decode(self.encode(x)) - x) ** 2).sum(-1).mean()
        return float(err / (x**2).sum(-1).mean().clamp_min(1e-30))

    def served(self, metric: torch.Tensor | None = None) -> PQCodec:
        """The residual :class:`~dsaindex.pq.PQCodec` the runtime serves for this RQ code: its codebooks
        [M, K, D] mapped back to the keys' space (``@ unwhiten``) and ``metric`` (the full [1, D, D] one the
        code was whitened by, or None), which the codec encodes under. Its codes come from the core's beam
        search (width :attr:`beam`), the same search the torch trainer codes with."""
        from dsaindex.errors import DsaIndexError

        if self.kind != "rq":
            raise DsaIndexError(f"{self.kind.upper()} codes are not served: their encoder is an iterated local "
                                "search.", "train an RQ or PQ code to serve (`dsaindex train pq --quantizer rq`).")
        if (metric is None) != (self.whiten is None):
            raise ValueError("served(): pass the metric the code was trained under (score-aware), and only then")
        if isinstance(self.quantizer, TorchRQ):
            books = self.quantizer.codebooks.detach().float().cpu()
        else:
            import faiss

            dim = int(self.quantizer.d)
            books = torch.from_numpy(faiss.vector_to_array(self.quantizer.codebooks).reshape(
                self.codebooks, 2**self.bits, dim).copy())
        if self.unwhiten is not None:
            books = books @ self.unwhiten
        return PQCodec(books.contiguous(), None if metric is None else metric.float().cpu(), residual=True,
                       beam=self.beam)

    @property
    def beam(self) -> int:
        """Beam width of the code's search (faiss's ``max_beam_size``; 1 for LSQ)."""
        if isinstance(self.quantizer, TorchRQ):
            return self.quantizer.beam
        return int(getattr(self.quantizer, "max_beam_size", 1))


def train_additive(keys: torch.Tensor, kind: str, codebooks: int, centroids: int, metric: torch.Tensor | None = None,
                   seed: int = 0, beam: int = 5, trainer: str = "faiss", device: str = "cpu",
                   iterations: int = 20) -> AdditiveCodec:
    """Train an RQ (``kind="rq"``, beam search of width ``beam``) or LSQ (``"lsq"``) code of ``codebooks``
    codebooks of ``centroids`` (a power of two up to 256) whole-key codewords on ``keys`` [N, D], in the
    space whitened by ``metric`` [1, D, D] if given (score-aware; see :func:`full_spec`). ``trainer``:
    ``faiss`` (CPU), or ``torch`` for RQ (:func:`train_rq_torch`, ``iterations`` k-means rounds a codebook,
    on ``device``); LSQ is faiss's only."""
    from dsaindex.errors import DsaIndexError

    if kind not in QUANTIZERS:
        raise DsaIndexError(f"Unknown additive quantizer {kind!r}.", f"pass one of {', '.join(QUANTIZERS)}.")
    check_codebook_size(centroids)
    bits = centroids.bit_length() - 1
    if keys.shape[0] < 4 * centroids:
        raise DsaIndexError(f"{keys.shape[0]} training keys are fewer than 4 per codeword ({4 * centroids}).",
                            "train on more keys (--max-train-keys) or fewer centroids.")
    dim = keys.shape[1]
    whiten = unwhiten = None
    x = keys.float().cpu()
    if metric is not None:
        lt, lt_inv = whitening(metric, full_spec(dim, centroids), "cpu")  # [1, D, D] each: L^T, L^-T
        whiten, unwhiten = lt[0].t().contiguous(), lt_inv[0].t().contiguous()  # x @ L, then y @ L^-1
        x = x @ whiten
    if kind == "rq" and trainer == "torch":
        return AdditiveCodec(kind, train_rq_torch(x, codebooks, centroids, iterations, beam, seed, device), bits,
                             whiten, unwhiten)
    import faiss

    if kind == "rq":
        quantizer = faiss.ResidualQuantizer(dim, codebooks, bits)
        quantizer.max_beam_size = beam
    else:
        quantizer = faiss.LocalSearchQuantizer(dim, codebooks, bits)
        quantizer.random_seed = seed
    quantizer.train(np.ascontiguousarray(x.numpy(), dtype=np.float32))
    return AdditiveCodec(kind, quantizer, bits, whiten, unwhiten)
