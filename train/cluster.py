"""Per-layer jobs fanned out over a Ray cluster (``train pq``, ``train ivf``, ``eval pq``, ``eval ivf`` with
``ray=...``).

Each layer is one Ray task. The task opens the capture store by its location (a path today, an ``s3://``
URI later: the location string travels, never the keys), trains or evaluates its layer on the worker's
device (a GPU where Ray gave the task one, else the CPU) with a fixed thread count, and returns plain
arrays and dicts through Ray's object store (nothing is written to disk and read back, no string becomes
code). The driver waits with ``ray.wait``, advances the progress callback as each layer finishes, and
assembles the results in layer order, so the bundle it writes is the serial job's.

Identity with the serial job holds on the same device at the same thread count: CPU matmuls and faiss
split their sums by thread, so a layer trained with 2 threads differs in the last bits from one trained
with 1. :func:`pinned_threads` sets the count in both (a task runs with ``RaySettings.threads``, which is
also the CPUs it asks Ray for).

A worker that dies (killed, out of memory, its node lost) has its task retried (``RaySettings.retries``);
an error the task raises (a :class:`~dsaindex.errors.DsaIndexError`, a bug) is not retried and reaches
the caller as it was raised.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOCAL = "auto"
"""The address that starts a local Ray cluster on this machine (stopped when the job ends)."""

RAY_VERSION = ">=2.60"

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class RaySettings:
    """Where and how the layers run.

    ``address``: :data:`LOCAL` (``"auto"``) starts a local cluster of ``local_cpus`` CPUs (None: every
    core), its own even where ``RAY_ADDRESS`` names another or a ``ray start`` cluster runs here; anything
    else is the address of a running cluster (``host:port`` of its head, or ``ray://host:10001``), probed
    within ``connect_timeout_s`` first. A process already connected to Ray (``ray.init`` called) keeps its
    connection. ``threads``: torch / faiss threads of each layer task, and the CPUs it asks Ray for.
    ``workers``: layer tasks in flight at most (None: as many as the cluster schedules). ``retries``:
    times a layer whose worker died is run again."""

    address: str = LOCAL
    threads: int = 1
    workers: int | None = None
    local_cpus: int | None = None
    retries: int = 3
    connect_timeout_s: float = 10.0

    @classmethod
    def of(cls, ray: str | RaySettings) -> RaySettings:
        """Settings from an address (defaults otherwise) or settings as given."""
        return ray if isinstance(ray, RaySettings) else cls(address=ray)


@dataclass(frozen=True)
class ClusterInfo:
    """What the connected cluster offers: alive nodes, CPUs and GPUs in all."""

    nodes: int
    cpus: float
    gpus: float
    node_cpus: tuple[float, ...]
    node_gpus: tuple[float, ...]

    def describe(self) -> str:
        return (f"{self.nodes} Ray node{'s' * (self.nodes != 1)} ({self.cpus:g} CPUs"
                + (f", {self.gpus:g} GPUs)" if self.gpus else ")"))


def require_ray() -> Any:
    """The ``ray`` module, or a :class:`DsaIndexError` naming the install."""
    try:
        import ray
    except ImportError:
        from dsaindex.errors import DsaIndexError

        raise DsaIndexError("--ray needs Ray, which is not installed in this environment.",
                            f"pip install 'ray{RAY_VERSION}' (the same version on every node of the cluster), "
                            "or leave out --ray to train one layer after another here.") from None
    return ray


def _probe(address: str, timeout_s: float) -> None:
    """Refuse an address where nothing answers within ``timeout_s`` (``ray.init`` would retry for minutes)."""
    from dsaindex.errors import DsaIndexError

    host, _, port = address.removeprefix("ray://").rpartition(":")
    fix = (f"start the cluster (`ray start --head` on its head node), pass its head's host:port (or "
           f"ray://host:10001), or pass --ray {LOCAL} for a local cluster on this machine.")
    if not host or not port.isdigit():
        raise DsaIndexError(f"--ray {address!r} is not a cluster address (host:port or ray://host:port).", fix)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise DsaIndexError(f"No Ray cluster answers at {address} within {timeout_s:g} s "
                            f"({err.strerror or type(err).__name__}).", fix) from None


def check_reachable(ray: str | RaySettings) -> None:
    """Raise :class:`DsaIndexError` now if Ray is missing or nothing answers at the address (before a job
    spends time on anything else)."""
    settings = RaySettings.of(ray)
    require_ray()
    if settings.address != LOCAL:
        _probe(settings.address, settings.connect_timeout_s)


def _cluster_info(ray: Any) -> ClusterInfo:
    alive = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    cpus = tuple(float(r.get("CPU", 0)) for r in alive)
    gpus = tuple(float(r.get("GPU", 0)) for r in alive)
    return ClusterInfo(len(alive), sum(cpus), sum(gpus), cpus, gpus)


AUTH_MODE = "RAY_AUTH_MODE"


def _token_at_hand() -> bool:
    """Whether this process can present a Ray cluster token: ``RAY_AUTH_TOKEN``, the file named by
    ``RAY_AUTH_TOKEN_PATH``, or ``~/.ray/auth_token`` (where ``ray get-auth-token --generate`` and a local
    ``ray.init()`` write one)."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or (Path(path).is_file() if path
                                                        else (Path.home() / ".ray" / "auth_token").is_file())


