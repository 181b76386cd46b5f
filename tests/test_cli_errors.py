"""The command line as a user meets it when something goes wrong: usage errors, unusable store paths,
bad corpora, damaged stores, Ctrl-C, CUDA out of memory. Each error is one line on stderr,
``error: <problem> Fix: <fix>``, with exit code 2 (130 for Ctrl-C), and leaves what was captured as it was.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dsaindex.artifacts.capture_store import CaptureStore
from helpers import run_cli, run_cli_in_process, text_corpus

TINY = ("-m", "preset:tiny-v32", "--seq-len", "200", "--chunk-len", "100", "--no-progress")


def first_error_line(proc, code=2):
    """Asserts the exit code and a single-line error report; returns that line."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def assert_one_line_error(proc, *needles):
    line = first_error_line(proc)
    assert line.startswith("error: ") and " Fix: " in line, line
    for needle in needles:
        assert needle.lower() in line.lower(), line
    return line


def start_cli(*args):
    """``python -m dsaindex ARGS`` in the background, with Ctrl-C (SIGINT) handled as on a terminal even
    when the test runner was started with SIGINT ignored."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.Popen([sys.executable, "-m", "dsaindex", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def committed_sequences(path):
    try:
        return CaptureStore.open(path).committed.sequences if CaptureStore.exists(path) else 0
    except Exception:  # noqa: BLE001 - the store may be mid-creation
        return 0


# ---- 1. usage errors ------------------------------------------------------------------------------
@pytest.mark.parametrize("args, needle", [
    (["capture"], "missing argument"),
    (["capture", "s", "--no-such-flag"], "no such option"),
    (["capture", "s", "--sequences", "abc"], "--sequences"),
    (["store", "info"], "missing argument"),
    (["train", "pq", "s", "--subspaces", "many"], "--subspaces"),
    (["eval", "pq"], "missing argument"),
    (["registry", "show", "name"], "missing argument"),
    (["runtime", "check"], "missing option"),
    (["bench", "decode", "--no-such-flag"], "no such option"),
    (["reference", "eval", "--no-such-flag"], "no such option"),
    (["--no-such-flag"], "no such option"),
])
def test_usage_errors_are_one_line(args, needle):
    line = assert_one_line_error(run_cli(*args), needle)
    assert "--help" in line


def test_a_group_without_a_command_shows_its_help():
    proc = run_cli("store")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "info" in proc.stdout + proc.stderr


# ---- 3. option bounds: refused before anything is created --------------------------------------------
@pytest.mark.parametrize("args, needle", [
    (["--queries", "-3"], "--queries"),
    (["--sequences", "0"], "--sequences"),
    (["--sequences", "-1"], "--sequences"),
    (["--chunk-len", "0"], "--chunk-len"),
    (["--flush-tokens", "-1"], "--flush-tokens"),
])
def test_out_of_range_options_create_nothing(tmp_path, args, needle):
    store = tmp_path / "s"
    assert_one_line_error(run_cli("capture", str(store), *TINY, *args), needle)
    assert not store.exists()


# ---- 3. store locations -------------------------------------------------------------------------------
def test_store_path_that_is_a_file(tmp_path):
    corpus = text_corpus(tmp_path)
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    assert_one_line_error(run_cli("capture", str(target), *TINY, "-c", str(corpus)), "is a file")
    assert_one_line_error(run_cli("capture", str(target / "store"), *TINY, "-c", str(corpus)), "is a file")
    assert_one_line_error(run_cli("store", "info", str(target)), "is a file")
    assert target.read_text() == "mine"


def test_unwritable_store_location(tmp_path):
    corpus = text_corpus(tmp_path)
    assert_one_line_error(run_cli("capture", "/proc/dsaindex-test/store", *TINY, "-c", str(corpus)),
                          "cannot be created", "writable")
    if os.geteuid() != 0:  # root writes through permission bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert_one_line_error(run_cli("capture", str(locked / "s"), *TINY, "-c", str(corpus)), "cannot be created")
        assert list(locked.iterdir()) == []


# ---- 5. the corpus is checked before any model loads ----------------------------------------------------
def test_bad_corpus_is_refused_before_the_model_loads(tmp_path):
    """The model directory holds a non-DSA config: loading it first would report the model instead."""
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "ok"}\n{oops\n')
    wrong_field = tmp_path / "c.jsonl"
    wrong_field.write_text('{"body": "text under another field"}\n')
    for corpus, needle in ((tmp_path / "missing", "does not exist"), (bad_json, "bad.jsonl:2"),
                           (wrong_field, "no sequence")):
        store = tmp_path / "s"
        assert_one_line_error(run_cli("capture", str(store), "-m", str(model), "-c", str(corpus), "-n", "1"), needle)
        assert not store.exists()
    # a good corpus reaches the model, which is refused in turn
    assert_one_line_error(run_cli("capture", str(tmp_path / "s"), "-m", str(model), "-c", str(text_corpus(tmp_path)),
                                  "-n", "1"), "llama")


# ---- 6. binary files ------------------------------------------------------------------------------------
def test_binary_files_are_skipped_and_counted(tmp_path):
    corpus = text_corpus(tmp_path, files=1)
    (corpus / "image.txt").write_bytes(bytes(range(256)) * 8)  # NUL bytes
    (corpus / "latin1.md").write_bytes("caf\xe9 cr\xe8me ".encode("latin-1") * 50)  # not UTF-8
    store = tmp_path / "s"
    proc = run_cli("capture", str(store), *TINY, "-c", str(corpus), "-n", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines()[0].startswith("note: skipped 2 binary files"), proc.stderr
    corpus_record = json.loads(proc.stdout)["store"]["corpus"]
    assert corpus_record["skipped_binary"] == 2 and corpus_record["files"] == 1


# ---- 3. damaged chunks ------------------------------------------------------------------------------------
def test_corrupted_chunk_is_found_by_store_info_and_named_by_training(tmp_path):
    store = tmp_path / "s"
    proc = run_cli("capture", str(store), *TINY, "-c", str(text_corpus(tmp_path)), "-n", "2")
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("store", "info", str(store))
    assert proc.returncode == 0 and "verified" in proc.stdout, proc.stderr

    chunk = store / "layers" / "0" / "keys" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x10
    chunk.write_bytes(bytes(data))
    assert_one_line_error(run_cli("store", "info", str(store)), "layers/0/keys", "checksum")
    assert run_cli("store", "info", str(store), "--no-verify").returncode == 0
    assert_one_line_error(run_cli("train", "pq", str(store), "--no-register", "--json", "-o", str(tmp_path / "b")),
                          "layers/0/keys", "damaged")
    assert not (tmp_path / "b").exists()


def test_a_deleted_chunk_is_found_by_store_info_and_by_training_before_any_layer_trains(tmp_path):
    """zarr reads a missing chunk as zeros: `store info` and every reader must refuse it, and training checks
    every layer's chunks before the first layer trains (here the last layer's are damaged)."""
    store = tmp_path / "s"
    proc = run_cli("capture", str(store), *TINY, "-c", str(text_corpus(tmp_path)), "-n", "2")
    assert proc.returncode == 0, proc.stderr
    last = CaptureStore.open(store).layers[-1]
    (store / "layers" / str(last) / "keys" / "c" / "0" / "0").unlink()
    assert_one_line_error(run_cli("store", "info", str(store)), f"layers/{last}/keys", "lost its chunk")
    opened = CaptureStore.open(store)
    with pytest.raises(Exception, match="lost its chunk of committed rows 0-"):
        opened.keys(last)
    assert opened.check_chunks(layers=opened.layers[:1]) > 0  # the intact layers' chunks are all there
    proc = run_cli("train", "pq", str(store), "--no-register", "--json", "-o", str(tmp_path / "b"))
    assert_one_line_error(proc, f"layers/{last}/keys", "lost its chunk")
    assert "layer 0:" not in proc.stderr  # refused before the first layer trained
    assert not (tmp_path / "b").exists()


# ---- 2, 4. Ctrl-C keeps every committed sequence; the default commits after each one -------------------
@pytest.mark.slow
def test_ctrl_c_reports_what_was_kept_and_exits_130(tmp_path):
    store = tmp_path / "s"
    args = ["capture", str(store), "-m", "preset:tiny-v32", "-c", str(text_corpus(tmp_path, files=3)), "-n", "3",
            "--seq-len", "640", "--chunk-len", "320", "--no-progress"]
    # Ctrl-C lands just after the first sequence is committed (the command sends it to itself there: no race
    # with a capture that may run faster or slower than a poll)
    interrupting = textwrap.dedent("""
        import os, signal, sys
        from dsaindex.artifacts.capture_store import CaptureStore
        from dsaindex.cli import main

        commit = CaptureStore._write_attrs

        def write_attrs(self):
            commit(self)
            if self.committed.sequences == 1:
                os.kill(os.getpid(), signal.SIGINT)

        CaptureStore._write_attrs = write_attrs
        sys.argv = ["dsaindex", *sys.argv[1:]]
        main()
    """)
    proc = subprocess.Popen([sys.executable, "-c", interrupting, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONWARNINGS="ignore"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _, err = proc.communicate(timeout=240)
    kept = CaptureStore.open(store).committed.sequences
    assert kept == 1, err
    line = first_error_line(subprocess.CompletedProcess(args, proc.returncode, "", err), code=130)
    assert line.startswith(f"interrupted (Ctrl-C): {kept} of 3 sequences are committed in {store}"), line
    assert "same command" in line

    resumed = run_cli(*args, "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["capture"]["resumed_from"] == kept
    assert CaptureStore.open(store).committed.sequences == 3

    # any long command: training stops with 130 too, so `capture && train pq` chains stop
    bundle = tmp_path / "bundle"
    train = start_cli("train", "pq", str(store), "--no-register", "--json", "--trainer", "torch", "--device", "cpu",
                      "--iterations", "1000000", "-o", str(bundle))
    # no clock: wait until the command has torch loaded (its training has begun; main()'s handler is set)
    while train.poll() is None and not torch_loaded(train.pid):
        time.sleep(0.05)
    assert train.poll() is None, train.communicate()
    train.send_signal(signal.SIGINT)
    _, err = train.communicate(timeout=120)
    line = first_error_line(subprocess.CompletedProcess([], train.returncode, "", err), code=130)
    assert line.startswith("interrupted (Ctrl-C)"), line
    assert not bundle.exists()


def torch_loaded(pid: int) -> bool:
    """Whether process ``pid`` has torch's library mapped (Linux /proc; elsewhere: assume it has)."""
    try:
        return "libtorch" in open(f"/proc/{pid}/maps").read()
    except FileNotFoundError:
        return not os.path.isdir("/proc")
    except OSError:
        return False


