"""How the benchmarks time work: one synchronized call, and the median of many. Every benchmark of
``dsaindex bench`` times through these functions.

Two ways to take a median, chosen by :func:`median_ms`'s ``repeats``:

* ``repeats=None``: ``triton.testing.do_bench`` (CUDA only) decides how many runs fit its time budget and
  clears the L2 cache between them; for short GPU steps (a decode step's selection), where launch and
  cache effects matter.
* ``repeats=N``: one warm-up call (compilation, caches), then ``N`` calls, each bracketed by device
  synchronization and timed with ``time.perf_counter``; for long steps on any device (a prefill chunk),
  where a few runs suffice and the caller fixes their number.

Two more for CUDA only: :func:`graph_median_ms` times a step captured in one CUDA graph and replayed
(launch overhead gone, as a decode server runs its steps), through :func:`median_ms`;
:func:`event_median_ms` times with CUDA events on the stream, the device's own clock (work the host
queues ahead, such as streams that overlap, copies).
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


def _need_cuda(what: str) -> None:
    """Refuse ``what`` (a CUDA-only way of timing) where torch sees no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        from dsaindex.errors import DsaIndexError

        raise DsaIndexError(f"{what} needs a CUDA device; torch sees none here.",
                            "run the benchmark on a GPU machine.")


def graph_median_ms(fn: Callable[[], Any], warmup: int = 2, repeats: int | None = None) -> float:
    """Median milliseconds of one replay of ``fn`` captured in a CUDA graph: what a decode server runs,
    the host's launch work gone. ``fn`` is called ``warmup`` times on a side stream first (compilation,
    allocations, lazy initialization, which a capture must not see), then captured once on the current
    device and the replay timed by :func:`median_ms` (``repeats=None``: ``triton.testing.do_bench``'s
    medians, the L2 cache cleared between replays; else ``repeats`` synchronized replays after one
    warm-up replay). ``fn`` must be capturable (no host synchronization, fixed shapes); a capture
    failure raises what ``torch.cuda.graph`` raised (the caller may time eagerly instead). Without a
    CUDA device it refuses with :class:`dsaindex.errors.DsaIndexError`."""
    _need_cuda("CUDA-graph timing")
    return median_ms(captured_graph(fn, warmup).replay, repeats)


def captured_graph(fn: Callable[[], Any], warmup: int = 2):
    """``fn`` captured once in a CUDA graph on the current device, after ``warmup`` calls on a side stream
    (compilation, allocations, lazy initialization, which a capture must not see); the device synchronized."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def event_median_ms(fn: Callable[[], Any], repeats: int, warmup: int = 1, idle_start: bool = True) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA stream between two CUDA events recorded around
    it (device time from the first to the last of the work ``fn`` queues, including the gaps in
    between, e.g. waits on other streams). ``fn`` is called ``warmup`` times untimed first, then
    ``repeats`` timed times, the device synchronized after each. With ``idle_start`` (the default) the
    device is synchronized before each timed call too, so it starts on an idle device; without, a
    timed call is queued behind the work before it and only its own device time counts. ``nan`` when
    ``repeats`` is 0 (the warm-up calls still run). Without a CUDA device it refuses with
    :class:`dsaindex.errors.DsaIndexError`."""
    import torch

    _need_cuda("CUDA-event timing")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if idle_start:
            torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) if times else float("nan")


def kernel_profile(fn: Callable[[], Any], steps: int = 5, top: int = 30) -> dict:
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
