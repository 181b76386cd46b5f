"""How the benchmarks time work: one synchronized call, and the median of many.

Two ways to take a median, chosen by :func:`median_ms`'s ``repeats``:

* ``repeats=None``: ``triton.testing.do_bench`` (CUDA only) decides how many runs fit its time budget and
  clears the L2 cache between them; for short GPU steps (a decode step's selection), where launch and
  cache effects matter.
* ``repeats=N``: one warm-up call (compilation, caches), then ``N`` calls, each bracketed by device
  synchronization and timed with ``time.perf_counter``; for long steps on any device (a prefill chunk),
  where a few runs suffice and the caller fixes their number.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def synchronize(device: str) -> None:
    """Wait for the work queued on ``device`` (a no-op on the CPU)."""
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def time_call(fn: Callable[[], Any], device: str) -> tuple[Any, float]:
    """``(fn(), seconds)``: one call, with the device synchronized before and after it."""
    synchronize(device)
    t0 = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - t0


def median_ms(fn: Callable[[], Any], repeats: int | None = None, device: str = "cuda") -> float:
    """Median milliseconds of ``fn()``: ``triton.testing.do_bench`` when ``repeats`` is ``None`` (CUDA),
    else a warm-up call and ``repeats`` synchronized calls on ``device`` (see the module docstring)."""
    if repeats is None:
        import triton.testing

        return float(triton.testing.do_bench(fn, return_mode="median"))
    fn()
    return statistics.median(time_call(fn, device)[1] for _ in range(repeats)) * 1e3
