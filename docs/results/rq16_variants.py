"""RQ16 score-aware variants side by side on one capture store (the figures in results.md, "16 bytes a key:
what moves RQ16, and what does not"): held-out recall of the exact top-512 for each variant.

Usage: ``python docs/results/rq16_variants.py STORE OUT.json DEVICE VARIANTS [QUERIES [LAYERS]]``, e.g.
``... /tmp/v2l out.json cuda base,ebeam=16,keys=393216,reg=0.05,scale,beam=16,beam=16+keys=393216 128``.

A variant is ``name`` or settings joined by ``+``, each ``key=value`` (or ``scale`` alone):
``m`` bytes (codebooks, default 16), ``beam`` training and coding beam (5), ``ebeam`` coding beam of the
held-out keys (the training one if 0), ``keys`` training keys (262,144), ``reg`` the metric's ridge after
normalizing its trace (1e-3, as ``dsaindex.pq.whitening``), ``it`` k-means rounds per codebook (20),
``scale``: m - 1 codebooks and a byte holding a per-key scale (norm-explicit coding, 256 levels by 1-D
k-means)."""

import json
import sys
import time

import torch

from dsaindex.artifacts.capture_store import CaptureStore
from dsaindex.pq import beam_search
from dsaindex.train.additive import full_spec, train_rq_torch
from dsaindex.train.pq_job import _subsample, metric_for_layer
from dsaindex.train.recall import evaluate_selection, held_out, layer_keys, split_sequences

DEFAULTS = {"m": 16, "beam": 5, "ebeam": 0, "keys": 262144, "reg": 1e-3, "scale": False, "it": 20}


def settings(variant: str) -> dict:
    opts = dict(DEFAULTS)
    for part in variant.split("+"):
        key, _, value = part.partition("=")
        if key == "scale":
            opts["scale"] = True
        elif key in opts:
            opts[key] = type(opts[key])(value)
    return opts


def whitening(metric: torch.Tensor, reg: float, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, L^-1) with ``A / mean(diag A) + reg I = L L^T``: codes are of ``x @ L``."""
    a = metric[0].double().to(device)
    a = a / a.diagonal().mean() + reg * torch.eye(a.shape[0], dtype=torch.float64, device=device)
    lt = torch.linalg.cholesky(a).t()
    return lt.t().float().contiguous(), torch.linalg.inv(lt).t().float().contiguous()


def scalar_levels(values: torch.Tensor, n: int = 256, rounds: int = 30) -> torch.Tensor:
    """``n`` levels of a 1-D k-means on ``values``, started at their quantiles."""
    levels = torch.quantile(values, torch.linspace(0, 1, n, device=values.device))
    for _ in range(rounds):
        nearest = (values[:, None] - levels[None]).abs().argmin(1)
        sums = torch.zeros_like(levels).scatter_add_(0, nearest, values)
        counts = torch.zeros_like(levels).scatter_add_(0, nearest, torch.ones_like(values))
        levels = torch.where(counts > 0, sums / counts.clamp_min(1), levels)
    return levels


def reconstruct(x: torch.Tensor, codebooks: torch.Tensor, beam: int) -> torch.Tensor:
    """The residual code's reconstruction of ``x`` (whitened) by beam search of width ``beam``."""
    parts = []
    for i in range(0, x.shape[0], 16384):
        _, residual = beam_search(x[i : i + 16384], codebooks, beam)
        parts.append(x[i : i + 16384] - residual[:, 0])
    return torch.cat(parts)


def main() -> None:
    path, out, device, variants = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
    queries = int(sys.argv[5]) if len(sys.argv) > 5 else 128
    store = CaptureStore.open(path)
    layers = [int(x) for x in sys.argv[6].split(",")] if len(sys.argv) > 6 else list(store.layers)
    key_format = store.manifest.model.geometry.key_format
    train, held = split_sequences(store.committed.sequences)
    per_layer: dict[str, dict[int, dict]] = {}
    for layer in layers:
        raw = store.keys(layer)
        every = layer_keys(store, layer, train, key_format, raw)
        metric = metric_for_layer(store, layer, train, key_format, full_spec(every.shape[1], 256), 256, 512,
                                  device=device, raw=raw)
        data = held_out(store, layer, held, 2048, key_format, queries, raw)
        held_keys = data.keys.to(device).float()
        for variant in variants:
            opts = settings(variant)
            t0 = time.time()
            keys = _subsample(every, opts["keys"], layer).to(device).float()
            white, unwhite = whitening(metric, opts["reg"], device)
            rq = train_rq_torch(keys @ white, opts["m"] - int(opts["scale"]), 256, opts["it"], opts["beam"],
                                seed=layer, device=device)
            beam = opts["ebeam"] or opts["beam"]
            x = held_keys @ white
            y = reconstruct(x, rq.codebooks, beam)
            if opts["scale"]:
                xt = keys @ white
                yt = reconstruct(xt, rq.codebooks, beam)
                levels = scalar_levels((xt * yt).sum(-1) / (yt * yt).sum(-1).clamp_min(1e-12))
                best = (x * y).sum(-1) / (y * y).sum(-1).clamp_min(1e-12)
                y = y * levels[(best[:, None] - levels[None]).abs().argmin(1)][:, None]
            recall = evaluate_selection(data, y @ unwhite, (512,), (1024, 2048, 4096), device=device)
            row = {k: round(v, 5) for k, v in recall.items() if "rerank" in k or "direct" in k or "queries" in k}
            row["white_mse"] = round(float(((x - y) ** 2).sum(-1).mean() / (x**2).sum(-1).mean()), 5)
            row["seconds"] = round(time.time() - t0, 1)
            per_layer.setdefault(variant, {})[layer] = row
            print(layer, variant, row.get("k512/direct"), row.get("k512/rerank@2048"), row["white_mse"], flush=True)
    summary = {}
    for variant, rows in per_layer.items():
        names = set.intersection(*(set(r) for r in rows.values()))
        summary[variant] = {n: round(sum(r[n] for r in rows.values()) / len(rows), 5) for n in sorted(names)}
        print(variant, {n: summary[variant].get(n) for n in ("k512/direct", "k512/rerank@2048")})
    with open(out, "w") as f:
        json.dump({"summary": summary, "per_layer": per_layer}, f, indent=1)


if __name__ == "__main__":
    main()
