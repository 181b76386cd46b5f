"""The registry against a shared MLflow tracking server, as a team runs one: ``mlflow server`` as a process
(basic auth on), its backend store in PostgreSQL (a throwaway cluster, ``postgres_cluster``), its artifact
root in S3 (moto's server, ``s3_endpoint``), clients uploading bundles straight to S3.

Every test here starts real processes (``slow``). One server is shared by the module; the test that stops
its server mid-registration starts one of its own. Each test registers under a model fingerprint (so a
registered name) of its own.
"""

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from dsaindex.artifacts import registry
from dsaindex.artifacts.bundle import LayerArtifact, Lineage, new_bundle_manifest, read_bundle, write_bundle
from dsaindex.artifacts.fingerprint import ModelFingerprint
from dsaindex.errors import DsaIndexError
from dsaindex.geometry import IndexerGeometry

pytestmark = pytest.mark.slow

ADMIN, PASSWORD = "admin", "dsaindex-admin-pw-1"
CREDENTIALS = {"MLFLOW_TRACKING_USERNAME": ADMIN, "MLFLOW_TRACKING_PASSWORD": PASSWORD}
_CLEARED = (*registry.HTTP_SETTINGS, "MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME",
            "MLFLOW_TRACKING_PASSWORD")


# ---- bundles ---------------------------------------------------------------------------------------
def fingerprint(name: str) -> ModelFingerprint:
    return ModelFingerprint(
        name=name, family="deepseek_v32",
        geometry=IndexerGeometry(family="deepseek_v32", num_layers=5, indexer_layers=(1, 4), n_heads=3,
                                 head_dim=8, topk=16, rope_dim=4, rope_layout="half_split_head"),
        config_digest="c0ffee", weights_digest="0123456789abcdef", dtype="bfloat16",
    )


def make_bundle(path: Path, model: str, seed: int) -> Path:
    """A two-layer bundle of small random arrays (its content differs with ``seed``)."""
    rng = np.random.default_rng(seed)
    lineage = Lineage(capture_store_id="store01", capture_store_path="/data/store", capture_store_digest="ab" * 8,
                      train_sequences=[0, 1], eval_sequences=[2])
    manifest = new_bundle_manifest(
        fingerprint(model), "hadamard", "bfloat16-bits",
        {1: LayerArtifact(kind="pq", params={"m": 2}), 4: LayerArtifact(kind="pq", params={"m": 2})},
        lineage, {"mean/k512/rerank@2048": 0.9 + seed / 1000}, {"seed": seed})
    write_bundle(path, manifest, {layer: {"codebooks": rng.standard_normal((2, 4, 4)).astype(np.float32)}
                                  for layer in (1, 4)})
    return path


