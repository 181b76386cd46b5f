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


def _count_indexer_forwards(monkeypatch) -> list[int]:
    """Count the calls that reach tiny-v32's own indexer forward (its exact scores of every key) from now on."""
    import functools

    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as modeling

    calls = [0]
    own = modeling.DeepseekV32Indexer.forward

    @functools.wraps(own)
    def counted(self, *args, **kwargs):
        calls[0] += 1
        return own(self, *args, **kwargs)

    monkeypatch.setattr(modeling.DeepseekV32Indexer, "forward", counted)
    return calls


def test_capture_prefills_through_the_runtimes_ivf_selection(trained, tmp_path, monkeypatch):
    """`capture --ivf-artifacts`: the model's attention reads the runtime's IVF selection, so its own indexer
    never scores a chunk. The first indexer layer's keys come before any selection and equal the exact
    capture's; later layers' keys follow the served selection, which at a budget of a sixth of the keys is
    not the exact one. The store records the bundle and the budget, and a resume with other ones is refused."""
    import numpy as np

    from dsaindex.artifacts.bundle import read_manifest
    from dsaindex.artifacts.capture_store import CaptureStore
    from helpers import run_cli_in_process

    root, exact_store, bundle, result = trained
    calls = _count_indexer_forwards(monkeypatch)
    store = tmp_path / "served"
    args = ("capture", str(store), "-m", "preset:tiny-v32", "-n", "1", "--seq-len", "1536", "--chunk-len", "768",
            "--no-progress", "--ivf-artifacts", str(bundle))
    proc = run_cli_in_process(*args, "--ivf-budget", "256")
    assert proc.returncode == 0, proc.stderr
    assert calls[0] == 0  # 2 chunks x 4 layers selected by the runtime
    bundle_id = read_manifest(bundle).bundle_id
    assert f"256 candidates a query (bundle {bundle_id})" in proc.stderr
    served, exact = CaptureStore.open(store), CaptureStore.open(exact_store)
    assert served.manifest.settings.prefill_selection.model_dump() == {"kind": "ivf", "bundle_id": bundle_id,
                                                                         "budget": 256}
    assert exact.manifest.settings.prefill_selection is None
    assert np.array_equal(served.array("tokens"), exact.array("tokens")[:1536])
    assert np.array_equal(served.keys(0), exact.keys(0)[:1536])
    for layer in (1, 2, 3):
        differ = (served.keys(layer) != exact.keys(layer)[:1536]).any(axis=1)
        assert not differ[:32].any() and differ.mean() > 0.5, layer  # the first top-32 keys see every key
    info = run_cli_in_process("store", "info", str(store))
    assert "the runtime's IVF prefill, 256 candidates a query" in info.stdout

    for other in (("--ivf-budget", "512"), ()):  # resumed with another budget, or with the model's own selection
        again = run_cli_in_process(*(args if other else args[:-2]), "-n", "2", *other)
        assert again.returncode == 2 and "prefill_selection" in again.stderr, again.stderr
    assert CaptureStore.open(store).committed.sequences == 1

    control = run_cli_in_process("capture", str(tmp_path / "exact"), "-m", "preset:tiny-v32", "-n", "1", "--seq-len",
                                 "256", "--no-progress")
    assert control.returncode == 0 and calls[0] == 4  # without the bundle, the model's own indexer scores

    # a capture the bundle was not trained on is measured whole (one sequence: no split), longest prefixes apart
    measured = {}
    for longer in ("0", "1024"):
        proc = run_cli("eval", "ivf", str(bundle), "--store", str(store), "--budgets", "256", "--eval-queries", "64",
                       "--min-prefix", longer, "--device", "cpu", "--json")
        assert proc.returncode == 0, proc.stderr
        measured[longer] = json.loads(proc.stdout)
    assert measured["0"]["sequences"] == [0] and measured["0"]["held_out"].startswith("every sequence")
    counts = {longer: r["per_layer"]["1"]["queries"]["256"] for longer, r in measured.items()}
    assert 0 < counts["1024"] < counts["0"], counts
    fixed = run_cli("eval", "ivf", str(bundle), "--store", str(store), "--budgets", "256", "--eval-queries", "8",
                    "--refit-fraction", "0", "--device", "cpu", "--json")
    assert fixed.returncode == 0, fixed.stderr
    assert measured["0"]["refit_fraction"] == 0.0625 and json.loads(fixed.stdout)["refit_fraction"] == 0


def test_capture_refuses_an_ivf_budget_without_a_bundle_and_a_bundle_that_is_not_ivf(trained, tmp_path):
    import numpy as np

    from dsaindex.artifacts.bundle import LayerArtifact, read_bundle, write_bundle

    root, store, bundle, result = trained
    proc = run_cli("capture", str(tmp_path / "a"), "-m", "preset:tiny-v32", "--ivf-budget", "256")
    assert proc.returncode == 2 and "--ivf-artifacts" in proc.stderr
    proc = run_cli("capture", str(tmp_path / "b"), "-m", "preset:tiny-v32", "--ivf-artifacts", str(tmp_path / "none"))
    assert proc.returncode == 2 and "no bundle there" in proc.stderr
    manifest, _ = read_bundle(bundle)
    layers = {str(i): LayerArtifact(kind="pq", params={"subspaces": 32, "score_aware": False}) for i in range(4)}
    pq = tmp_path / "pq"
    write_bundle(pq, manifest.model_copy(update={"layers": layers}),
                 {i: {"codebooks": np.zeros((32, 256, 4), dtype=np.float32)} for i in range(4)})
    proc = run_cli("capture", str(tmp_path / "c"), "-m", "preset:tiny-v32", "--ivf-artifacts", str(pq))
    assert proc.returncode == 2 and "not an ivf bundle alone: it holds decode codes" in proc.stderr, proc.stderr
    assert not any((tmp_path / name).exists() for name in ("a", "b", "c"))
