"""Residual and additive quantizers at a PQ code's bytes, trained for comparison with PQ.

A PQ code gives each of its M bytes a slice of the key (D/M dimensions). A residual quantizer (RQ) gives
each byte a codebook of whole D-dimensional vectors, coded one after another on what the earlier ones
left (beam search over partial codes); local search quantization (LSQ) learns all M codebooks jointly
and encodes by iterated local search. Both decode a key as the sum of its M codewords, so at equal
bytes they can fit keys that PQ's independent slices cannot. Their score against a query is still a sum
of M table lookups (one table of query . codeword per codebook), the form the decode runtime's stage 1
reads; the runtime has no kernels for them yet, so they are trained only by ``dsaindex eval pq-compare``
and never written as a bundle.

The codebooks are faiss's (``faiss.ResidualQuantizer``, ``faiss.LocalSearchQuantizer``). The score-aware
form trains them on keys mapped by the Cholesky factor of the full D x D score-gradient metric (a PQ
spec of one subspace, :func:`dsaindex.train.pq.score_gradient_metric`) and maps the decoded keys back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dsaindex.pq import PQSpec, whitening

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


@dataclass
class AdditiveCodec:
    """A trained RQ or LSQ code of M codebooks of K = 2**bits whole-key codewords. ``whiten`` / ``unwhiten``
    [D, D] (score-aware): codes are of ``keys @ whiten`` and decode through ``@ unwhiten``."""

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

    def encode(self, keys: torch.Tensor) -> np.ndarray:
        """Codes of ``keys`` [N, D] as faiss packs them: [N, bytes] uint8."""
        x = keys.float().cpu()
        if self.whiten is not None:
            x = x @ self.whiten
        return self.quantizer.compute_codes(np.ascontiguousarray(x.numpy(), dtype=np.float32))

    def decode(self, codes: np.ndarray) -> torch.Tensor:
        """Keys [N, D] float32 back from :meth:`encode`'s codes (the sum of their codewords)."""
        y = torch.from_numpy(self.quantizer.decode(codes))
        return y @ self.unwhiten if self.unwhiten is not None else y

    def relative_mse(self, keys: torch.Tensor) -> float:
        """Plain (Euclidean) reconstruction error of ``keys`` over their mean squared norm, as
        :meth:`dsaindex.pq.PQCodec.relative_mse` reports it for PQ."""
        x = keys.float().cpu()
        err = ((self.decode(self.encode(x)) - x) ** 2).sum(-1).mean()
        return float(err / (x**2).sum(-1).mean().clamp_min(1e-30))


def train_additive(keys: torch.Tensor, kind: str, codebooks: int, centroids: int, metric: torch.Tensor | None = None,
                   seed: int = 0, beam: int = 5) -> AdditiveCodec:
    """Train an RQ (``kind="rq"``, beam search of width ``beam``) or LSQ (``"lsq"``) code of ``codebooks``
    codebooks of ``centroids`` (a power of two up to 256) whole-key codewords on ``keys`` [N, D], in the
    space whitened by ``metric`` [1, D, D] if given (score-aware; see :func:`full_spec`)."""
    import faiss

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
    if kind == "rq":
        quantizer = faiss.ResidualQuantizer(dim, codebooks, bits)
        quantizer.max_beam_size = beam
    else:
        quantizer = faiss.LocalSearchQuantizer(dim, codebooks, bits)
        quantizer.random_seed = seed
    quantizer.train(np.ascontiguousarray(x.numpy(), dtype=np.float32))
    return AdditiveCodec(kind, quantizer, bits, whiten, unwhiten)
