"""Run the CUDA stage-1 scan's own source on the CPU, for tests on machines without a GPU.

The kernel source of :mod:`dsaindex.kernels.pq_scan_cuda` is compiled by the host C++ compiler behind a small
header that gives the CUDA names it uses a CPU meaning: every thread of a block is an OS thread,
``__syncthreads`` a barrier of the block, ``__ballot_sync`` / ``__shfl_sync`` exchanges through a barrier of
the warp (so a warp's lanes meet there as they do on the GPU), ``atomicAdd`` an atomic, ``__ldcg`` a plain
load. Blocks run one after another. It checks the kernel's indexing, its block and warp logic and its
appends; it says nothing of its speed.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

_HEADER = r"""
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

struct emu_dim3 { unsigned x, y, z; };
static thread_local emu_dim3 threadIdx, blockIdx;
static emu_dim3 blockDim, gridDim;
struct uint4 { unsigned x, y, z, w; };
struct int4 { int x, y, z, w; };
#define __global__
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
using std::min;

static std::barrier<>* emu_block;
static std::vector<std::unique_ptr<std::barrier<>>> emu_warps;
static long long emu_lanes[64][32];

inline void __syncthreads() { emu_block->arrive_and_wait(); }
inline long long emu_exchange(long long mine, int from, bool vote) {
    const int w = threadIdx.x / 32, l = threadIdx.x % 32;
    emu_lanes[w][l] = mine;
    emu_warps[w]->arrive_and_wait();
    long long out = 0;
    if (vote) {
        for (int i = 0; i < 32; ++i) out |= (emu_lanes[w][i] ? 1LL : 0LL) << i;
    } else {
        out = emu_lanes[w][from];
    }
    emu_warps[w]->arrive_and_wait();
    return out;
}
inline unsigned __ballot_sync(unsigned, bool p) { return (unsigned)emu_exchange(p ? 1 : 0, 0, true); }
inline int __shfl_sync(unsigned, int v, int src) { return (int)emu_exchange(v, src, false); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
template <class T> inline T __ldcg(const T* p) { return *p; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
    return (unsigned)((((unsigned long long)hi << 32) | lo) >> (s & 31u));
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int n = 0; n < 4; ++n) r |= (unsigned)((v >> (8 * ((s >> (4 * n)) & 7u))) & 0xffu) << (8 * n);
    return r;
}
#define SHARED_DYNAMIC static __attribute__((aligned(16))) int smem[256 * 64 + 8192]
"""

_LAUNCH = r"""
extern "C" void emu_launch(unsigned gx, unsigned gy, unsigned threads,
    const unsigned char* codes, const int* lengths, const signed char* lut, const float* thr, float* out_score,
    int* out_pos, int* count, const int* table, int table_width, int n_rows, int capacity, int rows_per_block,
    int paged)
{
    blockDim = {threads, 1, 1};
    gridDim = {gx, gy, 1};
    for (unsigned y = 0; y < gy; ++y) {
        for (unsigned x = 0; x < gx; ++x) {
            std::barrier<> block((std::ptrdiff_t)threads);
            emu_block = &block;
            emu_warps.clear();
            for (unsigned w = 0; w < threads / 32; ++w) emu_warps.emplace_back(std::make_unique<std::barrier<>>(32));
            std::vector<std::thread> team;
            for (unsigned t = 0; t < threads; ++t) {
                team.emplace_back([=] {
                    threadIdx = {t, 0, 0};
                    blockIdx = {x, y, 0};
                    pq_scan_select(codes, lengths, lut, thr, out_score, out_pos, count, table, table_width, n_rows,
                                   capacity, rows_per_block, paged);
                });
            }
            for (auto& t : team) t.join();
        }
    }
}
"""


def compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


@functools.cache
def emulated_scan():
    """The scan compiled for the CPU: a ctypes function ``emu_launch(grid x, grid y, threads, <the kernel's
    arguments>)``."""
    from dsaindex.kernels.pq_scan_cuda import source

    folder = Path(tempfile.mkdtemp(prefix="cuda_emu_"))
    atexit.register(shutil.rmtree, folder, True)  # the library stays loaded until the process ends
    src = folder / "scan.cpp"
    src.write_text(_HEADER + source() + _LAUNCH)
    lib = folder / "scan.so"
    proc = subprocess.run([compiler(), "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", "-o", str(lib), str(src)],
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"the emulated scan did not compile:\n{proc.stderr}")
    fn = ctypes.CDLL(str(lib)).emu_launch
    p = ctypes.c_void_p
    fn.argtypes = [ctypes.c_uint] * 3 + [p] * 8 + [ctypes.c_int] * 5
    fn.restype = None
    return fn


def run_scan(codes: np.ndarray, lengths: np.ndarray, lut: np.ndarray, thr: np.ndarray, capacity: int, n: int,
             page_table: np.ndarray | None = None, rows_per_block: int = 512):
    """The kernel's launch as :func:`dsaindex.kernels.pq_scan_cuda.pq_scan_select` makes it, on the CPU:
    (scores [B, capacity] float32, rows [B, capacity] int32, counts [B] int32), unset slots NaN / -1."""
    from dsaindex.kernels.pq_scan_cuda import THREADS

    b = lut.shape[0]
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    lengths = np.ascontiguousarray(lengths, dtype=np.int32)
    lut = np.ascontiguousarray(lut, dtype=np.int8)
    thr = np.ascontiguousarray(thr, dtype=np.float32)
    scores = np.full((b, capacity), np.nan, dtype=np.float32)
    rows = np.full((b, capacity), -1, dtype=np.int32)
    counts = np.zeros(b, dtype=np.int32)
    paged = page_table is not None
    table = np.ascontiguousarray(page_table if paged else lengths, dtype=np.int32)
    n_rows = table.shape[-1] * 64 if paged else codes.shape[1]
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    emulated_scan()(max(1, -(-n // rows_per_block)), b, THREADS, ptr(codes), ptr(lengths), ptr(lut), ptr(thr),
                     ptr(scores), ptr(rows), ptr(counts), ptr(table), table.shape[-1] if paged else 0, n_rows, capacity,
                     rows_per_block, int(paged))
    return scores, rows, counts
