"""Host memory a GPU reads and writes in place: what an engine's index-K buffer becomes when the exact
index keys leave HBM (``DSAINDEX_KEYS=host``).

:func:`host_mapped_zeros` allocates pinned (page-locked) host memory and returns it as a CUDA tensor. On
64-bit Linux every CUDA context uses unified virtual addressing, so pinned host memory has one address
the host and the device both use; kernels (the engine's, DeepGEMM's, the runtime's Triton kernels) read
and write it through PCIe / NVLink-C2C by pointer, as they read HBM. Nothing is copied: the GPU holds
only the PQ codes of those keys, and a decode step reads, of the exact keys, only the ones it rescores.
"""

from __future__ import annotations

import torch

from dsaindex.errors import DsaIndexError


class _Interface:
    """A CUDA array interface over a pinned host tensor (kept alive by the tensor made from it)."""

    def __init__(self, host: torch.Tensor):
        self.host = host
        typestr = {torch.uint8: "|u1", torch.int32: "<i4", torch.float32: "<f4", torch.int64: "<i8",
                   torch.bfloat16: "<V2", torch.float16: "<f2"}[host.dtype]
        self.__cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": typestr,
                                         "data": (host.data_ptr(), False), "version": 3, "strides": None}


def host_mapped_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros of ``shape`` / ``dtype`` in host memory, as a tensor on ``device``: on a CUDA device, pinned host
    memory seen through its unified address (reads and writes from kernels go over the host link); on a
    CPU, ordinary host memory (where a CPU tensor lives anyway)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return torch.zeros(shape, dtype=dtype, device=dev)
    if not torch.cuda.is_available():
        raise DsaIndexError("Host-mapped index keys need CUDA, and this process has no CUDA device.",
                            "set DSAINDEX_KEYS=device, or run on the GPU machine.")
    host = torch.zeros(shape, dtype=dtype, pin_memory=True)
    view = torch.as_tensor(_Interface(host), device=dev)
    if view.data_ptr() != host.data_ptr():  # not the unified address: a copy, which would defeat the purpose
        raise DsaIndexError("This CUDA setup does not map pinned host memory at its host address (no unified "
                            "addressing), so the GPU cannot read the index keys in place.",
                            "set DSAINDEX_KEYS=device.")
    return view
