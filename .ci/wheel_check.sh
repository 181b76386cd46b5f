#!/usr/bin/env bash
# The wheel as a user gets it: built from this tree, installed into a clean virtualenv with no source tree on
# the path, then a short capture of the default model, PQ training and the runtime check, all from the
# installed package (its package data: the default reference checkpoint and tokenizer).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
"$PYTHON" -m pip wheel -q --disable-pip-version-check --no-deps -w "$work/wheel" .
"$PYTHON" -m venv "$work/venv"
pip=("$work/venv/bin/pip" -q --disable-pip-version-check)
"${pip[@]}" install torch==2.13.0  # the CPU build, as the Makefile installs it
PYTHONWARNINGS=ignore "${pip[@]}" install "$work"/wheel/dsaindex-*.whl
cd "$work"  # nothing of the source tree is importable from here
dsa="$work/venv/bin/dsaindex"
"$work/venv/bin/python" - "$work" <<'PY'
import pathlib, sys
import dsaindex
where = pathlib.Path(dsaindex.__file__).resolve()
assert str(where).startswith(sys.argv[1]), f"dsaindex imported from {where}, not the installed wheel"
PY
"$dsa" capture store -m reference --sequences 2 --seq-len 2560 --no-progress
"$dsa" train pq store -m reference --out bundle --subspaces 16 --iterations 4 --candidates 512 --no-register
"$dsa" runtime check -m reference -a bundle
echo "wheel check: passed in $(( $(date +%s) - start ))s"
