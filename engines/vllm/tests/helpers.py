"""Test bundles, vLLM configs and index-K caches laid out as vLLM lays them out."""

from __future__ import annotations

import numpy as np
import torch

from dsaindex.artifacts.bundle import LayerArtifact, Lineage, new_bundle_manifest, write_bundle
from dsaindex.geometry import geometry_from_config
from dsaindex.pipelines.capture.models import preset_config
from dsaindex.quant import fp8_quantize

PAGE = 64
D = 128  # vLLM: Indexer.head_dim = config.index_head_dim; the cache row is D + D // 128 * 4 = 132 bytes


def preset_fingerprint(preset: str):
    from dsaindex.pipelines.capture.models import load_model

    return load_model(f"preset:{preset}").fingerprint


def kmeans_codebooks(keys: torch.Tensor, subspaces: int = 32, k: int = 256, iters: int = 8, seed: int = 0) -> np.ndarray:
    """Per-subspace Lloyd on ``keys`` [N, D]: codebooks [M, K, D/M] float32 (small, for tests)."""
    g = torch.Generator().manual_seed(seed)
    n, d = keys.shape
    x = keys.float().reshape(n, subspaces, d // subspaces).transpose(0, 1)  # [M, N, d]
    cent = x[:, torch.randperm(n, generator=g)[:k]].clone()
    for _ in range(iters):
        assign = torch.cdist(x, cent).argmin(dim=2)  # [M, N]
        for m in range(subspaces):
            sums = torch.zeros_like(cent[m]).index_add_(0, assign[m], x[m])
            counts = torch.bincount(assign[m], minlength=k).clamp_min(1).unsqueeze(1)
            cent[m] = torch.where(counts > 1, sums / counts, cent[m])
    return cent.numpy().astype(np.float32)


def write_pq_bundle(path, preset: str = "bench-v32", model_preset: str | None = None, codebooks=None,
                    basis: str = "raw", subspaces: int = 32, seed: int = 0, metrics=None):
    """A PQ bundle for every indexer layer of ``preset``'s geometry, trained (its manifest says) for
    ``model_preset`` (default: the same preset), recording ``metrics`` (held-out recall, as ``train pq``
    writes them); as the main tests' ``tests/test_runtime_loader.py`` pq_bundle."""
    geometry = geometry_from_config(preset_config(preset))
    model = preset_fingerprint(model_preset or preset)
    rng = np.random.default_rng(seed)
    sub = geometry.head_dim // subspaces
    arrays = {}
    for i in geometry.indexer_layers:
        cb = codebooks if codebooks is not None else rng.standard_normal((subspaces, 256, sub)).astype(np.float32)
        arrays[i] = {"codebooks": cb, "metric": np.tile(np.eye(sub, dtype=np.float32), (subspaces, 1, 1))}
    manifest = new_bundle_manifest(
        model, basis, geometry.key_format,
        {str(i): LayerArtifact(kind="pq", params={"subspaces": subspaces, "score_aware": True})
         for i in geometry.indexer_layers},
        Lineage(capture_store_id="s", capture_store_path="/nowhere", capture_store_digest="d" * 16,
                train_sequences=[0], eval_sequences=[1]),
        metrics=metrics,
    )
    write_bundle(path, manifest, arrays)
    return arrays


def synthetic_keys(n: int, seed: int = 0, rank: int = 16) -> torch.Tensor:
    """Keys [n, D] with some shared structure (a low-rank part plus noise), like post-LayerNorm keys."""
    basis = torch.randn(rank, D, generator=torch.Generator().manual_seed(1234))  # one model: one key distribution
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, rank, generator=g) @ basis / rank**0.5 + 0.7 * torch.randn(n, D, generator=g)


def write_keys(pages: torch.Tensor, block_row: list[int], keys: torch.Tensor) -> None:
    """Write ``keys`` [n, D] float of one request into ``pages`` [num_blocks, 64 * (D + 4)] uint8 (a flat view
    of the bound cache) in vLLM's index-K page layout: 64 x D FP8 bytes, then 64 float32 scales. This is
    what vLLM's ``indexer_k_quant_and_cache`` (vllm/_custom_ops.py:3191, a compiled kernel that does not run here) writes, with ue8m0
    scales; ``DeepseekV32IndexerCache`` documents the same split (deepseek_v2.py: "we use fp8 naive cache,
    where we store value in fp8 and scale in fp32 per self.quant_block_size element")."""
    fp8, scales = fp8_quantize(keys.float())
    fp8 = fp8.view(torch.uint8)
    scales = scales.reshape(-1).float()
    for i in range(keys.shape[0]):
        blk, slot = block_row[i // PAGE], i % PAGE
        pages[blk, slot * D : (slot + 1) * D] = fp8[i]
        pages[blk, PAGE * D + slot * 4 : PAGE * D + (slot + 1) * 4] = scales[i : i + 1].view(torch.uint8)
