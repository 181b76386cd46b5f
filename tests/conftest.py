import os

import pytest
import torch

from helpers import PRESETS

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def _interpret_programs_out_of_order(order: str) -> None:
    """Run the Triton interpreter's programs in another order than 0, 1, 2, ... (``DSAINDEX_GRID_ORDER=reverse``, or
    ``shuffle`` for a fixed random one): a GPU runs a launch's programs in any order, and a kernel or test that
    assumed the interpreter's (atomics appending in program order, a program reading what an earlier one wrote)
    passes on the CPU and fails on a GPU. Each program still sees its own ids; only when it runs changes. The lanes of
    an atomic read-modify-write take their turns in the same kind of order, not in lane order: a GPU's atomics on
    one address from one launch may come in any order."""
    import random

    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    set_dim, set_idx = builder.set_grid_dim, builder.set_grid_idx
    perms: list[list[int]] = [[0], [0], [0]]

    def order_of(n: int) -> list[int]:
        ids = list(range(n))
        if order == "reverse":
            return ids[::-1]
        random.Random(n).shuffle(ids)
        return ids

    def grid_dim(nx, ny, nz):
        perms[:] = [order_of(nx), order_of(ny), order_of(nz)]
        return set_dim(nx, ny, nz)

    def grid_idx(x, y, z):
        return set_idx(perms[0][x], perms[1][y], perms[2][z])

    builder.set_grid_dim, builder.set_grid_idx = grid_dim, grid_idx
    atomic_rmw = builder.create_atomic_rmw

    def lanes_out_of_order(op, ptr, val, mask, sem, scope):
        shape = ptr.data.shape
        perm = np.asarray(order_of(ptr.data.size), dtype=np.int64)

        def permuted(h):
            return interpreter.TensorHandle(np.ascontiguousarray(h.data.reshape(-1)[perm]).reshape(shape), h.dtype)

        old = atomic_rmw(op, permuted(ptr), permuted(val), permuted(mask), sem, scope)
        back = np.empty_like(old.data.reshape(-1))
        back[perm] = old.data.reshape(-1)
        return interpreter.TensorHandle(back.reshape(shape), old.dtype)

    builder.create_atomic_rmw = lanes_out_of_order


_GRID_ORDER = os.environ.get("DSAINDEX_GRID_ORDER", "")
if _GRID_ORDER:
    if _GRID_ORDER not in ("reverse", "shuffle") or os.environ.get("TRITON_INTERPRET") != "1":
        raise pytest.UsageError(f"DSAINDEX_GRID_ORDER={_GRID_ORDER!r}: want 'reverse' or 'shuffle', with "
                                f"TRITON_INTERPRET=1 (the interpreter's program order is what it changes)")
    _interpret_programs_out_of_order(_GRID_ORDER)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def loaded_models():
    """One loaded instance per preset for the whole session (loading takes ~0.1 s, but keeps tests short)."""
    from dsaindex.pipelines.capture.models import load_model

    return {ref: load_model(ref) for ref in PRESETS}


