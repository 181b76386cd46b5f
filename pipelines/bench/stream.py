"""``dsaindex bench prefill-stream``: the exposed wait of layer-wise streamed prefill against chunk size.

A stack of ``--layers`` synthetic layers of production size runs one prefill chunk of C tokens on a
prefix of L tokens. Each layer's prefix state (L exact index keys, 132 B each: 128 FP8 bytes and a
4-byte scale) lives in pinned host memory and reaches the GPU through
:class:`dsaindex.runtime.streaming.PrefixStreamer` (two buffers, a copy stream). A layer's compute is
sized as a DeepSeek-V3.2 layer's for that chunk (``flops_per_token``: the indexer scoring every prefix
key, the projections and the active experts, the sparse attention over the top-k), run as bf16 GEMMs,
followed by a read of the layer's whole streamed buffer (the indexer's data dependency).

Per chunk size, medians of ``--repeats`` runs of 4 chunks back to back: the compute alone (every
layer's prefix resident), the streamed run with the next chunk's first load prefetched during the last
layer (the runtime's default) and without it, and per layer the exposed wait = (streamed - compute) /
layers; beside them the prediction of
LeanSparse's Eq. 3-5 from the measured host bandwidth and the measured compute (T_wait = max(0,
T_load - T_comp), T_load = payload / bandwidth). The break-even chunk is the smallest C whose measured
wait is at most 5% of its compute, and the predicted one where T_comp >= T_load. The device memory
of prefix state is measured as allocated: the two buffers plus every layer's PQ32 codes, against every
layer's exact keys resident. ``--timeline`` plots two chunks' copy and compute streams.

``--model M`` measures the same on a real checkpoint (the reference one, or any DSA checkpoint) inside
the served runtime: :class:`dsaindex.runtime.serving.ServedIndex` with ``stream_prefix=True`` keeps the
model's own indexer keys in pinned host memory and streams them per layer, against the model run as is
(keys resident in its cache). Per chunk size the prompt is random tokens, the prefix prefilled untimed
and the next chunk timed, whole forward passes; beside the times, the largest difference of the chunk's
logits between the two runs (streaming must change nothing). Runs on CPU too (timings there only show
that it works).
"""

from __future__ import annotations

from pathlib import Path

import typer

KEY_BYTES = 132  # one exact index key: 128 FP8 bytes + a float32 scale (the engines' layout)
PQ32_BYTES = 32  # one key's PQ32 code, which stays on the GPU for decode
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


def time_stack(prefix: int, chunk: int, layers: int, repeats: int, mode: str, state: dict,
               trace: list | None = None) -> float:
    """Median ms of one chunk through the stack: ``mode`` "resident" (every layer's prefix on the GPU),
    "streamed" or "prefetch" (the next chunk's first load issued during the last layer). Each timed run
    is ``CHUNKS_PER_RUN`` chunks back to back, as a long prefill runs them (a prefetch then overlaps
    the previous chunk's last layer, as it would in service), timed by
    :func:`~dsaindex.pipelines.bench.timing.event_median_ms` after one warm-up run (``nan`` for 0
    ``repeats``). ``trace`` collects (what, layer, start, end) CUDA events of one more run, for a timeline."""
    import torch

    from dsaindex.pipelines.bench.timing import event_median_ms

    streamer, resident, weight = state["streamer"], state["resident"], state["weight"]
    streamer.prefetch = mode == "prefetch"
    streamer._pending = None
    x = torch.randn(chunk, HIDDEN, device="cuda", dtype=torch.bfloat16)
    gemm_flops = 2 * chunk * HIDDEN * HIDDEN
    reps = max(1, round(flops_per_token(prefix) * chunk / gemm_flops))
    sink = torch.zeros((), device="cuda", dtype=torch.float32)

    def one_chunk(events: list | None = None) -> None:
        if mode != "resident":
            streamer.begin_chunk()
        y = x
        for layer in range(layers):
            keys = streamer.acquire(layer) if mode != "resident" else resident[layer]
            start = None
            if events is not None:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
            sink.add_(keys[:, :4].float().sum())  # the indexer reads the layer's prefix
            for _ in range(reps):
                y = torch.mm(y, weight) * 0.001  # the layer's compute (bf16 GEMMs of its FLOPs)
            if events is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                events.append(("compute", layer, start, end))
            if mode != "resident":
                streamer.release(layer)

    def run() -> None:
        for _ in range(CHUNKS_PER_RUN):
            one_chunk()

    ms = event_median_ms(run, repeats, warmup=1) / CHUNKS_PER_RUN  # the first run warms up
    if trace is not None and mode != "resident":
        torch.cuda.synchronize()
        streamer.trace = []
        base = torch.cuda.Event(enable_timing=True)
        base.record()
        compute: list = []
        for _ in range(2):  # two chunks: the second one's first load was prefetched during the first
            one_chunk(compute)
        torch.cuda.synchronize()
        trace += [("load", layer, base.elapsed_time(a), base.elapsed_time(b)) for layer, a, b in streamer.trace]
        trace += [(what, layer, base.elapsed_time(a), base.elapsed_time(b)) for what, layer, a, b in compute]
        streamer.trace = None
    return ms


