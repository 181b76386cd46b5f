#!/usr/bin/env bash
# Contract tests of the vLLM plugin in their own virtualenv (/work/main/.venv-vllm by default).
#
# vLLM's wheel pins a CUDA torch; these tests run on a CPU machine, so vLLM is installed with --no-deps
# beside torch CPU and only the packages its plugin loader, op registry and the indexer layer's module
# import. The constraints file keeps every one of them from replacing torch.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${VENV:-$ROOT/.venv-vllm}"
VLLM_VERSION="${VLLM_VERSION:-0.33.0}"
start=$(date +%s)

# from scratch: remove an earlier virtualenv at that path (only a virtualenv)
if [ -f "$VENV/pyvenv.cfg" ]; then rm -rf "$VENV"; fi
python3 -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip
CONSTRAINTS="$(mktemp)"
printf 'torch==2.13.0\ntransformers>=5.16.1,<5.21\n' > "$CONSTRAINTS"
"$PIP" install -q -c "$CONSTRAINTS" torch==2.13.0 numpy pytest
"$PIP" install -q --no-deps "vllm==$VLLM_VERSION"
# what `import vllm.plugins, vllm.model_executor.custom_op, vllm.model_executor.layers.sparse_attn_indexer`
# needs on a CPU machine (found by importing until nothing was missing)
"$PIP" install -q -c "$CONSTRAINTS" packaging psutil pyzmq urllib3 regex "pydantic>=2.12" cbor2 \
    "transformers>=5.16.1,<5.21" aiohttp requests openai-harmony openai pillow pybase64 cachetools msgspec \
    cloudpickle uvloop py-cpuinfo prometheus_client "fastapi>=0.133,<0.137" partial-json-parser einops
# grammar backends vLLM imports at module level; their own deps would pull a CUDA torch
"$PIP" install -q --no-deps xgrammar==0.2.8 "llguidance>=1.7,<1.8" apache-tvm-ffi==0.1.11
# dsaindex without its training/registry stack, plus what its runtime imports for local bundles
"$PIP" install -q --no-deps -e "$ROOT"
"$PIP" install -q -c "$CONSTRAINTS" "zarr>=3.1" "typer>=0.12" "rich>=13" "safetensors>=0.4"
"$PIP" install -q --no-deps -e "$HERE"
"$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('2.13'), torch.__version__"

echo "ci.sh: environment ready in $(( $(date +%s) - start ))s"
cd "$HERE"
"$VENV/bin/python" -m pytest tests "$@"
echo "ci.sh: total $(( $(date +%s) - start ))s"