def bundle_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---- the server ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TrackingServer:
    """``mlflow server`` over a PostgreSQL database and an S3 artifact root, in a process group of its own
    (so the test can stop or pause all its workers at once)."""

    def __init__(self, postgres_cluster, bucket: str, folder: Path):
        self.pg = postgres_cluster
        self.db = f"mlflow_{uuid.uuid4().hex[:8]}"
        self.bucket, self.artifact_root = bucket, f"{bucket}/mlflow"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        backend = postgres_cluster.create_database(self.db)
        auth_ini = folder / "basic_auth.ini"
        auth_ini.write_text(textwrap.dedent(f"""
            [mlflow]
            default_permission = READ
            database_uri = {postgres_cluster.create_database(self.db + "_auth")}
            admin_username = {ADMIN}
            admin_password = {PASSWORD}
            authorization_function = mlflow.server.auth:authenticate_request_basic_auth
            auth_cache_ttl_seconds = 600
            """))
        # clients log artifacts straight to S3 (--no-serve-artifacts): bundle bytes never pass through the server
        cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend,
               "--default-artifact-root", self.artifact_root, "--no-serve-artifacts", "--app-name", "basic-auth",
               "--host", "127.0.0.1", "--port", str(self.port), "--workers", "2"]
        env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
        env.update(MLFLOW_AUTH_CONFIG_PATH=str(auth_ini), PYTHONWARNINGS="ignore",
                   MLFLOW_FLASK_SERVER_SECRET_KEY=uuid.uuid4().hex)
        self.log = folder / "server.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.pgid = self.proc.pid
        start = time.monotonic()
        while True:
            try:
                with contextlib.closing(http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)) as conn:
                    conn.request("GET", "/health")
                    if conn.getresponse().status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() - start > 120:
                self.stop()
                pytest.fail(f"mlflow server did not start at {self.url}: {self.log.read_text()[-3000:]}")
            time.sleep(0.25)
        self.start_s = time.monotonic() - start
        self._warm_up()

    def _warm_up(self) -> None:
        """A few authenticated requests with a long timeout: each worker's first request starts its schedulers
        and checks the password (hashed: slow on a loaded machine) before the tests' short timeouts apply."""
        import base64

        token = base64.b64encode(f"{ADMIN}:{PASSWORD}".encode()).decode()
        for _ in range(4):
            with contextlib.closing(http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)) as conn:
                conn.request("GET", "/api/2.0/mlflow/experiments/get-by-name?experiment_name=Default",
                             headers={"Authorization": f"Basic {token}"})
                assert conn.getresponse().status == 200

    def query(self, sql: str, *args) -> list[tuple]:
        """Rows of the server's backend store, read straight from PostgreSQL."""
        return self.pg.query(self.db, sql, *args)

    def stop(self) -> None:
        for sig, wait_s in ((signal.SIGCONT, 0), (signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)  # workers left behind by a server that died first


def new_bucket() -> str:
    from dsaindex.artifacts.storage import filesystem

    name = f"dsa-{uuid.uuid4().hex[:10]}"
    filesystem().mkdir(name)
    return f"s3://{name}"


@pytest.fixture(scope="module")
def server(postgres_cluster, s3_endpoint, tmp_path_factory):
    srv = TrackingServer(postgres_cluster, new_bucket(), tmp_path_factory.mktemp("mlflow-server"))
    print(f"\nmlflow server (PostgreSQL + S3, basic auth) answered after {srv.start_s:.1f} s")
    saved = {k: os.environ.get(k) for k in _CLEARED}
    for key in _CLEARED:
        os.environ.pop(key, None)
    os.environ.update(CREDENTIALS)  # the API calls of this process (its CLI subprocesses get env())
    try:
        yield srv
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        srv.stop()


def env(**extra: str) -> dict[str, str]:
    """The environment of a CLI subprocess: this one's (AWS variables included), MLflow's HTTP settings
    left to dsaindex, the admin's credentials unless overridden (a value of None removes a variable)."""
    out = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    out.update(CREDENTIALS, PYTHONWARNINGS="ignore")
    for key, value in extra.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def cli(*args: str, environ: dict | None = None, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "dsaindex", *args], capture_output=True, text=True,
                          timeout=timeout, env=environ or env())
    return proc, time.perf_counter() - start


def s3_files(server: TrackingServer, model_id: str) -> dict[str, bytes]:
    """The artifact files of a logged model, read straight from the bucket: relative path -> bytes."""
    from dsaindex.artifacts.storage import filesystem

    fs = filesystem()
    found = [k for k in fs.find(server.artifact_root[len("s3://"):] + "/") if f"/models/{model_id}/artifacts/" in k]
    return {k.split("/artifacts/", 1)[1]: fs.cat_file(k) for k in found}


