"""The MLflow 3 registry: register, promote, list, show, diff, pull, load, the CLI and racing writers.

One sqlite tracking store is shared by the module (MLflow creates its tables in ~5 s); tests that need
a registered name of their own use their own model fingerprint.
"""

import json
import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from dsaindex.artifacts import registry
from dsaindex.artifacts.bundle import LayerArtifact, Lineage, new_bundle_manifest, read_bundle, write_bundle
from dsaindex.artifacts.fingerprint import ModelFingerprint
from dsaindex.errors import CorruptBundleError, DsaIndexError
from dsaindex.geometry import IndexerGeometry
from helpers import run_cli


def fingerprint(name: str = "hand/tiny-dsa", digest: str = "0123456789abcdef") -> ModelFingerprint:
    return ModelFingerprint(
        name=name, family="deepseek_v32",
        geometry=IndexerGeometry(family="deepseek_v32", num_layers=5, indexer_layers=(1, 4), n_heads=3,
                                 head_dim=8, topk=16, rope_dim=4, rope_layout="half_split_head"),
        config_digest="c0ffee", weights_digest=digest, dtype="bfloat16",
    )


def make_bundle(path: Path, seed: int, model: ModelFingerprint | None = None, m: int = 7) -> dict:
    """A two-layer bundle of small random arrays; returns its arrays."""
    rng = np.random.default_rng(seed)
    arrays = {
        1: {"codebooks": rng.standard_normal((m, 19, 3)).astype(np.float32),
            "scale": np.asarray(float(seed), dtype=np.float64)},
        4: {"centroids": rng.standard_normal((31, 8)).astype(np.float32),
            "assign": rng.integers(0, 31, (50,), dtype=np.int32)},
    }
    layers = {1: LayerArtifact(kind="pq", params={"m": m, "ksub": 19}),
              4: LayerArtifact(kind="ivf", params={"nlist": 31})}
    lineage = Lineage(capture_store_id="store01", capture_store_path="/data/store", capture_store_digest="ab" * 8,
                      train_sequences=[0, 1, 2], eval_sequences=[3])
    metrics = {"recall@64": 0.5 + seed / 100, "layer1/recall@64": 0.6 + seed / 100, "layer4/recall@64": 0.7}
    manifest = new_bundle_manifest(model or fingerprint(), "hadamard", "bfloat16-bits", layers, lineage, metrics,
                                   {"seed": seed, "opt": {"lr": 0.01}})
    write_bundle(path, manifest, arrays)
    return arrays


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    """A store with two versions of one name: v1 (then promoted to production) and v2 (@candidate)."""
    root = tmp_path_factory.mktemp("registry")
    uri = "sqlite:///" + str(root / "mlflow" / "mlflow.db")
    plot = root / "recall.png"
    plot.write_bytes(b"\x89PNG\r\n\x1a\n not really an image")
    arrays = {1: make_bundle(root / "b1", 1), 2: make_bundle(root / "b2", 2, m=5)}
    t0 = time.perf_counter()
    first = registry.register_bundle(root / "b1", {"epochs": 3}, {"train_seconds": 1.5}, [plot], tracking_uri=uri)
    after_first = registry.list_versions(tracking_uri=uri)
    second = registry.register_bundle(root / "b2", {"epochs": 4}, {}, [], tracking_uri=uri)
    promoted = registry.promote(first["name"], 1, tracking_uri=uri)
    timing = {"register_first_s": time.perf_counter() - t0}
    return {"root": root, "uri": uri, "arrays": arrays, "first": first, "second": second,
            "after_first": after_first, "promoted": promoted, "timing": timing}


def test_register_creates_versions_with_candidate_alias(reg):
    first, second = reg["first"], reg["second"]
    assert first["name"] == second["name"] == "dsaindex-hand-tiny-dsa-01234567"
    assert (first["version"], second["version"]) == (1, 2)
    assert first["alias"] == "candidate" and first["model_id"].startswith("m-") and first["run_id"]
    assert [(r["version"], r["aliases"]) for r in reg["after_first"]] == [(1, ["candidate"])]
    assert reg["promoted"] == {"name": first["name"], "version": 1, "alias": "production", "previous": None}


def test_registered_name_is_safe():
    name = registry.registered_name(fingerprint("deepseek-ai/DeepSeek V3.2 (exp)", "sha256:9f86d081884c7d65"))
    assert name == "dsaindex-deepseek-ai-DeepSeek-V3.2-exp-sha2569f"
    assert registry.registered_name(fingerprint()) == "dsaindex-hand-tiny-dsa-01234567"


