"""The writer lock of capture stores in object storage (``storage.ObjectLock``), against moto's S3 server
run as its own process (the ``s3_endpoint`` fixture): of writers racing for a prefix exactly one wins; a
live holder is named and refused; a holder known dead (this host, its pid gone; or not refreshed for the
TTL by the store's clock) is taken over; a writer whose lock was taken commits nothing more; a refused
writer never removes what the holder is making."""

import json
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from dsaindex.artifacts.capture_store import CaptureSettings, CaptureStore, SequenceBatch, new_manifest
from dsaindex.artifacts.fingerprint import ModelFingerprint
from dsaindex.artifacts.storage import LOCK_OBJECT, ObjectLock, filesystem, list_objects, location
from dsaindex.errors import WriterLockError
from dsaindex.geometry import IndexerGeometry

GEOMETRY = IndexerGeometry(family="deepseek_v32", num_layers=2, indexer_layers=(0, 1), n_heads=4, head_dim=16,
                           topk=8, rope_dim=8, rope_layout="interleaved_head")
MODEL = ModelFingerprint(name="hand/lock-test", family="deepseek_v32", geometry=GEOMETRY, config_digest="c0",
                         weights_digest="0123456789abcdef", dtype="bfloat16")
SETTINGS = CaptureSettings(seq_len=16, chunk_len=16, basis="raw", key_dtype="float32")


def batch(seed: int) -> SequenceBatch:
    rng = np.random.default_rng(seed)
    return SequenceBatch(
        sequence_tokens=[16], sequence_keys=[16], sequence_queries=[2], tokens=[np.arange(16)],
        query_position=[np.array([3, 9])], query_sequence=[np.array([0, 0])], query_window=[np.array([-1, -1])],
        keys={i: [rng.standard_normal((16, 16)).astype(np.float32)] for i in (0, 1)},
        queries={i: [rng.standard_normal((2, 4, 16)).astype(np.float32)] for i in (0, 1)},
        head_weights={i: [rng.random((2, 4)).astype(np.float32)] for i in (0, 1)})


def put_lock(where, holder: dict) -> None:
    """A lock object as another writer would have left it (unconditional PUT)."""
    filesystem().pipe_file(f"{where.fs_path}/{LOCK_OBJECT}", json.dumps(holder).encode())


def holder_of(where) -> dict:
    return json.loads(filesystem().cat_file(f"{where.fs_path}/{LOCK_OBJECT}"))