def _use_cluster_token() -> bool:
    """Present the cluster token where one is at hand and the user left ``RAY_AUTH_MODE`` unset.

    ``ray start`` (Ray 2.60) turns token authentication on where a token is in ``~/.ray/auth_token`` (any
    earlier local ``ray.init()`` leaves one there), but ``ray.init`` with an explicit address sends no token
    unless ``RAY_AUTH_MODE=token``: the connection is refused after half a minute of retries. A cluster without
    authentication ignores a token, so presenting one is safe either way. Returns whether a token is sent."""
    mode = os.environ.get(AUTH_MODE)
    if mode is not None:
        return mode.lower() == "token"
    if not _token_at_hand():
        return False
    try:  # Ray reads the mode when it is imported: its own switch refreshes that
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:
        return False
    return bool(maybe_enable_token_auth_if_token_available(warn_if_disabled=False))


def _refused(address: str, token: bool, err: Exception) -> Exception:
    """The error for a cluster that answers at ``address`` but would not take this process as a driver."""
    from dsaindex.errors import DsaIndexError

    if token:
        fix = ("pass the token the cluster was started with (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, or the head "
               "node's ~/.ray/auth_token copied to this machine), or check that --ray names the cluster's head.")
    else:
        fix = ("if the cluster uses token authentication (`ray start` turns it on), set RAY_AUTH_MODE=token and "
               "its token (RAY_AUTH_TOKEN, or the head node's ~/.ray/auth_token copied here); or start the "
               "cluster with RAY_AUTH_MODE=disabled on a trusted network.")
    return DsaIndexError(f"The Ray cluster at {address} answers but did not accept this process ({err}).", fix)


@contextlib.contextmanager
def connect(settings: RaySettings) -> Iterator[ClusterInfo]:
    """Connect to (or start) the cluster of ``settings`` for the block; a cluster this call started, or a
    connection it opened, is shut down after it. Unreachable addresses and a missing Ray raise
    :class:`DsaIndexError`."""
    import logging

    ray = require_ray()
    if settings.address != LOCAL:
        _probe(settings.address, settings.connect_timeout_s)
    started = False
    if not ray.is_initialized():
        quiet = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.WARNING}
        if settings.address == LOCAL:
            # "local": a cluster of its own even where RAY_ADDRESS is set or an earlier `ray start` left its
            # address in Ray's temp folder (Ray would join that one, and refuse num_cpus for it)
            ray.init(address="local", num_cpus=settings.local_cpus, **quiet)
        else:
            token = _use_cluster_token()
            try:
                ray.init(address=settings.address, **quiet)
            except (ConnectionError, RuntimeError) as err:
                raise _refused(settings.address, token, err) from None
        started = True
    try:
        yield _cluster_info(ray)
    finally:
        if started:
            ray.shutdown()


@contextlib.contextmanager
def pinned_threads(threads: int) -> Iterator[None]:
    """Run the block with ``threads`` torch (intra-op) and faiss (OpenMP) threads, restored after. A layer
    task runs under it; so must a serial job whose result is to be compared bit for bit."""
    import torch

    try:
        import faiss
    except ImportError:
        faiss = None
    before = torch.get_num_threads(), faiss.omp_get_max_threads() if faiss else None
    torch.set_num_threads(threads)
    if faiss:
        faiss.omp_set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before[0])
        if faiss:
            faiss.omp_set_num_threads(before[1])


def _run_layer(task: Callable[..., dict], threads: int, layer: int, *args: Any) -> dict:
    """A layer task as a worker runs it: ``task(layer, device, *args)`` under :func:`pinned_threads`, on
    the GPU Ray gave it (else the CPU). Returns ``{"result": what the task returned, "worker": where and
    how long}``."""
    import ray

    device = "cuda" if ray.get_gpu_ids() else "cpu"
    t0 = time.perf_counter()
    with pinned_threads(threads):
        result = task(layer, device, *args)
    worker = {"host": socket.gethostname(), "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()[:12],
              "device": device, "threads": threads, "seconds": round(time.perf_counter() - t0, 3)}
    return {"result": result, "worker": worker}


def location(store_path: str | Path) -> str:
    """The store's location as a worker opens it: a URI as given, a local path made absolute (a worker's
    working folder is not the driver's)."""
    text = str(store_path)
    return text if "://" in text else str(Path(text).resolve())


