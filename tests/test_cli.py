"""The command line: instant help (no heavy imports at start-up), sub-apps, JSON output."""

import json
import subprocess
import sys

from helpers import run_cli


def test_cli_import_is_light():
    code = (
        "import sys, dsaindex.cli; "
        "heavy = [m for m in ('torch', 'zarr', 'transformers', 'numpy', 'mlflow', 'faiss') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"heavy modules imported by the CLI at start-up: {out}"


def test_help_lists_commands():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for command in ("capture", "store", "bench", "demo", "reference"):
        assert command in proc.stdout


def test_help_shows_no_type_for_flags():
    for command in (("capture",), ("train", "pq"), ("registry", "list"), ("bench", "decode")):
        proc = run_cli(*command, "--help")
        assert proc.returncode == 0, proc.stderr
        assert "--json" in proc.stdout or "--progress" in proc.stdout or "--graphs" in proc.stdout
        assert "<bool>" not in proc.stdout, (command, proc.stdout)
    assert "<int>" in run_cli("train", "pq", "--help").stdout  # options that take a value keep their type


def test_capture_json_reports_throughput(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 40)
    proc = run_cli("capture", str(tmp_path / "s"), "-m", "preset:tiny-glm5", "-c", str(corpus), "-n", "2",
                   "--seq-len", "300", "--chunk-len", "128", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["capture"]["sequences_added"] == 2 and out["capture"]["tokens_per_s"] > 0
    assert out["store"]["layers"] == [0, 1, 3]  # GLM-5 "shared" layer 2 has no indexer
    assert out["store"]["committed"]["tokens"] == 600 and out["store"]["key_bytes_on_disk"] > 0


def test_train_pq_help_says_opq_is_the_default_and_how_to_train_plain_pq():
    from dsaindex.train.pq_job import CPU_ROTATION_ROUNDS, GPU_ROTATION_ROUNDS

    proc = run_cli("train", "pq", "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.replace("│", " ").split())  # the rich panel's lines joined
    assert "OPQ by default" in text and "--no-rotate for plain PQ" in text
    assert "--rotate,--opq --no-rotate" in text and "[default: (rotate for --quantizer pq)]" in text
    assert "(default: runs/bundles/<store>-opq<M>" in text and "-pq<M>[-sa] with --no-rotate" in text
    # the rounds' default as the help states it is the one the job applies
    assert (f"[default: ({GPU_ROTATION_ROUNDS} with --trainer torch on a GPU, else {CPU_ROTATION_ROUNDS})]"
            in text)
