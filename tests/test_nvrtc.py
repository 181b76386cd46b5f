"""The CUDA kernels' shared NVRTC build (kernels/nvrtc.py): one build a process and device, a failed build
remembered, so ``auto`` falls back once instead of compiling again at every step."""

import contextlib

import pytest
import torch

from dsaindex.kernels import nvrtc


class _Kernel:
    def __init__(self):
        self.shared = None

    def set_shared_memory_config(self, shared):
        self.shared = shared


def test_a_build_runs_once_and_a_failed_build_is_not_retried(monkeypatch):
    calls = []

    def compile_kernel(source, name):
        calls.append(name)
        if "broken" in source:
            raise RuntimeError("nvrtc: error: identifier INFINITY is undefined")
        return _Kernel()

    monkeypatch.setattr(torch.cuda, "_compile_kernel", compile_kernel, raising=False)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    good = nvrtc.compiled("__global__ void k() {} // good", "k_good", 4096, 7, "the test kernel", "kind='triton'")
    assert good.shared == 4096
    assert nvrtc.compiled("__global__ void k() {} // good", "k_good", 4096, 7, "the test kernel",
                          "kind='triton'") is good
    assert calls == ["k_good"]
    for _ in range(3):  # the error names the kernel, the compiler's reason and the way around it, every time
        with pytest.raises(ValueError, match=r"the test kernel did not compile here \(nvrtc: error: identifier "
                                             r"INFINITY is undefined\).*kind='triton'"):
            nvrtc.compiled("__global__ void k() {} // broken", "k_broken", 4096, 7, "the test kernel", "kind='triton'")
    assert calls == ["k_good", "k_broken"]  # one failed build, not three
    # the same source on another device is its own build
    assert nvrtc.compiled("__global__ void k() {} // good", "k_good", 4096, 6, "the test kernel", "x").shared == 4096
    assert calls == ["k_good", "k_broken", "k_good"]


def test_compiles_is_false_off_cuda_without_building(monkeypatch):
    monkeypatch.setattr(torch.cuda, "_compile_kernel", lambda *a: pytest.fail("built off CUDA"), raising=False)
    assert nvrtc.compiles("src", "k", 0, torch.device("cpu"), "the test kernel", "x") is False