def run_layers(task: Callable[..., dict], layers: list[int], args: tuple, ray: str | RaySettings,
               device: str = "cpu", progress: Progress | None = None) -> dict[int, dict]:
    """Run ``task(layer, device, *args)`` for every layer as Ray tasks; returns ``{layer: {"result",
    "worker"}}`` in the order of ``layers`` (see :func:`_run_layer`).

    ``task`` is a module-level function (workers import it by name) returning plain arrays and dicts.
    ``device``: the job's device; unless it is ``cpu``, each task asks for a GPU where the cluster has
    GPUs. ``progress(layers done, layers in all, text)`` is called once before the first layer finishes
    and then as each layer's result arrives (``layer N: done (...)``)."""
    settings = RaySettings.of(ray)
    progress = progress or (lambda done, total, text: None)
    with connect(settings) as cluster:
        import ray as ray_module

        gpus = 1 if cluster.gpus and device != "cpu" else 0
        _check_schedulable(cluster, settings, gpus)
        remote = ray_module.remote(_run_layer).options(num_cpus=settings.threads, num_gpus=gpus,
                                                       max_retries=settings.retries, retry_exceptions=False)
        shared = [ray_module.put(a) for a in args]  # stored once, read by every task (Ray resolves the refs)
        queue, pending, done = list(layers), {}, {}

        def submit() -> None:
            while queue and (settings.workers is None or len(pending) < settings.workers):
                layer = queue.pop(0)
                pending[remote.remote(task, settings.threads, layer, *shared)] = layer

        submit()
        progress(0, len(layers), f"{len(layers)} layers on {cluster.describe()}")
        try:
            while pending:
                ready, _ = ray_module.wait(list(pending), num_returns=1)
                layer = pending.pop(ready[0])
                done[layer] = _result(ray_module, ready[0], layer, settings)
                worker = done[layer]["worker"]
                progress(len(done), len(layers), f"layer {layer}: done ({worker['host']}, {worker['device']}, "
                                                 f"{worker['seconds']:.1f} s)")
                submit()
        finally:
            for ref in pending:  # a failed layer stops the job: the others' work is dropped
                ray_module.cancel(ref, force=True)
    return {layer: done[layer] for layer in layers}


def _check_schedulable(cluster: ClusterInfo, settings: RaySettings, gpus: int) -> None:
    """Refuse tasks no node can run (Ray would wait for such a node forever)."""
    from dsaindex.errors import DsaIndexError

    if settings.threads < 1 or (settings.workers is not None and settings.workers < 1):
        raise DsaIndexError(f"Ray tasks of {settings.threads} threads, {settings.workers} at a time, cannot run.",
                            "pass 1 or more threads and workers.")
    fits = [c >= settings.threads and g >= gpus for c, g in zip(cluster.node_cpus, cluster.node_gpus, strict=True)]
    if not any(fits):
        raise DsaIndexError(f"No node of the Ray cluster ({cluster.describe()}) has {settings.threads} CPUs"
                            + (" and a GPU" if gpus else "") + " for a layer task.",
                            "ask for fewer threads per task, or add larger nodes to the cluster.")


def _result(ray: Any, ref: Any, layer: int, settings: RaySettings) -> dict:
    """The layer's result; a task's own error is raised as it was raised, a worker lost more often than
    the retries allow as a :class:`DsaIndexError`."""
    from ray import exceptions

    from dsaindex.errors import DsaIndexError

    try:
        return ray.get(ref)
    except exceptions.RayTaskError as err:
        cause = getattr(err, "cause", None)
        if isinstance(cause, DsaIndexError):
            raise cause from None
        raise
    except exceptions.RayError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        attempts = settings.retries + 1
        raise DsaIndexError(
            f"Layer {layer}'s Ray worker was lost on {'each of its' if attempts > 1 else 'its'} {attempts} "
            f"attempt{'s' * (attempts > 1)} ({type(err).__name__}: {first}).",
            "check the workers' memory (one layer's keys, metric queries and training subsample must fit) and "
            "the nodes' logs (`ray logs`), then run the job again.") from None


def bundle_differences(a: str | Path, b: str | Path) -> list[str]:
    """Where two bundles differ, array for array (bitwise), in their metrics and in their layers'
    parameters (timings left out: ``train_seconds``, ``train.seconds``). Empty: the same bundle."""
    import numpy as np

    from dsaindex.artifacts.bundle import read_bundle

    (ma, xa), (mb, xb) = read_bundle(a), read_bundle(b)
    if ma.layer_ids != mb.layer_ids:
        return [f"layers {ma.layer_ids} vs {mb.layer_ids}"]
    found = []
    for layer in ma.layer_ids:
        if set(xa[layer]) != set(xb[layer]):
            found.append(f"layer {layer}: arrays {sorted(xa[layer])} vs {sorted(xb[layer])}")
        found += [f"layer {layer}: {name}" for name in sorted(set(xa[layer]) & set(xb[layer]))
                  if not np.array_equal(np.asarray(xa[layer][name]), np.asarray(xb[layer][name]))]
        pa, pb = (_untimed(m.layers[str(layer)].params) for m in (ma, mb))
        if pa != pb:
            found.append(f"layer {layer}: params")
    found += [f"metric {name}" for name in sorted(set(ma.metrics) | set(mb.metrics))
              if ma.metrics.get(name) != mb.metrics.get(name)]
    return found


def _untimed(params: Any) -> Any:
    params = params if isinstance(params, dict) else params.model_dump()
    return {k: _untimed(v) if isinstance(v, dict) else v for k, v in params.items()
            if k not in ("train_seconds", "seconds")}
