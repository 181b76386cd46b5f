"""Registry reliability, driven through the CLI as a user would: registrations killed at the worst moment,
`registry register`, unreachable tracking servers, `registry ui` shutdown, `registry list` layout, mistyped
sqlite paths, registrations cut short by Ctrl-C or by a tracking server that stops answering.

One sqlite store is shared by the module; each test that registers uses a model fingerprint (so a
registered name) of its own.
"""

import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from dsaindex.artifacts import registry
from dsaindex.artifacts.bundle import LayerArtifact, Lineage, new_bundle_manifest, write_bundle
from dsaindex.artifacts.fingerprint import ModelFingerprint
from dsaindex.errors import DsaIndexError
from dsaindex.geometry import IndexerGeometry

ENV = dict(os.environ, PYTHONWARNINGS="ignore")
for _key in registry.HTTP_SETTINGS:
    ENV.pop(_key, None)


def cli(*args: str, env: dict | None = None, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    """``python -m dsaindex ARGS`` in a subprocess (as tests/helpers.run_cli, with an environment); the
    result and its wall time."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "dsaindex", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or ENV)
    return proc, time.perf_counter() - start


def first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else ""


def fingerprint(name: str) -> ModelFingerprint:
    return ModelFingerprint(
        name=name, family="deepseek_v32",
        geometry=IndexerGeometry(family="deepseek_v32", num_layers=5, indexer_layers=(1, 4), n_heads=3,
                                 head_dim=8, topk=16, rope_dim=4, rope_layout="half_split_head"),
        config_digest="c0ffee", weights_digest="0123456789abcdef", dtype="bfloat16",
    )


def make_bundle(path: Path, model: str, metrics: dict[str, float] | None = None) -> Path:
    import numpy as np

    rng = np.random.default_rng(0)
    lineage = Lineage(capture_store_id="store01", capture_store_path="/data/store", capture_store_digest="ab" * 8,
                      train_sequences=[0, 1], eval_sequences=[2])
    manifest = new_bundle_manifest(fingerprint(model), "hadamard", "bfloat16-bits",
                                   {1: LayerArtifact(kind="pq", params={"m": 2}), 4: LayerArtifact(kind="pq", params={"m": 2})},
                                   lineage, metrics or {"mean/k512/rerank@2048": 0.9}, {})
    write_bundle(path, manifest, {layer: {"codebooks": rng.standard_normal((2, 4, 4)).astype(np.float32)}
                                  for layer in (1, 4)})
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability")
    uri = "sqlite:///" + str(root / "mlflow" / "mlflow.db")
    registry.register_bundle(make_bundle(root / "warm", "hand/warm"), {}, {}, [], tracking_uri=uri)  # makes the tables
    return {"root": root, "uri": uri, "db": root / "mlflow" / "mlflow.db"}


# ---- 1: a registration killed at the worst moment is undone by the next command --------------------
KILLER = textwrap.dedent("""
    import os, signal, sys
    from mlflow import MlflowClient
    from dsaindex.artifacts.registry import register_bundle

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(MlflowClient, sys.argv[3], die)
    register_bundle(sys.argv[1], {}, {}, [], tracking_uri=sys.argv[2])
""")


def sql(db: Path, query: str, *args) -> list[tuple]:
    with sqlite3.connect(db) as con:
        return con.execute(query, args).fetchall()


@pytest.mark.parametrize(("step", "command"), [
    ("set_registered_model_alias", "list"),  # the version exists, @candidate not moved yet, run RUNNING
    ("delete_model_version_tag", "show"),  # the last step: @candidate moved, run FINISHED
    ("log_model_artifacts", "list"),  # no version yet: run RUNNING, logged model PENDING
])
def test_killed_registration_is_undone_by_the_next_command(store, tmp_path, step, command):
    from urllib.parse import urlparse

    from mlflow import MlflowClient

    uri, db = store["uri"], store["db"]
    model = f"hand/killed-{step}"
    first = registry.register_bundle(make_bundle(tmp_path / "b1", model), {}, {}, [], tracking_uri=uri)
    name = first["name"]
    killed = subprocess.run([sys.executable, "-c", KILLER, str(make_bundle(tmp_path / "b2", model)), uri, step],
                            capture_output=True, text=True, timeout=120, env=ENV)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    run_id, status = sql(db, "SELECT r.run_uuid, r.status FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
                             "WHERE t.key = 'mlflow.runName' ORDER BY r.start_time DESC LIMIT 1")[0]
    half = sql(db, "SELECT version FROM model_versions WHERE name = ? AND current_stage != 'Deleted_Internal'", name)
    if step == "log_model_artifacts":
        assert status == "RUNNING" and half == [(1,)]
    else:  # version 2 exists half-registered
        assert sorted(half) == [(1,), (2,)] and status == ("FINISHED" if step == "delete_model_version_tag" else "RUNNING")

    if command == "list":
        proc, _ = cli("registry", "list", "--json", "--tracking-uri", uri)
        assert proc.returncode == 0, proc.stderr
        assert [(r["version"], r["aliases"]) for r in json.loads(proc.stdout) if r["name"] == name] == [(1, ["candidate"])]
    else:
        proc, _ = cli("registry", "show", name, "latest", "--json", "--tracking-uri", uri)
        assert proc.returncode == 0, proc.stderr
        assert (json.loads(proc.stdout)["version"], json.loads(proc.stdout)["aliases"]) == (1, ["candidate"])

    # nothing half-registered remains, and the previous candidate is intact
    client = MlflowClient(tracking_uri=uri)
    assert [str(v.version) for v in client.search_model_versions(f"name='{name}'")] == ["1"]
    assert str(client.get_model_version_by_alias(name, "candidate").version) == "1"
    assert client.get_run(run_id).info.status == "FAILED"
    exp = client.get_experiment_by_name("dsaindex").experiment_id
    dead = client.search_logged_models([exp], filter_string=f"source_run_id = '{run_id}'")
    assert {str(m.status) for m in dead} == {"FAILED"}
    assert not any(Path(urlparse(m.artifact_location).path).exists() for m in dead)  # its copy removed
    assert client.get_run(first["run_id"]).info.status == "FINISHED"
    assert sql(db, "SELECT count(*) FROM model_version_tags t JOIN model_versions v ON v.name = t.name AND "
                   "v.version = t.version WHERE t.key = ? AND v.current_stage != 'Deleted_Internal'",
               registry.REGISTERING) == [(0,)]
    assert registry.resolve(name, "latest", tracking_uri=uri) == 1
    again = registry.register_bundle(tmp_path / "b2", {}, {}, [], tracking_uri=uri)  # registering again works
    assert not again["existing"] and registry.resolve(name, "@candidate", tracking_uri=uri) == again["version"]


PAUSER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from mlflow import MlflowClient
    from dsaindex.artifacts.registry import register_bundle

    original = MlflowClient.set_terminated

    def pause(self, *args, **kwargs):  # after @candidate moved onto the new version
        Path(sys.argv[3]).write_text("paused")
        while not Path(sys.argv[4]).exists():
            time.sleep(0.05)
        return original(self, *args, **kwargs)

    MlflowClient.set_terminated = pause
    print(register_bundle(sys.argv[1], {}, {}, [], tracking_uri=sys.argv[2])["version"])
""")


