"""``dsaindex train ivf`` / ``eval ivf``: routing encoders from a capture store, held-out recall, bundle."""

import json

import pytest

from helpers import run_cli


@pytest.fixture(scope="module")
def trained(tmp_path_factory, routing_store):
    root = tmp_path_factory.mktemp("ivfjob")
    store, bundle = routing_store, root / "bundle"
    proc = run_cli("train", "ivf", str(store), "--out", str(bundle), "--window", "256", "--cluster-size", "32",
                   "--refit-every", "512", "--budgets", "256,512", "--steps", "25", "--eval-queries", "8",
                   "--device", "cpu", "--no-register", "--json")
    assert proc.returncode == 0, proc.stderr
    return root, store, bundle, json.loads(proc.stdout)


def test_bundle_holds_one_encoder_per_layer_and_the_recall_of_each_method(trained):
    from dsaindex.artifacts.bundle import read_bundle
    from dsaindex.artifacts.kinds import ENCODER_ARRAYS

    root, store, bundle, result = trained
    manifest, arrays = read_bundle(bundle)
    assert sorted(manifest.layer_ids) == [0, 1, 2, 3]
    assert {a.kind for a in manifest.layers.values()} == {"ivf"}
    assert set(arrays[0]) == set(ENCODER_ARRAYS) and arrays[0]["out_weight"].shape == (128, 256)
    assert manifest.params["window"] == 256 and manifest.params["cluster_size"] == 32
    mean = result["mean"]
    assert set(mean) == {"blocks", "ivf-seal-only", "ivf", "ivf-learned"}
    for by in mean.values():
        assert all(0.0 < v <= 1.0 for v in by.values())
        assert by["512"] >= by["256"]  # a larger budget never routes worse
    for layer in result["per_layer"].values():  # training lowered the routing loss
        assert layer["train"]["loss_end"] < layer["train"]["loss_start"]
        # 4 training sequences: 3 fit, the last picks the step kept, at the smallest budget evaluated (it
        # holds fewer clusters than the validation queries see, so the steps can differ)
        train = layer["train"]
        assert train["val_budget"] == 256
        assert train["val_hit_rate@256_kept"] >= train["val_hit_rate@256_start"]
        assert train["val_hit_rate@256_start"] < 1.0
        profile = layer["truth_profile"]
        assert 0 <= profile["window_share"] <= 1 and profile["keys_per_block"] >= 1
    assert (root / "bundle-recall.png").is_file()


def test_eval_reproduces_the_training_figures(trained):
    root, store, bundle, result = trained
    proc = run_cli("eval", "ivf", str(bundle), "--store", str(store), "--budgets", "256,512", "--eval-queries", "8",
                   "--device", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr
    again = json.loads(proc.stdout)["mean"]
    for method, by in result["mean"].items():
        for b, v in by.items():
            assert again[method][b] == pytest.approx(v, abs=1e-4), (method, b)


def test_unknown_layers_are_refused_before_training(trained, tmp_path):
    root, store, bundle, result = trained
    proc = run_cli("train", "ivf", str(store), "--out", str(tmp_path / "b"), "--layers", "1,9", "--no-register")
    assert proc.returncode == 2 and "not [9]" in proc.stderr and "--layers" in proc.stderr
    assert not (tmp_path / "b").exists()


def test_a_pq_bundle_is_refused_as_ivf(trained, tmp_path):
    import numpy as np

    from dsaindex.artifacts.bundle import LayerArtifact, read_bundle, write_bundle

    root, store, bundle, result = trained
    manifest, _ = read_bundle(bundle)
    pq_manifest = manifest.model_copy(update={"layers": {"0": LayerArtifact(kind="pq", params={"subspaces": 32})}})
    pq = tmp_path / "pq"
    write_bundle(pq, pq_manifest, {0: {"codebooks": np.zeros((32, 256, 4), dtype=np.float32)}})
    proc = run_cli("eval", "ivf", str(pq), "--store", str(store), "--budgets", "256")
    assert proc.returncode == 2 and "not ivf routing encoders" in proc.stderr


def test_runtime_loader_learns_the_ivf_kind(trained):
    import json as _json

    from dsaindex.pipelines.capture.models import preset_config
    from dsaindex.runtime import IVFLayer, load_bundle

    root, store, bundle, result = trained
    loaded = load_bundle(bundle, preset_config("tiny-v32"))
    assert all(isinstance(v, IVFLayer) for v in loaded.layers.values()) and sorted(loaded.layers) == [0, 1, 2, 3]
    assert loaded.layers[0].settings.window == 256 and loaded.layers[0].params["out_weight"].shape == (128, 256)
    summary = loaded.summary()
    assert summary["layers"]["0"]["kind"] == "ivf" and summary["device_bytes"] == sum(v.nbytes for v in loaded.layers.values())
    proc = run_cli("runtime", "check", "--model", "preset:tiny-v32", "--artifacts", str(bundle), "--json")
    assert proc.returncode == 0, proc.stderr
    assert _json.loads(proc.stdout)["layers"]["1"]["cluster_size"] == 32


def test_runtime_check_prints_an_ivf_bundle(trained):
    root, store, bundle, result = trained
    proc = run_cli("runtime", "check", "--model", "preset:tiny-v32", "--artifacts", str(bundle))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"ok: {bundle} fits preset:tiny-v32 (same weights and config): deepseek_v32")
    assert "0 (IVF routing (window 256, clusters of 32, refit every 512, then 1/16 of the prefix))" in proc.stdout