@pytest.fixture(scope="session")
def routing_store(tmp_path_factory):
    """A capture store of preset:tiny-v32 (the default corpus, 5 sequences of 1,536 tokens in chunks of 768),
    captured once for the modules that train and evaluate on it (IVF routing, cross-layer reuse): training
    and evaluation only read a store."""
    from helpers import run_cli

    store = tmp_path_factory.mktemp("routing") / "store"
    proc = run_cli("capture", str(store), "-m", "preset:tiny-v32", "-n", "5", "--seq-len", "1536",
                   "--chunk-len", "768", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    before = _digest(store)
    yield store
    assert _digest(store) == before, f"a test changed the shared store {store}"


def _digest(path) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file() and not p.name.startswith(".writer"):  # the writer's lock file
            h.update(str(p.relative_to(path)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """A real S3 endpoint for the session: moto's standalone server as its own process, over HTTP on
    127.0.0.1 at a free port, with the standard AWS variables pointing at it (restored afterwards; the AWS
    config files of the machine are kept out). Skips where moto's server is not installed."""
    import importlib.util
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("moto.server") is None:
        pytest.skip("moto's S3 server is not installed (pip install 'moto[server]')")
    if importlib.util.find_spec("s3fs") is None:
        pytest.skip("s3fs is not installed (pip install s3fs)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp_path_factory.mktemp("moto") / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                  stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"moto's server did not start on {url}: {log.read_text()[-2000:]}")
            time.sleep(0.2)
    nowhere = str(log.parent / "no-aws-config")
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_ENDPOINT_URL": url,
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": nowhere, "AWS_SHARED_CREDENTIALS_FILE": nowhere}
    saved = {k: os.environ.get(k) for k in (*env, "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3")}
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        os.environ.pop(k, None)
    os.environ.update(env)
    try:
        yield url
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A new, empty bucket on the session's S3 endpoint: its ``s3://name`` URI."""
    import uuid

    from dsaindex.artifacts.storage import filesystem

    name = f"dsa-{uuid.uuid4().hex[:10]}"
    filesystem().mkdir(name)
    return f"s3://{name}"


# ---- a throwaway PostgreSQL cluster (the backend store of a shared MLflow tracking server) ----------
def _postgres_binaries():
    """The folder holding ``initdb`` and ``postgres``: Debian's ``/usr/lib/postgresql/<major>/bin`` (newest
    first), else the PATH; None where neither has them."""
    import glob
    import re
    import shutil
    from pathlib import Path

    def major(folder: str) -> int:
        found = re.search(r"/postgresql/(\d+)/bin$", folder)
        return int(found.group(1)) if found else 0

    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=major, reverse=True):
        if all(os.access(os.path.join(folder, b), os.X_OK) for b in ("initdb", "postgres")):
            return Path(folder)
    initdb, postgres = shutil.which("initdb"), shutil.which("postgres")
    if initdb and postgres:
        return Path(os.path.realpath(initdb)).parent
    return None


def _missing(reason: str):
    """Skip, except on CI (``CI`` set, as CI services set it): there a missing service fails the run."""
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(f"{reason} (CI is set: the slow server tests must run there; see tools/services.sh)")
    pytest.skip(reason)


class PostgresCluster:
    """A running throwaway cluster: unix socket in ``socket_dir``, TCP on 127.0.0.1:``port``, one
    superuser ``user`` trusted without a password."""

    def __init__(self, socket_dir, port: int, user: str):
        self.socket_dir, self.port, self.user = str(socket_dir), port, user

    def connect(self, dbname: str = "postgres"):
        import psycopg2

        return psycopg2.connect(host=self.socket_dir, port=self.port, user=self.user, dbname=dbname)

    def create_database(self, name: str) -> str:
        """A new, empty database; its SQLAlchemy URI (over the unix socket; SQLAlchemy 2.1 takes a bare
        ``postgresql://`` for psycopg 3, so the URI names psycopg2)."""
        con = self.connect()
        try:
            con.autocommit = True
            with con.cursor() as cur:
                cur.execute(f'CREATE DATABASE "{name}"')
        finally:
            con.close()
        return self.uri(name)

    def uri(self, dbname: str) -> str:
        return f"postgresql+psycopg2://{self.user}@/{dbname}?host={self.socket_dir}&port={self.port}"

    def query(self, dbname: str, sql: str, *args) -> list[tuple]:
        con = self.connect(dbname)
        try:
            with con, con.cursor() as cur:
                cur.execute(sql, args)
                return cur.fetchall()
        finally:
            con.close()


@pytest.fixture(scope="session")
def postgres_cluster():
    """A PostgreSQL cluster for the session, made with ``initdb`` in a temporary folder and run with
    ``postgres`` on a free port (unix socket in that folder), stopped and deleted at the end.

    PostgreSQL refuses to run as root: as root the cluster belongs to and runs as the ``postgres`` system
    user (Debian's package makes it; it is created here where missing). Skips where no PostgreSQL binaries
    or no psycopg2 are found, unless ``CI`` is set: then it fails."""
    import importlib.util
    import pwd
    import shutil
    import signal
    import socket
    import subprocess
    import tempfile
    import time

    binaries = _postgres_binaries()
    if binaries is None:
        _missing("no PostgreSQL server binaries (initdb, postgres) under /usr/lib/postgresql/*/bin or on PATH "
                 "(apt-get install -y postgresql)")
    if importlib.util.find_spec("psycopg2") is None:
        _missing("psycopg2 is not installed (pip install psycopg2-binary)")
    as_user: dict = {}
    if os.geteuid() == 0:
        try:
            account = pwd.getpwnam("postgres")
        except KeyError:
            subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin",
                            "postgres"], check=True, capture_output=True)
            account = pwd.getpwnam("postgres")
        as_user = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
    # not under pytest's tmp folder: that is private to root (0700), and the server runs as another user
    base = tempfile.mkdtemp(prefix="dsaindex-pg-")
    if as_user:
        os.chown(base, as_user["user"], as_user["group"])
    data, log = os.path.join(base, "data"), os.path.join(base, "server.log")
    made = subprocess.run([str(binaries / "initdb"), "-D", data, "-U", "dsaindex", "--auth=trust", "-E", "UTF8",
                           "--no-sync"], capture_output=True, text=True, cwd=base, **as_user)
    if made.returncode != 0:
        shutil.rmtree(base, ignore_errors=True)
        pytest.fail(f"initdb failed: {made.stderr[-2000:]}")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with open(log, "w") as out:
        if as_user:
            os.chown(log, as_user["user"], as_user["group"])
        server = subprocess.Popen([str(binaries / "postgres"), "-D", data, "-p", str(port), "-k", base,
                                   "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=200"],
                                  stdout=out, stderr=subprocess.STDOUT, cwd=base, start_new_session=True, **as_user)
    cluster = PostgresCluster(base, port, "dsaindex")
    deadline = time.monotonic() + 60
    while True:
        try:
            cluster.connect().close()
            break
        except Exception:  # noqa: BLE001 - psycopg2.OperationalError until the server accepts connections
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                text = open(log).read()[-2000:]
                shutil.rmtree(base, ignore_errors=True)
                pytest.fail(f"PostgreSQL did not start: {text}")
            time.sleep(0.1)
    try:
        yield cluster
    finally:
        server.send_signal(signal.SIGINT)  # fast shutdown: a client left connected must not hold it up
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
        shutil.rmtree(base, ignore_errors=True)
