"""``dsaindex bench prefill-stream``: the exposed wait of layer-wise streamed prefill against chunk size.

A stack of ``--layers`` synthetic layers of production size runs one prefill chunk of C tokens on a
prefix of L tokens. Each layer's prefix state (L exact index keys, 132 B each: 128 FP8 bytes and a
4-byte scale) lives in pinned host memory and reaches the GPU through
:class:`dsaindex.runtime.streaming.PrefixStreamer` (two buffers, a copy stream). A layer's compute is
sized as a DeepSeek-V3.2 layer's for that chunk (``flops_per_token``: the indexer scoring every prefix
key, the projections and the active experts, the sparse attention over the top-k), run as bf16 GEMMs,
followed by a read of the layer's whole streamed buffer (the indexer's data dependency).

Per chunk size, medians of ``--repeats`` runs: the compute alone (prefix already resident), the streamed
run, and per layer the exposed wait = (streamed - compute) / layers; beside them the prediction of
LeanSparse's Eq. 3-5 from the measured host bandwidth and the measured compute (T_wait = max(0,
T_load - T_comp), T_load = payload / bandwidth). The break-even chunk is the smallest C whose measured
wait is at most 5% of its compute, and the predicted one where T_comp >= T_load.
"""

from __future__ import annotations

from pathlib import Path

import typer

KEY_BYTES = 132  # one exact index key: 128 FP8 bytes + a float32 scale (the engines' layout)
HIDDEN = 7168  # DeepSeek-V3.2's hidden size (config.json of the published checkpoint)
INDEX_HEADS, INDEX_DIM, TOPK = 64, 128, 2048  # its indexer: 64 heads x 128, top-2048
ACTIVE_PARAMS_PER_LAYER = 37e9 / 61  # 37B activated parameters over 61 layers (the model card)
ATTN_HEADS, QK_DIM, V_DIM = 128, 192, 128  # MLA: 128 heads, 128 + 64 rope query/key dims, 128 value dims


def flops_per_token(prefix: int) -> float:
    """FLOPs of one V3.2 layer for one prefill token at ``prefix`` keys: the indexer's scores against every
    prefix key (64 heads x 128), the active parameters' matmuls, the sparse attention over the top-k."""
    indexer = 2 * INDEX_HEADS * INDEX_DIM * prefix
    dense = 2 * ACTIVE_PARAMS_PER_LAYER
    attention = 2 * ATTN_HEADS * min(TOPK, prefix) * (QK_DIM + V_DIM)
    return indexer + dense + attention