# ---- 1: the commands, on PostgreSQL and S3 ---------------------------------------------------------
def test_commands_against_a_postgres_s3_server(server, tmp_path):
    model = "team/commands"
    b1, b2 = make_bundle(tmp_path / "b1", model, 1), make_bundle(tmp_path / "b2", model, 2)
    name = registry.registered_name(fingerprint(model))
    first, _ = cli("registry", "register", str(b1), "--tracking-uri", server.url)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == f"{name} version 1 @candidate"
    second = registry.register_bundle(b2, {}, {}, [], tracking_uri=server.url)  # the API: one CLI start less
    assert (second["version"], second["alias"], second["existing"]) == (2, "candidate", False)
    again = registry.register_bundle(b1, {}, {}, [], tracking_uri=server.url)
    assert (again["version"], again["alias"], again["existing"]) == (1, None, True)

    # the rows are in PostgreSQL, the bundle files in the bucket, byte for byte
    assert server.query("SELECT version, status FROM model_versions WHERE name = %s AND "
                        "current_stage != 'Deleted_Internal' ORDER BY version", name) == [(1, "READY"), (2, "READY")]
    rows = registry.list_versions(name, tracking_uri=server.url)
    assert [(r["version"], r["aliases"], r["status"]) for r in rows] == [(2, ["candidate"], "READY"), (1, [], "READY")]
    for row, bundle in zip(rows, (b2, b1), strict=True):
        assert s3_files(server, row["model_id"]) == bundle_files(bundle)

    promoted, _ = cli("registry", "promote", name, "1", "--tracking-uri", server.url)
    assert promoted.returncode == 0 and promoted.stdout.strip() == f"{name}@production -> version 1", promoted.stderr
    listed, _ = cli("registry", "list", "--json", "--tracking-uri", server.url)
    assert listed.returncode == 0, listed.stderr
    assert [(r["version"], r["aliases"]) for r in json.loads(listed.stdout) if r["name"] == name] == [
        (2, ["candidate"]), (1, ["production"])]
    shown, _ = cli("registry", "show", name, "@production", "--json", "--tracking-uri", server.url)
    assert shown.returncode == 0, shown.stderr
    info = json.loads(shown.stdout)
    assert info["version"] == 1 and info["manifest"] == read_bundle(b1)[0].model_dump(mode="json")
    pulled, _ = cli("registry", "pull", name, "@candidate", str(tmp_path / "pulled"), "--tracking-uri", server.url)
    assert pulled.returncode == 0 and pulled.stdout.strip() == str(tmp_path / "pulled"), pulled.stderr
    assert bundle_files(tmp_path / "pulled") == bundle_files(b2)
    d = registry.diff(name, "1", "2", tracking_uri=server.url)
    assert d["params"] == {"seed": [1, 2]}
    loaded = registry.load_uri(f"models:/{name}@production", tmp_path / "cache", tracking_uri=server.url)
    assert bundle_files(loaded) == bundle_files(b1)


