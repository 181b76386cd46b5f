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
