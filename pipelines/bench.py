"""``dsaindex bench ...``: measurements users run on their own hardware, JSON out."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import typer

bench_app = typer.Typer(no_args_is_help=True)


@bench_app.command("capture")
def bench_capture(
    model: str = typer.Option(None, "--model", "-m", help="Model reference (default: reference or tiny preset)."),
    sequences: int = typer.Option(2, "--sequences", "-n", help="Sequences to capture (after one warm-up)."),
    seq_len: int = typer.Option(4096, help="Tokens per sequence."),
    chunk_len: int = typer.Option(2048, help="Tokens per forward call."),
    device: str = typer.Option("auto", help="cpu, cuda or auto."),
    out: Path = typer.Option(None, help="Also write the JSON result to this file."),
) -> None:
    """Capture throughput (tokens/s, keys/s written) and store bytes per million keys."""
    import time

    import torch

    from dsaindex.artifacts.capture_store import CaptureSettings, CaptureStore
    from dsaindex.pipelines.capture import capture
    from dsaindex.pipelines.cli import _device
    from dsaindex.pipelines.corpus import CorpusSpec
    from dsaindex.pipelines.models import default_model_ref, load_model

    device = _device(device)
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
        t0 = time.perf_counter()
        result = capture(Path(tmp) / "store", ref, CorpusSpec(), settings, sequences, device=device, loaded=loaded)
        seconds = time.perf_counter() - t0
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
    text = json.dumps(report, indent=2)
    if out:
        out.write_text(text)
    print(text)
