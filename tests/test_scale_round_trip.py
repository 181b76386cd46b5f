"""The scale-out pieces together, as a team runs them: one round trip through the command line against real
services that the fixtures start and stop.

capture a store into S3 (moto's server, ``s3_endpoint``) -> ``store info`` on it -> ``train pq --ray auto`` on a
local Ray cluster of 2 CPUs, reading the store from S3 and writing the bundle to S3 (and the same training
serially, for comparison) -> ``registry register`` on a shared MLflow tracking server (PostgreSQL backend store,
``postgres_cluster``; S3 artifact root; clients upload straight to S3) -> ``registry pull`` of the version and
``models:/NAME@candidate`` into fresh folders -> ``runtime check`` against the served model (and against another
model, refused with the fix) -> the server-side load (:func:`dsaindex.runtime.serving.serve_index`) of
``models:/NAME@candidate``, decoding a few tokens through it.

The commands run from an empty working folder, so anything written locally by mistake (a folder named
``s3:``, an ``mlruns``) shows. Every test here starts real processes (``slow``).
"""

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
import torch

from helpers import run_cli, run_cli_in_process

pytestmark = pytest.mark.slow

MODEL = "preset:tiny-v32"
OTHER_MODEL = "preset:tiny-v4"  # another family and geometry: its config does not fit the bundle
SEQUENCES = 4
# the demo's corpus (the Python stdlib sources) on the tiny preset, short sequences
CAPTURE = ("-m", MODEL, "-n", str(SEQUENCES), "--seq-len", "384", "--chunk-len", "192", "--no-progress", "--json")
TRAIN = ("--subspaces", "16", "--iterations", "3", "--max-train-keys", "1024", "--eval-queries", "8",
         "--candidates", "64,128", "--device", "cpu", "--no-register", "--json")
RECALL_TARGET = "0.5"  # what `runtime check` asks of the recorded recall: a tiny store, a loose target
# MLflow client settings of the caller that would point the commands elsewhere than the module's server
_MLFLOW_VARS = ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD",
                "MLFLOW_REGISTRY_URI")


# ---- the services ----------------------------------------------------------------------------------
def _s3_client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint)


def bucket_objects(endpoint: str, bucket: str, prefix: str = "") -> dict[str, int]:
    """Every object of ``bucket`` under ``prefix``, listed with boto3 (not through dsaindex's own storage
    layer): key relative to the prefix -> size."""
    pages = _s3_client(endpoint).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"][len(prefix):]: o["Size"] for page in pages for o in page.get("Contents", [])}


def object_bytes(endpoint: str, bucket: str, key: str) -> bytes:
    return _s3_client(endpoint).get_object(Bucket=bucket, Key=key)["Body"].read()


@pytest.fixture(scope="module")
def bucket(s3_endpoint) -> str:
    """A bucket of its own for the module (made with boto3): the store, the bundles and MLflow's artifacts."""
    pytest.importorskip("boto3", reason="boto3 is not installed (pip install boto3)")
    name = f"dsa-trip-{uuid.uuid4().hex[:8]}"
    _s3_client(s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="module")
def ray_cluster(s3_endpoint):
    """A local Ray cluster of 2 CPUs for the module (layer tasks take one CPU each: 2 at a time at most).
    Started after the S3 endpoint's variables are set, so that its workers reach the same endpoint; the
    commands run in this process keep this connection (``--ray auto`` with Ray already started)."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ray>=2.60')")
    assert not ray.is_initialized(), "a Ray connection was left open by an earlier module"
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


class TrackingServer:
    """``mlflow server`` over a new PostgreSQL database and the artifact root ``s3://<bucket>/mlflow``
    (``--no-serve-artifacts``: clients put bundles into S3 themselves), in a process group of its own."""

    def __init__(self, postgres_cluster, bucket: str, folder):
        self.pg = postgres_cluster
        self.db = f"mlflow_{uuid.uuid4().hex[:8]}"
        self.artifact_root = f"s3://{bucket}/mlflow"
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", postgres_cluster.create_database(self.db),
               "--default-artifact-root", self.artifact_root, "--no-serve-artifacts", "--host", "127.0.0.1",
               "--port", str(self.port), "--workers", "1"]
        env = {k: v for k, v in os.environ.items() if k not in _MLFLOW_VARS}
        env["PYTHONWARNINGS"] = "ignore"
        self.log = folder / "server.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 180
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"mlflow server did not start at {self.url}: {self.log.read_text()[-3000:]}")
            time.sleep(0.25)

    def _healthy(self) -> bool:
        try:
            with contextlib.closing(http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)) as conn:
                conn.request("GET", "/health")
                return conn.getresponse().status == 200
        except OSError:
            return False

    def query(self, sql: str, *args) -> list[tuple]:
        """Rows of the server's backend store, read straight from PostgreSQL."""
        return self.pg.query(self.db, sql, *args)

    def stop(self) -> None:
        for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait_s)
                break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # workers left behind by a server that exited first


