"""Layer-wise streamed prefill: every layer sees exactly its prefix, whatever the buffer it lands in; the
host holds every row written back; the device holds two layers' buffers."""

import json

import pytest
import torch

from dsaindex.errors import DsaIndexError
from dsaindex.runtime.streaming import PrefixStreamer

CUDA = torch.cuda.is_available()


def run_chunks(device, layers=(0, 2, 3, 5, 7), chunks=(37, 1, 200, 64), width=132, work=None, prefetch=True):
    """Stream ``chunks`` through ``layers``; each layer reads its prefix + chunk like an indexer would.
    Returns the streamer and, per chunk and layer, the sum the layer computed from what it read."""
    g = torch.Generator().manual_seed(0)
    streamer = PrefixStreamer(list(layers), (width,), torch.uint8, sum(chunks) + 8, device, prefetch=prefetch)
    written = {layer: [] for layer in layers}
    seen = []
    for n in chunks:
        streamer.begin_chunk()
        sums = {}
        for layer in layers:
            prefix = streamer.acquire(layer)
            rows = torch.randint(0, 255, (n, width), generator=g, dtype=torch.uint8)
            full = streamer.extend(layer, rows.to(device))
            if work is not None:
                work()  # compute the copies can overlap
            sums[layer] = (int(prefix.long().sum()), int(full.long().sum()), full.shape[0])
            streamer.release(layer)
            written[layer].append(rows)
        seen.append(sums)
    streamer.finish()
    return streamer, written, seen


def check(streamer, written, seen, chunks):
    for i, sums in enumerate(seen):
        for layer, (prefix_sum, full_sum, rows) in sums.items():
            before = torch.cat(written[layer][:i]) if i else torch.zeros(0, 132, dtype=torch.uint8)
            assert rows == sum(chunks[: i + 1])
            assert prefix_sum == int(before.long().sum()), (i, layer)
            assert full_sum == int(torch.cat(written[layer][: i + 1]).long().sum()), (i, layer)
    for layer, parts in written.items():
        every = torch.cat(parts)
        assert torch.equal(streamer.host[layer][: every.shape[0]], every)
        assert streamer.length[layer] == every.shape[0]


@pytest.mark.parametrize("prefetch", [True, False])
def test_each_layer_reads_its_own_prefix_through_two_buffers(prefetch):
    chunks = (37, 1, 200, 64)
    streamer, written, seen = run_chunks("cpu", chunks=chunks, prefetch=prefetch)
    check(streamer, written, seen, chunks)
    assert streamer.device_bytes() == 2 * streamer.capacity * 132  # two layers' worth, not five
    # with prefetch the next chunk's first load was issued during the last layer; a new request drops it
    assert (streamer._pending is not None) == prefetch
    streamer.reset()
    assert streamer._pending is None and set(streamer.length.values()) == {0}


def test_a_prefetched_first_layer_holds_the_rows_of_the_chunk_just_written():
    """The first layer's rows for chunk 2 are loaded while chunk 1's last layer runs: they must include
    chunk 1's rows of the first layer (written back before the prefetch)."""
    streamer = PrefixStreamer([4, 9], (2,), torch.float32, 16, "cpu")
    streamer.begin_chunk()
    for layer in (4, 9):
        streamer.acquire(layer)
        streamer.extend(layer, torch.full((3, 2), float(layer)))
        streamer.release(layer)
    streamer.begin_chunk(skip={9})
    assert torch.equal(streamer.acquire(4), torch.full((3, 2), 4.0))
    assert not streamer.reads(9) and streamer.reads(4)


def test_out_of_order_use_and_overflow_are_named():
    streamer = PrefixStreamer([0, 1], (4,), torch.float32, 10, "cpu")
    with pytest.raises(DsaIndexError, match="never loaded"):
        streamer.acquire(1)
    streamer.begin_chunk()
    streamer.acquire(0)
    with pytest.raises(DsaIndexError, match="sized for 10"):
        streamer.extend(0, torch.zeros(11, 4))


@pytest.mark.gpu
def test_streams_and_events_keep_the_prefixes_exact_under_load():
    if not CUDA:
        pytest.skip("needs a CUDA device")
    a = torch.randn(2048, 2048, device="cuda")

    def work():
        for _ in range(3):
            a.copy_(torch.tanh(a @ a) * 0.01)

    chunks = (1000, 3, 4096, 512, 77)
    streamer, written, seen = run_chunks("cuda", chunks=chunks, work=work)
    check(streamer, written, seen, chunks)
    assert streamer.host[0].is_pinned()


def test_stream_bench_sizes_layers_as_v32_and_refuses_a_cpu():
    from dsaindex.pipelines.bench.stream import flops_per_token
    from helpers import run_cli

    # at a 1M prefix the indexer's scores over the prefix dominate a V3.2 layer's work per token
    assert flops_per_token(1 << 20) > 10 * flops_per_token(1024) > 0
    assert 2 * 64 * 128 * (1 << 20) / flops_per_token(1 << 20) > 0.9
    if not CUDA:
        result = run_cli("bench", "prefill-stream", "--prefixes", "4096")
        assert result.returncode == 2 and "needs a CUDA device" in result.stderr


def test_stream_bench_on_a_checkpoint_serves_it_streamed_and_changes_no_logit(tmp_path, monkeypatch):
    """`bench prefill-stream --model` times real forward passes with the served runtime streaming the
    model's own indexer keys, against the model as is: the chunk's logits are the same, and the
    streamed prefix state is two layers' rows against every layer's."""
    from helpers import run_cli

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch path: the kernels have tests of their own
    out = tmp_path / "stream.json"
    result = run_cli("bench", "prefill-stream", "--model", "preset:tiny-v32", "--prefixes", "128", "--chunks", "32,64",
                     "--repeats", "1", "--device", "cpu", "--out", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert [(r["prefix"], r["chunk"]) for r in report["rows"]] == [(128, 32), (128, 64)]
    assert all(r["max_logit_difference"] == 0.0 and r["compute_ms_per_layer"] > 0 for r in report["rows"])
    memory = report["prefix_state_memory"]["128"]
    layers, row = report["layers"], report["key_bytes"]
    assert layers == 4 and row == 128 * 4  # float32 keys of 128 dims on the CPU
    assert memory["all_layers_resident_bytes"] == layers * (128 + 64) * row
    assert memory["streamed_two_buffers_bytes"] == 2 * (128 + 64) * row
    too_long = run_cli("bench", "prefill-stream", "--model", "preset:tiny-v32", "--prefixes", "70000", "--device", "cpu")
    assert too_long.returncode == 2 and "exceed the model's 65,536 positions" in too_long.stderr


def test_break_even_is_the_smallest_chunk_that_hides_the_load():
    from dsaindex.pipelines.bench.stream import _break_even

    def row(chunk, share, share_without, compute, load):
        return {"chunk": chunk, "wait_share": share, "wait_share_no_prefetch": share_without,
                "compute_ms_per_layer": compute, "load_ms": load}

    stack = [row(64, 0.5, 0.9, 0.1, 0.4), row(256, 0.04, 0.3, 0.5, 0.4), row(1024, 0.0, 0.02, 2.0, 0.4)]
    assert _break_even(stack) == {"measured": 256, "measured_no_prefetch": 1024, "predicted": 256}
    # the model mode has no no-prefetch column, and no load time on a CPU
    model = [row(64, 0.2, None, 0.1, None), row(256, 0.3, None, 0.5, None)]
    assert _break_even(model) == {"measured": None, "predicted": None}