def test_of_writers_racing_for_a_prefix_exactly_one_wins(s3_bucket):
    where = location(f"{s3_bucket}/race.zarr")
    locks = [ObjectLock(where) for _ in range(6)]
    start = threading.Barrier(len(locks))
    outcome: list[str] = [""] * len(locks)

    def take(i):
        start.wait()
        try:
            locks[i].acquire()
            outcome[i] = "won"
        except WriterLockError:
            outcome[i] = "refused"

    threads = [threading.Thread(target=take, args=(i,)) for i in range(len(locks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcome.count("won") == 1 and outcome.count("refused") == len(locks) - 1, outcome
    winner = locks[outcome.index("won")]
    assert holder_of(where)["id"] == winner.owner["id"]
    winner.release()
    assert LOCK_OBJECT not in list_objects(where)  # released: deleted


def test_a_live_holder_is_named_and_refused_until_it_releases(s3_bucket):
    where = location(f"{s3_bucket}/live.zarr")
    first, second = ObjectLock(where), ObjectLock(where)
    first.acquire()
    with pytest.raises(WriterLockError) as err:
        second.acquire()
    assert f"process {first.owner['pid']} on {socket.gethostname()}" in err.value.problem
    assert "wait for it to finish" in err.value.fix
    first.release()
    second.acquire()
    assert holder_of(where)["id"] == second.owner["id"]
    second.release()


def test_a_holder_whose_process_is_gone_is_taken_over_at_once(s3_bucket):
    where = location(f"{s3_bucket}/dead.zarr")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    put_lock(where, {"id": "x", "host": socket.gethostname(), "pid": int(gone.stdout), "refreshed": time.time()})
    lock = ObjectLock(where)  # the default TTL (a minute): only the dead pid lets it in now
    lock.acquire()
    assert holder_of(where)["id"] == lock.owner["id"]
    lock.release()


def test_a_holder_on_another_host_is_taken_over_only_after_the_ttl(s3_bucket):
    where = location(f"{s3_bucket}/remote.zarr")
    put_lock(where, {"id": "x", "host": "another-host", "pid": 1, "refreshed": time.time()})
    with pytest.raises(WriterLockError, match="another-host"):
        ObjectLock(where, ttl=60).acquire()
    time.sleep(2.5)  # the store's Last-Modified has a resolution of one second
    lock = ObjectLock(where, ttl=1)
    lock.acquire()
    assert holder_of(where)["id"] == lock.owner["id"]
    lock.release()


def test_a_holder_keeps_its_lock_alive_past_the_ttl(s3_bucket):
    where = location(f"{s3_bucket}/refreshed.zarr")
    holder = ObjectLock(where, ttl=2, heartbeat=0.3)
    holder.acquire()
    time.sleep(3.5)  # longer than the TTL: only the refreshes keep it
    with pytest.raises(WriterLockError):
        ObjectLock(where, ttl=2).acquire()
    assert holder.lost is None
    holder.release()


def test_a_writer_that_lost_its_lock_commits_nothing_more(s3_bucket):
    path = f"{s3_bucket}/lost.zarr"
    CaptureStore.create(path, new_manifest(MODEL, SETTINGS, {"sources": ["x"]}, "tok")).close()
    store = CaptureStore.open_for_append(path)
    store._object_lock.heartbeat = 0.2
    store._object_lock.release()  # restart the refreshes at the short period
    store._object_lock.acquire()
    store.append(batch(0))
    where = location(path)
    put_lock(where, {"id": "y", "host": "another-host", "pid": 2, "refreshed": time.time()})  # taken over
    deadline = time.monotonic() + 10
    while store._object_lock.lost is None and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(WriterLockError, match="lost"):
        store.append(batch(1))
    store.close()
    assert CaptureStore.open(path).committed.sequences == 1
    assert holder_of(where)["id"] == "y"  # the new holder's lock is left alone


def test_a_second_writer_on_a_store_is_refused_and_removes_nothing(s3_bucket):
    path = f"{s3_bucket}/two.zarr"
    CaptureStore.create(path, new_manifest(MODEL, SETTINGS, {"sources": ["x"]}, "tok")).close()
    with CaptureStore.open_for_append(path) as store:
        store.append(batch(0))
        before = list_objects(location(path))
        with pytest.raises(WriterLockError):
            CaptureStore.open_for_append(path)
        with pytest.raises(WriterLockError):  # a creation racing the holder is refused before it lists or removes
            CaptureStore.create(path, new_manifest(MODEL, SETTINGS, {"sources": ["x"]}, "tok"))
        assert list_objects(location(path)) == before
        store.append(batch(1))
    assert CaptureStore.open(path).committed.sequences == 2
    assert LOCK_OBJECT not in list_objects(location(path))
    with CaptureStore.open_for_append(path) as again:  # free again once the writer closed
        assert again.committed.sequences == 2


def test_a_lock_taken_between_the_refusal_and_the_read_is_refused_as_held(s3_bucket, monkeypatch):
    """The holder released and another writer took the lock between this writer's refused PUT and its read
    of the holder: the second PUT is refused too, as a lock held, not as an object-store failure."""
    where = location(f"{s3_bucket}/between.zarr")
    other = ObjectLock(where)
    other.acquire()
    late = ObjectLock(where)
    monkeypatch.setattr(late, "_holder", lambda: None)  # it read no holder: the lock looked released
    with pytest.raises(WriterLockError, match="at the same time"):
        late.acquire()
    assert holder_of(where)["id"] == other.owner["id"]
    other.release()