def test_resolve_refs(reg):
    name, uri = reg["first"]["name"], reg["uri"]
    assert registry.resolve(name, "@production", tracking_uri=uri) == 1
    assert registry.resolve(name, "production", tracking_uri=uri) == 1
    assert registry.resolve(name, "candidate", tracking_uri=uri) == 2
    assert registry.resolve(name, "latest", tracking_uri=uri) == 2
    assert registry.resolve(name, "1", tracking_uri=uri) == 1
    with pytest.raises(DsaIndexError, match="no version 9"):
        registry.resolve(name, "9", tracking_uri=uri)
    with pytest.raises(DsaIndexError, match="no version or alias '@staging'"):
        registry.resolve(name, "@staging", tracking_uri=uri)
    with pytest.raises(DsaIndexError, match="No registered model"):
        registry.resolve("dsaindex-nothing-here", "1", tracking_uri=uri)
    with pytest.raises(DsaIndexError, match="No registry at"):
        registry.resolve(name, "1", tracking_uri="sqlite:///" + str(reg["root"] / "absent" / "x.db"))
    assert not (reg["root"] / "absent").exists()


def test_list_versions(reg):
    rows = registry.list_versions(tracking_uri=reg["uri"])
    assert [(r["version"], r["aliases"]) for r in rows] == [(2, ["candidate"]), (1, ["production"])]
    v1 = rows[1]
    assert v1["family"] == "deepseek_v32" and v1["model"] == "hand/tiny-dsa" and v1["layers"] == [1, 4]
    assert v1["kinds"] == ["ivf", "pq"] and v1["status"] == "READY" and v1["created"]
    assert v1["metrics"] == {"recall_64": 0.51, "train_seconds": 1.5}  # per-layer metrics are left to show
    assert registry.list_versions(reg["first"]["name"], tracking_uri=reg["uri"]) == rows
    assert registry.list_versions(tracking_uri="sqlite:///" + str(reg["root"] / "none" / "x.db")) == []


def test_show(reg):
    info = registry.show(reg["first"]["name"], "@production", tracking_uri=reg["uri"])
    manifest, _ = read_bundle(reg["root"] / "b1")
    assert info["version"] == 1 and info["aliases"] == ["production"]
    assert info["run_id"] == reg["first"]["run_id"] and info["model_id"] == reg["first"]["model_id"]
    assert info["manifest"] == manifest.model_dump(mode="json")
    assert info["lineage"]["capture_store_digest"] == "ab" * 8
    assert info["metrics"]["layer1/recall@64"] == pytest.approx(0.61)
    assert info["metrics"]["train_seconds"] == 1.5
    assert info["params"]["epochs"] == "3" and info["params"]["opt.lr"] == "0.01"


def test_run_holds_plots_and_manifest(reg):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=reg["uri"])
    run_id = reg["first"]["run_id"]
    assert {a.path for a in client.list_artifacts(run_id)} == {"bundle_manifest.json", "plots"}
    assert [a.path for a in client.list_artifacts(run_id, "plots")] == ["plots/recall.png"]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert str(client.get_logged_model(reg["first"]["model_id"]).status) == "READY"


def test_diff(reg):
    d = registry.diff(reg["first"]["name"], "1", "candidate", tracking_uri=reg["uri"])
    assert (d["a"], d["b"]) == (1, 2)
    assert d["params"] == {"seed": [1, 2]} and d["bundle"] == {}
    assert d["metrics"] == {"recall@64": [0.51, 0.52]}
    assert d["layers"]["1"]["params"] == {"m": [7, 5]}
    assert d["layers"]["1"]["metrics"] == {"recall@64": [0.61, 0.62]}
    assert d["layers"]["1"]["arrays"]["codebooks"] == [[[7, 19, 3], "float32"], [[5, 19, 3], "float32"]]
    assert "4" not in d["layers"]  # layer 4: same params, same metric, same shapes
    same = registry.diff(reg["first"]["name"], "2", "latest", tracking_uri=reg["uri"])
    assert same["layers"] == {} and same["params"] == {} and same["metrics"] == {}


def test_pull_round_trip(reg):
    dest = reg["root"] / "pulled" / "v2"
    t0 = time.perf_counter()
    got = registry.pull(reg["first"]["name"], "@candidate", dest, tracking_uri=reg["uri"])
    reg["timing"]["pull_s"] = time.perf_counter() - t0
    assert got == dest
    manifest, arrays = read_bundle(dest)
    for layer, named in reg["arrays"][2].items():
        for name, values in named.items():
            np.testing.assert_array_equal(arrays[layer][name], values)
    assert sorted(os.listdir(dest.parent)) == ["v2"]
    with pytest.raises(DsaIndexError, match="exists and is not empty"):
        registry.pull(reg["first"]["name"], "1", dest, tracking_uri=reg["uri"])


