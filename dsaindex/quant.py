"""Key bases and the engines' key storage format.

* Hadamard basis: engines multiply indexer queries and keys by a normalized Sylvester-Hadamard matrix
  (scale ``D**-0.5``) before FP8 quantization. Scores are unchanged (the matrix is orthogonal) but the
  coordinates of a key are not, so codebooks are specific to a basis and the manifests record it.
* FP8 e4m3 with a per-token ue8m0 scale: ``scale = 2 ** ceil(log2(amax / 448))``; 128 FP8 bytes plus a
  4-byte scale = 132 bytes per key per layer, as SGLang and vLLM store them.
"""

from __future__ import annotations

import functools

import torch

BASES = ("raw", "hadamard")
FP8_E4M3_MAX = 448.0


@functools.lru_cache(maxsize=8)
def _hadamard_cpu(dim: int) -> torch.Tensor:
    if dim <= 0 or dim & (dim - 1):
        raise ValueError(f"Hadamard basis needs a power-of-two dim, got {dim}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * dim**-0.5).float()


def hadamard_matrix(dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[dim, dim] float32 normalized Sylvester-Hadamard matrix (symmetric and orthogonal)."""
    return _hadamard_cpu(dim).to(device)


def to_basis(x: torch.Tensor, basis: str) -> torch.Tensor:
    """Express vectors (last dim D) in ``basis``: ``raw`` returns x; ``hadamard`` returns ``x @ H``.

    Returns a float32 tensor for ``hadamard`` (the rotation is done in fp32), else ``x`` itself.
    """
    if basis == "raw":
        return x
    if basis == "hadamard":
        return x.float() @ hadamard_matrix(x.shape[-1], x.device)
    raise ValueError(f"unknown key basis {basis!r}; known: {', '.join(BASES)}")


def fp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rows to FP8 e4m3 with one ue8m0 (power-of-two) scale per row.

    Parameters
    ----------
    x : [..., D] float

    Returns
    -------
    (codes [..., D] torch.float8_e4m3fn, scales [..., 1] float32, each a power of two)
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10)
    scales = torch.exp2(torch.ceil(torch.log2(amax / FP8_E4M3_MAX)))
    codes = (xf / scales).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scales


def fp8_dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`fp8_quantize`: float32 ``codes * scales``."""
    return codes.float() * scales.float()


def ue8m0_exponent(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales -> their biased 8-bit exponent (uint8), the ue8m0 byte."""
    return (torch.log2(scales.float()).round().to(torch.int32) + 127).clamp(0, 255).to(torch.uint8)


def bf16_to_bits(x: torch.Tensor) -> torch.Tensor:
    """bfloat16 values -> their uint16 bit patterns (as int16 storage reinterpreted), for zarr."""
    return x.to(torch.bfloat16).contiguous().view(torch.int16)


def bits_to_bf16(bits: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`bf16_to_bits`."""
    return bits.contiguous().view(torch.bfloat16)


def engine_keys(keys: torch.Tensor, key_format: str) -> torch.Tensor:
    """Keys as the engine holds them, float32: the FP8 e4m3 + ue8m0 round trip for ``fp8_e4m3_ue8m0``,
    else the keys as they are."""
    if key_format == "fp8_e4m3_ue8m0":
        return fp8_dequantize(*fp8_quantize(keys))
    return keys.float()