CHUNKS_PER_RUN = 4


def plot_timeline(trace: list, title: str, path: Path) -> None:
    """Copy-stream loads above, compute-stream layers below, on one time axis (ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 2.8))
    for what, layer, start, end in trace:
        row = 1 if what == "load" else 0
        ax.broken_barh([(start, end - start)], (row - 0.35, 0.7),
                       facecolors="tab:orange" if row else "tab:blue", edgecolor="black", linewidth=0.5)
        if end - start > 0.02 * max(t[3] for t in trace):
            ax.text((start + end) / 2, row, str(layer), ha="center", va="center", fontsize=8)
    ax.set_yticks([0, 1], ["compute (layer)", "copy stream (load of layer)"])
    ax.set_xlabel("ms since the first chunk began")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def bench_prefill_stream(
    prefixes: str = typer.Option("262144,1048576", help="Comma-separated prefix lengths L (tokens)."),
    chunks: str = typer.Option("64,128,256,512,1024,2048,4096", help="Comma-separated chunk sizes C (tokens)."),
    layers: int = typer.Option(6, help="Layers in the synthetic stack (each with its own streamed prefix)."),
    repeats: int = typer.Option(3, help="Timed runs per case (after one warm-up); medians reported."),
    out: Path = typer.Option(None, help="Also write the JSON result to this file."),
    markdown: Path = typer.Option(None, help="Also write the table as markdown to this file."),
    timeline: Path = typer.Option(None, help="Also plot two chunks' copy and compute streams (PNG), at the "
                                             "longest prefix and the chunk nearest its measured break-even."),
    model: str = typer.Option(None, "--model", "-m", help="Measure a real checkpoint (`reference`, a folder, a "
                                                          "preset) inside the served runtime instead of the stack."),
    device: str = typer.Option("auto", help="With --model: cuda, cpu or auto."),
) -> None:
    """Streamed prefill's exposed load wait vs chunk size on a production-size synthetic stack (or with
    --model a real checkpoint in the served runtime), against the LeanSparse model's prediction from the
    measured host bandwidth. The stack needs a CUDA device."""
    import torch

    from dsaindex.console import emit_report, parse_ints
    from dsaindex.errors import DsaIndexError
    from dsaindex.runtime.streaming import PrefixStreamer

    prefix_list = parse_ints(prefixes, "--prefixes", minimum=64)
    chunk_list = parse_ints(chunks, "--chunks", minimum=16)
    if model is not None:
        from dsaindex.console import resolve_device

        report = bench_model_stream(model, prefix_list, chunk_list, repeats, resolve_device(device))
        emit_report(report, out, markdown, _table(report["rows"]))
        return
    if layers < 2:
        raise DsaIndexError(f"--layers {layers}: streaming needs at least 2 layers.", "pass --layers 2 or more.")
    if not torch.cuda.is_available():
        raise DsaIndexError("bench prefill-stream needs a CUDA device (streams, pinned memory).",
                            "run it on a GPU machine.")
    weight = torch.randn(HIDDEN, HIDDEN, device="cuda", dtype=torch.bfloat16) * HIDDEN**-0.5
    rows = []
    memory = {}
    for prefix in prefix_list:
        capacity = prefix + max(chunk_list) * (CHUNKS_PER_RUN + 1)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        streamer = PrefixStreamer(list(range(layers)), (KEY_BYTES,), torch.uint8, capacity, "cuda")
        codes = torch.zeros(layers, prefix, PQ32_BYTES, dtype=torch.uint8, device="cuda")  # what stays resident
        streamed_bytes = torch.cuda.memory_allocated() - before
        for layer in range(layers):
            streamer.host[layer][:prefix].random_(0, 255)
        before = torch.cuda.memory_allocated()
        resident = torch.randint(0, 255, (layers, capacity, KEY_BYTES), dtype=torch.uint8, device="cuda")
        resident_bytes = torch.cuda.memory_allocated() - before
        memory[str(prefix)] = {"streamed_two_buffers_plus_pq32_bytes": streamed_bytes,
                               "all_layers_resident_bytes": resident_bytes,
                               "two_layers_exact_plus_pq32_bytes": 2 * capacity * KEY_BYTES + codes.numel()}
        state = {"streamer": streamer, "resident": resident, "weight": weight}
        copy_ms = time_stack_copy(streamer.host[0][:prefix], resident[0, :prefix], repeats)
        for chunk in chunk_list:
            times = {}
            for mode in ("resident", "streamed", "prefetch"):
                for layer in range(layers):  # every timed chunk sees the same prefix
                    streamer.length[layer] = prefix
                times[mode] = time_stack(prefix, chunk, layers, repeats, mode, state)
            per_layer = times["resident"] / layers
            wait = {m: max(0.0, (times[m] - times["resident"]) / layers) for m in ("streamed", "prefetch")}
            predicted = max(0.0, copy_ms - per_layer)
            rows.append({"prefix": prefix, "chunk": chunk, "compute_ms_per_layer": round(per_layer, 4),
                         "streamed_ms_per_layer": round(times["prefetch"] / layers, 4), "load_ms": round(copy_ms, 4),
                         "wait_ms_per_layer": round(wait["prefetch"], 4), "predicted_wait_ms": round(predicted, 4),
                         "wait_share": round(wait["prefetch"] / max(per_layer, 1e-9), 4),
                         "wait_share_no_prefetch": round(wait["streamed"] / max(per_layer, 1e-9), 4)})
            typer.echo(str(rows[-1]), err=True)
        if timeline is not None and prefix == max(prefix_list):
            mine = [r for r in rows if r["prefix"] == prefix]
            chunk = min((r["chunk"] for r in mine if r["wait_share"] <= 0.05), default=max(chunk_list))
            for layer in range(layers):
                streamer.length[layer] = prefix
            trace: list = []
            time_stack(prefix, chunk, layers, 0, "prefetch", state, trace=trace)
            plot_timeline(trace, f"streamed prefill, {layers} layers, {prefix:,}-key prefix, {chunk:,}-token chunks "
                                 "(two chunks; the second one's first load prefetched)", timeline)
        del streamer, resident, state, codes
        torch.cuda.empty_cache()
    report = {"device": torch.cuda.get_device_name(), "layers": layers, "key_bytes": KEY_BYTES,
              "chunks_per_timed_run": CHUNKS_PER_RUN, "host_bandwidth_gbps": {}, "break_even_chunk": {},
              "prefix_state_memory": memory, "rows": rows}
    for prefix in prefix_list:
        mine = [r for r in rows if r["prefix"] == prefix]
        report["host_bandwidth_gbps"][str(prefix)] = round(prefix * KEY_BYTES / (mine[0]["load_ms"] * 1e-3) / 1e9, 2)
        report["break_even_chunk"][str(prefix)] = _break_even(mine)
    emit_report(report, out, markdown, _table(rows))


def bench_model_stream(model_ref: str, prefixes: list[int], chunks: list[int], repeats: int, device: str) -> dict:
    """The streamed-prefill measurement on a real checkpoint in the served runtime (see the module notes):
    per (prefix, chunk), medians of ``repeats`` timed chunks (after a warm-up) with the prefix resident
    and streamed, the exposed wait per layer, the predicted one and the break-even chunks, as the stack's
    report; ``prefix_state_memory`` compares the streamer's two buffers with every layer's keys resident."""
    import statistics

    import torch

    from dsaindex.errors import DsaIndexError
    from dsaindex.pipelines.bench.timing import time_call
    from dsaindex.pipelines.capture.models import load_model
    from dsaindex.runtime.serving import ServedIndex
    from dsaindex.runtime.settings import ServeSettings

    cuda = device.startswith("cuda")
    net = load_model(model_ref, device=device, dtype="bfloat16" if cuda else "float32").model.eval()
    limit = int(getattr(net.config, "max_position_embeddings", 0) or 0)
    if limit and max(prefixes) + max(chunks) > limit:
        raise DsaIndexError(f"A {max(prefixes):,}-token prefix and a {max(chunks):,}-token chunk exceed the model's "
                            f"{limit:,} positions.", "pass shorter --prefixes or --chunks.")
    fill = 2048  # the prefix is prefilled in pieces of at most this many tokens (untimed)

    def run(ids: torch.Tensor, prefix: int, streamed: bool) -> tuple[float, torch.Tensor, ServedIndex | None]:
        runtime = (ServedIndex(net, {}, {}, ServeSettings.of(stream_prefix=True, max_keys=ids.shape[1]), device=device)
                   if streamed else None)
        if runtime is not None:
            runtime.attach()
        try:
            with torch.no_grad():
                cache = None
                for start in range(0, prefix, fill):
                    cache = net(input_ids=ids[:, start : min(prefix, start + fill)], past_key_values=cache,
                                use_cache=True).past_key_values
                logits, seconds = time_call(
                    lambda: net(input_ids=ids[:, prefix:], past_key_values=cache, use_cache=True).logits, device)
                return seconds * 1e3, logits[0, -1].float().cpu(), runtime
        finally:
            if runtime is not None:
                runtime.remove()

    gen = torch.Generator().manual_seed(0)
    rows, memory, load_ms = [], {}, {}
    layers = row_bytes = None
    for prefix in prefixes:
        for chunk in chunks:
            ids = torch.randint(3, int(net.config.vocab_size), (1, prefix + chunk), generator=gen).to(device)
            times, last = {}, {}
            for mode in ("resident", "streamed"):
                runs = [run(ids, prefix, mode == "streamed") for _ in range(repeats + 1)]
                times[mode] = statistics.median(r[0] for r in runs[1:])
                last[mode] = runs[-1][1]
                runtime = runs[-1][2]
                if runtime is not None:
                    layers, streamer = len(runtime.indexers), runtime.streamer
                    first = streamer.host[streamer.layers[0]]  # [capacity, head_dim] rows of the model's dtype
                    row_bytes = first[0].numel() * first.element_size()
                    memory[str(prefix)] = {"streamed_two_buffers_bytes": streamer.device_bytes(),
                                           "all_layers_resident_bytes": layers * (prefix + chunk) * row_bytes}
                    if cuda and str(prefix) not in load_ms:
                        load_ms[str(prefix)] = time_stack_copy(first[:prefix], torch.empty_like(first[:prefix],
                                                                                               device=device), repeats)
            per_layer = times["resident"] / layers
            wait = max(0.0, (times["streamed"] - times["resident"]) / layers)
            load = load_ms.get(str(prefix))
            rows.append({"prefix": prefix, "chunk": chunk, "compute_ms_per_layer": round(per_layer, 4),
                         "streamed_ms_per_layer": round(times["streamed"] / layers, 4),
                         "load_ms": None if load is None else round(load, 4),
                         "wait_ms_per_layer": round(wait, 4),
                         "predicted_wait_ms": None if load is None else round(max(0.0, load - per_layer), 4),
                         "wait_share": round(wait / max(per_layer, 1e-9), 4), "wait_share_no_prefetch": None,
                         "max_logit_difference": float((last["streamed"] - last["resident"]).abs().max())})
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu", "model": model_ref, "layers": layers,
              "key_bytes": row_bytes, "chunks_per_timed_run": 1, "host_bandwidth_gbps": {}, "break_even_chunk": {},
              "prefix_state_memory": memory, "rows": rows}
    for prefix in prefixes:
        mine = [r for r in rows if r["prefix"] == prefix]
        if mine[0]["load_ms"]:
            report["host_bandwidth_gbps"][str(prefix)] = round(prefix * row_bytes / (mine[0]["load_ms"] * 1e-3) / 1e9, 2)
        report["break_even_chunk"][str(prefix)] = _break_even(mine)
    return report


def _break_even(rows: list[dict]) -> dict:
    """The smallest chunk of one prefix's rows whose exposed wait is at most 5% of its compute (with the
    prefetch, and without it where measured), and the smallest whose compute per layer covers the load."""
    def smallest(keep) -> int | None:
        return min((r["chunk"] for r in rows if keep(r)), default=None)

    out = {"measured": smallest(lambda r: r["wait_share"] <= 0.05)}
    if any(r["wait_share_no_prefetch"] is not None for r in rows):
        out["measured_no_prefetch"] = smallest(lambda r: r["wait_share_no_prefetch"] is not None
                                               and r["wait_share_no_prefetch"] <= 0.05)
    out["predicted"] = smallest(lambda r: r["load_ms"] is not None and r["compute_ms_per_layer"] >= r["load_ms"])
    return out


def time_stack_copy(host, device_rows, repeats: int) -> float:
    """Median ms of one pinned host -> device copy of a layer's prefix (the load of Eq. 3), CUDA events
    around ``repeats`` copies after one warm-up copy."""
    from dsaindex.pipelines.bench.timing import event_median_ms

    return event_median_ms(lambda: device_rows.copy_(host, non_blocking=True), repeats, warmup=1)


def _table(rows: list[dict]) -> str:
    from dsaindex.console import markdown_rows

    head = ["prefix", "chunk", "compute ms/layer", "streamed ms/layer", "load ms", "exposed wait ms/layer",
            "predicted wait ms", "wait / compute", "without the prefetch"]
    def num(x, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    return markdown_rows(head, [[f"{r['prefix']:,}", f"{r['chunk']:,}", f"{r['compute_ms_per_layer']:.3f}",
                                 f"{r['streamed_ms_per_layer']:.3f}", num(r["load_ms"], ".3f"),
                                 f"{r['wait_ms_per_layer']:.3f}", num(r["predicted_wait_ms"], ".3f"),
                                 f"{100 * r['wait_share']:.1f}%",
                                 num(None if r["wait_share_no_prefetch"] is None else 100 * r["wait_share_no_prefetch"],
                                     ".1f") + ("%" if r["wait_share_no_prefetch"] is not None else "")] for r in rows])