def test_live_registration_is_neither_shown_nor_undone(store, tmp_path):
    uri = store["uri"]
    first = registry.register_bundle(make_bundle(tmp_path / "b1", "hand/live"), {}, {}, [], tracking_uri=uri)
    paused, go = tmp_path / "paused", tmp_path / "go"
    proc = subprocess.Popen([sys.executable, "-c", PAUSER, str(make_bundle(tmp_path / "b2", "hand/live")), uri,
                             str(paused), str(go)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 90
        while not paused.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.1)
        listed, _ = cli("registry", "list", "--json", "--tracking-uri", uri)
        shown, _ = cli("registry", "show", first["name"], "@candidate", "--json", "--tracking-uri", uri)
        with pytest.raises(DsaIndexError, match="version 2 is not completely registered"):
            registry.resolve(first["name"], "2", tracking_uri=uri)
        assert registry.resolve(first["name"], "latest", tracking_uri=uri) == 1
    finally:
        go.write_text("go")
        out, err = proc.communicate(timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert [(r["version"], r["aliases"]) for r in json.loads(listed.stdout) if r["name"] == first["name"]] == [
        (1, ["candidate"])]
    assert shown.returncode == 0 and json.loads(shown.stdout)["version"] == 1
    assert proc.returncode == 0 and out.strip() == "2", err  # the registration finished undisturbed
    assert registry.resolve(first["name"], "@candidate", tracking_uri=uri) == 2


def test_server_rule_undoes_only_stale_registrations(store, tmp_path, monkeypatch):
    """Without the sqlite lock (a tracking server) an unfinished version is undone once it is older than
    STALE_VERSION_S, and never counted before."""
    import mlflow
    from mlflow import MlflowClient

    uri = store["uri"]
    first = registry.register_bundle(make_bundle(tmp_path / "b1", "hand/stale"), {}, {}, [], tracking_uri=uri)
    name, client = first["name"], MlflowClient(tracking_uri=uri)
    record = {"started": int(time.time() * 1000), "previous_candidate": "1"}
    mlflow.set_tracking_uri(uri)  # MLflow's sqlite registry resolves models:/<model id> through it
    try:
        client.create_model_version(name, source=f"models:/{first['model_id']}", model_id=first["model_id"],
                                    tags={registry.REGISTERING: json.dumps(record)})
    finally:
        mlflow.set_tracking_uri(None)
    client.set_registered_model_alias(name, "candidate", "2")
    registry.recovery._settle(client, uri, everything=False)
    assert sorted(str(v.version) for v in client.search_model_versions(f"name='{name}'")) == ["1", "2"]  # left alone
    assert registry.versions._resolve(client, name, "latest") == "1" and registry.versions._resolve(client, name, "@candidate") == "1"
    monkeypatch.setattr(registry.recovery, "STALE_VERSION_S", 0.0)
    registry.recovery._settle(client, uri, everything=False)
    assert [str(v.version) for v in client.search_model_versions(f"name='{name}'")] == ["1"]
    assert str(client.get_model_version_by_alias(name, "candidate").version) == "1"


# ---- 2: `registry register`, idempotent ------------------------------------------------------------
def test_register_command_is_idempotent(store, tmp_path):
    uri = store["uri"]
    bundle = make_bundle(tmp_path / "b", "hand/register-cli")
    first, _ = cli("registry", "register", str(bundle), "--tracking-uri", uri)
    again, _ = cli("registry", "register", str(bundle), "--tracking-uri", uri)
    assert first.returncode == 0, first.stderr
    name = registry.registered_name(fingerprint("hand/register-cli"))
    assert first.stdout.strip() == f"{name} version 1 @candidate"
    assert again.returncode == 0 and again.stdout.strip() == f"{name} version 1 @candidate (already registered)"
    assert [r["version"] for r in registry.list_versions(name, tracking_uri=uri)] == [1]
    missing, _ = cli("registry", "register", str(tmp_path / "nothing"), "--tracking-uri", uri)
    assert missing.returncode == 2 and first_line(missing.stderr).startswith("error: ")


# ---- 3: unreachable tracking servers fail in seconds -----------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_refused_port_fails_fast():
    uri = f"http://127.0.0.1:{free_port()}"
    proc, seconds = cli("registry", "list", env=dict(ENV, MLFLOW_TRACKING_URI=uri))
    print(f"\nrefused port: exit {proc.returncode} after {seconds:.1f} s")
    assert proc.returncode == 2 and seconds < 30
    assert uri in first_line(proc.stderr)
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: Cannot reach the MLflow tracking server at {uri}")


@pytest.fixture()
def silent_server():
    """A socket that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    sock.settimeout(0.2)
    held, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    thread.join(5)
    for conn in held:
        conn.close()
    sock.close()


def test_silent_server_fails_fast(silent_server, tmp_path):
    proc, seconds = cli("registry", "register", str(make_bundle(tmp_path / "b", "hand/silent")),
                        "--tracking-uri", silent_server)
    print(f"\nsilent server: exit {proc.returncode} after {seconds:.1f} s")
    assert proc.returncode == 2 and seconds < 40
    assert silent_server in first_line(proc.stderr)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: Cannot reach the MLflow tracking server at {silent_server}") and "no answer" in last


def test_user_http_settings_are_kept(silent_server):
    env = dict(ENV, MLFLOW_HTTP_REQUEST_TIMEOUT="1", MLFLOW_HTTP_REQUEST_MAX_RETRIES="0")
    proc, seconds = cli("registry", "show", "dsaindex-x-1", "latest", "--tracking-uri", silent_server, env=env)
    assert proc.returncode == 2 and seconds < 20
    assert first_line(proc.stderr) == (f"registry: contacting the MLflow tracking server at {silent_server} "
                                       "(timeout 1 s, retries 0)")


# ---- 4: `registry ui` stops its whole process group ------------------------------------------------
def group_members(pgid: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            pids.append(int(stat.parent.name))
    return pids


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process groups from /proc")
@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_ui_stops_its_process_group_with_the_command(tmp_path, how):
    """SIGTERM: the command stops its group and exits 0. SIGKILL (no word from the command): the watchdog
    in the group stops it (SIGTERM, SIGKILL 10 s later)."""
    port = free_port()
    with open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "dsaindex", "registry", "ui", "--port", str(port),
                                 "--tracking-uri", "sqlite:///" + str(tmp_path / "mlflow" / "mlflow.db")],
                                stdout=subprocess.PIPE, stderr=stderr, text=True, env=ENV)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not lines and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert lines and lines[0].startswith(f"ready at http://127.0.0.1:{port} (server process group "), (
            (tmp_path / "stderr").read_text()[-3000:])
        pgid = int(lines[0].rsplit(" ", 1)[1].rstrip(")\n"))
        assert pgid != os.getpgid(proc.pid) and group_members(pgid)
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
            assert f"registry: the MLflow UI is stopped (its process group {pgid} is down)" in (
                tmp_path / "stderr").read_text()
        else:
            proc.kill()
            assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + (5 if how == "sigterm" else 30)
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert group_members(pgid) == []
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # nothing listens any more


# ---- 6: headline metrics, 80 columns ---------------------------------------------------------------
def test_list_shows_headline_metrics_within_80_columns(store, tmp_path):
    metrics = {"mean/aaa": 1.0, "mean/k512/direct": 0.5, "mean/k512/filter@2048": 0.93,
               "mean/k512/rerank@2048": 0.97, "mean/k512/queries": 64.0, "layer1/k512/rerank@2048": 0.9}
    name = registry.register_bundle(make_bundle(tmp_path / "b", "deepseek-ai/DeepSeek-V3.2-Exp-long-name", metrics),
                                    {}, {}, [], tracking_uri=store["uri"])["name"]
    proc, _ = cli("registry", "list", "--name", name, "--tracking-uri", store["uri"], env=dict(ENV, COLUMNS="80"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"registry {store['uri']}: 1 version of 1 name"
    assert all(len(line) <= 80 for line in lines[1:]), proc.stdout
    text = proc.stdout
    assert "k512/rerank@2048 0.97" in text and "k512/filter@2048 0.93" in text
    assert text.index("rerank@2048") < text.index("filter@2048") and "aaa" not in text
    assert registry.headline_metrics({"mean/ivf/recall@16384": 0.8, "mean/ivf-learned/recall@16384": 0.9}) == [
        ("ivf-learned/recall@16384", 0.9), ("ivf/recall@16384", 0.8)]
    assert registry.headline_metrics({"mean/k32/direct": 0.5, "mean/k32/rerank_64": 0.9, "mean/k32/queries": 9.0,
                                      "mean/k32/filter_64": 0.8, "mean/k32/fetch_64": 0.7}) == [
        ("k32/rerank_64", 0.9), ("k32/filter_64", 0.8), ("k32/direct", 0.5)]
    assert registry.headline_metrics({"b": 2.0, "a": 1.0, "k8/queries": 3.0, "c": 3.0, "d": 4.0}) == [
        ("a", 1.0), ("b", 2.0), ("c", 3.0)]


# ---- 7: a mistyped sqlite path is refused ----------------------------------------------------------
def test_list_refuses_a_sqlite_path_in_a_missing_folder(tmp_path):
    uri = "sqlite:///" + str(tmp_path / "nowhere" / "mlflow.db")
    proc, _ = cli("registry", "list", "--tracking-uri", uri)
    assert proc.returncode == 2 and proc.stdout == ""
    assert first_line(proc.stderr).startswith(f"error: No registry at {uri}: the folder {tmp_path / 'nowhere'} "
                                              "does not exist. Fix: ")
    assert not (tmp_path / "nowhere").exists()
    (tmp_path / "empty").mkdir()
    uri = "sqlite:///" + str(tmp_path / "empty" / "mlflow.db")
    proc, _ = cli("registry", "list", "--tracking-uri", uri)
    assert proc.returncode == 0 and proc.stdout.strip() == (
        f"no registered bundles in {uri} (its database file does not exist yet)")


# ---- 8: a registration cut short (Ctrl-C, a tracking server gone silent) ends quickly ---------------
def wait_for_version(db: Path, name: str, version: int, proc: subprocess.Popen, limit_s: float = 120) -> None:
    """Poll the store's database until ``name`` has a row for ``version`` (the registration is between its
    version row and its last step)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if sql(db, "SELECT 1 FROM model_versions WHERE name = ? AND version = ?", name, version):
                return
        except sqlite3.Error:
            pass
        time.sleep(0.005)
    raise AssertionError(f"no version {version} of {name} appeared (exit {proc.poll()})")


@pytest.mark.slow
def test_ctrl_c_mid_registration_rolls_back_at_once(store, tmp_path):
    """Ctrl-C just after the version row appears: the command says it stops after the current request, undoes
    its registration itself and exits 130, without waiting on a write lock an interrupted write would hold."""
    uri, db = store["uri"], store["db"]
    model = "hand/ctrl-c"
    name = registry.register_bundle(make_bundle(tmp_path / "b1", model), {}, {}, [], tracking_uri=uri)["name"]
    proc = subprocess.Popen([sys.executable, "-m", "dsaindex", "registry", "register",
                             str(make_bundle(tmp_path / "b2", model)), "--tracking-uri", uri],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        wait_for_version(db, name, 2, proc)
        proc.send_signal(signal.SIGINT)
        interrupted = time.perf_counter()
        _, err = proc.communicate(timeout=120)  # before: 337 s of 'database is locked' retries
        print(f"\nCtrl-C mid-registration: exit {proc.returncode} after {time.perf_counter() - interrupted:.1f} s")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "database is locked" not in err and "Traceback" not in err
    assert err.strip().splitlines()[-1] == "interrupted (Ctrl-C) before the command finished."
    assert "registry: Ctrl-C: stopping after the current request (Ctrl-C again to stop at once)" in err
    # undone by the interrupted command itself, before any other command ran
    assert sql(db, "SELECT current_stage FROM model_versions WHERE name = ? AND version = 2", name) == [
        ("Deleted_Internal",)]
    assert sql(db, "SELECT alias, version FROM registered_model_aliases WHERE name = ?", name) == [("candidate", 1)]
    assert sql(db, "SELECT status FROM runs WHERE run_uuid = (SELECT r.run_uuid FROM runs r JOIN tags t ON "
                   "t.run_uuid = r.run_uuid WHERE t.key = 'mlflow.runName' ORDER BY r.start_time DESC LIMIT 1)"
               ) == [("FAILED",)]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="stops the server's process group")
def test_tracking_server_silent_mid_registration(tmp_path):
    """The tracking server stops answering (SIGSTOP) between the version row and the last step: the
    command gives up with one line naming what it left, and once the server answers again the next command
    from this machine undoes the version (its process is gone) instead of waiting for it to go stale."""
    db = tmp_path / "mlflow" / "mlflow.db"
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "dsaindex", "registry", "ui", "--port", str(port),
                               "--tracking-uri", "sqlite:///" + str(db)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV)
    url = f"http://127.0.0.1:{port}"
    pgid = None
    try:
        ready = server.stdout.readline()
        assert ready.startswith(f"ready at {url} (server process group "), ready
        pgid = int(ready.rsplit(" ", 1)[1].rstrip(")\n"))
        model = "hand/silent-mid"
        name = registry.register_bundle(make_bundle(tmp_path / "b1", model), {}, {}, [], tracking_uri=url)["name"]
        # one reader, MLflow's client API: the server lists what its sqlite store holds, row for row
        rows = registry.list_versions(tracking_uri=url)
        assert [(r["name"], r["version"], r["aliases"]) for r in rows] == [(name, 1, ["candidate"])]
        assert rows == registry.list_versions(tracking_uri="sqlite:///" + str(db))
        proc = subprocess.Popen([sys.executable, "-m", "dsaindex", "registry", "register",
                                 str(make_bundle(tmp_path / "b2", model)), "--tracking-uri", url],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        try:
            wait_for_version(db, name, 2, proc)
            os.killpg(pgid, signal.SIGSTOP)
            stopped = time.perf_counter()
            _, err = proc.communicate(timeout=90)  # before: 312 s (20 s x 3 tries, for each of five calls)
            print(f"\nserver silent mid-registration: exit {proc.returncode} after {time.perf_counter() - stopped:.1f} s")
        finally:
            if proc.poll() is None:
                proc.kill()
        os.killpg(pgid, signal.SIGCONT)
        assert proc.returncode == 2, err
        last = err.strip().splitlines()[-1]
        assert last.startswith("error: ") and "Traceback" not in err
        assert "What it wrote stays unfinished" in last and "the next registry command on this machine undoes it" in last
        # hidden meanwhile; the next command undoes it at once (the registering process is gone)
        proc2, _ = cli("registry", "list", "--json", "--tracking-uri", url)
        assert proc2.returncode == 0 and proc2.stdout.startswith("["), (proc2.stdout, proc2.stderr)
        assert [(r["version"], r["aliases"]) for r in json.loads(proc2.stdout or "null") or [] if r["name"] == name] == [  # noqa: E501
            (1, ["candidate"])]
        assert sql(db, "SELECT current_stage FROM model_versions WHERE name = ? AND version = 2", name) == [
            ("Deleted_Internal",)]
        assert sql(db, "SELECT status FROM runs WHERE run_uuid = (SELECT r.run_uuid FROM runs r JOIN tags t ON "
                       "t.run_uuid = r.run_uuid WHERE t.key = 'mlflow.runName' ORDER BY r.start_time DESC LIMIT 1)"
                   ) == [("FAILED",)]
    finally:
        if pgid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGCONT)
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


