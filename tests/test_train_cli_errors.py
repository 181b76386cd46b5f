"""Nonsense input to the training, evaluation, runtime and bench commands is refused at once, on one line
(``error: <problem> Fix: <fix>``, exit code 2), before any model, store or training is touched; and every
option of those commands says what it is for."""

import os
import subprocess
import sys

import pytest

from helpers import run_cli

# the store need not exist: a bad count is refused while the command line is parsed
STORE = "no-such-store"


@pytest.mark.parametrize("args,first_line", [
    (("train", "pq", STORE, "--iterations", "0"), "error: --iterations 0 is below 1."),
    (("train", "pq", STORE, "--max-train-keys", "-1"), "error: --max-train-keys -1 is below 1024."),
    (("train", "pq", STORE, "--subspaces", "0"), "error: --subspaces 0 is below 1."),
    (("train", "pq", STORE, "--eval-queries", "0"), "error: --eval-queries 0 is below 1."),
    (("train", "pq", STORE, "--candidates", "0,1024"), "error: --candidates '0,1024' holds 0"),
    (("train", "pq", STORE, "--rotation-rounds", "-1"), "error: --rotation-rounds -1 is below 0."),
    # OPQ is the default for product codes only: a rotation asked for where the code takes none
    (("train", "pq", STORE, "--quantizer", "rq", "--rotate"), "error: RQ codes take no OPQ rotation"),
    (("train", "pq", STORE, "--no-rotate", "--rotation-rounds", "2"),
     "error: --rotation-rounds 2 applies to OPQ codes only, not PQ32."),
    (("train", "pq", STORE, "--quantizer", "rq", "--rotation-rounds", "2"),
     "error: --rotation-rounds 2 applies to OPQ codes only, not RQ32."),
    (("train", "ivf", STORE, "--steps", "0"), "error: --steps 0 is below 1."),
    (("train", "ivf", STORE, "--window", "0"), "error: --window 0 is below 1."),
    (("train", "ivf", STORE, "--refit-every", "-1"), "error: --refit-every -1 is below 0."),
    (("train", "ivf", STORE, "--budgets", "4096,-8"), "error: --budgets '4096,-8' holds -8"),
    (("train", "ivf", STORE, "--train-queries", "0"), "error: --train-queries 0 is below 1."),
    (("eval", "pq", "bundle", "--store", STORE, "--eval-queries", "0"), "error: --eval-queries 0 is below 1."),
    (("eval", "pq-compare", STORE, "--max-train-keys", "0"), "error: --max-train-keys 0 is below 1024."),
    (("eval", "pq-compare", STORE, "--subspaces", "32,0"), "error: --subspaces '32,0' holds 0"),
    (("eval", "pq-compare", STORE, "--centroids", "256,24"), "error: --centroids '256,24': [24] are not powers"),
    (("eval", "ivf", "bundle", "--store", STORE, "--budgets", "0"), "error: --budgets '0' holds 0"),
    (("runtime", "generate", "-a", "bundle", "--new-tokens", "0"), "error: --new-tokens 0 is below 1."),
    (("bench", "decode", "--batches", "0"), "error: --batches '0' holds 0"),
])
def test_nonsense_counts_are_refused_on_one_line(args, first_line):
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.splitlines()[0]
    assert line.startswith(first_line) and "Fix: " in line, proc.stderr
    assert "Traceback" not in proc.stderr


def test_variants_and_trainer_are_checked_before_training(tmp_path):
    proc = run_cli("eval", "pq-compare", STORE, "--variants", "plain,fancy")
    assert proc.returncode == 2 and proc.stderr.startswith("error: --variants 'plain,fancy' names no known variant. Unknown: fancy.")


def test_bench_decode_recall_inputs_are_checked_before_any_timing(tmp_path):
    proc = run_cli("bench", "decode", "--recall-store", str(tmp_path / "missing-store"))
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0].startswith("error: --recall-store and --artifacts go together")
    proc = run_cli("bench", "decode", "--recall-store", str(tmp_path / "missing-store"),
                   "--artifacts", str(tmp_path / "missing-bundle"))
    assert proc.returncode == 2
    first = proc.stderr.splitlines()[0]
    assert first.startswith("error:") and "missing-store" in first and "CUDA" not in first


def _commands():
    """(name, click command) of every command whose options this file vouches for."""
    import typer

    from dsaindex.cli import app

    root = typer.main.get_command(app)
    wanted = {("train", "pq"), ("train", "ivf"), ("eval", "pq"), ("eval", "pq-compare"), ("eval", "ivf"),
              ("runtime", "check"), ("runtime", "generate"), ("bench", "decode"), ("bench", "prefill-select"),
              ("bench", "capture"), ("bench", "pq-train"), ("bench", "frontier"), ("demo",)}
    for path in sorted(wanted):
        cmd = root
        for part in path:
            cmd = cmd.commands[part]
        yield " ".join(path), cmd


def test_every_option_says_what_it_is_for():
    missing = [f"{name} {param.name}" for name, cmd in _commands() for param in cmd.params
               if param.name != "help" and not (getattr(param, "help", None) or "").strip()]
    assert not missing, missing


def test_prompt_tokens_are_described_as_tokens():
    env = dict(os.environ, COLUMNS="200", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-m", "dsaindex", "runtime", "generate", "--help"], capture_output=True,
                         text=True, env=env, timeout=60).stdout
    row = next(line for line in out.splitlines() if "--prompt-tokens" in line)
    assert "Prompt length in tokens" in row and "bytes" not in row.split("UTF-8")[0]