@pytest.fixture(scope="module")
def tracking_server(postgres_cluster, s3_endpoint, bucket, tmp_path_factory):
    pytest.importorskip("mlflow", reason="MLflow is not installed")
    server = TrackingServer(postgres_cluster, bucket, tmp_path_factory.mktemp("mlflow-server"))
    try:
        yield server
    finally:
        server.stop()


# ---- the round trip --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trip(s3_endpoint, bucket, ray_cluster, tracking_server, tmp_path_factory):
    """Every command of the round trip, in order, from an empty working folder; each must exit 0 (the
    mismatched check is the tests'). Returns what the tests look at."""
    from dsaindex.train.cluster import pinned_threads

    root = tmp_path_factory.mktemp("trip")
    work, cache = root / "cwd", root / "cache"
    work.mkdir()
    store, ray_bundle = f"s3://{bucket}/captures/tiny.zarr", f"s3://{bucket}/bundles/tiny-pq16"
    serial_bundle, pulled = root / "serial-pq16", root / "pulled" / "candidate"
    url = tracking_server.url
    out: dict = {"root": root, "work": work, "cache": cache, "store": store, "ray_bundle": ray_bundle,
                 "serial_bundle": serial_bundle, "pulled": pulled, "url": url, "bucket": bucket}

    def ok(step: str, proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
        assert proc.returncode == 0, (f"{step}: {proc.args} exited {proc.returncode}\n{proc.stdout[-3000:]}\n"
                                      f"{proc.stderr[-3000:]}")
        return proc

    with pytest.MonkeyPatch.context() as mp:
        for key in _MLFLOW_VARS:
            mp.delenv(key, raising=False)
        mp.chdir(work)
        out["capture"] = json.loads(ok("capture", run_cli("capture", store, *CAPTURE)).stdout)
        out["info"] = json.loads(ok("store info", run_cli("store", "info", store, "--json")).stdout)
        # in this process: the command keeps the module's 2-CPU cluster (a subprocess would start one of
        # every core); each layer task runs on one thread
        out["ray"] = json.loads(ok("train pq --ray", run_cli_in_process(
            "train", "pq", store, "--out", ray_bundle, "--ray", "auto", *TRAIN)).stdout)
        with pinned_threads(1):  # the serial job at the tasks' thread count: its sums add up in the same order
            out["serial"] = json.loads(ok("train pq (serial)", run_cli_in_process(
                "train", "pq", store, "--out", str(serial_bundle), *TRAIN)).stdout)
        out["register"] = ok("registry register", run_cli("registry", "register", ray_bundle, "--tracking-uri", url))
        name = out["register"].stdout.split()[0]
        out["name"], out["models_uri"] = name, f"models:/{name}@candidate"
        out["list"] = json.loads(ok("registry list", run_cli("registry", "list", "--name", name, "--json",
                                                              "--tracking-uri", url)).stdout)
        out["show"] = json.loads(ok("registry show", run_cli("registry", "show", name, "@candidate", "--json",
                                                              "--tracking-uri", url)).stdout)
        out["pull"] = ok("registry pull", run_cli("registry", "pull", name, "@candidate", str(pulled),
                                                  "--tracking-uri", url))
        mp.setenv("DSAINDEX_CACHE", str(cache))  # a fresh cache: models:/ is pulled into it
        out["check"] = json.loads(ok("runtime check", run_cli(
            "runtime", "check", "-m", MODEL, "-a", out["models_uri"], "--tracking-uri", url,
            "--recall-target", RECALL_TARGET, "--json")).stdout)
        out["mismatch"] = run_cli("runtime", "check", "-m", OTHER_MODEL, "-a", str(pulled))
        out["cwd_after"] = sorted(os.listdir(work))
    return out


def _bundle_arrays(bundle):
    from dsaindex.artifacts.bundle import read_bundle

    return read_bundle(bundle)


def _codes(bundle, store) -> dict[int, torch.Tensor]:
    """The codes of every layer's first 512 store keys under the bundle's codecs: layer -> uint8 tensor."""
    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.runtime.loader import place_layers

    manifest, arrays = _bundle_arrays(bundle)
    opened = CaptureStore.open(store)
    return {layer: codec.encode(opened.as_float(opened.keys(layer)[:512]))
            for layer, codec in place_layers(manifest, arrays).items()}


# ---- the checks ------------------------------------------------------------------------------------
def test_the_bucket_holds_the_store_and_the_bundles_and_nothing_was_written_locally(trip, s3_endpoint):
    from dsaindex.artifacts.capture_store import CaptureStore

    layers = CaptureStore.open(trip["store"]).layers
    assert layers, "the store records no indexer layer"
    store_keys = bucket_objects(s3_endpoint, trip["bucket"], "captures/tiny.zarr/")
    assert "zarr.json" in store_keys
    for layer in layers:
        for array in ("keys", "queries", "head_weights"):
            assert f"layers/{layer}/{array}/zarr.json" in store_keys, (layer, array, sorted(store_keys))
            # chunks, not only metadata
            assert any(k.startswith(f"layers/{layer}/{array}/c/") and size > 0 for k, size in store_keys.items()), \
                (layer, array)
    bundle_keys = bucket_objects(s3_endpoint, trip["bucket"], "bundles/tiny-pq16/")
    assert "zarr.json" in bundle_keys
    for layer in layers:
        assert f"layers/{layer}/codebooks/zarr.json" in bundle_keys
        assert any(k.startswith(f"layers/{layer}/codebooks/c") for k in bundle_keys), sorted(bundle_keys)
    # the registered version's files, put into the server's S3 artifact root by the client, are the bundle's
    model_id = trip["list"][0]["model_id"]
    logged = {k: k.split("/artifacts/", 1)[1] for k in bucket_objects(s3_endpoint, trip["bucket"], "mlflow/")
              if f"/models/{model_id}/artifacts/" in k}
    assert sorted(logged.values()) == sorted(bundle_keys)
    for key, relative in logged.items():
        assert object_bytes(s3_endpoint, trip["bucket"], "mlflow/" + key) == \
            object_bytes(s3_endpoint, trip["bucket"], "bundles/tiny-pq16/" + relative), relative
    # nothing local: no folder named after the scheme, no MLflow store, no default bundle folder
    assert trip["cwd_after"] == [], trip["cwd_after"]
    assert not [p for p in trip["root"].rglob("s3:*")], "a local path named after s3: was written"


def test_capture_and_store_info_through_s3(trip):
    capture, info = trip["capture"], trip["info"]
    assert capture["capture"]["sequences_added"] == SEQUENCES and capture["capture"]["resumed_from"] == 0
    assert info["path"] == trip["store"]
    assert info["committed"] == capture["store"]["committed"] and info["committed"]["sequences"] == SEQUENCES
    assert info["verified_chunks"] > 0  # every committed chunk read back from S3 with its checksum
    assert info["key_bytes_on_disk"] > 0 and info["bytes_on_disk"] > info["key_bytes_on_disk"]


def test_the_ray_bundle_is_the_serial_one_and_the_registry_gives_it_back(trip):
    from dsaindex.artifacts.bundle import read_manifest
    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.train.cluster import bundle_differences

    ray, serial = trip["ray"], trip["serial"]
    layers = CaptureStore.open(trip["store"]).layers
    assert ray["bundle"] == trip["ray_bundle"] and serial["bundle"] == str(trip["serial_bundle"])
    # the layers ran as Ray tasks, one thread each; the serial job had none
    assert sorted(ray["workers"], key=int) == [str(layer) for layer in layers]
    assert {w["device"] for w in ray["workers"].values()} == {"cpu"}
    assert {w["threads"] for w in ray["workers"].values()} == {1}
    assert "workers" not in serial
    assert trip["pull"].stdout.strip() == str(trip["pulled"])
    cached = trip["cache"] / "bundles" / trip["name"] / "v1"  # where `runtime check` pulled models:/ to
    bundles = {"ray (s3)": trip["ray_bundle"], "serial": trip["serial_bundle"], "pulled": trip["pulled"],
               "models:/ cache": cached}
    arrays = {what: _bundle_arrays(where)[1] for what, where in bundles.items()}
    for what, named in arrays.items():
        assert sorted(named) == layers, what
        for layer in layers:
            assert sorted(named[layer]) == sorted(arrays["ray (s3)"][layer]), (what, layer)
            for array, values in named[layer].items():
                reference = arrays["ray (s3)"][layer][array]
                assert values.dtype == reference.dtype and np.array_equal(values, reference), (what, layer, array)
        assert bundle_differences(trip["ray_bundle"], bundles[what]) == [], what  # params and metrics too
    assert ray["per_layer"] == serial["per_layer"] and ray["mean"] == serial["mean"]
    codes = {what: _codes(where, trip["store"]) for what, where in bundles.items()}
    for what, per_layer in codes.items():
        assert sorted(per_layer) == layers
        for layer in layers:
            assert per_layer[layer].dtype == torch.uint8
            assert torch.equal(per_layer[layer], codes["ray (s3)"][layer]), (what, layer)
    # the same bundle: the version holds the very bundle the Ray job wrote, trained on the store in S3
    ray_manifest, serial_manifest = read_manifest(trip["ray_bundle"]), read_manifest(trip["serial_bundle"])
    assert read_manifest(trip["pulled"]).bundle_id == read_manifest(cached).bundle_id == ray_manifest.bundle_id
    assert ray_manifest.lineage.capture_store_path == trip["store"]
    assert ray_manifest.lineage.capture_store_digest == serial_manifest.lineage.capture_store_digest


def test_the_registry_holds_one_ready_version_from_s3(trip, tracking_server):
    from mlflow import MlflowClient

    from dsaindex.artifacts.bundle import read_manifest
    from dsaindex.artifacts.registry import registered_name

    manifest = read_manifest(trip["ray_bundle"])
    name = registered_name(manifest.model)
    assert trip["register"].stdout.strip() == f"{name} version 1 @candidate"
    rows = trip["list"]
    assert [(r["name"], r["version"], r["aliases"], r["status"]) for r in rows] == [(name, 1, ["candidate"], "READY")]
    row = rows[0]
    assert row["bundle_id"] == manifest.bundle_id
    assert trip["show"]["version"] == 1 and trip["show"]["manifest"]["bundle_id"] == manifest.bundle_id
    assert trip["show"]["lineage"]["capture_store_path"] == trip["store"]
    # the version's source is the logged model holding the bundle, whose artifacts live in the S3 root
    client = MlflowClient(tracking_uri=trip["url"])
    version = client.get_model_version(name, "1")
    assert version.source == f"models:/{row['model_id']}" and str(version.status) == "READY"
    assert client.get_model_version_download_uri(name, "1").startswith(tracking_server.artifact_root + "/")
    # as the backend store holds it: one version, READY, no other
    assert tracking_server.query("SELECT version, status, source FROM model_versions WHERE name = %s", name) == [
        (1, "READY", f"models:/{row['model_id']}")]
    assert tracking_server.query("SELECT alias, version FROM registered_model_aliases WHERE name = %s", name) == [
        ("candidate", 1)]


def test_runtime_check_of_the_registered_bundle(trip):
    from dsaindex.artifacts.capture_store import CaptureStore

    layers = CaptureStore.open(trip["store"]).layers
    check = trip["check"]
    # models:/NAME@candidate was pulled into the fresh cache and checked there
    assert check["bundle"] == str(trip["cache"] / "bundles" / trip["name"] / "v1")
    assert check["family"] == "deepseek_v32" and check["model_identity"] == "same weights and config"
    assert sorted(int(layer) for layer in check["layers"]) == layers
    assert sorted(int(layer) for layer in check["candidates_auto"]["per_layer"]) == layers
    mismatch = trip["mismatch"]
    assert mismatch.returncode == 2, (mismatch.stdout, mismatch.stderr)
    lines = mismatch.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in mismatch.stderr, mismatch.stderr
    # names what differs (the family the bundle was trained for and the served one) and the fix
    assert lines[0].startswith("error: The artifacts' family is 'deepseek_v32'"), lines[0]
    assert "'deepseek_v4'" in lines[0] and " Fix: train artifacts for this model" in lines[0], lines[0]


def test_a_server_loads_the_registered_bundle_and_decodes_through_it(trip, loaded_models, tmp_path, monkeypatch):
    """What ``dsaindex serve`` does at startup with ``models:/NAME@candidate``: pulled into a fresh cache,
    verified, validated against the served model; then a short greedy generation decodes through PQ."""
    from dsaindex.runtime.serving import serve_index
    from dsaindex.runtime.settings import ServeSettings

    monkeypatch.setenv("DSAINDEX_CACHE", str(tmp_path / "server-cache"))
    loaded = loaded_models[MODEL]
    settings = ServeSettings.of(candidates=64, tracking_uri=trip["url"], use_triton=False)
    index = serve_index(trip["models_uri"], loaded.model, settings, served=loaded.fingerprint)
    layers = sorted(index.decode_layers)
    assert layers == sorted(int(layer) for layer in trip["check"]["layers"])
    assert "decode pq: layers" in index.describe()
    assert (tmp_path / "server-cache" / "bundles" / trip["name"] / "v1" / "zarr.json").is_file()
    prompt = torch.randint(0, int(loaded.model.config.vocab_size), (1, 96), generator=torch.Generator().manual_seed(0))
    new = 4
    with index:
        out = loaded.model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, num_beams=1)
    assert out.shape == (1, prompt.shape[1] + new)
    assert index.log.queries["decode"] == {layer: new - 1 for layer in layers}  # every step after the prompt