# ---- 2: transient errors and timeouts of a proxy in front of the server are retried -----------------
class FaultyProxy:
    """An HTTP proxy in front of the server (as nginx or a load balancer would be) that answers some
    requests itself instead of forwarding them: ``fault(n, method, path)`` returns ``"503"`` (a 503 with a
    plain-text body), ``"stall"`` (no answer at all, the request never forwarded), ``"drop"`` (the connection
    closed without an answer) or None (forwarded)."""

    def __init__(self, upstream_port: int, fault):
        proxy = self
        self.faults: list[tuple[str, str, str]] = []
        self.forwarded: list[tuple[str, str]] = []
        self.count = 0
        self.lock = threading.Lock()
        self.closing = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy.lock:
                    proxy.count += 1
                    what = fault(proxy.count, self.command, self.path) if self.path.startswith("/api/") else None
                    if what:
                        proxy.faults.append((what, self.command, self.path.split("?")[0]))
                    else:
                        proxy.forwarded.append((self.command, self.path.split("?")[0]))
                if what == "stall":
                    proxy.closing.wait(60)
                    self.close_connection = True
                    return
                if what == "drop":  # the connection closes without an answer, as when the server dies
                    self.close_connection = True
                    return
                if what == "503":
                    text = b"upstream unavailable"
                    self.send_response(503)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(text)))
                    self.end_headers()
                    self.wfile.write(text)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    answer = conn.getresponse()
                    data = answer.read()
                finally:
                    conn.close()
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in ("connection", "transfer-encoding", "content-length", "date", "server"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _any

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@contextlib.contextmanager
def faulty_proxy(server: TrackingServer, fault):
    proxy = FaultyProxy(server.port, fault)
    try:
        yield proxy
    finally:
        proxy.close()


def test_transient_503s_and_a_timeout_are_retried(server, tmp_path, monkeypatch):
    """Every 4th request gets a 503 from the proxy, and the first try of the run's creation no answer: with
    MLflow's retries that dsaindex sets, and dsaindex's own for the creates MLflow does not send again (a lookup
    first), the registration and the listing go through, once each (the retried requests were never
    forwarded: no second run, no second version)."""
    model = "team/transient"
    bundle = make_bundle(tmp_path / "b", model, 3)
    stalled: list[int] = []

    def fault(n, method, path):
        if path.startswith("/api/2.0/mlflow/runs/create") and not stalled:
            stalled.append(n)
            return "stall"
        return "503" if n % 4 == 0 else None

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")  # the user's setting is kept: the stall costs 3 s
    with faulty_proxy(server, fault) as proxy:
        start = time.monotonic()
        out = registry.register_bundle(bundle, {}, {}, [], tracking_uri=proxy.url)
        rows = registry.list_versions(out["name"], tracking_uri=proxy.url)
        seconds = time.monotonic() - start
    kinds = [kind for kind, _, _ in proxy.faults]
    print(f"\nthrough a faulty proxy: {kinds.count('503')} x 503 and {kinds.count('stall')} stall retried; "
          f"{seconds:.1f} s")
    assert kinds.count("stall") == 1 and kinds.count("503") >= 4
    assert ("POST", "/api/2.0/mlflow/runs/create") in proxy.forwarded  # its retry went through
    assert (out["version"], out["alias"], out["existing"]) == (1, "candidate", False)
    assert [(r["version"], r["aliases"], r["status"]) for r in rows] == [(1, ["candidate"], "READY")]
    # once each, as PostgreSQL holds it
    assert server.query("SELECT count(*) FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid WHERE t.key = "
                        "'dsaindex.bundle_id' AND t.value = %s", read_bundle(bundle)[0].bundle_id) == [(1,)]
    assert server.query("SELECT version FROM model_versions WHERE name = %s", out["name"]) == [(1,)]
    assert s3_files(server, out["model_id"]) == bundle_files(bundle)


def test_a_server_that_stops_answering_fails_in_seconds(server, tmp_path):
    """A proxy in front of the server that answers nothing (the server behind it is fine): one line naming the
    server, within the probe's short timeouts; a port where nothing listens: connection refused."""
    bundle = make_bundle(tmp_path / "b", "team/no-answer", 4)
    with faulty_proxy(server, lambda n, method, path: "stall") as proxy:
        start = time.monotonic()
        with pytest.raises(DsaIndexError) as err:
            registry.register_bundle(bundle, {}, {}, [], tracking_uri=proxy.url)
        seconds = time.monotonic() - start
    print(f"\nno answer: gave up after {seconds:.1f} s")
    assert seconds < 30
    assert err.value.problem.startswith(f"Cannot reach the MLflow tracking server at {proxy.url} (no answer in time")
    assert "Nothing was registered" in err.value.problem and "MLFLOW_HTTP_REQUEST_TIMEOUT" in err.value.fix
    refused_url = f"http://127.0.0.1:{free_port()}"
    proc, seconds = cli("registry", "list", "--tracking-uri", refused_url)
    assert proc.returncode == 2 and seconds < 30, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: Cannot reach the MLflow tracking server at {refused_url} (connection refused")
    assert "Traceback" not in proc.stderr


# ---- 3: credentials ------------------------------------------------------------------------------
def test_refused_credentials_name_the_variables_to_set(server, tmp_path, monkeypatch):
    wrong, _ = cli("registry", "list", "--tracking-uri", server.url, environ=env(MLFLOW_TRACKING_PASSWORD="wrong"))
    assert wrong.returncode == 2 and wrong.stdout == "" and "Traceback" not in wrong.stderr
    last = wrong.stderr.strip().splitlines()[-1]
    assert last == (f"error: The MLflow tracking server at {server.url} refused the credentials (HTTP 401; user "
                    f"'{ADMIN}' given). Fix: set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (the server's "
                    "basic auth) or MLFLOW_TRACKING_TOKEN (a bearer token) to credentials the server accepts, then "
                    "retry.")
    for key in CREDENTIALS:
        monkeypatch.delenv(key)
    with pytest.raises(DsaIndexError, match=r"refused the credentials \(HTTP 401; no credentials given\)"):
        registry.list_versions(tracking_uri=server.url)

    # a user the server knows, with only the default READ permission, may list but not register
    from mlflow.server.auth.client import AuthServiceClient

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    AuthServiceClient(server.url).create_user("reader", "reader-pw-1234")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "reader")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "reader-pw-1234")
    assert isinstance(registry.list_versions(tracking_uri=server.url), list)
    with pytest.raises(DsaIndexError) as err:
        registry.register_bundle(make_bundle(tmp_path / "b", "team/reader", 5), {}, {}, [], tracking_uri=server.url)
    assert "denied a request to user 'reader' (HTTP 403" in err.value.problem
    assert "Nothing was registered" in err.value.problem and "MLFLOW_TRACKING_PASSWORD" in err.value.fix


# ---- 4: two registrations at once -------------------------------------------------------------------
RACER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    import mlflow  # imported before the start line: both processes start their requests together
    from dsaindex.artifacts.registry import register_bundle
    while not Path(sys.argv[3]).exists():
        time.sleep(0.005)
    print(json.dumps(register_bundle(sys.argv[1], {}, {}, [], tracking_uri=sys.argv[2])))