# ---- 3. CUDA out of memory ---------------------------------------------------------------------------
def test_cuda_out_of_memory_names_the_chunk_len(tmp_path, monkeypatch):
    import torch

    from dsaindex.pipelines.capture import run as capture

    def out_of_memory(self, *args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")

    monkeypatch.setattr(capture.SequenceCapturer, "run", out_of_memory)
    store = tmp_path / "s"
    # in this process whatever DSAINDEX_TEST_SUBPROCESS says: a fresh interpreter would not see the patch
    proc = run_cli_in_process("capture", str(store), "-m", "preset:tiny-v32", "-c",
                              str(text_corpus(tmp_path, files=3, words=2000)), "--seq-len", "4096",
                              "--chunk-len", "2048", "--no-progress")
    line = assert_one_line_error(proc, "out of memory", "--chunk-len 2048", "[1, 2048, 8, 4096] fp32")
    # 2048 queries x 8 heads x 4096 keys x 4 bytes; the suggested quarter needs a quarter of it
    assert "~256.0 MiB" in line and "--chunk-len 512 (~64.0 MiB" in line, line
    assert not store.exists()  # a store this run created and committed nothing to is removed


# ---- 7, 8. help and quiet model loads ---------------------------------------------------------------------
def test_capture_help_lists_every_preset():
    from dsaindex.pipelines.capture.presets import PRESETS

    env = dict(os.environ, COLUMNS="250")
    proc = subprocess.run([sys.executable, "-m", "dsaindex", "capture", "--help"], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 0
    for name in PRESETS:
        assert f"preset:{name}" in proc.stdout, name


def test_loading_a_checkpoint_prints_no_bars_or_warnings(tmp_path, loaded_models):
    checkpoint = tmp_path / "ckpt"
    loaded_models["preset:tiny-v32"].model.save_pretrained(str(checkpoint))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    proc = subprocess.run([sys.executable, "-W", "default", "-m", "dsaindex", "capture", str(tmp_path / "s"), "-m",
                           str(checkpoint), "-c", str(text_corpus(tmp_path)), "-n", "1", "--seq-len", "200",
                           "--no-progress"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr



@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("command", [("capture", "{tmp}/s", *TINY), ("train", "pq", "{tmp}/none", "--no-register"),
                                     ("bench", "pq-train", "--keys", "5000")])
def test_cuda_asked_for_on_a_machine_without_one(tmp_path, command):
    proc = run_cli(*[part.format(tmp=tmp_path) for part in command], "--device", "cuda")
    assert_one_line_error(proc, "--device cuda", "no CUDA device")
    assert not (tmp_path / "s").exists()


def test_a_missing_default_model_is_an_error_not_a_random_weight_stand_in(tmp_path, monkeypatch):
    """Without the reference checkpoint, a capture that names no model fails with the fix; it never falls
    back to a random-weight preset (which would train and register artifacts of a model nobody serves)."""
    from dsaindex.pipelines.capture import models

    monkeypatch.setitem(models.REFERENCES, "reference", tmp_path / "not-installed")
    store = tmp_path / "s"
    proc = run_cli_in_process("capture", str(store), "-n", "1", "--seq-len", "64", "--no-progress")
    assert_one_line_error(proc, "reference checkpoint (the default model) is not present", "reinstall dsaindex")
    assert not store.exists()


# ---- I/O failures: one line naming the file and the fix, never a traceback ------------------------------
def test_a_missing_output_folder_is_one_line_exit_1(tmp_path):
    result = run_cli("plan", "memory", "--mode", "plugin", "--out", str(tmp_path / "nowhere" / "plan.json"))
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1
    assert "nowhere" in result.stderr and "Fix:" in result.stderr


@pytest.mark.parametrize("code, needle", [(28, "free space"), (13, "writable"), (30, "writable")])
def test_a_full_or_read_only_disk_is_one_line_exit_1(tmp_path, monkeypatch, code, needle):
    """ENOSPC, EACCES and EROFS when a command writes its result."""
    import os
    import pathlib

    def refuse(self, *args, **kwargs):
        raise OSError(code, os.strerror(code), str(self))

    monkeypatch.setattr(pathlib.Path, "write_text", refuse)
    result = run_cli_in_process("plan", "memory", "--mode", "plugin", "--out", str(tmp_path / "plan.json"))
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and needle in result.stderr and "plan.json" in result.stderr


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """``dsaindex ... | head``: the pipe closes while the command writes; no traceback, a non-zero exit (1 where
    click notices the closed pipe, 141 where the command's own print does)."""
    import subprocess
    import sys

    contexts = ",".join(str(64 * i) for i in range(1, 3000))  # a JSON report larger than a pipe's buffer
    proc = subprocess.Popen([sys.executable, "-m", "dsaindex", "plan", "memory", "--mode", "plugin", "--json",
                             "--contexts", contexts], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(10)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (1, 141)
    assert "Traceback" not in err and "Exception ignored" not in err, err
