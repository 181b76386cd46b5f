"""``dsaindex bench pq-job`` at a tiny size on the CPU: the store it builds, the job's timing report, the
clean-up of its work folder, and its refusals of input no job can train on."""

import json

import pytest
import torch

from helpers import run_cli

TINY = ("--queries-per-seq", "16", "--subspaces", "8", "--iterations", "3", "--eval-queries", "8",
        "--max-train-keys", "4096", "--device", "cpu")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("benchpqjob")
    work, out = root / "work", root / "report.json"
    proc = run_cli("bench", "pq-job", "--layers", "2", "--keys", "8192", "--seq-len", "4096", *TINY,
                   "--quantizer", "pq,rq", "--work-dir", str(work), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return work, json.loads(proc.stdout), json.loads(out.read_text())


def test_report_times_every_layer_of_the_whole_job(tiny_run):
    work, report, written = tiny_run
    assert written == report
    assert report["layers"] == 2 and report["sequences"] == 2 and report["keys_per_layer"] == 8192
    assert 0 < report["queries_per_layer"] <= 2 * 16
    assert report["device"] == "cpu" and report["options"]["label"] == "OPQ8" and report["options"]["score_aware"]
    store = report["store"]
    assert store["bytes"] > store["key_bytes"] > 2 * 8192 * 128  # bf16 keys hardly compress
    assert store["seconds"] >= store["generate_seconds"] + store["write_seconds"] > 0
    job = report["job"]
    for spread in (job["train_seconds_per_layer"], job["wall_seconds_per_layer"]):
        assert 0 < spread["mean"] <= spread["max"] and 0 < spread["median"] <= spread["max"]
    assert job["wall_seconds_per_layer"]["max"] >= job["train_seconds_per_layer"]["max"]
    phases = job["phases"]
    assert {"reading keys", "score-aware metric", "k-means", "held-out recall", "plots and bundle"} <= set(phases)
    assert all(s >= 0 for s in phases.values())
    assert sum(phases.values()) == pytest.approx(job["seconds"], abs=0.01)
    assert job["evaluation_seconds"] == pytest.approx(phases["held-out recall"], abs=0.002)
    assert 0 < job["training_seconds"] < job["seconds"]
    assert job["target_seconds"] == 300 and job["target_met"] is True  # a 2-layer toy job, far under 5 minutes
    assert job["peak_gpu_bytes"] is None and job["bundle"] is None and store["path"] is None


def test_each_quantizer_is_timed_on_the_one_store(tiny_run):
    report = tiny_run[1]
    runs = report["runs"]
    assert [r["options"]["label"] for r in runs] == ["OPQ8", "RQ8"]  # OPQ: train pq's default for product codes
    assert runs[0]["job"] == report["job"] and runs[0]["recall_mean"] == report["recall_mean"]
    rq = runs[1]["job"]
    assert {"reading keys", "score-aware metric", "RQ", "held-out recall"} <= set(rq["phases"])
    assert sum(rq["phases"].values()) == pytest.approx(rq["seconds"], abs=0.01)
    assert runs[1]["options"]["quantizer"] == "rq" and 0 < runs[1]["recall_mean"]["k512/direct"] <= 1


def test_recall_comes_from_held_out_queries(tiny_run):
    recall = tiny_run[1]["recall_mean"]
    assert recall["k512/queries"] > 0  # queries of the held-out sequence with a 2,048-key prefix
    rates = {name: v for name, v in recall.items() if name.split("/")[-1].split("@")[0] in ("direct", "rerank",
                                                                                             "filter", "fetch")}
    assert "k512/direct" in rates and "k512/rerank@2048" in rates
    assert all(0.0 <= v <= 1.0 for v in rates.values()), rates
    assert not any("@" in name.split("/")[0] for name in recall)  # overall means, not per prefix band
    assert 0 < recall["relative_mse"] < 1


def _source_store(path):
    """A 2-sequence store of a 32-head x 128 indexer (GLM-5's shape): float32 keys, sampled queries."""
    import numpy as np

    from dsaindex.artifacts.capture_store import CaptureSettings, CaptureStore, SequenceBatch, new_manifest
    from dsaindex.artifacts.fingerprint import ModelFingerprint
    from dsaindex.geometry import IndexerGeometry

    geometry = IndexerGeometry(family="glm_moe_dsa", num_layers=3, indexer_layers=(2,), n_heads=32, head_dim=128,
                               topk=2048, rope_dim=64, rope_layout="interleaved_head")
    model = ModelFingerprint(name="hand/glm5-shape", family="glm_moe_dsa", geometry=geometry, config_digest="c0",
                             weights_digest="fedcba9876543210", dtype="bfloat16")
    settings = CaptureSettings(seq_len=700, chunk_len=700, basis="raw", key_dtype="float32")
    rng = np.random.default_rng(0)
    with CaptureStore.create(path, new_manifest(model, settings, {"sources": ["x"]}, "tok")) as store:
        store.append(SequenceBatch(
            sequence_tokens=[700, 700], sequence_keys=[700, 700], sequence_queries=[5, 5],
            tokens=[np.zeros(1400)], query_position=[np.arange(5) * 100] * 2,
            query_sequence=[np.zeros(5), np.ones(5)], query_window=[-np.ones(5)] * 2,
            keys={2: [rng.standard_normal((1400, 128)).astype(np.float32)]},
            queries={2: [rng.standard_normal((10, 32, 128)).astype(np.float32)]},
            head_weights={2: [rng.random((10, 32)).astype(np.float32)]}))
    return CaptureStore.open(path)


def test_a_kept_store_tiles_a_real_store_and_passes_its_checks(tiny_run, tmp_path):
    assert list(tiny_run[0].iterdir()) == []  # the first run removed its work folder
    source = _source_store(tmp_path / "source")
    work = tmp_path / "work"
    proc = run_cli("bench", "pq-job", "--layers", "2", "--keys", "2048", "--seq-len", "1024", "--plain", *TINY,
                   "--store", str(source.path), "--work-dir", str(work), "--keep-store")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["source"].startswith(f"{source.path} layer 2 tiled")
    from dsaindex.artifacts.bundle import read_bundle
    from dsaindex.artifacts.capture_store import CaptureStore

    store = CaptureStore.open(report["store"]["path"])  # the manifest and arrays pass the store's checks
    assert store.path.parent.parent == work
    geometry = store.manifest.model.geometry
    assert (geometry.family, geometry.indexer_layers, geometry.n_heads, geometry.head_dim, geometry.topk) == (
        "deepseek_v32", (0, 1), 64, 128, 2048)
    assert geometry.key_format == "fp8_e4m3_ue8m0" and store.manifest.settings.key_dtype == "bfloat16"
    assert store.manifest.settings.basis == "raw"  # the source store's basis
    assert store.committed.sequences == 2 and store.keys(1).shape == (2048, 128) and store.verify() > 0
    # every key is a source key plus 1% noise (and bf16 rounding)
    keys, base = store.as_float(store.keys(1)), source.as_float(source.keys(2))
    nearest = torch.cdist(keys, base).min(1).values
    assert float(nearest.max()) < 0.05 * 128**0.5
    # 32 source heads repeated to 64, their weights halved: every score stays the source's
    queries, weights = store.as_float(store.queries(0)), store.head_weights(0)
    assert queries.shape[1:] == (64, 128) and weights.shape[1] == 64
    assert float((queries[:, :32] - queries[:, 32:]).abs().max()) < 0.1
    assert (weights[:, :32] == weights[:, 32:]).all() and weights.max() <= 0.5
    manifest, arrays = read_bundle(report["job"]["bundle"])
    assert manifest.layer_ids == [0, 1] and arrays[0]["codebooks"].shape == (8, 256, 16)
    assert manifest.lineage.capture_store_id == store.manifest.store_id


@pytest.mark.parametrize("args, message", [
    (("--keys", "10000", "--seq-len", "4096"), "is not a multiple of --seq-len"),
    (("--keys", "4096", "--seq-len", "4096"), "needs 2 or more"),
    (("--keys", "1024", "--seq-len", "512"), "too few for 256 centroids"),
    (("--keys", "8192", "--seq-len", "4096", "--quantizer", "lsq"), "--quantizer 'lsq'"),
    (("--keys", "8192", "--seq-len", "4096", "--quantizer", "rq", "--rotate"), "take no OPQ rotation"),
    (("--keys", "8192", "--seq-len", "4096", "--store", "/nonexistent/store"), "No capture store"),
])
def test_bad_input_is_refused_before_anything_is_written(tmp_path, args, message):
    proc = run_cli("bench", "pq-job", "--layers", "2", *args, "--device", "cpu", "--work-dir", str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and message in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_job_over_its_target_says_so(tmp_path):
    out = tmp_path / "report.json"
    proc = run_cli("bench", "pq-job", "--layers", "1", "--keys", "8192", "--seq-len", "4096", *TINY,
                   "--target-seconds", "0.001", "--work-dir", str(tmp_path / "work"), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    job = json.loads(out.read_text())["job"]
    assert job["target_seconds"] == 0.001 and job["target_met"] is False
