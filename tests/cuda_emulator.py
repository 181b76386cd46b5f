"""Run the project's CUDA kernels' own sources on the CPU, for tests on machines without a GPU.

A kernel source (:mod:`dsaindex.kernels.pq_scan_cuda`, :mod:`dsaindex.kernels.pq_stage2_cuda`) is compiled by
the host C++ compiler behind a small header that gives the CUDA names it uses a CPU meaning: every thread of a
block is an OS thread, ``__syncthreads`` a barrier of the block, ``__ballot_sync`` / ``__shfl_sync`` exchanges
through a barrier of the warp (so a warp's lanes meet there as they do on the GPU), ``atomicAdd`` an atomic,
``__ldcg`` / ``__ldg`` plain loads. The warp-wide tensor-core steps (``mma_bf16``, ``ldsm_x4``) are exchanges
too: each lane deposits its fragment registers, and each computes its own output registers from the whole
warp's, by the PTX ISA's fragment layouts for ``mma.m16n8k16`` and ``ldmatrix``. Blocks run one after
another. It checks the kernels' indexing, their block and warp logic and their fragment layouts; it says
nothing of their speed.
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
#include <cmath>
#include <cstring>
#include <math.h>
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
struct uint2 { unsigned x, y; };
#define EMULATED
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
using std::max;
using std::min;

static std::barrier<>* emu_block;
static std::vector<std::unique_ptr<std::barrier<>>> emu_warps;
static long long emu_lanes[64][32];

inline void __syncthreads() { emu_block->arrive_and_wait(); }
static int emu_votes[1024];
inline int __syncthreads_or(int p) {  // every thread's vote, read once all have voted, kept until all have read
    emu_votes[threadIdx.x] = p != 0;
    emu_block->arrive_and_wait();
    int any = 0;
    for (unsigned i = 0; i < blockDim.x; ++i) any |= emu_votes[i];
    emu_block->arrive_and_wait();
    return any;
}
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
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __shfl_xor_sync(unsigned, float v, int mask) {
    unsigned bits;
    std::memcpy(&bits, &v, 4);
    bits = (unsigned)emu_exchange((long long)bits, (int)(threadIdx.x % 32) ^ mask, false);
    return __uint_as_float(bits);
}
inline unsigned __shfl_xor_sync(unsigned, unsigned v, int mask) {
    return (unsigned)emu_exchange((long long)v, (int)(threadIdx.x % 32) ^ mask, false);
}
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldg(const T* p) { return *p; }
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

// the tensor-core steps, warp-wide: fragments deposited, then each lane computes its own registers
static unsigned emu_frag_a[64][32][4], emu_frag_b[64][32][2];
static const void* emu_rows[64][32];
inline float emu_bf16(unsigned word, int high) { return __uint_as_float(high ? word & 0xffff0000u : word << 16); }
inline void emu_deposit(const unsigned* a, unsigned b0, unsigned b1) {  // a lane's fragments, then the warp meets
    const int w = threadIdx.x / 32, l = threadIdx.x % 32;
    for (int i = 0; i < 4; ++i) emu_frag_a[w][l][i] = a[i];
    emu_frag_b[w][l][0] = b0;
    emu_frag_b[w][l][1] = b1;
    emu_warps[w]->arrive_and_wait();
}
inline void mma_bf16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    const int w = threadIdx.x / 32, l = threadIdx.x % 32, g = l / 4, t = l % 4;
    emu_deposit(a, b0, b1);
    for (int i = 0; i < 4; ++i) {  // c[i]: row g + 8 (i / 2), column 2t + i % 2
        const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
        float sum = 0.0f;
        for (int k = 0; k < 16; ++k) {
            // A[row][k]: lane (row % 8, (k % 8) / 2), register (row >= 8) + 2 (k >= 8); B[k][col]: lane (col,
            // (k % 8) / 2), register k >= 8; the lower column in a register's low half
            const float av = emu_bf16(emu_frag_a[w][(row % 8) * 4 + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)], k % 2);
            const float bv = emu_bf16(emu_frag_b[w][col * 4 + (k % 8) / 2][k >= 8], k % 2);
            sum += av * bv;
        }
        c[i] += sum;
    }
    emu_warps[w]->arrive_and_wait();
}
inline int emu_s8(unsigned word, int byte) { return (int)(signed char)((word >> (8 * byte)) & 0xffu); }
inline void mma_s8(int* c, const unsigned* a, unsigned b0, unsigned b1) {
    const int w = threadIdx.x / 32, l = threadIdx.x % 32, g = l / 4, t = l % 4;
    emu_deposit(a, b0, b1);
    for (int i = 0; i < 4; ++i) {  // c[i]: row g + 8 (i / 2), column 2t + i % 2
        const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
        int sum = 0;
        for (int k = 0; k < 32; ++k) {
            // A[row][k]: lane (row % 8, (k % 16) / 4), register (row >= 8) + 2 (k >= 16), byte k % 4; B[k][col]:
            // lane (col, (k % 16) / 4), register k >= 16, byte k % 4
            const int av = emu_s8(emu_frag_a[w][(row % 8) * 4 + (k % 16) / 4][(row >= 8) + 2 * (k >= 16)], k % 4);
            const int bv = emu_s8(emu_frag_b[w][col * 4 + (k % 16) / 4][k >= 16], k % 4);
            sum += av * bv;
        }
        c[i] += sum;
    }
    emu_warps[w]->arrive_and_wait();
}
inline void ldsm_x4(unsigned* a, const void* row) {  // matrix m's row r from lane 8 m + r; lane l gets word l % 4 of row l / 4
    const int w = threadIdx.x / 32, l = threadIdx.x % 32;
    emu_rows[w][l] = row;
    emu_warps[w]->arrive_and_wait();
    for (int m = 0; m < 4; ++m) a[m] = static_cast<const unsigned*>(emu_rows[w][m * 8 + l / 4])[l % 4];
    emu_warps[w]->arrive_and_wait();
}
"""

