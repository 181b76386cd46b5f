"""Capture stores and bundles in object storage (``s3://bucket/prefix``), against a real S3 endpoint: moto's
standalone server, started once per session as its own process (the ``s3_endpoint`` fixture), reached over
HTTP through the standard AWS variables. The same flow on a local folder is the reference: capture, store
info, train pq, runtime check and the registry give the same content through S3; a capture killed with
SIGKILL resumes to the uninterrupted store; a bundle without its manifest (put last) is refused; any other
scheme is a one-line error, never a local folder named after it."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from dsaindex.artifacts.bundle import read_bundle, read_manifest, store_digest
from dsaindex.artifacts.capture_store import CaptureStore
from dsaindex.artifacts.storage import filesystem, list_objects, location, upload_folder
from dsaindex.errors import CorruptBundleError, DsaIndexError
from helpers import run_cli, run_cli_in_process, text_corpus

CAPTURE = ("-m", "preset:tiny-v32", "-n", "4", "--seq-len", "384", "--chunk-len", "192", "--flush-tokens", "768",
           "--no-progress")
TRAIN = ("--subspaces", "16", "--plain", "--iterations", "2", "--max-train-keys", "1024", "--eval-queries", "8",
         "--candidates", "64", "--device", "cpu", "--no-register", "--json")


def objects(uri: str) -> list[str]:
    return list_objects(location(uri))


def assert_same_store(a, b):
    sa, sb = CaptureStore.open(a), CaptureStore.open(b)
    assert sa.committed == sb.committed and sa.committed.sequences > 0
    for name in ("tokens", "sequence_tokens", "sequence_keys", "query_position", "query_sequence", "query_window"):
        np.testing.assert_array_equal(sa.array(name), sb.array(name))
    for layer in sa.layers:
        np.testing.assert_array_equal(sa.keys(layer), sb.keys(layer))
        np.testing.assert_array_equal(sa.queries(layer), sb.queries(layer))
        np.testing.assert_array_equal(sa.head_weights(layer), sb.head_weights(layer))


def assert_same_bundle(a, b):
    ma, arrays_a = read_bundle(a)
    mb, arrays_b = read_bundle(b)
    assert ma.layers.keys() == mb.layers.keys() and arrays_a.keys() == arrays_b.keys()
    for layer, named in arrays_a.items():
        assert named.keys() == arrays_b[layer].keys()
        for name, values in named.items():
            np.testing.assert_array_equal(values, arrays_b[layer][name])
    assert (ma.lineage.train_sequences, ma.lineage.eval_sequences) == (mb.lineage.train_sequences,
                                                                        mb.lineage.eval_sequences)
    assert ma.metrics == mb.metrics


@pytest.fixture(scope="module")
def flow(s3_endpoint, tmp_path_factory):
    """The same capture + train pq on a local folder and on S3, run from an empty working folder."""
    import uuid

    bucket = f"s3://dsa-flow-{uuid.uuid4().hex[:8]}"
    filesystem().mkdir(bucket[len("s3://"):])
    root = tmp_path_factory.mktemp("flow")
    work = root / "cwd"
    work.mkdir()
    corpus = text_corpus(root, files=2, words=400)
    here = os.getcwd()
    os.chdir(work)
    try:
        local_store, s3_store = root / "store", f"{bucket}/captures/tiny.zarr"
        for store in (local_store, s3_store):
            proc = run_cli("capture", str(store), "-c", str(corpus), *CAPTURE)
            assert proc.returncode == 0, proc.stderr
        local_bundle, s3_bundle = root / "bundle", f"{bucket}/bundles/tiny-pq16"
        trained = {}
        for store, out in ((local_store, local_bundle), (s3_store, s3_bundle)):
            proc = run_cli("train", "pq", str(store), "--out", str(out), *TRAIN)
            assert proc.returncode == 0, proc.stderr
            trained[str(out)] = json.loads(proc.stdout)
        cwd_after = sorted(os.listdir(work))
    finally:
        os.chdir(here)
    return {"bucket": bucket, "root": root, "cwd_after": cwd_after, "local_store": local_store,
            "s3_store": s3_store, "local_bundle": local_bundle, "s3_bundle": s3_bundle, "trained": trained}


def test_capture_to_s3_writes_objects_and_no_local_folder(flow):
    keys = objects(flow["s3_store"])
    assert "zarr.json" in keys and "layers/0/keys/zarr.json" in keys
    assert any(k.startswith("layers/0/keys/c/") for k in keys), keys  # chunks, not only metadata
    assert flow["cwd_after"] == [], flow["cwd_after"]  # no 's3:' folder (nor anything else) where it ran
    assert not (flow["root"] / "s3:").exists()
    assert_same_store(flow["local_store"], flow["s3_store"])
    # the lineage digest is of content: a copy of the local store on S3 has the local store's digest
    copy = location(f"{flow['bucket']}/copies/tiny.zarr")
    upload_folder(flow["local_store"], copy)
    assert store_digest(CaptureStore.open(copy)) == store_digest(CaptureStore.open(flow["local_store"]))
    assert store_digest(CaptureStore.open(flow["s3_store"])) != store_digest(CaptureStore.open(copy))  # own id


def test_store_info_through_s3(flow):
    infos = []
    for store in (flow["local_store"], flow["s3_store"]):
        proc = run_cli("store", "info", str(store), "--json")
        assert proc.returncode == 0, proc.stderr
        infos.append(json.loads(proc.stdout))
    local, remote = infos
    assert remote["path"] == flow["s3_store"]
    assert remote["committed"] == local["committed"] and remote["committed"]["sequences"] == 4
    assert remote["verified_chunks"] == local["verified_chunks"] > 0
    assert remote["key_bytes_on_disk"] > 0 and remote["bytes_on_disk"] > remote["key_bytes_on_disk"]


def test_train_pq_from_s3_gives_the_local_bundle(flow):
    remote = flow["trained"][flow["s3_bundle"]]
    assert remote["bundle"] == flow["s3_bundle"]
    assert remote["plots"] and all(p.startswith(flow["bucket"] + "/bundles/tiny-pq16-recall") for p in remote["plots"])
    assert "zarr.json" in objects(flow["s3_bundle"])
    assert_same_bundle(flow["local_bundle"], flow["s3_bundle"])
    assert read_manifest(flow["s3_bundle"]).lineage.capture_store_path == flow["s3_store"]


def test_runtime_check_and_serving_load_a_bundle_from_s3(flow, loaded_models):
    summaries = []
    for bundle in (flow["local_bundle"], flow["s3_bundle"]):
        proc = run_cli("runtime", "check", "-m", "preset:tiny-v32", "-a", str(bundle), "--recall-target", "0.5",
                       "--json")
        assert proc.returncode == 0, proc.stderr
        summaries.append(json.loads(proc.stdout))
    local, remote = summaries
    assert remote["bundle"] == flow["s3_bundle"]
    assert remote["layers"] == local["layers"] and remote["candidates_auto"] == local["candidates_auto"]
    # what `dsaindex serve` builds its index from
    from helpers import serve

    loaded = loaded_models["preset:tiny-v32"]
    index = serve([flow["s3_bundle"]], loaded.model, served=loaded.fingerprint, candidates=64)
    assert "decode pq: layers 0-3" in index.describe()


def test_registry_register_and_pull_with_s3(flow, tmp_path):
    uri = "sqlite:///" + str(tmp_path / "mlflow.db")
    proc = run_cli("registry", "register", flow["s3_bundle"], "--tracking-uri", uri)
    assert proc.returncode == 0, proc.stderr
    name = proc.stdout.split()[0]
    assert "@candidate" in proc.stdout
    pulled = f"{flow['bucket']}/pulled/v1"
    proc = run_cli("registry", "pull", name, "1", pulled, "--tracking-uri", uri)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == pulled
    assert_same_bundle(flow["s3_bundle"], pulled)
    again = run_cli("registry", "pull", name, "1", pulled, "--tracking-uri", uri)  # never over another bundle
    assert again.returncode == 2 and "holds objects already" in again.stderr


def test_a_bundle_without_its_manifest_is_refused(flow, monkeypatch):
    """The root zarr.json (the manifest) is put last: an upload cut before it leaves a prefix every reader
    refuses, with the fix."""
    from dsaindex.artifacts import storage
    from dsaindex.artifacts.bundle import publish_bundle

    fs = storage.filesystem()
    real_put = fs.put_file  # fsspec binds the sync methods on the instance; the arrays go up in one fs.put
    half = f"{flow['bucket']}/bundles/half"
    def put_file(lpath, rpath, *args, **kwargs):
        if rpath == location(half).fs_path + "/zarr.json":
            raise ConnectionError("the writer died before its commit marker")
        return real_put(lpath, rpath, *args, **kwargs)

    monkeypatch.setattr(fs, "put_file", put_file)
    with pytest.raises(DsaIndexError):
        publish_bundle(flow["local_bundle"], half)
    monkeypatch.undo()
    keys = objects(half)
    assert keys and "zarr.json" not in keys and "layers/0/codebooks/zarr.json" in keys
    for read in (read_manifest, read_bundle):
        with pytest.raises(CorruptBundleError, match="unfinished bundle"):
            read(half)
    proc = run_cli("runtime", "check", "-m", "preset:tiny-v32", "-a", half)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and "unfinished bundle" in proc.stderr and " Fix: " in proc.stderr


@pytest.mark.parametrize("args, needle", [
    (["capture", "gs://bucket/s.zarr", "-m", "preset:tiny-v32"], "gs:// is not supported"),
    (["capture", "s3:/bucket/s.zarr", "-m", "preset:tiny-v32"], "two slashes"),
    (["store", "info", "http://example.com/s.zarr"], "http:// is not supported"),
    (["train", "pq", "s3:/bucket/s.zarr"], "two slashes"),
    (["train", "pq", "store", "--out", "gs://bucket/b"], "gs:// is not supported"),
    (["eval", "pq", "b", "--store", "s3://bucket"], "no prefix"),
    (["runtime", "check", "-m", "preset:tiny-v32", "-a", "gs://bucket/b"], "gs:// is not supported"),
    (["registry", "register", "https://example.com/b"], "https:// is not supported"),
    (["registry", "pull", "name", "1", "s3:bucket/b"], "two slashes"),
])
def test_another_scheme_is_a_one_line_error(args, needle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    proc = run_cli(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and " Fix: " in lines[0], proc.stderr
    assert needle in lines[0], lines[0]
    assert os.listdir(tmp_path) == []  # no folder named after the scheme


def one_thread_cli(*args):
    """``dsaindex ARGS`` in this process on one thread, as the killed subprocess runs (OMP_NUM_THREADS=1): a
    multi-threaded CPU forward may sum in another order and differ in the last bit of a few keys."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_cli_in_process(*args)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_sigkill_capture_on_s3_resumes_to_the_uninterrupted_store(s3_bucket, tmp_path):
    """A capture into S3 killed with SIGKILL between writing a sequence's rows and committing them, run again,
    gives the store an uninterrupted capture into S3 gives (test_capture.py does the same on a folder)."""
    corpus = text_corpus(tmp_path, files=3, words=500)
    args = ["--model", "preset:tiny-v32", "--corpus", str(corpus), "--sequences", "5", "--seq-len", "128",
            "--chunk-len", "64", "--flush-tokens", "128", "--no-progress", "--json"]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    ref, target = f"{s3_bucket}/ref.zarr", f"{s3_bucket}/killed.zarr"
    done = one_thread_cli("capture", ref, *args)
    assert done.returncode == 0, done.stderr
    killer = textwrap.dedent("""
        import os, signal, sys
        from dsaindex.artifacts.capture_store import CaptureStore
        from dsaindex.cli import main

        commit = CaptureStore._write_attrs

        def write_attrs(self):
            if self.committed.sequences == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            commit(self)

        CaptureStore._write_attrs = write_attrs
        sys.argv = ["dsaindex", *sys.argv[1:]]
        main()
    """)
    proc = subprocess.run([sys.executable, "-c", killer, "capture", target, *args], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    killed = CaptureStore.open(target)
    assert killed.committed.sequences == 2
    # the third sequence's rows were put before the kill: the arrays hold more rows than are committed
    assert killed.group["tokens"].shape[0] > killed.committed.tokens
    resumed = one_thread_cli("capture", target, *args)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["capture"]["resumed_from"] == 2
    assert_same_store(ref, target)
    assert objects(target) == objects(ref)  # the same objects: nothing left past the committed rows
    assert sorted(os.listdir(tmp_path)) == ["corpus"]


def test_a_store_creation_cut_short_is_started_again(s3_bucket):
    """A new store's group zarr.json is put after its arrays' metadata: a creation cut short leaves a prefix
    that is no store, which the next capture replaces; a prefix holding anything else is refused."""
    from test_bundle import FINGERPRINT

    from dsaindex.artifacts.capture_store import CaptureSettings, new_manifest

    manifest = new_manifest(FINGERPRINT, CaptureSettings(), {"sources": ["test"]}, "bytes")
    cut = location(f"{s3_bucket}/cut.zarr")
    filesystem().pipe_file(f"{cut.fs_path}/layers/1/keys/zarr.json", b"{}")
    assert not CaptureStore.exists(cut)
    CaptureStore.check_location(cut)  # no refusal
    store = CaptureStore.create(cut, manifest)
    assert store.committed.sequences == 0 and CaptureStore.open(cut).manifest.store_id == manifest.store_id
    assert "zarr.json" in objects(cut) and "layers/4/head_weights/zarr.json" in objects(cut)

    foreign = location(f"{s3_bucket}/foreign")
    filesystem().pipe_file(f"{foreign.fs_path}/notes.txt", b"mine")
    with pytest.raises(DsaIndexError, match="holds objects but no capture store"):
        CaptureStore.check_location(foreign)
    with pytest.raises(DsaIndexError, match="holds objects already"):
        CaptureStore.create(foreign, manifest)
