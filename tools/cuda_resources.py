"""The registers and spills of the project's CUDA kernels (the sources NVRTC compiles at first use) for sm_90, on a
machine without a GPU: NVRTC from the ``nvidia-cuda-nvrtc-cu12`` wheel compiles each source with ptxas' report on.
What a change or a compile-time variant does to register pressure is known before any device time is spent.

``python3 tools/cuda_resources.py [MODULE [DEFINE ...]]``: MODULE one of :data:`KERNELS` (default: all of them, as
shipped), each DEFINE ``NAME`` or ``NAME=VALUE`` put before the source, e.g. ``pq_fold_cuda THREADS=768 DEPTH=1``.
The library comes from ``NVRTC_LIB`` or from the wheel where Python finds it (``pip install --target DIR --no-deps
nvidia-cuda-nvrtc-cu12`` and ``PYTHONPATH=DIR``). NVRTC 12.9, sm_90 (H100 / H200): the fold scan as shipped takes
102 registers; with 768 threads and one step in flight 80, with 1,024 threads 63, no spills in either."""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import re
import sys

KERNELS = ("pq_fold_cuda", "pq_scan_cuda", "pq_stage2_cuda")


def library() -> ctypes.CDLL:
    """NVRTC, from ``NVRTC_LIB`` or the ``nvidia.cuda_nvrtc`` wheel; exits with the fix where neither is found."""
    path = os.environ.get("NVRTC_LIB")
    if not path:
        for root in sys.path:
            candidate = os.path.join(root or ".", "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.12")
            if os.path.exists(candidate):
                path = candidate
                break
    if not path:
        sys.exit("no NVRTC library: pip install --target DIR --no-deps nvidia-cuda-nvrtc-cu12, then PYTHONPATH=DIR "
                 "(or set NVRTC_LIB to libnvrtc.so.12)")
    return ctypes.CDLL(path)


def compile_log(lib: ctypes.CDLL, source: str, arch: int = 90) -> tuple[int, str]:
    """(NVRTC's result code, its log) of ``source`` compiled for ``sm_{arch}`` with ptxas' resource report."""
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture=sm_{arch}".encode(), b"-Xptxas=-v", b"-default-device", b"-std=c++17"]
    code = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return code, log.value.decode(errors="replace")


def resources(log: str) -> dict:
    """Per entry function of a ptxas report: registers, stack frame and spilled bytes."""
    out, name = {}, None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            name = m.group(1)
            out[name] = {}
        elif name and (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                                      line)):
            out[name].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif name and (m := re.search(r"Used (\d+) registers", line)):
            out[name]["registers"] = int(m.group(1))
    return out


def main() -> None:
    lib = library()
    modules = sys.argv[1:2] or list(KERNELS)
    defines = "".join(f"#define {d.replace('=', ' ', 1)}\n" for d in sys.argv[2:])
    report = {}
    for name in modules:
        module = importlib.import_module(f"dsaindex.kernels.{name}")
        code, log = compile_log(lib, defines + module.source())
        report[name] = resources(log) if code == 0 else {"error": log[-2000:]}
    print(json.dumps({"defines": sys.argv[2:], "kernels": report}, indent=1))


if __name__ == "__main__":
    main()
