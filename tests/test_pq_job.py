"""End to end: a capture store -> `dsaindex train pq` -> bundle + registered version -> `dsaindex eval pq`."""

import json
import os
import subprocess
import sys

import pytest

from dsaindex.artifacts.bundle import read_bundle
from helpers import run_cli


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("pqjob")
    store = root / "store"
    proc = run_cli("capture", str(store), "-m", "preset:tiny-v32", "-n", "5", "--seq-len", "640",
                   "--chunk-len", "320", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    uri = f"sqlite:///{root}/mlflow.db"
    bundle = root / "bundle"
    proc = run_cli("train", "pq", str(store), "--out", str(bundle), "--subspaces", "32", "--iterations", "8",
                   "--eval-queries", "24", "--candidates", "64,128", "--tracking-uri", uri, "--device", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr
    return root, store, bundle, uri, json.loads(proc.stdout)


def test_bundle_holds_codebooks_lineage_and_metrics(trained):
    root, store, bundle, uri, result = trained
    manifest, arrays = read_bundle(bundle)  # verifies every checksum
    assert sorted(manifest.layer_ids) == [0, 1, 2, 3]
    assert result["code"] == "OPQ32" and manifest.params["rotate"] is True  # OPQ by default
    for layer in manifest.layer_ids:
        assert arrays[layer]["codebooks"].shape == (32, 256, 4)
        assert arrays[layer]["metric"].shape == (32, 4, 4)  # score-aware by default
        assert arrays[layer]["rotation"].shape == (128, 128)  # the learned rotation beside them
        assert manifest.layers[str(layer)].params["score_aware"] is True
        assert manifest.layers[str(layer)].params["rotate"] is True
    train_seq, eval_seq = manifest.lineage.train_sequences, manifest.lineage.eval_sequences
    assert train_seq == [0, 1, 2, 3] and eval_seq == [4]
    assert manifest.basis == "hadamard" and manifest.key_format == "fp8_e4m3_ue8m0"
    # top-32 of the tiny preset: 128 reranked candidates recover nearly all of the exact top-32
    assert manifest.metrics["mean/k32/rerank@128"] == pytest.approx(result["mean"]["k32/rerank@128"])
    assert 0.9 <= manifest.metrics["mean/k32/rerank@128"] <= 1.0
    assert manifest.metrics["mean/k32/direct"] < manifest.metrics["mean/k32/rerank@128"] + 1e-9
    assert all(p.endswith(".png") for p in result["plots"]) and result["plots"]
    assert result["registered"]["version"] in (1, "1") and result["registered"]["alias"] == "candidate"


def test_eval_reproduces_training_metrics(trained):
    root, store, bundle, uri, result = trained
    proc = run_cli("eval", "pq", str(bundle), "--store", str(store), "--eval-queries", "24", "--candidates", "64,128", "--json")
    assert proc.returncode == 0, proc.stderr
    again = json.loads(proc.stdout)
    assert again["mean"]["k32/direct"] == pytest.approx(result["mean"]["k32/direct"])
    assert again["mean"]["relative_mse"] == pytest.approx(result["mean"]["relative_mse"], rel=1e-4)


def test_registry_lists_the_trained_version(trained):
    root, store, bundle, uri, result = trained
    proc = run_cli("registry", "list", "--tracking-uri", uri, "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert any(r["name"] == result["registered"]["name"] and "candidate" in r["aliases"] for r in rows)


def test_store_of_another_model_is_refused(trained):
    root, store, bundle, uri, result = trained
    proc = run_cli("train", "pq", str(store), "--model", "preset:tiny-glm5", "--no-register", "--out",
                   str(root / "never"))
    assert proc.returncode == 2
    assert "not from preset:tiny-glm5" in proc.stderr and "Fix:" in proc.stderr
    assert not (root / "never").exists()


def cli_in(cwd, *args):
    """``python -m dsaindex ARGS`` run from ``cwd`` (default paths are relative to it), 80 columns wide."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", COLUMNS="80")
    return subprocess.run([sys.executable, "-m", "dsaindex", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env)


FAST = ("--iterations", "1", "--max-train-keys", "1024", "--eval-queries", "4", "--candidates", "64",
        "--no-register", "--device", "cpu")


def test_a_rerun_with_the_default_out_writes_a_fresh_bundle(trained, tmp_path):
    root, store, bundle, uri, result = trained
    first = cli_in(tmp_path, "train", "pq", str(store), *FAST)
    assert first.returncode == 0, first.stderr
    assert "bundle: runs/bundles/store-opq32-sa\n" in first.stdout  # OPQ, the default code
    assert "4/4 layers" in first.stderr  # the per-layer progress bar, on stderr
    second = cli_in(tmp_path, "train", "pq", str(store), *FAST)
    assert second.returncode == 0, second.stderr
    assert "bundle: runs/bundles/store-opq32-sa-2\n" in second.stdout
    assert read_bundle(tmp_path / "runs/bundles/store-opq32-sa-2")[0].layer_ids == [0, 1, 2, 3]


def test_opq_is_the_default_code_and_no_rotate_trains_plain_pq(trained, tmp_path):
    """`train pq` without a rotation flag trains OPQ (a rotation per layer in the bundle, its Procrustes rounds
    recorded: the CPU's default, or --rotation-rounds) and says so in its last line; --no-rotate trains plain
    PQ (no rotation array, params rotate=false) and says that; `--json` names the code too."""
    import numpy as np

    from dsaindex.train.pq_job import CPU_ROTATION_ROUNDS

    root, store, bundle, uri, result = trained
    manifest, arrays = read_bundle(bundle)  # the module's bundle: trained without a rotation flag
    for layer in manifest.layer_ids:
        assert manifest.layers[str(layer)].params["rotation_rounds"] == CPU_ROTATION_ROUNDS  # --device cpu
        rot = arrays[layer]["rotation"]
        assert np.abs(rot @ rot.T - np.eye(128)).max() < 1e-4 and np.abs(rot - np.eye(128)).max() > 0.1

    rounds = cli_in(tmp_path, "train", "pq", str(store), "--rotation-rounds", "1", *FAST)
    assert rounds.returncode == 0, rounds.stderr
    last = " ".join(rounds.stdout[rounds.stdout.rindex("\ncode: ") :].split())  # the last line, wrapped at 80
    assert last == ("code: OPQ32 score-aware (a learned rotation: balanced PCA + 1 Procrustes round); --no-rotate "
                    "trains plain PQ")
    rotated, _ = read_bundle(tmp_path / "runs/bundles/store-opq32-sa")
    assert {rotated.layers[str(i)].params["rotation_rounds"] for i in rotated.layer_ids} == {1}

    plain = cli_in(tmp_path, "train", "pq", str(store), "--no-rotate", *FAST)
    assert plain.returncode == 0, plain.stderr
    assert "bundle: runs/bundles/store-pq32-sa\n" in plain.stdout
    assert plain.stdout.endswith("\ncode: PQ32 score-aware (no rotation)\n")
    manifest, arrays = read_bundle(tmp_path / "runs/bundles/store-pq32-sa")
    assert manifest.params["rotate"] is False and manifest.params["rotation_rounds"] is None
    for layer in manifest.layer_ids:
        assert manifest.layers[str(layer)].params["rotate"] is False
        assert "rotation" not in arrays[layer] and "rotation_rounds" not in manifest.layers[str(layer)].params
    as_json = run_cli("train", "pq", str(store), "--no-rotate", "--out", str(tmp_path / "plain-json"), "--json",
                      *FAST)
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["code"] == "PQ32"


def test_a_taken_or_unwritable_out_is_refused_before_training(trained, tmp_path):
    root, store, bundle, uri, result = trained
    taken = cli_in(tmp_path, "train", "pq", str(store), "--out", str(bundle), *FAST)
    assert taken.returncode == 2
    assert taken.stderr.splitlines()[0] == (f"error: {bundle} exists and is not empty. Fix: write the bundle to a new "
                                            "path (or leave out --out for a fresh default name), or delete the old one.")
    for out, problem in [("/proc/dsaindex-test/bundle", "cannot be written: creating a folder in /proc fails"),
                         (f"{store}/zarr.json/bundle", f"cannot be created: {store}/zarr.json is a file")]:
        proc = cli_in(tmp_path, "train", "pq", str(store), "--out", out, *FAST)
        assert proc.returncode == 2, proc.stderr
        first = proc.stderr.splitlines()[0]
        assert first.startswith(f"error: {out} {problem}") and "Fix: pass --out on a writable filesystem" in first
        assert "layers" not in proc.stderr  # refused before the first layer started
    assert not (tmp_path / "runs").exists()


def test_recall_tables_fit_80_columns_and_say_what_the_columns_mean(trained):
    root, store, bundle, uri, result = trained
    proc = cli_in(root, "eval", "pq", str(bundle), "--store", str(store), "--eval-queries", "24",
                  "--candidates", "32,64,128")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, proc.stdout
    assert any("rerank" in line for line in lines) and "@64" in proc.stdout and "@128" in proc.stdout
    assert "@32 " not in proc.stdout  # C = top-k: the top-C is the direct top-k, left out
    assert "fetch@C:" in proc.stdout and "-:" in proc.stdout  # the caption
    assert "fetch_" not in proc.stdout
    # the served step's recall (stage 1 keeping 1, 2, 4, 8, 16 x C) in one line under the table
    flat = " ".join(proc.stdout.split())
    assert "served step at C = 128 (stage 1 keeps 1 / 2 / 4 / 8 / 16 x C): mean" in flat
    assert "weakest at 1 x C: layer" in flat


def test_the_served_recall_line_reads_each_recorded_stage_1():
    from dsaindex.console import served_recall_line

    per_layer = {0: {"k8/prefilter4@64": 0.9, "k8/prefilter16@64": 0.99}, 1: {"k8/prefilter4@64": 0.97}}
    mean = {"k8/prefilter4@64": 0.935, "k8/prefilter16@64": 0.995, "k8/prefilter4@32": 0.5}
    line = served_recall_line(per_layer, mean, 8, (32, 64))
    assert line.startswith("served step at C = 64 (stage 1 keeps 4 / 16 x C): mean 93.50% / 99.50%")
    assert "weakest at 4 x C: layer 0 90.00%" in line
    assert served_recall_line(per_layer, {"k8/direct": 0.5}, 8, (32, 64)) is None
    assert served_recall_line(per_layer, mean, 64, (32, 64)) is None  # no C above the top-k


def test_pq_compare_trains_opq_beside_pq_and_bundles_carry_the_rotation(trained, tmp_path):
    """`eval pq-compare --variants opq,...` learns a rotation per layer and reports its recall beside plain
    PQ's on the same split; a rotated result is written as a bundle with its rotation beside the codebooks."""
    import numpy as np
    import torch

    from dsaindex.train.pq_job import PQOptions, train_pq, write_pq_bundle

    root, store, bundle, uri, result = trained
    out = tmp_path / "compare.json"
    # 1,024 training keys a layer (of 2,560): OPQ's rounds retrain the codebooks six times a layer
    proc = run_cli("eval", "pq-compare", str(store), "--subspaces", "16", "--variants", "plain,opq,opq-score-aware",
                   "--trainer", "torch", "--iterations", "6", "--eval-queries", "16", "--candidates", "64",
                   "--max-train-keys", "1024", "--device", "cpu", "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())
    assert set(rows) == {"PQ16 plain", "OPQ16 plain", "OPQ16 score-aware"}
    for row in rows.values():
        assert 0.0 < row["k32/direct"] <= 1.0 and row["relative_mse"] > 0
    # the rotation lowers the reconstruction error of the same PQ size
    assert rows["OPQ16 plain"]["relative_mse"] < rows["PQ16 plain"]["relative_mse"]
    opts = PQOptions(subspaces=16, trainer="torch", iterations=4, score_aware=False, rotate=True, max_eval_queries=8,
                     candidates=(64,), max_train_keys=1024)
    report = train_pq(store, opts)
    rot = report["results"][0].rotation
    torch.testing.assert_close(rot @ rot.t(), torch.eye(rot.shape[0]), atol=1e-4, rtol=0)
    manifest = write_pq_bundle(report, opts, tmp_path / "opq")
    _, arrays = read_bundle(tmp_path / "opq")
    for layer, r in report["results"].items():
        assert manifest.layers[str(layer)].params["rotate"] is True and "metric" not in arrays[layer]
        np.testing.assert_array_equal(arrays[layer]["rotation"], r.rotation.numpy())


def test_pq_compare_puts_4_bit_codes_beside_8_bit_ones(trained, tmp_path):
    """`eval pq-compare --centroids 256,16`: 16 centroids per subspace are a 4-bit code (half the bytes at the
    same subspace count), named and sized as such, with a higher reconstruction error."""
    _, store, _, _, _ = trained
    out = tmp_path / "bits.json"
    proc = run_cli("eval", "pq-compare", str(store), "--subspaces", "32", "--centroids", "256,16", "--variants",
                   "plain", "--trainer", "torch", "--iterations", "4", "--eval-queries", "8", "--candidates", "64",
                   "--device", "cpu", "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())
    assert set(rows) == {"PQ32 plain", "PQ32x4 plain"}
    assert rows["PQ32 plain"]["bytes_per_key"] == 32 and rows["PQ32x4 plain"]["bytes_per_key"] == 16
    assert rows["PQ32x4 plain"]["relative_mse"] > rows["PQ32 plain"]["relative_mse"] > 0


def test_pq_compare_puts_residual_and_additive_codes_beside_pq(trained, tmp_path):
    """`eval pq-compare --variants rq,...`: residual (RQ) and additive (LSQ) codes of M whole-key codebooks,
    the same bytes as PQ with M subspaces, reconstruct the keys better than PQ does; the score-aware RQ is
    trained in the metric's whitened space and decodes back to keys; faiss's RQ codebooks serve through the
    core's beam search (the residual codec a bundle holds); LSQ cannot become a bundle."""
    import torch

    from dsaindex.errors import DsaIndexError
    from dsaindex.train.additive import AdditiveCodec
    from dsaindex.train.pq_job import PQOptions, train_pq, write_pq_bundle

    _, store, _, _, _ = trained
    out = tmp_path / "additive.json"
    proc = run_cli("eval", "pq-compare", str(store), "--subspaces", "4", "--centroids", "256,16", "--variants",
                   "plain,rq,rq-score-aware,lsq", "--trainer", "torch", "--iterations", "6", "--eval-queries", "8",
                   "--candidates", "64", "--max-train-keys", "2048", "--device", "cpu", "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())
    names = {f"{c}4{b} {v}" for c, v in (("PQ", "plain"), ("RQ", "plain"), ("RQ", "score-aware"), ("LSQ", "plain"))
             for b in ("", "x4")}
    assert set(rows) == names
    for bits, size in (("", 4), ("x4", 2)):
        pq, rq, lsq = rows[f"PQ4{bits} plain"], rows[f"RQ4{bits} plain"], rows[f"LSQ4{bits} plain"]
        assert pq["bytes_per_key"] == rq["bytes_per_key"] == lsq["bytes_per_key"] == size
        assert rq["relative_mse"] < pq["relative_mse"] and lsq["relative_mse"] < pq["relative_mse"]
        assert 0.0 < rows[f"RQ4{bits} score-aware"]["k32/direct"] <= 1.0
    opts = PQOptions(subspaces=4, centroids=16, quantizer="rq", score_aware=True, max_train_keys=1024,
                     max_eval_queries=8, candidates=(64,))
    report = train_pq(store, opts)
    codec = report["results"][0].additive
    assert isinstance(codec, AdditiveCodec) and codec.whiten is not None and codec.bytes_per_key == 2
    keys = torch.randn(50, codec.whiten.shape[0])
    served = report["results"][0].codec  # what a bundle stores and the runtime encodes with
    assert served.residual and served.codebooks.shape == (4, 16, 128) and served.metric.shape == (1, 128, 128)
    assert served.relative_mse(keys) == pytest.approx(codec.relative_mse(keys), rel=0.05)
    torch.testing.assert_close(keys @ codec.whiten @ codec.unwhiten, keys, atol=1e-3, rtol=1e-3)
    assert codec.encode(keys).shape == (50, 2)  # faiss packs two 4-bit codes a byte
    # the torch trainer's RQ: one byte a codebook in memory, the same 4-bit size on paper
    opts_torch = PQOptions(subspaces=4, centroids=16, quantizer="rq", score_aware=True, max_train_keys=1024,
                           max_eval_queries=8, candidates=(64,), trainer="torch", iterations=4)
    torch_result = train_pq(store, opts_torch)["results"][0]
    torch_codec = torch_result.additive
    assert torch_codec.bytes_per_key == 2 and torch_codec.encode(keys).shape == (50, 4)
    assert 0 < torch_result.metrics["relative_mse"] < 1  # held-out keys of the store
    with pytest.raises(DsaIndexError, match="comparison only"):
        write_pq_bundle(report, PQOptions(subspaces=4, quantizer="lsq"), tmp_path / "lsq")


def test_train_pq_opq_writes_a_bundle_that_loads_with_its_rotation_and_selects(trained, tmp_path):
    """`train pq --opq` (alias of --rotate): the default name says OPQ, every layer stores its rotation, the
    loader builds codecs with it, `eval pq` reproduces the training's recall from the bundle alone (it
    would not with the rotation dropped) and the runtime selects the exact top-k with every key a candidate."""
    import numpy as np
    import torch

    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.kernels.fp8_score import fp8_topk_reference
    from dsaindex.pipelines.capture.models import preset_config
    from dsaindex.quant import fp8_quantize
    from dsaindex.runtime import load_bundle
    from dsaindex.runtime.host_store import HostKeyStore
    from dsaindex.runtime.pq_batch import PQDecodeGroup
    from dsaindex.train.recall import layer_keys

    root, store, bundle, uri, result = trained
    proc = cli_in(tmp_path, "train", "pq", str(store), "--opq", *FAST)
    assert proc.returncode == 0, proc.stderr
    assert "bundle: runs/bundles/store-opq32-sa\n" in proc.stdout
    path = tmp_path / "runs/bundles/store-opq32-sa"
    manifest, arrays = read_bundle(path)
    assert manifest.params["rotate"] is True
    loaded = load_bundle(path, preset_config("tiny-v32"))
    for layer in manifest.layer_ids:
        assert manifest.layers[str(layer)].params["rotate"] is True
        rot = arrays[layer]["rotation"]
        assert rot.shape == (128, 128) and np.abs(rot @ rot.T - np.eye(128)).max() < 1e-4
        np.testing.assert_array_equal(loaded.layers[layer].rotation.numpy(), rot)
    again = run_cli("eval", "pq", str(path), "--store", str(store), "--eval-queries", "4", "--candidates", "64",
                    "--json")
    assert again.returncode == 0, again.stderr
    mean = json.loads(again.stdout)["mean"]
    assert mean["k32/direct"] == pytest.approx(manifest.metrics["mean/k32/direct"])
    assert mean["relative_mse"] == pytest.approx(manifest.metrics["mean/relative_mse"], rel=1e-4)
    assert mean["relative_mse"] < 0.5  # codes of rotated keys decoded without the rotation would be noise
    # a held-out sequence served by the loaded OPQ codec: every key a candidate, so the exact top-k
    captured = CaptureStore.open(store)
    keys = layer_keys(captured, 1, [4], captured.manifest.model.geometry.key_format)
    queries = captured.as_float(captured.queries(1)[:3])
    weights = torch.from_numpy(captured.head_weights(1)[:3]).float()
    group = PQDecodeGroup(loaded.layers[1], HostKeyStore(-(-keys.shape[0] // 64) * 3, 128), 3, keys.shape[0] + 64,
                          32, candidates=keys.shape[0], cache_capacity=-(-keys.shape[0] // 4) * 4, device="cpu",
                          use_triton=False)
    for slot in range(3):
        group.admit(slot)
        group.append(slot, keys)
    picked, _ = group.select(queries, weights)
    fp8, scales = fp8_quantize(keys)
    want = fp8_topk_reference(fp8.view(torch.uint8).expand(3, -1, -1), scales.reshape(1, -1).expand(3, -1),
                              torch.full((3,), keys.shape[0]), queries.to(torch.bfloat16).float(), weights, 32)[1]
    for got, exact in zip(picked.tolist(), want.tolist(), strict=True):
        assert len(set(got) & set(exact)) >= 31


def test_eval_warm_replays_decode_windows_through_the_runtime_cache(trained, monkeypatch):
    """`eval pq --warm`: the held-out decode windows step through the runtime's group. With every key a
    candidate the selection is the exact top-k; later steps find most candidates in the cache and fetch
    fewer than the first (cold) step. The replays run the kernels' torch references (the same algorithm;
    the kernels are checked against them in their own tests): interpreted Triton takes minutes here."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch path (read when the group is made)
    root, store, bundle, uri, result = trained
    proc = run_cli("eval", "pq", str(bundle), "--store", str(store), "--eval-queries", "4", "--candidates", "64",
                   "--warm", "--warm-candidates", "1024", "--cache", "1024", "--prefilter", "1", "--device", "cpu",
                   "--json")
    assert proc.returncode == 0, proc.stderr
    steady = json.loads(proc.stdout)["warm"]
    assert steady["windows"] == 2 and steady["steps_per_window"] == 16  # the capture's default windows
    for m in steady["per_layer"].values():
        assert m["warm_recall_rerank"] >= 0.99 and m["cold_recall_filter"] <= 1.0
        assert m["warm_hit_share"] > 0.5 and m["warm_fetch_share"] < m["cold_fetch_share"]
        assert len(m["fetch_share_by_step"]) == 16 and m["fetch_share_by_step"][0] == m["cold_fetch_share"]
    proc = run_cli("eval", "pq", str(bundle), "--store", str(store), "--eval-queries", "4", "--candidates", "64",
                   "--warm", "--warm-candidates", "64", "--cache", "128", "--prefilter", "2", "--device", "cpu",
                   "--filter-width", "1,1e9", "--json")
    small = json.loads(proc.stdout)["warm"]["mean"]
    assert small["warm_recall_rerank"] < steady["mean"]["warm_recall_rerank"]  # fewer candidates, less recall
    # one replay per filter width, the first the headline; a margin past every score's spread drops nothing:
    # the same selections as no filter at all, and more fetches than the default margin
    narrow, wide = small["by_width"]["1"], small["by_width"]["1e+09"]
    assert narrow["warm_recall_filter"] == small["warm_recall_filter"]
    assert wide["warm_recall_filter"] == small["warm_recall_rerank"] and wide["warm_filter_loss"] == 0
    assert wide["warm_fetch_share"] > narrow["warm_fetch_share"]
    # C grown past a band below every window's prefix: each step keeps its grown C and rescores every candidate
    # (its filter run selects as its no-filter run), more recall than the fixed C, the cache sized for the growth
    # still holding most of a step's candidates the next step
    proc = run_cli("eval", "pq", str(bundle), "--store", str(store), "--eval-queries", "4", "--candidates", "64",
                   "--warm", "--warm-candidates", "64", "--cache", "128", "--prefilter", "2", "--device", "cpu",
                   "--grow-band", "128", "--json")
    assert proc.returncode == 0, proc.stderr
    grown = json.loads(proc.stdout)["warm"]
    assert grown["grow_band"] == 128 and grown["mean"]["mean_prefix"] > 256
    assert grown["mean"]["warm_recall_filter"] == grown["mean"]["warm_recall_rerank"] > small["warm_recall_rerank"]
    assert grown["mean"]["warm_filter_loss"] == 0
    assert grown["mean"]["warm_fetch_share"] < 0.5 * grown["mean"]["cold_fetch_share"]
    proc = run_cli("eval", "pq", str(bundle), "--store", str(store), "--eval-queries", "4", "--warm",
                   "--device", "cpu", "--filter-width", "1,-2")
    assert proc.returncode != 0 and "--filter-width" in proc.stderr and "Traceback" not in proc.stderr


def test_score_aware_metric_reads_each_sequence_once_and_matches_a_per_query_prefix(trained):
    """The metric reads a sequence's keys once and slices each query's causal prefix from them. It must
    match the metric built from each query's own prefix, read and quantized alone."""
    import numpy as np
    import torch

    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.pq import PQSpec
    from dsaindex.train.pq_job import metric_for_layer, metric_for_layer_reference, metric_rows

    _, store_path, _, _, _ = trained
    store = CaptureStore.open(store_path)
    key_format = store.manifest.model.geometry.key_format
    spec, topk, layer, train = PQSpec(dim=128, subspaces=32), 32, 1, [0, 2, 3]
    seq_of = store.array("query_sequence").astype(np.int64)
    assert set(seq_of[metric_rows(store, train, 40)]) == set(train)  # every training sequence, no other
    got = metric_for_layer(store, layer, train, key_format, spec, 40, topk)
    want = metric_for_layer_reference(store, layer, train, key_format, spec, 40, topk)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