def test_a_rerun_with_the_default_out_writes_a_fresh_bundle(trained, tmp_path):
    import os
    import subprocess
    import sys

    root, store, bundle, result = trained
    fast = ("--window", "256", "--cluster-size", "32", "--refit-every", "512", "--budgets", "256,512", "--steps", "1",
            "--train-queries", "8", "--eval-queries", "2", "--layers", "0", "--device", "cpu", "--no-register")
    env = dict(os.environ, PYTHONWARNINGS="ignore", COLUMNS="80")
    for name in ("store-ivf", "store-ivf-2"):
        proc = subprocess.run([sys.executable, "-m", "dsaindex", "train", "ivf", str(store), *fast], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr
        assert f"bundle: runs/bundles/{name} " in proc.stdout and (tmp_path / "runs/bundles" / name).is_dir()
        assert "1/1 layers" in proc.stderr  # the per-layer progress bar
        assert max(len(line) for line in proc.stdout.splitlines()) <= 80 and "B=256" in proc.stdout


def test_prefill_indexer_routes_with_the_loaded_encoder(trained):
    import dataclasses

    import torch

    from dsaindex.errors import DsaIndexError
    from dsaindex.pipelines.capture.models import preset_config
    from dsaindex.runtime import load_bundle
    from dsaindex.runtime.causal_ivf import CausalIVF, representatives
    from dsaindex.runtime.ivf_prefill import IVFPrefillIndexer, select_chunk

    root, store, bundle, result = trained
    layer = load_bundle(bundle, preset_config("tiny-v32")).layers[0]
    g = torch.Generator().manual_seed(0)
    params = dict(layer.params)
    params["out_bias"] = params["out_bias"] + torch.randn(params["out_bias"].shape, generator=g)  # reps != means
    layer = dataclasses.replace(layer, params=params)
    keys = torch.randn(3000, 128, generator=g)
    queries, weights = torch.randn(3000, 4, 128, generator=g), torch.rand(3000, 4, generator=g)
    learned = IVFPrefillIndexer(128, topk=16, budget=300, layer=layer)
    plain = IVFPrefillIndexer(128, topk=16, budget=300, **layer.settings.model_dump())
    whole = CausalIVF(128, **layer.settings.model_dump(), key_storage="fp8")  # the runtime's key form
    whole.append(keys)
    differ = 0
    for lo in range(0, 3000, 500):  # prefill chunks: keys first, then the chunk's queries
        pos = torch.arange(lo, lo + 500)
        learned.append(keys[lo : lo + 500])
        plain.append(keys[lo : lo + 500])
        got = learned.select(queries[pos], weights[pos], pos)
        want = select_chunk(whole, queries[pos], weights[pos], pos, 300, 16,
                            representatives=lambda v: representatives(params, whole.keys, v))
        assert torch.equal(got, want)
        held = learned.device_bytes()  # between chunks: 132-byte FP8 keys, no float copy
        assert held["float_view"] == 0 and held["keys"] == learned.index._fp8.shape[0] * (128 + 4)
        assert torch.equal(plain.select(queries[pos], weights[pos], pos),
                           select_chunk(whole, queries[pos], weights[pos], pos, 300, 16))
        differ += int((got != plain.select(queries[pos], weights[pos], pos)).any(1).sum())
    assert differ > 0, "the learned representatives changed no selection"
    assert len(learned.index.versions) < len(whole.versions)  # old versions are dropped as prefill moves on
    with pytest.raises(DsaIndexError, match="cannot hold the top-16"):
        IVFPrefillIndexer(128, topk=16, budget=8, layer=layer)
