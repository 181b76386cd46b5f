"""``dsaindex registry ui``: the MLflow UI over the registry's store, as a process group of its own.

The server starts workers of its own; it runs in its own process group, and the whole group is stopped
with the dsaindex process: on SIGTERM or SIGINT by the process itself, and when the process dies without a
word (SIGKILL, a crash) by the launcher that leads the group, which stops it once its parent is gone, so
no server is left running and serving.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from dsaindex.artifacts.registry import artifact_root, resolve_tracking_uri, sqlite_path
from dsaindex.errors import DsaIndexError


def ui_command(port: int = 5000, tracking_uri: str | None = None) -> list[str]:
    """The ``mlflow server`` command line bound to 127.0.0.1 on the resolved store."""
    uri = resolve_tracking_uri(tracking_uri)
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri,
           "--host", "127.0.0.1", "--port", str(port)]
    root = artifact_root(uri)
    if root is not None:
        cmd += ["--artifacts-destination", str(root)]
    return cmd


# the launcher: leads the server's process group (a session of its own), runs the server in it, and stops
# the whole group once the dsaindex process that started it is gone without stopping it (kill -9, a crash)
_LAUNCHER = """
import os, signal, subprocess, sys, time
parent = int(sys.argv[1])
server = subprocess.Popen(sys.argv[2:])
while server.poll() is None:
    if os.getppid() != parent:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.killpg(0, signal.SIGTERM)
        deadline = time.monotonic() + 10.0
        while server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(0, signal.SIGKILL)
    time.sleep(0.5)
sys.exit(server.returncode)
"""


def _launch(cmd: list[str]) -> subprocess.Popen:
    """``cmd`` in a new session and process group led by :data:`_LAUNCHER` (the group's id is its pid)."""
    return subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(os.getpid()), *cmd], start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=2)


class _Stop(Exception):
    """SIGTERM or SIGINT reached the process that runs the UI."""


def ui(port: int = 5000, tracking_uri: str | None = None, on_ready: Callable[[str, int], None] | None = None,
       start_timeout_s: float = 180.0) -> int:
    """Run the MLflow UI on http://127.0.0.1:<port> until this process gets SIGTERM or SIGINT (or the
    server exits); returns 0 when stopped, else the server's exit code.

    The server runs in its own process group (it starts workers of its own), and the whole group is
    stopped with this process: SIGTERM, then SIGKILL for what is left after 10 s. ``on_ready(url, pgid)``
    is called once the server answers HTTP.
    """
    uri = resolve_tracking_uri(tracking_uri)
    db = sqlite_path(uri)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as err:
            raise DsaIndexError(f"Port {port} on 127.0.0.1 is not free ({err.strerror}).",
                                "pass --port with a free port, or stop what listens there.") from None

    def stop(signum, frame):
        raise _Stop

    handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    proc = None
    stopped = False
    try:
        # the server's own output goes to stderr: stdout carries only what the caller prints
        proc = _launch(ui_command(port, uri))  # kill -9 of this process must not leave the server serving
        url = f"http://127.0.0.1:{port}"
        if _wait_until_answers(url, proc, start_timeout_s):
            if on_ready is not None:
                on_ready(url, proc.pid)
        elif proc.poll() is None:
            print(f"registry: the MLflow UI does not answer at {url} after {start_timeout_s:.0f} s; still waiting",
                  file=sys.stderr, flush=True)
        return proc.wait()
    except (_Stop, KeyboardInterrupt):
        stopped = True
        return 0
    finally:
        for sig in handlers:  # a second signal must not cut the group's shutdown short
            signal.signal(sig, signal.SIG_IGN)
        if proc is not None:
            _stop_group(proc)
            if stopped:
                print(f"registry: the MLflow UI is stopped (its process group {proc.pid} is down)",
                      file=sys.stderr, flush=True)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _wait_until_answers(url: str, proc: subprocess.Popen, timeout_s: float) -> bool:
    """Poll ``url/health`` until it answers (True), the server exits or ``timeout_s`` passes (False)."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1.0):
                return True
        except OSError:
            time.sleep(0.25)
    return False


def _stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop the process group that ``proc`` leads: SIGTERM, then SIGKILL after ``grace_s``."""
    pgid = proc.pid
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.1)
            if not group_alive(pgid):
                return


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies waiting to be reaped do not count)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc_fs = Path("/proc")
    if not proc_fs.is_dir():
        return True
    for stat in proc_fs.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False
