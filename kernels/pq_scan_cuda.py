"""Stage 1's selecting scan as a CUDA kernel with the lookup tables in shared memory.

The Triton scan (:func:`dsaindex.kernels.pq_select.pq_linear_topc`, ``scan="triton"``) gathers each key's
32 table entries from L1: at 32 x 1M keys on the H200 it runs at 2.0x the bytes floor, bound by the gathers'
throughput, not by HBM (docs/results.md, "Stage 1's lookups"). Triton cannot address shared memory by a
loaded byte without staging the table again at every tile. This kernel does: each block copies its
request's int8 tables (M x 256 bytes, 8 KB at M = 32) into shared memory once, then each thread scores
one key at a time, its M code bytes read in 16-byte loads past L1 (``ld.global.cg``) and looked up with a
32-bit shared address whose subspace offset is an immediate. A warp's lookups at one subspace fall in one
256-byte table: two words share a bank, so a lookup costs at most two shared-memory cycles.

**Measured slower; not the default.** H200, stage 1 alone at B x 1M paged keys (``tools/stage_sweep.py``,
docs/results/bench_stage1_scan_cuda_h200.json): 35 / 59 / 99 / 193 / 855 / 1,584 us at B = 1 / 2 / 4 / 8 / 32 /
64, against 32 / 52 / 81 / 140 / 500 / 1,004 us for the Triton scan's default launches, the same keys kept.
The byte lookups from shared memory (two-way bank conflicts at most) and one atomic per warp do not beat
Triton's L1 gathers. It stays for further variants (int32 tables, appends gathered per block).

Selection is the Triton scan's exactly: integer sums, kept where the sum reaches the request's threshold
(from the sampling pass of the same step), appended to the request's buffer with one atomic per warp. Only
the order of the appended keys may differ, which the next stage does not read.

The source is compiled at first use by NVRTC through torch (``torch.cuda._compile_kernel``), once per
process, device and subspace count: no compiler is needed beyond what a CUDA build of torch ships. It is
launched on the current stream, so a CUDA graph captures it. Without a GPU, ``tests/test_pq_scan_cuda.py``
runs this very source on the CPU (a thread per CUDA thread, warps meeting at barriers) against the pass's
specification.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SCANS = ("triton", "cuda")
THREADS = 256
KERNEL = "pq_scan_select"

_SOURCE = r"""
#define M_SUB __M__
#define K_ENT 256

extern "C" __global__ void __launch_bounds__(256) pq_scan_select(
    const unsigned char* __restrict__ codes,  // [B, n_rows, M] or [P, 64, M] (paged) uint8
    const int* __restrict__ lengths,          // [B] valid rows per request
    const signed char* __restrict__ lut,      // [B, M, 256] int8 tables
    const float* __restrict__ thr,            // [B] thresholds of the sampling pass
    float* __restrict__ out_score,            // [B, capacity]
    int* __restrict__ out_pos,                // [B, capacity]
    int* __restrict__ count,                  // [B] appended counts (zeroed by the sampling pass)
    const int* __restrict__ table,            // [B, table_width] physical page of each 64-row page (paged)
    int table_width, int n_rows, int capacity, int rows_per_block, int paged)
{
    __shared__ __align__(16) signed char lut_s[M_SUB * K_ENT];
    const int b = blockIdx.y;
    const long long length = lengths[b];
    const long long first = (long long)blockIdx.x * rows_per_block;
    if (first >= length) return;  // the whole block: a grid sized for the longest request
    const int4* src = reinterpret_cast<const int4*>(lut + (long long)b * M_SUB * K_ENT);
    int4* dst = reinterpret_cast<int4*>(lut_s);
    for (int i = threadIdx.x; i < M_SUB * K_ENT / 16; i += blockDim.x) dst[i] = src[i];
    __syncthreads();
    const float t = thr[b];
    const int lane = threadIdx.x & 31;
    const long long stop = min(length, first + rows_per_block);
    // every thread of the block loops as often (stop is the block's), so each ballot sees whole warps
    for (long long base = first; base < stop; base += blockDim.x) {
        const long long r = base + threadIdx.x;
        const bool valid = r < stop;
        int score = 0;
        if (valid) {
            const long long flat = paged ? (long long)table[(long long)b * table_width + (r >> 6)] * 64 + (r & 63)
                                         : (long long)b * n_rows + r;
            const uint4* row = reinterpret_cast<const uint4*>(codes + flat * M_SUB);
#pragma unroll
            for (int q = 0; q < M_SUB / 16; ++q) {
                const uint4 v = __ldcg(row + q);
                const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        score += lut_s[(q * 16 + i * 4 + j) * K_ENT + ((w[i] >> (8 * j)) & 0xffu)];
                    }
                }
            }
        }
        const float s = (float)score;
        const bool keep = valid && s >= t;
        const unsigned mask = __ballot_sync(0xffffffffu, keep);
        if (mask) {
            const int leader = __ffs(mask) - 1;
            int slot0 = 0;
            if (lane == leader) slot0 = atomicAdd(count + b, __popc(mask));
            slot0 = __shfl_sync(0xffffffffu, slot0, leader);
            if (keep) {
                const int slot = slot0 + __popc(mask & ((1u << lane) - 1u));
                if (slot < capacity) {  // past it: counted, not stored (the caller sees the overflow)
                    out_score[(long long)b * capacity + slot] = s;
                    out_pos[(long long)b * capacity + slot] = (int)r;
                }
            }
        }
    }
}
"""


def source(subspaces: int) -> str:
    """The kernel's CUDA source for ``subspaces`` code bytes a key (a multiple of 16)."""
    if subspaces <= 0 or subspaces % 16:
        raise ValueError(f"the CUDA scan reads 16 code bytes at a time: got {subspaces} subspaces, want a multiple of 16")
    return _SOURCE.replace("__M__", str(subspaces))


