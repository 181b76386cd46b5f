"""What the project's CUDA kernels (:mod:`~dsaindex.kernels.pq_scan_cuda`, :mod:`~dsaindex.kernels.pq_stage2_cuda`)
share: whether NVRTC can build them here, and their compilation, once a process and device, through torch
(``torch.cuda._compile_kernel``: no compiler beyond what a CUDA build of torch ships)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def available() -> bool:
    """Whether a CUDA kernel can run here: a CUDA device and a torch that compiles kernels with NVRTC."""
    import torch

    return torch.cuda.is_available() and hasattr(torch.cuda, "_compile_kernel") and torch.version.hip is None


def device_index(device: torch.device) -> int:
    """The index of a CUDA ``device`` (the current one where it names none)."""
    import torch

    return device.index if device.index is not None else torch.cuda.current_device()


_FAILED: dict[tuple, str] = {}  # (name, source, shared, device index) -> why its build failed, once a process


@functools.cache
def _build(source: str, name: str, shared: int, index: int):
    import torch

    with torch.cuda.device(index):
        kernel = torch.cuda._compile_kernel(source, name)
        kernel.set_shared_memory_config(shared)
        return kernel


def compiled(source: str, name: str, shared: int, index: int, what: str, fallback: str):
    """Kernel ``name`` of ``source`` built for device ``index`` with up to ``shared`` bytes of dynamic shared
    memory, once a process; ``ValueError`` naming ``what`` and the ``fallback`` option where it does not build
    (no CUDA_HOME for torch's include paths, no NVRTC, a compile error, a torch without large shared memory for
    compiled kernels). A failed build is remembered too: a later call raises at once instead of compiling again
    (``auto`` falls back once, not at every step)."""
    key = (name, source, shared, index)
    if key not in _FAILED:
        try:
            return _build(source, name, shared, index)
        except (OSError, RuntimeError, AttributeError) as err:
            _FAILED[key] = str(err)
    raise ValueError(f"{what} did not compile here ({_FAILED[key]}); set CUDA_HOME to the CUDA toolkit, or use "
                     f"{fallback}")


def compiles(source: str, name: str, shared: int, device: torch.device, what: str, fallback: str) -> bool:
    """Whether :func:`compiled` builds the kernel on ``device`` (False off CUDA or where NVRTC cannot)."""
    if device.type != "cuda" or not available():
        return False
    try:
        compiled(source, name, shared, device_index(device), what, fallback)
    except ValueError:
        return False
    return True


@functools.cache
def multiprocessors(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index``."""
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count