_LAUNCH = r"""
extern "C" void emu_launch(unsigned gx, unsigned gy, unsigned threads, PARAMS)
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
                    KERNEL(ARGS);
                });
            }
            for (auto& t : team) t.join();
        }
    }
}
"""

_SCAN_PARAMS = ("const unsigned char* codes, const int* lengths, const signed char* lut, const float* thr, "
                "float* out_score, int* out_pos, int* count, const int* table, int table_width, int n_rows, "
                "int capacity, int rows_per_block, int paged")
_STAGE2_PARAMS = ("const unsigned char* codes, const int* rows, const int* counts, const uint2* codebook, "
                  "const unsigned* queries, const float* weights, float* out_score, int* out_bins, int* scratch, "
                  "const int* table, int table_width, int n_rows, int n_out, int per_block, int paged, "
                  "int want_scores, int want_bins, double key_bound, const float* bounds")
_FOLD_PARAMS = ("const unsigned char* codes, const int* lengths, const unsigned* codebook, const unsigned* queries, "
                "const float* slopes, const float* thr, int* out_pos, int* count, float* samples, const int* table, "
                "int table_width, int n_rows, int capacity, int rows_per_block, int paged, int sample_stride, "
                "int n_samples, int batch, int tiles_x")


def compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _argtype(param: str):
    if "*" in param:
        return ctypes.c_void_p
    return ctypes.c_double if param.startswith("double") else ctypes.c_int


def _build(source: str, kernel: str, params: str, shared_words: int):
    """``source`` compiled for the CPU with its dynamic shared memory ``shared_words`` 4-byte words: a ctypes
    function ``emu_launch(grid x, grid y, threads, <the kernel's arguments>)``."""
    folder = Path(tempfile.mkdtemp(prefix="cuda_emu_"))
    atexit.register(shutil.rmtree, folder, True)  # the library stays loaded until the process ends
    names = ", ".join(p.split()[-1].lstrip("*") for p in params.split(", "))
    shared = f"#define SHARED_DYNAMIC static __attribute__((aligned(16))) unsigned smem_words[{shared_words}]; " \
             "int* smem = reinterpret_cast<int*>(smem_words)\n"
    launch = _LAUNCH.replace("PARAMS", params).replace("KERNEL", kernel).replace("ARGS", names)
    src = folder / f"{kernel}.cpp"
    src.write_text(_HEADER + shared + source + launch)
    lib = folder / f"{kernel}.so"
    proc = subprocess.run([compiler(), "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", "-o", str(lib), str(src)],
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"the emulated {kernel} did not compile:\n{proc.stderr}")
    fn = ctypes.CDLL(str(lib)).emu_launch
    fn.argtypes = [ctypes.c_uint] * 3 + [_argtype(p) for p in params.split(", ")]
    fn.restype = None
    return fn


