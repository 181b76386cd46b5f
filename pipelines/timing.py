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


def kernel_profile(fn: Callable[[], Any], steps: int = 5, top: int = 12) -> dict:
    """Where one step's GPU time goes: ``fn`` run ``steps`` times eagerly under ``torch.profiler``, each
    kernel's device time per step (microseconds), its launches per step, and the totals. The sum of kernel
    times is the step's busy time; what a CUDA-graph replay adds beyond it is launch gaps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = float(getattr(event, "device_time", 0.0) or getattr(event, "cuda_time", 0.0))
        entry = per_kernel.setdefault(event.name, [0.0, 0.0])
        entry[0] += us
        entry[1] += 1
    rows = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])
    return {
        "kernels_per_step": round(sum(v[1] for v in per_kernel.values()) / steps, 1),
        "busy_us_per_step": round(sum(v[0] for v in per_kernel.values()) / steps, 1),
        "top": [{"kernel": name[:90], "us": round(us / steps, 2), "calls": round(n / steps, 1)}
                for name, (us, n) in rows[:top]],
    }
