"""The PQ codec of indexer keys: shape, subspace split, score-aware whitening, encode and decode.

A key of D dims is cut into M subspaces of D/M dims; each subspace has K (at most 256) centroids, so a
key becomes M one-byte codes (PQ32 on 128-d keys: 32 bytes instead of the engines' 132). Training
(:mod:`dsaindex.train.pq`) produces a :class:`PQCodec`; the runtime, the kernels and the evaluation
encode and decode with the same object, so none of them imports training code.

Score-aware codebooks carry a per-subspace metric ``A_j`` (see :mod:`dsaindex.train.pq`); a key is
encoded to the centroid nearest under that metric, which is plain nearest-centroid search after
whitening both sides with the Cholesky factor of ``A_j``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsaindex.errors import DsaIndexError


@dataclass(frozen=True)
class PQSpec:
    """Shape of a product quantizer: ``subspaces`` x ``centroids`` over keys of ``dim`` dims."""

    dim: int
    subspaces: int = 32
    centroids: int = 256

    def __post_init__(self):
        if self.subspaces <= 0 or self.dim % self.subspaces:
            raise DsaIndexError(
                f"Key dim {self.dim} is not divisible by {self.subspaces} subspaces.",
                f"pick --subspaces among the divisors of {self.dim} (e.g. 16, 32, 64 for 128-d keys).",
            )
        if not 2 <= self.centroids <= 256:
            raise DsaIndexError(f"{self.centroids} centroids do not fit 8-bit codes.", "use at most 256 centroids.")

    @property
    def sub_dim(self) -> int:
        return self.dim // self.subspaces

    @property
    def bytes_per_key(self) -> int:
        return self.subspaces  # one uint8 code per subspace

    @classmethod
    def of(cls, codebooks: torch.Tensor) -> PQSpec:
        """The spec of ``codebooks`` [M, K, D/M]."""
        m, k, d = codebooks.shape
        return cls(dim=m * d, subspaces=m, centroids=k)


def split_subspaces(x: torch.Tensor, spec: PQSpec) -> torch.Tensor:
    """[N, D] -> [M, N, D/M] (a copy in fp32)."""
    return x.float().reshape(x.shape[0], spec.subspaces, spec.sub_dim).transpose(0, 1).contiguous()


def whitening(metric: torch.Tensor | None, spec: PQSpec, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-subspace (L^T, L^-T) with ``A_j + eps I = L L^T``; None for the plain (Euclidean) metric."""
    if metric is None:
        return None
    a = metric.double().to(device)
    eye = torch.eye(spec.sub_dim, dtype=torch.float64, device=device)
    scale = a.diagonal(dim1=1, dim2=2).mean(-1).clamp_min(1e-12)
    a = a / scale[:, None, None] + 1e-3 * eye  # normalize each block; regularize rank-deficient ones
    chol = torch.linalg.cholesky(a)  # [M, d, d]
    lt = chol.transpose(1, 2)
    return lt.float(), torch.linalg.inv(lt).float()


def encode(
    keys: torch.Tensor, codebooks: torch.Tensor, metric: torch.Tensor | None = None, block: int = 65536
) -> torch.Tensor:
    """Nearest centroid per subspace (under ``metric`` if given). keys [N, D] -> codes [N, M] uint8."""
    spec = PQSpec.of(codebooks)
    white = whitening(metric, spec, keys.device)
    cb = codebooks.to(keys.device).float()
    if white is not None:
        cb = torch.bmm(cb, white[0].transpose(1, 2))
    cb_sq = (cb * cb).sum(-1).unsqueeze(1)  # [M, 1, K]
    codes = torch.empty(keys.shape[0], spec.subspaces, dtype=torch.uint8, device=keys.device)
    for start in range(0, keys.shape[0], block):
        x = split_subspaces(keys[start : start + block], spec)
        if white is not None:
            x = torch.bmm(x, white[0].transpose(1, 2))
        dist = cb_sq - 2 * torch.bmm(x, cb.transpose(1, 2))
        codes[start : start + block] = dist.argmin(-1).t().to(torch.uint8)
    return codes


def decode(codes: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
    """codes [N, M] uint8 -> reconstructed keys [N, D] float32."""
    m, _, d = codebooks.shape
    cb = codebooks.to(codes.device).float()
    parts = cb[torch.arange(m, device=codes.device).unsqueeze(0), codes.long()]  # [N, M, d]
    return parts.reshape(codes.shape[0], m * d)


def quantization_mse(keys: torch.Tensor, codebooks: torch.Tensor, codes: torch.Tensor | None = None) -> float:
    """Mean squared reconstruction error per key (sum over dims), fp32."""
    codes = encode(keys, codebooks) if codes is None else codes
    return float(((decode(codes, codebooks) - keys.float()) ** 2).sum(-1).mean())


def relative_mse(keys: torch.Tensor, codebooks: torch.Tensor) -> float:
    """Reconstruction MSE over the keys' mean squared norm (0 = perfect)."""
    return quantization_mse(keys, codebooks) / max(float((keys.float() ** 2).sum(-1).mean()), math.ulp(1.0))


@dataclass
class PQCodec:
    """One layer's product quantizer: what training produces, a bundle stores and the runtime serves.

    codebooks : [M, K, D/M] float32; metric : optional [M, D/M, D/M] float32 (score-aware encoding)
    """

    codebooks: torch.Tensor
    metric: torch.Tensor | None = None

    @property
    def spec(self) -> PQSpec:
        return PQSpec.of(self.codebooks)

    @property
    def subspaces(self) -> int:
        return int(self.codebooks.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of the parameters (float32)."""
        return 4 * (self.codebooks.numel() + (0 if self.metric is None else self.metric.numel()))

    def encode(self, keys: torch.Tensor) -> torch.Tensor:
        """keys [N, D] -> codes [N, M] uint8 (see :func:`encode`)."""
        return encode(keys, self.codebooks, self.metric)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [N, M] uint8 -> keys [N, D] float32."""
        return decode(codes, self.codebooks)

    def to(self, device: torch.device | str) -> PQCodec:
        return PQCodec(self.codebooks.to(device), None if self.metric is None else self.metric.to(device))