def test_load_uri(reg, tmp_path):
    name, uri = reg["first"]["name"], reg["uri"]
    by_alias = registry.load_uri(f"models:/{name}@production", tmp_path / "cache", tracking_uri=uri)
    assert by_alias == tmp_path / "cache" / "bundles" / name / "v1"
    np.testing.assert_array_equal(read_bundle(by_alias)[1][4]["assign"], reg["arrays"][1][4]["assign"])
    assert registry.load_uri(f"models:/{name}/1", tmp_path / "cache", tracking_uri=uri) == by_alias  # cached
    assert registry.load_uri(str(reg["root"] / "b2")) == reg["root"] / "b2"
    with pytest.raises(DsaIndexError, match="not a registry URI"):
        registry.load_uri("models:/only-a-name", tmp_path / "cache", tracking_uri=uri)
    with pytest.raises(CorruptBundleError):
        registry.load_uri(tmp_path / "not-a-bundle")


def test_pull_of_damaged_artifacts_fails_cleanly(reg, tmp_path):
    model = fingerprint("hand/damaged", "fedcba9876543210")
    make_bundle(tmp_path / "b", 5, model)
    out = registry.register_bundle(tmp_path / "b", {}, {}, [], tracking_uri=reg["uri"])
    stored = next(p for p in (reg["root"] / "mlflow" / "artifacts").rglob("codebooks") if out["model_id"] in str(p))
    chunk = next(p for p in (stored / "c").rglob("*") if p.is_file())
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    dest = tmp_path / "pulled" / "damaged"
    with pytest.raises(CorruptBundleError) as err:
        registry.pull(out["name"], "1", dest, tracking_uri=reg["uri"])
    assert "'codebooks'" in err.value.problem and "version 1" in err.value.problem
    assert not dest.exists() and os.listdir(dest.parent) == []


def test_failed_registration_leaves_no_version(reg, tmp_path, monkeypatch):
    from urllib.parse import urlparse

    from mlflow import MlflowClient

    model = fingerprint("hand/rollback", "1111222233334444")
    make_bundle(tmp_path / "ok", 6, model)
    make_bundle(tmp_path / "bad", 7, model)
    ok = registry.register_bundle(tmp_path / "ok", {}, {}, [], tracking_uri=reg["uri"])
    original = MlflowClient.set_terminated

    def fail_on_finish(self, run_id, status=None, end_time=None):
        if status == "FINISHED":
            raise RuntimeError("tracking server went away")
        return original(self, run_id, status, end_time)

    monkeypatch.setattr(MlflowClient, "set_terminated", fail_on_finish)
    with pytest.raises(DsaIndexError, match="nothing was registered") as err:
        registry.register_bundle(tmp_path / "bad", {}, {}, [], tracking_uri=reg["uri"])
    monkeypatch.undo()
    rows = registry.list_versions(ok["name"], tracking_uri=reg["uri"])
    assert [(r["version"], r["aliases"]) for r in rows] == [(1, ["candidate"])]
    client = MlflowClient(tracking_uri=reg["uri"])
    assert isinstance(err.value.__cause__, RuntimeError)
    failed = [r for r in client.search_runs([client.get_experiment_by_name("dsaindex").experiment_id])
              if r.info.status == "FAILED"]
    assert len(failed) == 1 and failed[0].info.run_name.startswith("train-")
    # the failed registration's copy of the bundle is gone from the artifact store; the good one's is there
    exp = client.get_experiment_by_name("dsaindex").experiment_id

    def copies(run_id):
        return [Path(urlparse(m.artifact_location).path) for m in
                client.search_logged_models([exp], filter_string=f"source_run_id = '{run_id}'")]

    assert copies(failed[0].info.run_id) and not any(p.exists() for p in copies(failed[0].info.run_id))
    assert all(p.is_dir() for p in copies(ok["run_id"]))


def test_promote_errors(reg):
    with pytest.raises(DsaIndexError, match="cannot be an alias"):
        registry.promote(reg["first"]["name"], 1, alias="latest", tracking_uri=reg["uri"])
    with pytest.raises(DsaIndexError, match="no version 42"):
        registry.promote(reg["first"]["name"], 42, tracking_uri=reg["uri"])


