"""``dsaindex.pipelines.bench.timing``: the CUDA-only timers refuse a machine without CUDA by name (no timing
is asserted anywhere)."""

import pytest
import torch

from dsaindex.errors import DsaIndexError
from dsaindex.pipelines.bench.timing import event_median_ms, graph_median_ms


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a CUDA device")
@pytest.mark.parametrize("timer", [lambda fn: graph_median_ms(fn), lambda fn: event_median_ms(fn, repeats=1)])
def test_cuda_timers_refuse_without_cuda_before_running_anything(timer):
    calls = []
    with pytest.raises(DsaIndexError, match="needs a CUDA device"):
        timer(lambda: calls.append(1))
    assert calls == []  # refused before any warm-up call


@pytest.mark.gpu
def test_graph_median_ms_warms_up_on_a_side_stream_then_replays_the_captured_call():
    count = torch.zeros((), device="cuda")
    ms = graph_median_ms(lambda: count.add_(1), warmup=2, repeats=3)
    # two warm-up calls, none while capturing, then median_ms's warm-up replay and its 3 timed replays
    assert int(count) == 2 + 1 + 3 and ms == ms


@pytest.mark.gpu
def test_event_median_ms_runs_warmup_then_repeats_and_is_nan_without_repeats():
    import math

    count = torch.zeros((), device="cuda")
    for idle_start in (True, False):
        count.zero_()
        ms = event_median_ms(lambda: count.add_(1), repeats=3, warmup=2, idle_start=idle_start)
        assert int(count) == 5 and not math.isnan(ms)
    assert math.isnan(event_median_ms(lambda: count.add_(1), repeats=0, warmup=1))
    assert int(count) == 6  # the warm-up call still ran
