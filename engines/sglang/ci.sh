#!/usr/bin/env bash
# Contract tests of the SGLang plugin against SGLang's real code, on a CPU.
# Creates /work/main/.venv-sglang (or $VENV) from scratch, installs torch (CPU), sglang 0.5.23 without
# its dependency set plus the few packages its plugin loader, DSA indexer and KV pool modules import,
# dsaindex (editable, with the deps its runtime imports) and this plugin (editable), then runs pytest.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${VENV:-$ROOT/.venv-sglang}"
PY="${PYTHON:-python3.11}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
start=$(date +%s)

rm -rf "$VENV"
"$PY" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip
# torch first, CPU build; the constraint keeps any later install from replacing it (sglang pins a CUDA torch).
"$PIP" install -q torch==2.13.0 ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
CONSTRAINTS="$VENV/constraints.txt"
"$VENV/bin/python" -c "import torch; print('torch==' + torch.__version__)" > "$CONSTRAINTS"

# sglang itself without its (CUDA) dependency set ...
"$PIP" install -q --no-deps "sglang==$SGLANG_VERSION"
# ... plus what `import sglang.srt.plugins`, `...dsa.dsa_indexer`, `...mem_cache.memory_pool` and
# `...dsa_backend`, `...configs.model_config` need on a CPU (found by importing until nothing was
# missing); transformers and tokenizers at the versions sglang 0.5.23 pins.
"$PIP" install -q -c "$CONSTRAINTS" \
  numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm ipython \
  aiohttp einops "apache-tvm-ffi==0.1.11" "transformers==5.19.0" "tokenizers==0.23.2" dill sentencepiece gguf openai partial_json_parser loguru \
  "triton" "setuptools"
"$PIP" install -q -c "$CONSTRAINTS" --no-deps compressed-tensors

# dsaindex (editable, no deps) + what its runtime and the test bundles import
"$PIP" install -q -c "$CONSTRAINTS" --no-deps -e "$ROOT"
"$PIP" install -q -c "$CONSTRAINTS" "zarr>=3.1" "pydantic>=2.6" "safetensors>=0.4" pytest
# the plugin, through its entry point
"$PIP" install -q -c "$CONSTRAINTS" --no-deps -e "$HERE"

"$VENV/bin/python" -c "import torch; assert not torch.version.cuda, torch.__version__; print('torch', torch.__version__)"
echo "ci.sh: environment ready in $(( $(date +%s) - start ))s"
cd "$HERE"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests "$@"
echo "ci.sh: done in $(( $(date +%s) - start ))s"
