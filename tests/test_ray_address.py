"""``train pq --ray HOST:PORT`` against a cluster started the way a team starts one, ``ray start --head``, which
in Ray 2.60 turns token authentication on where a token is in ``~/.ray/auth_token`` (any earlier local
``ray.init()`` leaves one there, as does ``ray get-auth-token --generate``): the job
presents that token by itself (Ray sends none to an explicit address unless ``RAY_AUTH_MODE=token``), and a
process without the token is refused with the fix named, not with a bare ``ConnectionError``.

The cluster runs in a HOME of its own (its token file with it) and is stopped after the module."""

import os
import socket
import subprocess
import sys

import pytest

from helpers import run_cli

pytestmark = pytest.mark.slow

TRAIN = ("--subspaces", "32", "--trainer", "torch", "--iterations", "3", "--max-train-keys", "2048",
         "--eval-queries", "8", "--candidates", "64", "--device", "cpu", "--no-register")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A one-node cluster from ``ray start --head`` (token authentication as Ray sets it up by default),
    its HOME holding the token: yields (address, that HOME)."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'ray>=2.60')")
    home = tmp_path_factory.mktemp("ray-home")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(home)}
    cli = [sys.executable, "-m", "ray.scripts.scripts"]
    # a token in HOME (as `ray get-auth-token --generate` or any earlier local `ray.init()` leaves one) makes
    # `ray start` turn authentication on
    made = subprocess.run([*cli, "get-auth-token", "--generate"], capture_output=True, text=True, env=env, timeout=60)
    assert made.returncode == 0, made.stderr
    started = subprocess.run([*cli, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                              "--num-cpus", "1", "--num-gpus", "0", "--include-dashboard=false",
                              "--disable-usage-stats"], capture_output=True, text=True, env=env, timeout=120)
    assert started.returncode == 0, started.stderr
    try:
        yield f"127.0.0.1:{port}", home, env
    finally:
        subprocess.run([*cli, "stop", "--force"], capture_output=True, env=env, timeout=120)


def test_a_job_presents_the_token_ray_start_wrote(head, routing_store, tmp_path):
    address, home, env = head
    assert (home / ".ray" / "auth_token").is_file()  # the cluster expects it
    out = tmp_path / "bundle"
    proc = run_cli("train", "pq", str(routing_store), "--out", str(out), *TRAIN, "--ray", address, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from dsaindex.artifacts.bundle import read_bundle

    manifest, _ = read_bundle(out)
    assert manifest.layer_ids == [0, 1, 2, 3]  # every layer trained on the cluster


def test_a_process_without_the_token_is_refused_with_the_fix(head, routing_store, tmp_path):
    address, _, env = head
    stranger = tmp_path / "home"
    stranger.mkdir()
    out = tmp_path / "bundle"
    proc = run_cli("train", "pq", str(routing_store), "--out", str(out), *TRAIN, "--ray", address,
                   env=env | {"HOME": str(stranger)}, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"The Ray cluster at {address} answers but did not accept this process" in proc.stderr
    assert "RAY_AUTH_MODE=token" in proc.stderr
    assert not out.exists()


def test_ray_auto_starts_its_own_cluster_beside_a_running_one(head, routing_store, tmp_path):
    # RAY_ADDRESS names the running head and `ray start` left its address in Ray's temp folder: Ray alone would
    # join that cluster (which refuses this tokenless HOME, and takes no CPU count from a driver); --ray auto
    # starts a cluster of its own and trains every layer there
    address, _, env = head
    stranger = tmp_path / "home"
    stranger.mkdir()
    out = tmp_path / "bundle"
    proc = run_cli("train", "pq", str(routing_store), "--out", str(out), *TRAIN, "--ray", "auto",
                   env=env | {"HOME": str(stranger), "RAY_ADDRESS": address}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from dsaindex.artifacts.bundle import read_bundle

    manifest, _ = read_bundle(out)
    assert manifest.layer_ids == [0, 1, 2, 3]