@functools.cache
def emulated_scan(defines: str = ""):
    """Stage 1's scan compiled for the CPU (:func:`_build`), ``defines`` (#define lines) put before its source."""
    from dsaindex.kernels.pq_scan_cuda import source

    return _build(defines + source(), "pq_scan_select", _SCAN_PARAMS, 256 * 64 + 8192)


@functools.cache
def emulated_stage2(int8: bool = False, defines: str = ""):
    """Stage 2 compiled for the CPU (:func:`_build`); ``int8``: its form on 8-bit operands; ``defines``: #define
    lines put before the source (a variant of the kernel)."""
    from dsaindex.kernels.pq_stage2_cuda import SHARED_BINS, source

    return _build(defines + source(int8), "pq_stage2", _STAGE2_PARAMS, SHARED_BINS // 4)


@functools.cache
def emulated_fold(defines: str = ""):
    """The fold scan compiled for the CPU (:func:`_build`); ``defines`` as :func:`emulated_stage2`."""
    from dsaindex.kernels.pq_fold_cuda import SHARED, source

    return _build(defines + source(), "pq_fold_scan", _FOLD_PARAMS, SHARED // 4)


def _ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


def _pages(page_table: np.ndarray | None, stand_in: np.ndarray, codes: np.ndarray):
    """A launch's (table, table width, rows a request): the page table of paged codes, else ``stand_in`` (an
    int32 array the kernel never reads as a table) and the codes' rows."""
    if page_table is None:
        return stand_in, 0, codes.shape[1]
    table = np.ascontiguousarray(page_table, dtype=np.int32)
    return table, table.shape[-1], table.shape[-1] * 64


def run_scan(codes: np.ndarray, lengths: np.ndarray, lut: np.ndarray, thr: np.ndarray, capacity: int, n: int,
             page_table: np.ndarray | None = None, rows_per_block: int = 512, defines: str = ""):
    """The kernel's launch as :func:`dsaindex.kernels.pq_scan_cuda.pq_scan_select` makes it, on the CPU:
    (scores [B, capacity] float32, rows [B, capacity] int32, counts [B] int32), unset slots NaN / -1.
    ``defines``: #define lines put before the source (a variant of the kernel)."""
    from dsaindex.kernels.pq_scan_cuda import THREADS

    b = lut.shape[0]
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    lengths = np.ascontiguousarray(lengths, dtype=np.int32)
    lut = np.ascontiguousarray(lut, dtype=np.int8)
    thr = np.ascontiguousarray(thr, dtype=np.float32)
    scores = np.full((b, capacity), np.nan, dtype=np.float32)
    rows = np.full((b, capacity), -1, dtype=np.int32)
    counts = np.zeros(b, dtype=np.int32)
    table, width, n_rows = _pages(page_table, lengths, codes)
    emulated_scan(defines)(max(1, -(-n // rows_per_block)), b, THREADS, _ptr(codes), _ptr(lengths), _ptr(lut), _ptr(thr),
                     _ptr(scores), _ptr(rows), _ptr(counts), _ptr(table), width, n_rows, capacity, rows_per_block,
                     int(page_table is not None))
    return scores, rows, counts


def run_stage2(codes: np.ndarray, rows: np.ndarray, counts: np.ndarray, queries: np.ndarray, weights: np.ndarray,
               codebook: np.ndarray, key_bound: float, page_table: np.ndarray | None = None, per_block: int = 256,
               scratch: np.ndarray | None = None, want_scores: bool = True, want_bins: bool = True,
               bounds: np.ndarray | None = None, defines: str = ""):
    """The launch :func:`dsaindex.kernels.pq_stage2_cuda.pq_stage2` makes, on the CPU. ``queries`` [B, 64, 128] and
    ``codebook`` [32, 256, 4] as bf16 bit patterns (uint16), or with ``bounds`` [B] float32 (the int8 kernel, the
    operands of :func:`~dsaindex.kernels.pq_stage2_cuda.int8_operands`) as int8; ``defines``: as
    :func:`emulated_stage2` (``#define MTILES 1``: 16 heads, ``queries`` [B, 16, 128]). Returns (scores [B, R] float32,
    bins [B, R] int32, scratch [B, NBINS + 4] int32); unset slots NaN / -1, ``scratch`` zeros unless given."""
    from dsaindex.kernels.pq_stage2_cuda import NBINS, THREADS

    b, r = rows.shape
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    rows = np.ascontiguousarray(rows, dtype=np.int32)
    counts = np.ascontiguousarray(counts, dtype=np.int32)
    int8 = bounds is not None
    queries = np.ascontiguousarray(queries, dtype=np.int8 if int8 else np.uint16)
    weights = np.ascontiguousarray(weights, dtype=np.float32)
    codebook = np.ascontiguousarray(codebook, dtype=np.int8 if int8 else np.uint16)
    bounds = np.ascontiguousarray(bounds if int8 else np.zeros(b), dtype=np.float32)
    scores = np.full((b, r), np.nan, dtype=np.float32)
    bins = np.full((b, r), -1, dtype=np.int32)
    scratch = np.zeros((b, NBINS + 4), dtype=np.int32) if scratch is None else np.ascontiguousarray(scratch, np.int32)
    table, width, n_rows = _pages(page_table, counts, codes)
    emulated_stage2(int8, defines)(-(-r // per_block), b, THREADS, _ptr(codes), _ptr(rows), _ptr(counts), _ptr(codebook),
                          _ptr(queries), _ptr(weights), _ptr(scores), _ptr(bins), _ptr(scratch), _ptr(table), width,
                          n_rows, r, per_block, int(page_table is not None), int(want_scores), int(want_bins),
                          float(key_bound), _ptr(bounds))
    return scores, bins, scratch


def run_fold(codes: np.ndarray, lengths: np.ndarray, q8: np.ndarray, slopes: np.ndarray, book8: np.ndarray,
             page_table: np.ndarray | None = None, thr: np.ndarray | None = None, capacity: int = 0, n: int = 0,
             stride: int = 0, n_samples: int = 0, rows_per_block: int = 512, defines: str = "",
             blocks: int | None = None, threads: int | None = None):
    """The launches of :mod:`dsaindex.kernels.pq_fold_cuda` on the CPU: with ``stride`` > 0 its sampling
    (returns samples [B, n_samples] float32, unset NaN), else its scan of the first ``n`` rows against ``thr``
    (returns (rows [B, capacity] int32, counts [B] int32), unset -1). ``blocks``: a grid of that many blocks,
    each taking tiles in turn, else one a tile; ``threads``: a block's (``defines`` setting THREADS to the same),
    else the kernel's default."""
    from dsaindex.kernels.pq_fold_cuda import THREADS

    b = q8.shape[0]
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    lengths = np.ascontiguousarray(lengths, dtype=np.int32)
    q8 = np.ascontiguousarray(q8, dtype=np.int8)
    slopes = np.ascontiguousarray(slopes, dtype=np.float32)
    book8 = np.ascontiguousarray(book8, dtype=np.int8)
    thr = np.ascontiguousarray(np.zeros(b) if thr is None else thr, dtype=np.float32)
    samples = np.full((b, max(1, n_samples)), np.nan, dtype=np.float32)
    rows = np.full((b, max(1, capacity)), -1, dtype=np.int32)
    counts = np.zeros(b, dtype=np.int32)
    table, width, n_rows = _pages(page_table, lengths, codes)
    indices = n_samples if stride > 0 else n
    tiles_x = max(1, -(-indices // rows_per_block))
    emulated_fold(defines)(blocks or b * tiles_x, 1, threads or THREADS, _ptr(codes), _ptr(lengths), _ptr(book8),
                           _ptr(q8), _ptr(slopes), _ptr(thr), _ptr(rows), _ptr(counts), _ptr(samples), _ptr(table),
                           width, n_rows, capacity, rows_per_block, int(page_table is not None), stride, n_samples, b,
                           tiles_x)
    return samples if stride > 0 else (rows, counts)