""")


def test_two_registrations_at_once_both_land(server, tmp_path):
    """Two processes register two bundles under one registered name at the same moment: two READY versions,
    distinct numbers, each holding its own bundle in S3, @candidate on the newer one."""
    model = "team/race"
    bundles = [make_bundle(tmp_path / f"b{i}", model, 10 + i) for i in (0, 1)]
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(b), server.url, str(go)], env=env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for b in bundles]
    time.sleep(3)  # both interpreters have imported MLflow
    go.write_text("go")
    results = [p.communicate(timeout=180) + (p.returncode,) for p in procs]
    for _out, err, rc in results:
        assert rc == 0, err
    done = [json.loads(out) for out, _, _ in results]
    name = done[0]["name"]
    assert sorted(d["version"] for d in done) == [1, 2]
    newer = max(done, key=lambda d: d["version"])
    assert newer["alias"] == "candidate"
    rows = registry.list_versions(name, tracking_uri=server.url)
    assert [(r["version"], r["aliases"], r["status"]) for r in rows] == [(2, ["candidate"], "READY"), (1, [], "READY")]
    for d, bundle in zip(done, bundles, strict=True):  # each version holds its own bundle
        assert s3_files(server, d["model_id"]) == bundle_files(bundle)
        assert registry.show(name, str(d["version"]), tracking_uri=server.url)["manifest"]["bundle_id"] == (
            read_bundle(bundle)[0].bundle_id)
    assert server.query("SELECT alias, version FROM registered_model_aliases WHERE name = %s", name) == [("candidate", 2)]
    assert server.query("SELECT count(*) FROM model_version_tags WHERE name = %s AND key = %s", name,
                        registry.REGISTERING) == [(0,)]


PAUSER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from mlflow import MlflowClient
    from dsaindex.artifacts.registry import register_bundle

    original = MlflowClient.set_registered_model_alias

    def pause(self, *args, **kwargs):  # its first write of @candidate waits until the other registration is done
        if not Path(sys.argv[3]).exists():
            Path(sys.argv[3]).write_text("paused")
            while not Path(sys.argv[4]).exists():
                time.sleep(0.05)
        return original(self, *args, **kwargs)

    MlflowClient.set_registered_model_alias = pause
    print(json.dumps(register_bundle(sys.argv[1], {}, {}, [], tracking_uri=sys.argv[2])))
""")