def time_stack(prefix: int, chunk: int, layers: int, repeats: int, streamed: bool, state: dict) -> float:
    """Median ms of one chunk through the stack (streamed prefix, or prefix resident on the GPU)."""
    import statistics

    import torch

    streamer, resident, weight = state["streamer"], state["resident"], state["weight"]
    x = torch.randn(chunk, HIDDEN, device="cuda", dtype=torch.bfloat16)
    gemm_flops = 2 * chunk * HIDDEN * HIDDEN
    reps = max(1, round(flops_per_token(prefix) * chunk / gemm_flops))
    sink = torch.zeros((), device="cuda", dtype=torch.float32)

    def one_chunk() -> None:
        if streamed:
            streamer.begin_chunk()
        y = x
        for layer in range(layers):
            keys = streamer.acquire(layer) if streamed else resident
            sink.add_(keys[:, :4].float().sum())  # the indexer reads the layer's prefix
            for _ in range(reps):
                y = torch.mm(y, weight) * 0.001  # the layer's compute (bf16 GEMMs of its FLOPs)
            if streamed:
                streamer.release(layer)

    times = []
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        one_chunk()
        end.record()
        torch.cuda.synchronize()
        if i:  # the first run warms up
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_prefill_stream(
    prefixes: str = typer.Option("262144,1048576", help="Comma-separated prefix lengths L (tokens)."),
    chunks: str = typer.Option("64,128,256,512,1024,2048,4096", help="Comma-separated chunk sizes C (tokens)."),
    layers: int = typer.Option(6, help="Layers in the synthetic stack (each with its own streamed prefix)."),
    repeats: int = typer.Option(3, help="Timed runs per case (after one warm-up); medians reported."),
    out: Path = typer.Option(None, help="Also write the JSON result to this file."),
    markdown: Path = typer.Option(None, help="Also write the table as markdown to this file."),
) -> None:
    """Streamed prefill's exposed load wait vs chunk size on a production-size synthetic stack, against
    the LeanSparse model's prediction from the measured host bandwidth. Needs a CUDA device."""
    import torch

    from dsaindex.console import emit_report, parse_ints
    from dsaindex.errors import DsaIndexError
    from dsaindex.runtime.streaming import PrefixStreamer

    prefix_list = parse_ints(prefixes, "--prefixes", minimum=64)
    chunk_list = parse_ints(chunks, "--chunks", minimum=16)
    if layers < 2:
        raise DsaIndexError(f"--layers {layers}: streaming needs at least 2 layers.", "pass --layers 2 or more.")
    if not torch.cuda.is_available():
        raise DsaIndexError("bench prefill-stream needs a CUDA device (streams, pinned memory).",
                            "run it on a GPU machine.")
    weight = torch.randn(HIDDEN, HIDDEN, device="cuda", dtype=torch.bfloat16) * HIDDEN**-0.5
    rows = []
    for prefix in prefix_list:
        streamer = PrefixStreamer(list(range(layers)), (KEY_BYTES,), torch.uint8, prefix + max(chunk_list), "cuda")
        for layer in range(layers):
            streamer.host[layer][:prefix].random_(0, 255)
            streamer.length[layer] = prefix
        resident = torch.randint(0, 255, (prefix, KEY_BYTES), dtype=torch.uint8, device="cuda")
        state = {"streamer": streamer, "resident": resident, "weight": weight}
        copy_ms = time_stack_copy(streamer.host[0][:prefix], resident, repeats)
        for chunk in chunk_list:
            compute = time_stack(prefix, chunk, layers, repeats, False, state)
            stream = time_stack(prefix, chunk, layers, repeats, True, state)
            per_layer = compute / layers
            wait = max(0.0, (stream - compute) / layers)
            predicted = max(0.0, copy_ms - per_layer)
            rows.append({"prefix": prefix, "chunk": chunk, "compute_ms_per_layer": round(per_layer, 4),
                         "streamed_ms_per_layer": round(stream / layers, 4), "load_ms": round(copy_ms, 4),
                         "wait_ms_per_layer": round(wait, 4), "predicted_wait_ms": round(predicted, 4),
                         "wait_share": round(wait / max(per_layer, 1e-9), 4)})
            typer.echo(str(rows[-1]), err=True)
        del streamer, resident, state
        torch.cuda.empty_cache()
    report = {"device": torch.cuda.get_device_name(), "layers": layers, "key_bytes": KEY_BYTES,
              "host_bandwidth_gbps": {}, "break_even_chunk": {}, "rows": rows}
    for prefix in prefix_list:
        mine = [r for r in rows if r["prefix"] == prefix]
        report["host_bandwidth_gbps"][str(prefix)] = round(prefix * KEY_BYTES / (mine[0]["load_ms"] * 1e-3) / 1e9, 2)
        measured = [r["chunk"] for r in mine if r["wait_share"] <= 0.05]
        predicted = [r["chunk"] for r in mine if r["compute_ms_per_layer"] >= r["load_ms"]]
        report["break_even_chunk"][str(prefix)] = {"measured": min(measured, default=None),
                                                   "predicted": min(predicted, default=None)}
    emit_report(report, out, markdown, _table(rows))


def time_stack_copy(host, device_rows, repeats: int) -> float:
    """Median ms of one pinned host -> device copy of a layer's prefix (the load of Eq. 3)."""
    import statistics

    import torch

    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        device_rows.copy_(host, non_blocking=True)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def _table(rows: list[dict]) -> str:
    head = ("| prefix | chunk | compute ms/layer | streamed ms/layer | load ms | exposed wait ms/layer | "
            "predicted wait ms | wait / compute |\n|---|---|---|---|---|---|---|---|")
    lines = [f"| {r['prefix']:,} | {r['chunk']:,} | {r['compute_ms_per_layer']:.3f} | {r['streamed_ms_per_layer']:.3f} "
             f"| {r['load_ms']:.3f} | {r['wait_ms_per_layer']:.3f} | {r['predicted_wait_ms']:.3f} | "
             f"{100 * r['wait_share']:.1f}% |" for r in rows]
    return "\n".join([head, *lines])