def test_an_alias_write_that_loses_a_race_on_its_row_is_written_again():
    """Two writers of one alias on a tracking server can insert its row at once: the loser's write fails whole
    with a unique-constraint violation (PostgreSQL's words here), and is written again; any other error, or a
    race lost every time, is raised."""
    from dsaindex.artifacts.registry.tracking import _set_alias

    class Client:
        def __init__(self, failures, text):
            self.failures, self.text, self.written = failures, text, []

        def set_registered_model_alias(self, name, alias, version):
            if self.failures:
                self.failures -= 1
                raise RuntimeError(self.text)
            self.written.append((name, alias, version))

    race = ('BAD_REQUEST: (psycopg2.errors.UniqueViolation) duplicate key value violates unique constraint '
            '"registered_model_alias_pk"')
    client = Client(2, race)
    _set_alias(client, "m", "candidate", 3)
    assert client.written == [("m", "candidate", 3)] and client.failures == 0
    with pytest.raises(RuntimeError, match="RESOURCE_DOES_NOT_EXIST"):
        _set_alias(Client(1, "RESOURCE_DOES_NOT_EXIST: no model m"), "m", "candidate", 3)
    lost = Client(10, race)
    with pytest.raises(RuntimeError, match="UniqueViolation"):
        _set_alias(lost, "m", "candidate", 3, attempts=3)
    assert lost.failures == 7 and not lost.written