def test_the_last_alias_write_of_an_older_version_does_not_win(server, tmp_path):
    """The worst interleaving, made certain: registration A (version 1) is about to point @candidate at its
    version when registration B (version 2) runs from start to end. A's late write would leave @candidate on
    the older version; A sees the newer one and puts it back."""
    model = "team/interleaved"
    paused, go = tmp_path / "paused", tmp_path / "go"
    a = subprocess.Popen([sys.executable, "-c", PAUSER, str(make_bundle(tmp_path / "a", model, 20)), server.url,
                          str(paused), str(go)], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not paused.exists():
            assert a.poll() is None and time.monotonic() < deadline, a.stderr.read() if a.stderr else ""
            time.sleep(0.1)
        b = registry.register_bundle(make_bundle(tmp_path / "b", model, 21), {}, {}, [], tracking_uri=server.url)
    finally:
        go.write_text("go")
        out, err = a.communicate(timeout=120)
    assert a.returncode == 0, err
    first = json.loads(out)
    assert (first["version"], first["alias"]) == (1, None)
    assert (b["version"], b["alias"]) == (2, "candidate")
    assert registry.resolve(b["name"], "@candidate", tracking_uri=server.url) == 2
    assert [(r["version"], r["aliases"]) for r in registry.list_versions(b["name"], tracking_uri=server.url)] == [
        (2, ["candidate"]), (1, [])]


# ---- 5: the server gone or stopped mid-registration (SIGSTOP last: it pauses the module's server) ----
def wait_for_version(server: TrackingServer, name: str, version: int, proc: subprocess.Popen) -> None:
    """Poll PostgreSQL until ``name`` has a row for ``version`` (the registration is between its version
    row and its last step)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if server.query("SELECT 1 FROM model_versions WHERE name = %s AND version = %s", name, version):
            return
        time.sleep(0.005)
    raise AssertionError(f"no version {version} of {name} appeared (exit {proc.poll()})")


def test_server_gone_mid_registration(server, tmp_path):
    """The server goes away just after the version row appears (every later request's connection closes
    unanswered, as when its process dies): one line within seconds; when it is back, the next command from
    this machine undoes the half registration."""
    model = "team/gone"
    b1, b2 = make_bundle(tmp_path / "b1", model, 40), make_bundle(tmp_path / "b2", model, 41)
    state = {"down": False}
    with faulty_proxy(server, lambda n, method, path: "drop" if state["down"] else None) as proxy:
        name = registry.register_bundle(b1, {}, {}, [], tracking_uri=proxy.url)["name"]
        proc = subprocess.Popen([sys.executable, "-m", "dsaindex", "registry", "register", str(b2), "--tracking-uri",
                                 proxy.url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
        try:
            wait_for_version(server, name, 2, proc)
            state["down"] = True
            gone = time.monotonic()
            _, err = proc.communicate(timeout=90)
            seconds = time.monotonic() - gone
            print(f"\nserver gone mid-registration: exit {proc.returncode} after {seconds:.1f} s")
        finally:
            if proc.poll() is None:
                proc.kill()
        state["down"] = False
        assert proc.returncode == 2 and seconds < 30, err
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"error: Registering {b2} in {proxy.url} failed (") and "Traceback" not in err
        assert "What it wrote stays unfinished" in last and "the next registry command on this machine undoes it" in last
        assert any(kind == "drop" for kind, _, _ in proxy.faults)
        rows = registry.list_versions(name, tracking_uri=proxy.url)
    assert [(r["version"], r["aliases"]) for r in rows] == [(1, ["candidate"])]
    assert server.query("SELECT version, current_stage FROM model_versions WHERE name = %s ORDER BY version", name) == [
        (1, "None"), (2, "Deleted_Internal")]
    assert server.query("SELECT alias, version FROM registered_model_aliases WHERE name = %s", name) == [("candidate", 1)]


def test_server_stopped_mid_registration(server, tmp_path):
    """The server stops answering (SIGSTOP of its process group) just after the version row appears: the
    command gives up within 30 s with one line naming what it left; no version is READY without its bundle;
    once the server answers again the next command from this machine undoes the half registration."""
    from mlflow import MlflowClient

    model = "team/stopped"
    b1, b2 = make_bundle(tmp_path / "b1", model, 30), make_bundle(tmp_path / "b2", model, 31)
    name = registry.register_bundle(b1, {}, {}, [], tracking_uri=server.url)["name"]
    proc = subprocess.Popen([sys.executable, "-m", "dsaindex", "registry", "register", str(b2), "--tracking-uri",
                             server.url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    try:
        wait_for_version(server, name, 2, proc)
        os.killpg(server.pgid, signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = proc.communicate(timeout=90)
        seconds = time.monotonic() - stopped
        print(f"\nserver stopped mid-registration: exit {proc.returncode} after {seconds:.1f} s")
    finally:
        if proc.poll() is None:
            proc.kill()
        os.killpg(server.pgid, signal.SIGCONT)
    assert proc.returncode == 2 and seconds < 30, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "Traceback" not in err
    assert "What it wrote stays unfinished" in last and "the next registry command on this machine undoes it" in last

    # no version is READY and finished without its bundle: every finished one holds its files in S3
    client = MlflowClient(tracking_uri=server.url)
    for mv in client.search_model_versions(f"name='{name}'"):
        if registry.REGISTERING not in (mv.tags or {}):
            assert str(mv.status) == "READY"
            assert s3_files(server, mv.tags[registry.TAG + "model_id"]) == bundle_files(b1 if mv.version == "1" else b2)
    listed, _ = cli("registry", "list", "--json", "--tracking-uri", server.url)
    assert listed.returncode == 0, listed.stderr
    assert [(r["version"], r["aliases"]) for r in json.loads(listed.stdout) if r["name"] == name] == [(1, ["candidate"])]
    assert server.query("SELECT version, current_stage FROM model_versions WHERE name = %s ORDER BY version", name) == [
        (1, "None"), (2, "Deleted_Internal")]
    assert server.query("SELECT alias, version FROM registered_model_aliases WHERE name = %s", name) == [("candidate", 1)]
    assert server.query("SELECT r.status FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid WHERE t.key = "
                        "'dsaindex.bundle_id' AND t.value = %s", read_bundle(b2)[0].bundle_id) == [("FAILED",)]
    again = registry.register_bundle(b2, {}, {}, [], tracking_uri=server.url)  # and it registers once it answers
    assert (again["version"], again["alias"]) == (3, "candidate")

