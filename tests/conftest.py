import os

import pytest
import torch

from helpers import PRESETS

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


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