def test_ui_command_binds_localhost(reg):
    from dsaindex.artifacts.registry_ui import ui_command

    cmd = ui_command(5123, reg["uri"])
    assert cmd[1:4] == ["-m", "mlflow", "server"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "5123"
    assert cmd[cmd.index("--backend-store-uri") + 1] == reg["uri"]
    assert cmd[cmd.index("--artifacts-destination") + 1] == str(reg["root"] / "mlflow" / "artifacts")


def test_default_tracking_uri(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert registry.default_tracking_uri() == "sqlite:///" + str(tmp_path / "runs" / "mlflow" / "mlflow.db")
    assert registry.artifact_root(registry.default_tracking_uri()) == tmp_path / "runs" / "mlflow" / "artifacts"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert registry.resolve_tracking_uri(None) == "http://127.0.0.1:5000"
    assert registry.resolve_tracking_uri("sqlite:///x.db") == "sqlite:///x.db"
    assert registry.artifact_root("http://127.0.0.1:5000") is None


def test_cli(reg):
    name, uri = reg["first"]["name"], reg["uri"]
    with ThreadPoolExecutor(2) as pool:  # two interpreter start-ups at once
        listing = pool.submit(run_cli, "registry", "list", "--json", "--tracking-uri", uri, isolated=True)
        showing = pool.submit(run_cli, "registry", "show", name, "@nope", "--tracking-uri", uri, isolated=True)
        listed, bad = listing.result(), showing.result()
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [(r["name"], r["version"]) for r in rows if r["name"] == name] == [(name, 2), (name, 1)]
    assert bad.returncode == 2 and bad.stdout == ""
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and " Fix: " in lines[0]


RACER = textwrap.dedent("""
    import json, sys
    from dsaindex.artifacts.registry import register_bundle
    from dsaindex.errors import DsaIndexError
    try:
        out = register_bundle(sys.argv[1], {"racer": sys.argv[1]}, {}, [], tracking_uri=sys.argv[2])
    except DsaIndexError as err:
        print(f"error: {err.problem} Fix: {err.fix}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(out))
""")


def test_two_processes_race_on_one_sqlite_file(tmp_path):
    """Both start on a fresh database (so even table creation races); each ends complete or with a clean
    error, and no version is left half made."""
    uri = "sqlite:///" + str(tmp_path / "race" / "mlflow.db")
    arrays = {i: make_bundle(tmp_path / f"b{i}", 10 + i) for i in (0, 1)}
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(tmp_path / f"b{i}"), uri], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    results = [p.communicate(timeout=240) + (p.returncode,) for p in procs]
    done = [json.loads(out) for out, _, rc in results if rc == 0]
    print(f"\nrace: {len(done)} of 2 registrations completed")
    for _out, err, rc in results:
        assert rc in (0, 2), err
        if rc == 2:
            assert err.strip().splitlines()[-1].startswith("error: ")
    assert len(done) >= 1
    rows = registry.list_versions(tracking_uri=uri)
    assert sorted(r["version"] for r in rows) == sorted(d["version"] for d in done)
    assert sorted(r["version"] for r in rows) == list(range(1, len(done) + 1))
    assert all(r["status"] == "READY" for r in rows)
    for d in done:  # every version is complete: its bundle pulls and verifies
        i = int(Path(registry.show(d["name"], str(d["version"]), tracking_uri=uri)["params"]["racer"]).name[1:])
        pulled = registry.pull(d["name"], str(d["version"]), tmp_path / "pulled" / str(d["version"]), tracking_uri=uri)
        np.testing.assert_array_equal(read_bundle(pulled)[1][1]["codebooks"], arrays[i][1]["codebooks"])
    latest = max(d["version"] for d in done)
    assert registry.resolve(done[0]["name"], "@candidate", tracking_uri=uri) == latest


def test_round_trip_timing(reg, tmp_path):
    """Register, promote and pull on a warm store: the pulled bundle is the registered one; the time is
    printed for the record (a measurement, not an assertion)."""
    model = fingerprint("hand/timing", "5555666677778888")
    make_bundle(tmp_path / "b", 9, model)
    t0 = time.perf_counter()
    out = registry.register_bundle(tmp_path / "b", {}, {}, [], tracking_uri=reg["uri"])
    t1 = time.perf_counter()
    registry.promote(out["name"], out["version"], tracking_uri=reg["uri"])
    t2 = time.perf_counter()
    registry.pull(out["name"], "@production", tmp_path / "pulled", tracking_uri=reg["uri"])
    t3 = time.perf_counter()
    print(f"\nregistry round trip: register {t1 - t0:.2f} s, promote {t2 - t1:.2f} s, pull {t3 - t2:.2f} s, "
          f"total {t3 - t0:.2f} s (first registration on a fresh store: {reg['timing']['register_first_s']:.2f} s)")
    np.testing.assert_array_equal(read_bundle(tmp_path / "pulled")[1][1]["codebooks"],
                                  read_bundle(tmp_path / "b")[1][1]["codebooks"])
    assert registry.resolve(out["name"], "@production", tracking_uri=reg["uri"]) == out["version"]