def check_scan(scan: str) -> None:
    if scan not in SCANS:
        raise ValueError(f"scan: got {scan!r}, want one of {', '.join(SCANS)}")


def available() -> bool:
    """Whether the CUDA scan can run here: a CUDA device and a torch that compiles kernels with NVRTC."""
    import torch

    return torch.cuda.is_available() and hasattr(torch.cuda, "_compile_kernel") and torch.version.hip is None


@functools.cache
def _compiled(subspaces: int, device_index: int):
    import torch

    with torch.cuda.device(device_index):
        try:
            return torch.cuda._compile_kernel(source(subspaces), KERNEL)
        except (OSError, RuntimeError) as err:  # no CUDA_HOME for torch's include paths, no NVRTC, a compile error
            raise ValueError(f"the CUDA scan did not compile here ({err}); set CUDA_HOME to the CUDA toolkit, or "
                             "use scan='triton'") from err


def rows_per_block(batch: int, slots: int) -> int:
    """Keys a block scans: 2,048 (the table copy, 8 KB from L2, is then 1/8 of the codes a block reads), or
    512 where few key slots would leave the GPU short of blocks (the bound of the Triton scan's wide tiles)."""
    return 512 if batch * slots <= 8 << 20 else 2048


def pq_scan_select(codes: torch.Tensor, lengths: torch.Tensor, lut: torch.Tensor, thr: torch.Tensor,
                   buf_scores: torch.Tensor, buf_pos: torch.Tensor, counts: torch.Tensor,
                   page_table: torch.Tensor | None, n: int, block_rows: int | None = None) -> None:
    """Append every one of the first ``n`` rows of each request whose integer score reaches ``thr`` to its
    buffer, as the Triton selecting pass does. ``codes`` [B, N, M] or [P, 64, M] uint8 (``page_table`` [B, W]
    int32); ``lengths`` [B] int32; ``lut`` [B, M, 256] int8; ``thr`` [B] float32; ``buf_scores`` [B, cap]
    float32, ``buf_pos`` [B, cap] int32, ``counts`` [B] int32 (zeroed by the sampling pass before it), all
    contiguous on one CUDA device. Raises ``ValueError`` otherwise."""
    import torch

    b, m = lut.shape[0], codes.shape[-1]
    if not available() or codes.device.type != "cuda":
        raise ValueError("the CUDA scan needs a CUDA device and a CUDA build of torch with NVRTC "
                         "(torch.cuda._compile_kernel); use scan='triton' elsewhere")
    want = {"codes": torch.uint8, "lengths": torch.int32, "lut": torch.int8, "thr": torch.float32,
            "buf_scores": torch.float32, "buf_pos": torch.int32, "counts": torch.int32}
    tensors = {"codes": codes, "lengths": lengths, "lut": lut, "thr": thr, "buf_scores": buf_scores,
               "buf_pos": buf_pos, "counts": counts}
    if page_table is not None:
        want["page_table"], tensors["page_table"] = torch.int32, page_table
    for name, t in tensors.items():
        if t.dtype != want[name] or t.device != codes.device or not t.is_contiguous():
            raise ValueError(f"{name}: got {t.dtype} on {t.device} (contiguous: {t.is_contiguous()}), want "
                             f"{want[name]} contiguous on {codes.device}")
    if lut.shape[1:] != (m, 256):
        raise ValueError(f"lut: got shape {tuple(lut.shape)}, want [B, {m}, 256] (one byte a code)")
    if codes.data_ptr() % 16 or lut.data_ptr() % 16:
        raise ValueError("codes and lut must start on a 16-byte boundary (the kernel reads 16 bytes at a time)")
    paged = page_table is not None
    n_rows = page_table.shape[1] * 64 if paged else codes.shape[1]
    rows = block_rows or rows_per_block(b, n)
    kernel = _compiled(m, codes.device.index if codes.device.index is not None else torch.cuda.current_device())
    table = page_table if paged else lengths
    kernel(grid=(max(1, -(-n // rows)), b, 1), block=(THREADS, 1, 1),
           args=[codes, lengths, lut, thr, buf_scores, buf_pos, counts, table, int(table.shape[-1]) if paged else 0,
                 int(n_rows), int(buf_scores.shape[1]), int(rows), int(paged)])
