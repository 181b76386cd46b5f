"""``dsaindex train ivf`` / ``eval ivf``: routing encoders from a capture store, held-out recall, bundle."""

import json

import pytest

from helpers import run_cli


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("ivfjob")
    store, bundle = root / "store", root / "bundle"
    proc = run_cli("capture", str(store), "-m", "preset:tiny-v32", "-n", "5", "--seq-len", "1536",
                   "--chunk-len", "768", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("train", "ivf", str(store), "--out", str(bundle), "--window", "256", "--cluster-size", "32",
                   "--refit-every", "512", "--budgets", "256,512", "--steps", "25", "--eval-queries", "8",
                   "--device", "cpu", "--no-register", "--json")
    assert proc.returncode == 0, proc.stderr
    return root, store, bundle, json.loads(proc.stdout)


def test_bundle_holds_one_encoder_per_layer_and_the_recall_of_each_method(trained):
    from dsaindex.artifacts.bundle import read_bundle
    from dsaindex.train.ivf import ENCODER_ARRAYS

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

    from dsaindex.pipelines.models import preset_config
    from dsaindex.runtime import IVFLayer, load

    root, store, bundle, result = trained
    loaded = load(bundle, preset_config("tiny-v32"))
    assert all(isinstance(v, IVFLayer) for v in loaded.layers.values()) and sorted(loaded.layers) == [0, 1, 2, 3]
    assert loaded.layers[0].settings["window"] == 256 and loaded.layers[0].params["out_weight"].shape == (128, 256)
    summary = loaded.summary()
    assert summary["layers"]["0"]["kind"] == "ivf" and summary["device_bytes"] == sum(v.nbytes for v in loaded.layers.values())
    proc = run_cli("runtime", "check", "--model", "preset:tiny-v32", "--artifacts", str(bundle), "--json")
    assert proc.returncode == 0, proc.stderr
    assert _json.loads(proc.stdout)["layers"]["1"]["cluster_size"] == 32
