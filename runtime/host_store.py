"""Host-resident exact indexer keys in the engines' layout: 64-token pages of FP8 e4m3 bytes plus one
ue8m0 (power-of-two) scale per key, 132 bytes per key (128-d keys).

Pinned memory when CUDA is present, so page reads overlap compute on a copy stream.
"""

from __future__ import annotations

import torch

from dsaindex.errors import DsaIndexError
from dsaindex.quant import fp8_quantize

PAGE_SIZE = 64


class HostMemoryError(DsaIndexError):
    """The host key store has no free page for a new or growing request."""


class HostKeyStore:
    """A pool of host pages; requests own lists of pages.

    Parameters
    ----------
    capacity_pages : pages in the pool (each holds ``page_size`` keys)
    head_dim : key dim
    pin : pin the pool's memory (default: when CUDA is available)
    """

    def __init__(self, capacity_pages: int, head_dim: int = 128, page_size: int = PAGE_SIZE, pin: bool | None = None):
        pin = torch.cuda.is_available() if pin is None else pin
        self.page_size = page_size
        self.head_dim = head_dim
        self.fp8 = torch.zeros(capacity_pages, page_size, head_dim, dtype=torch.uint8, pin_memory=pin)
        self.scales = torch.zeros(capacity_pages, page_size, dtype=torch.float32, pin_memory=pin)
        self._free = list(range(capacity_pages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def bytes_per_key(self) -> int:
        return self.head_dim + 4

    def allocate(self) -> int:
        if not self._free:
            raise HostMemoryError(
                f"The host key store is full ({self.fp8.shape[0]} pages of {self.page_size} keys).",
                "admit the request later, free finished requests, or start the server with a larger host pool.",
            )
        return self._free.pop()

    def allocate_many(self, n: int) -> list[int]:
        """``n`` pages at once, or none (a :class:`HostMemoryError` leaves the pool unchanged)."""
        if n > len(self._free):
            raise HostMemoryError(
                f"The host key store has {len(self._free)} free pages of {self.page_size} keys; {n} are needed.",
                "admit the request later, free finished requests, or start the server with a larger host pool.",
            )
        return [self._free.pop() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def write_page(self, page: int, keys: torch.Tensor) -> None:
        """Quantize ``keys`` [page_size, D] to FP8 + ue8m0 and store them in ``page``."""
        assert keys.shape == (self.page_size, self.head_dim), f"want [{self.page_size}, {self.head_dim}], got {tuple(keys.shape)}"
        codes, scales = fp8_quantize(keys)
        self.fp8[page].copy_(codes.view(torch.uint8).cpu())
        self.scales[page].copy_(scales.squeeze(-1).cpu())

    def write_fp8_pages(self, pages: list[int], fp8: torch.Tensor, scales: torch.Tensor) -> None:
        """Store already quantized pages: ``fp8`` [n, page_size, D] uint8 bits, ``scales`` [n, page_size]."""
        assert fp8.shape == (len(pages), self.page_size, self.head_dim), f"bad page block {tuple(fp8.shape)}"
        index = torch.tensor(pages, dtype=torch.long)
        self.fp8[index] = fp8.cpu()
        self.scales[index] = scales.float().cpu()

    def read(self, pages: torch.Tensor, slots: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
        """Dequantized keys [n, D] float32 at (page, slot) pairs, moved to ``device``."""
        pages, slots = pages.cpu(), slots.cpu()
        raw = self.fp8[pages, slots].to(device, non_blocking=True)
        scale = self.scales[pages, slots].to(device, non_blocking=True)
        return raw.view(torch.float8_e4m3fn).float() * scale.unsqueeze(-1)