@pytest.mark.parametrize("applied", [True, False], ids=["answer-lost", "not-applied"])
@pytest.mark.parametrize("method", ["create_run", "create_logged_model", "create_model_version"])
def test_a_create_whose_outcome_is_unknown_is_looked_up_before_it_is_sent_again(store, tmp_path, monkeypatch,
                                                                                  method, applied):
    """MLflow does not send a create again after a timeout or a 5xx (it may have been applied): the registration
    looks for what that try made, by a tag or id only it uses, and sends the create again only when nothing is
    there. Either way the bundle is registered once: one run, one logged model, one version."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    real, calls = getattr(MlflowClient, method), []

    def flaky(self, *args, **kwargs):
        calls.append(method)
        if len(calls) > 1:
            return real(self, *args, **kwargs)
        if applied:  # the store wrote it; its answer never came
            real(self, *args, **kwargs)
            raise MlflowException(f"API request to http://store/{method} failed with timeout exception Read timed out")
        raise MlflowException(f"API request to endpoint /{method} failed with error code 503 != 200. "
                              "Response body: 'upstream unavailable'")

    monkeypatch.setattr(MlflowClient, method, flaky)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    model = f"hand/unknown-{method.replace('_', '-')}-{applied}"
    bundle = make_bundle(tmp_path / "b", model)
    out = registry.register_bundle(bundle, {}, {}, [], tracking_uri=store["uri"])
    assert len(calls) == (1 if applied else 2)
    assert (out["version"], out["alias"], out["existing"]) == (1, "candidate", False)
    db = store["db"]
    runs = sql(db, "SELECT r.status FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
                   "WHERE t.key = 'dsaindex.registered_name' AND t.value = ?", out["name"])
    assert runs == [("FINISHED",)]
    assert sql(db, "SELECT count(*) FROM logged_models WHERE source_run_id = ?", out["run_id"]) == [(1,)]
    assert sql(db, "SELECT version FROM model_versions WHERE name = ?", out["name"]) == [(1,)]


def test_a_create_refused_outright_is_not_sent_again(store, tmp_path, monkeypatch):
    """An answer that says the store refused the write (a 4xx) is not a lost answer: no lookup, no second try,
    nothing registered."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    calls = []

    def refused(self, *args, **kwargs):
        calls.append(1)
        raise MlflowException("API request to endpoint /runs/create failed with error code 400 != 200.")

    monkeypatch.setattr(MlflowClient, "create_run", refused)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
    with pytest.raises(DsaIndexError, match="Cannot start a run .* nothing was registered"):
        registry.register_bundle(make_bundle(tmp_path / "b", "hand/refused-create"), {}, {}, [],
                                 tracking_uri=store["uri"])
    assert calls == [1]
