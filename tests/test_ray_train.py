"""Per-layer training and evaluation on Ray (``ray=`` of ``train pq`` / ``train ivf`` / ``eval``, and ``bench
pq-job --ray``): one bundle, bit for bit the serial job's at the same thread count, a killed worker retried,
progress per layer, clear errors for a missing Ray and an unreachable cluster.

The module starts a local cluster of 2 CPUs and stops it after; every Ray worker it starts runs a setup
hook that makes a layer's worker kill itself (SIGKILL) on its first attempt when the test arms that layer.
"""

import sys

import numpy as np
import pytest
import torch

from dsaindex.errors import DsaIndexError
from helpers import run_cli

FAST = {"subspaces": 32, "iterations": 4, "max_train_keys": 2048, "metric_queries": 64, "max_eval_queries": 8,
        "candidates": (64,), "device": "cpu"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local Ray cluster of 2 CPUs for the module; yields the folder where tests arm a layer's worker to
    die (``kill-<layer>``) and find whether it did (``killed-<layer>``, holding the killed worker's pid)."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ray>=2.60')")
    arm = tmp_path_factory.mktemp("kill")

    def kill_armed_layers():  # runs in each worker as it starts (pickled by value: a nested function)
        import os

        from dsaindex.train import pq_job

        train_layer = pq_job.train_layer

        def dying(store, layer, *args, **kwargs):
            armed, killed = arm / f"kill-{layer}", arm / f"killed-{layer}"
            if armed.exists() and not killed.exists():
                killed.write_text(str(os.getpid()))
                os.kill(os.getpid(), 9)
            return train_layer(store, layer, *args, **kwargs)

        pq_job.train_layer = dying

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": kill_armed_layers})
    yield arm
    ray.shutdown()


@pytest.fixture(scope="module")
def serial_pq(routing_store, tmp_path_factory):
    """The serial PQ32 bundle of the shared store, trained at one thread (as each Ray task is)."""
    from dsaindex.train.cluster import pinned_threads
    from dsaindex.train.pq_job import PQOptions, run_pq_job

    out = tmp_path_factory.mktemp("serial") / "bundle"
    with pinned_threads(1):
        run_pq_job(routing_store, PQOptions(**FAST), out=out, register=False)
    return out


def _codes(bundle, store):
    """Codes of the first 512 keys of every layer under the bundle's codecs: layer -> uint8 tensor."""
    from dsaindex.artifacts.bundle import read_bundle
    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.runtime.loader import place_layers

    manifest, arrays = read_bundle(bundle)
    store = CaptureStore.open(store)
    return {layer: codec.encode(store.as_float(store.keys(layer)[:512]))
            for layer, codec in place_layers(manifest, arrays).items()}


def test_the_bundle_trained_on_ray_is_the_serial_one(cluster, routing_store, serial_pq, tmp_path):
    from dsaindex.artifacts.bundle import read_bundle
    from dsaindex.train.cluster import bundle_differences
    from dsaindex.train.pq_job import PQOptions, run_pq_job

    events = []
    result = run_pq_job(routing_store, PQOptions(**FAST), out=tmp_path / "ray", register=False,
                        progress=lambda done, total, text: events.append((done, total, text)), ray="auto")
    assert bundle_differences(serial_pq, tmp_path / "ray") == []
    (serial, serial_arrays), (ray, ray_arrays) = read_bundle(serial_pq), read_bundle(tmp_path / "ray")
    assert ray.layer_ids == serial.layer_ids == [0, 1, 2, 3]
    for layer in serial.layer_ids:
        for name in ("codebooks", "metric"):
            assert np.array_equal(ray_arrays[layer][name], serial_arrays[layer][name]), (layer, name)
    assert ray.metrics == serial.metrics  # held-out recall, evaluated on the workers
    serial_codes, ray_codes = _codes(serial_pq, routing_store), _codes(tmp_path / "ray", routing_store)
    assert all(torch.equal(ray_codes[layer], serial_codes[layer]) for layer in serial.layer_ids)
    # progress: once before any layer is done, once per layer as it arrives, then done
    assert events[0][:2] == (0, 4) and "Ray node" in events[0][2]
    finished = [text.split(":")[0] for _, _, text in events if text.endswith(" s)")]
    assert sorted(finished) == ["layer 0", "layer 1", "layer 2", "layer 3"]
    assert [done for done, _, _ in events[1:-1]] == [1, 2, 3, 4] and events[-1] == (4, 4, "done")
    workers = result.as_dict()["workers"]  # where each layer ran, in `train pq --json`
    assert sorted(workers) == ["0", "1", "2", "3"]
    assert {w["device"] for w in workers.values()} == {"cpu"} and {w["threads"] for w in workers.values()} == {1}


@pytest.mark.parametrize("variant", [{"rotate": True, "centroids": 16, "trainer": "torch"},
                                     {"quantizer": "rq", "subspaces": 4, "trainer": "torch"}], ids=["opq", "rq"])
def test_rotations_and_residual_codes_come_back_bit_for_bit(cluster, routing_store, tmp_path, variant):
    from dsaindex.train.cluster import bundle_differences, pinned_threads
    from dsaindex.train.pq_job import PQOptions, train_pq, write_pq_bundle

    opts = PQOptions(**FAST | variant)
    with pinned_threads(1):
        serial = train_pq(routing_store, opts)
    on_ray = train_pq(routing_store, opts, ray="auto")
    for layer, r in serial["results"].items():
        mine = on_ray["results"][layer]
        assert torch.equal(mine.codec.codebooks, r.codec.codebooks) and torch.equal(mine.codec.metric, r.codec.metric)
        assert mine.codec.residual == r.codec.residual and mine.metrics == r.metrics
        if opts.rotate:
            assert torch.equal(mine.codec.rotation, r.codec.rotation)
    write_pq_bundle(serial, opts, tmp_path / "serial")
    write_pq_bundle(on_ray, opts, tmp_path / "ray")
    assert bundle_differences(tmp_path / "serial", tmp_path / "ray") == []


def test_a_killed_worker_is_retried_and_the_bundle_is_still_the_serial_one(cluster, routing_store, serial_pq,
                                                                           tmp_path):
    from dsaindex.train.cluster import RaySettings, bundle_differences
    from dsaindex.train.pq_job import PQOptions, run_pq_job, train_pq

    (cluster / "kill-2").touch()
    result = run_pq_job(routing_store, PQOptions(**FAST), out=tmp_path / "ray", register=False, ray="auto")
    killed = cluster / "killed-2"
    assert killed.exists(), "layer 2's first worker was not killed"
    assert result.report["results"][2].worker["pid"] != int(killed.read_text())  # a new worker ran it again
    assert bundle_differences(serial_pq, tmp_path / "ray") == []
    # without retries the job stops with the layer named
    (cluster / "kill-1").touch()
    with pytest.raises(DsaIndexError) as err:
        train_pq(routing_store, PQOptions(**FAST), ray=RaySettings(retries=0))
    assert "Layer 1's Ray worker was lost on its 1 attempt" in err.value.problem and "memory" in err.value.fix


def test_ivf_training_and_evaluation_on_ray_equal_the_serial_ones(cluster, routing_store, tmp_path):
    from dsaindex.artifacts.kinds import IVFIndexSettings
    from dsaindex.train.cluster import bundle_differences, pinned_threads
    from dsaindex.train.ivf import IVFOptions
    from dsaindex.train.ivf_job import evaluate_bundle, run_ivf_job

    opts = IVFOptions(IVFIndexSettings(window=256, cluster_size=32, refit_every=512), steps=10, device="cpu")
    budgets, common = [256, 512], {"register": False, "layers": [0, 2]}
    with pinned_threads(1):
        serial = run_ivf_job(routing_store, opts, budgets, 8, out=tmp_path / "serial", **common)
        serial_eval = evaluate_bundle(tmp_path / "serial", routing_store, budgets, 8)
    events = []
    on_ray = run_ivf_job(routing_store, opts, budgets, 8, out=tmp_path / "ray", ray="auto",
                         progress=lambda *event: events.append(event), **common)
    assert bundle_differences(tmp_path / "serial", tmp_path / "ray") == []
    assert on_ray["mean"] == serial["mean"] and on_ray["per_layer"]["2"]["worker"]["threads"] == 1
    assert [done for done, _, _ in events] == [0, 1, 2, 2] and events[-1] == (2, 2, "done")
    ray_eval = evaluate_bundle(tmp_path / "serial", routing_store, budgets, 8, ray="auto")
    assert ray_eval["per_layer"] == serial_eval["per_layer"] and ray_eval["mean"] == serial["mean"]


def test_pq_evaluation_on_ray_equals_the_serial_one(cluster, routing_store, serial_pq):
    from dsaindex.train.cluster import pinned_threads
    from dsaindex.train.pq_job import PQOptions, evaluate_bundle

    with pinned_threads(1):
        serial = evaluate_bundle(serial_pq, routing_store, PQOptions(**FAST))
    events = []
    on_ray = evaluate_bundle(serial_pq, routing_store, PQOptions(**FAST), ray="auto",
                             progress=lambda *event: events.append(event))
    assert on_ray["per_layer"] == serial["per_layer"] and list(on_ray["per_layer"]) == [0, 1, 2, 3]
    assert events[-1] == (4, 4, "done") and len(events) == 6


def test_an_unreachable_cluster_is_refused_with_the_fix(routing_store):
    import socket

    pytest.importorskip("ray", reason="Ray is not installed (pip install 'ray>=2.60')")
    from dsaindex.train.pq_job import PQOptions, train_pq

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(DsaIndexError) as err:
        train_pq(routing_store, PQOptions(**FAST), ray=f"127.0.0.1:{port}")
    assert err.value.problem.startswith(f"No Ray cluster answers at 127.0.0.1:{port} within 10 s")
    assert "ray start --head" in err.value.fix and "--ray auto" in err.value.fix
    with pytest.raises(DsaIndexError, match="is not a cluster address"):
        train_pq(routing_store, PQOptions(**FAST), ray="head-node")


def test_a_missing_ray_names_the_install(routing_store, monkeypatch):
    from dsaindex.train.pq_job import PQOptions, train_pq

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(DsaIndexError) as err:
        train_pq(routing_store, PQOptions(**FAST), ray="auto")
    assert "not installed" in err.value.problem and "pip install 'ray>=" in err.value.fix


def test_bench_times_each_worker_count_and_compares_the_bundles(cluster, tmp_path):
    import json

    proc = run_cli("bench", "pq-job", "--layers", "2", "--keys", "8192", "--seq-len", "4096", "--queries-per-seq",
                   "16", "--subspaces", "8", "--iterations", "3", "--eval-queries", "8", "--max-train-keys", "4096",
                   "--device", "cpu", "--ray", "auto", "--workers", "1,2", "--work-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["job"]["threads"] == 1  # the serial reference runs at the tasks' thread count
    scaling = report["ray"]
    assert scaling["threads_per_task"] == 1 and scaling["serial_seconds"] == report["job"]["seconds"]
    runs = scaling["runs"]
    assert [r["workers"] for r in runs] == [1, 2]
    assert all(r["bundle_equals_serial"] and r["differences"] == [] for r in runs), runs
    assert runs[0]["scaling_efficiency"] == 1.0 and all(r["scaling_efficiency"] > 0 for r in runs)
    for r in runs:
        assert r["seconds"] > 0 and 0 < r["layer_seconds"]["mean"] <= r["layer_seconds"]["max"]
        assert r["devices"] == ["cpu"] and r["processes"] >= 1 and r["speedup_vs_serial"] > 0
    assert list(tmp_path.iterdir()) == []  # the work folder is removed


def test_bench_without_the_serial_job_compares_each_run_with_the_first(cluster, tmp_path):
    """``--no-serial`` skips the job without Ray: no top-level job timing, each Ray bundle compared with the
    first Ray run's (equal: same thread count), the first run's recall reported."""
    import json

    proc = run_cli("bench", "pq-job", "--layers", "2", "--keys", "8192", "--seq-len", "4096", "--queries-per-seq",
                   "16", "--subspaces", "8", "--iterations", "3", "--eval-queries", "8", "--max-train-keys", "4096",
                   "--device", "cpu", "--ray", "auto", "--workers", "1,2", "--no-serial", "--work-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert "job" not in report and report["options"]["label"] == "OPQ8"
    scaling = report["ray"]
    assert scaling["serial_seconds"] is None and 0 < scaling["recall_mean"]["k512/direct"] <= 1
    runs = scaling["runs"]
    assert [r["workers"] for r in runs] == [1, 2]
    assert all(r["bundle_equals_first"] and "speedup_vs_serial" not in r for r in runs), runs
    assert runs[0]["speedup_vs_first"] == 1.0 and runs[1]["speedup_vs_first"] > 0


def test_the_cli_hands_ray_to_the_jobs(routing_store, tmp_path):
    """``--ray`` on train pq / eval pq / train ivf reaches the layer fan-out: an address nothing answers at is
    refused by each command with the fix, exit 2, and no bundle is written."""
    import socket

    pytest.importorskip("ray", reason="Ray is not installed (pip install 'ray>=2.60')")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for args in (["train", "pq", str(routing_store), "--out", str(tmp_path / "pq"), "--no-register"],
                 ["train", "ivf", str(routing_store), "--out", str(tmp_path / "ivf"), "--no-register"]):
        proc = run_cli(*args, "--ray", f"127.0.0.1:{port}")
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert f"No Ray cluster answers at 127.0.0.1:{port}" in proc.stderr + proc.stdout
        assert "ray start --head" in proc.stderr + proc.stdout
    assert not (tmp_path / "pq").exists() and not (tmp_path / "ivf").exists()
