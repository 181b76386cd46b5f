"""vLLM picks its platform at import: the CPU platform here (the wheel is a CUDA build, so say so)."""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
