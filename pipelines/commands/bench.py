"""``dsaindex bench ...``: measurements users run on their own hardware, JSON out."""

from __future__ import annotations

import tempfile
from pathlib import Path

import typer

from dsaindex.console import at_least, emit_report, resolve_device
from dsaindex.pipelines.bench.decode import bench_decode
from dsaindex.pipelines.bench.frontier import bench_frontier
from dsaindex.pipelines.bench.paged import bench_paged
from dsaindex.pipelines.bench.pq_job import bench_pq_job
from dsaindex.pipelines.bench.prefill import bench_prefill_select
from dsaindex.pipelines.bench.reuse import bench_decode_reuse
from dsaindex.pipelines.bench.stream import bench_prefill_stream
from dsaindex.pipelines.bench.timing import time_call

bench_app = typer.Typer(no_args_is_help=True)
bench_app.command("decode")(bench_decode)
bench_app.command("decode-reuse")(bench_decode_reuse)
bench_app.command("frontier")(bench_frontier)
bench_app.command("paged")(bench_paged)
bench_app.command("prefill-select")(bench_prefill_select)
bench_app.command("prefill-stream")(bench_prefill_stream)
bench_app.command("pq-job")(bench_pq_job)


@bench_app.command("capture")
def bench_capture(
    model: str = typer.Option(None, "--model", "-m", help="Model reference (default: reference or tiny preset)."),
    sequences: int = typer.Option(2, "--sequences", "-n", callback=at_least(1),
                                  help="Sequences to capture (after one warm-up)."),
    seq_len: int = typer.Option(4096, callback=at_least(1), help="Tokens per sequence."),
    chunk_len: int = typer.Option(2048, callback=at_least(1), help="Tokens per forward call."),
    device: str = typer.Option("auto", help="cpu, cuda or auto."),
    out: Path = typer.Option(None, help="Also write the JSON result to this file."),
) -> None:
    """Capture throughput (tokens/s, keys/s written) and store bytes per million keys."""
    import torch

    from dsaindex.artifacts.capture_store import CaptureSettings, CaptureStore
    from dsaindex.pipelines.capture.corpus import CorpusSpec
    from dsaindex.pipelines.capture.models import default_model_ref, load_model
    from dsaindex.pipelines.capture.run import capture

    device = resolve_device(device)
    ref = model or default_model_ref()
    loaded = load_model(ref, device=device)
    settings = CaptureSettings(seq_len=seq_len, chunk_len=chunk_len)
    cuda = device.startswith("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        capture(Path(tmp) / "warmup", ref, CorpusSpec(), settings.model_copy(update={"seq_len": min(seq_len, 2 * chunk_len)}),
                1, device=device, loaded=loaded)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        result, seconds = time_call(
            lambda: capture(Path(tmp) / "store", ref, CorpusSpec(), settings, sequences, device=device, loaded=loaded),
            device,
        )
        info = CaptureStore.open(Path(tmp) / "store").info()
    layers = len(info["layers"])
    keys = info["committed"]["keys"]
    report = {
        "model": ref,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch_threads": torch.get_num_threads(),
        "geometry": {k: info[k] for k in ("n_heads", "head_dim", "topk", "key_stride")} | {"layers": layers},
        "seq_len": seq_len,
        "chunk_len": chunk_len,
        "sequences": result.sequences_added,
        "tokens": result.tokens_added,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(result.tokens_added / seconds, 1),
        "keys_per_s_all_layers": round(keys * layers / seconds, 1),
        "store_bytes": info["bytes_on_disk"],
        "key_bytes_per_million_keys": round(info["key_bytes_on_disk"] / max(1, keys * layers) * 1e6),
        "store_bytes_per_million_keys": round(info["bytes_on_disk"] / max(1, keys * layers) * 1e6),
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    }
    emit_report(report, out)


@bench_app.command("pq-train")
def bench_pq_train(
    store: str = typer.Option(None, "--store", "-s", help="Capture store whose keys to train on (tiled up to --keys): "
                                                         "a folder or s3://bucket/prefix."),
    layer: int = typer.Option(None, callback=at_least(0), help="Layer of the store (default: its first indexer layer)."),
    keys: int = typer.Option(1_000_000, callback=at_least(1024), help="Keys to train on (at least 4 per centroid)."),
    subspaces: int = typer.Option(32, callback=at_least(1), help="PQ subspaces."),
    iterations: int = typer.Option(20, callback=at_least(1), help="k-means iterations."),
    trainers: str = typer.Option("faiss,torch", help="Comma-separated trainers to time side by side."),
    device: str = typer.Option("auto", help="Device of the torch trainer."),
    out: Path = typer.Option(None, help="Also write the JSON result to this file."),
) -> None:
    """Time of one layer's PQ training for N keys, per trainer, and the quantization error each reaches."""
    import os

    import torch

    from dsaindex.pq import PQSpec, relative_mse
    from dsaindex.train.codebooks import train_codebooks

    device = resolve_device(device)
    if store is not None:
        from dsaindex.artifacts.capture_store import CaptureStore

        cs = CaptureStore.open(store)
        layer = cs.layers[0] if layer is None else layer
        base = cs.engine_keys(cs.keys(layer))
        reps = -(-keys // base.shape[0])
        g = torch.Generator().manual_seed(0)
        data = base.repeat(reps, 1)[:keys]
        data = data + 0.01 * data.std() * torch.randn(data.shape, generator=g)  # tiled copies are not identical
        source = f"{store} layer {layer} ({base.shape[0]} keys tiled)"
    else:
        g = torch.Generator().manual_seed(0)
        centers = torch.randn(4096, 128, generator=g)
        data = centers[torch.randint(0, 4096, (keys,), generator=g)] + 0.5 * torch.randn(keys, 128, generator=g)
        source = "synthetic clustered keys"
    spec = PQSpec(dim=data.shape[1], subspaces=subspaces)
    report = {"source": source, "keys": keys, "subspaces": subspaces, "iterations": iterations,
              "cpu_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
              "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None, "trainers": {}}
    for trainer in [t for t in trainers.split(",") if t]:
        if trainer == "torch" and device.startswith("cuda"):
            train_codebooks(data[:65536], spec, "torch", 2, device=device)  # warm-up (CUDA init, kernels)
            torch.cuda.synchronize()
        cb, seconds = time_call(
            lambda t=trainer: train_codebooks(data, spec, t, iterations, device=device if t == "torch" else "cpu"),
            device,
        )
        report["trainers"][trainer] = {
            "device": device if trainer == "torch" else "cpu",
            "seconds": round(seconds, 3),
            "relative_mse": round(relative_mse(data[:200_000], cb), 5),
        }
    emit_report(report, out)
