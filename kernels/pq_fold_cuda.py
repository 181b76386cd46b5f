"""Stage 1 on folded queries: a CUDA scan that scores every key with 16 folded queries on the tensor cores.

Stage 1 as shipped scores a key by one folded query, ``sum_h w_h q_h . k``: a linear score, blind to the
ReLU of stage 2's ``sum_h w_h relu(q_h . k)``. Folds keep some of it (docs/results.md, "A stage 1 that sees
the ReLU: signed grouped folds"): the request's heads split by the sign of their weight, each side in 8
groups by the direction of their queries (:func:`fold_operands`), group ``g`` folded into one query
``Q_g = sum_{h in g} w_h q_h``, and a key scored

    ``sum_g f_g(Q_g . k)``, ``f_g(x) = (1 + leak) x`` where the sign of x is the group's, else ``leak x``,

(the ReLU of a positive group, the other side's minimum for a negative one, plus a small leak that orders the
keys every fold scores below zero). 128K held-out captures (H100, top-512, reference path, leak 0.05, 3 rounds):
99.46 / 99.29% (mean / 64K-128K) at a quarter of the shipped stage 1's width, 99.79 / 99.72% at half, against
99.24 / 98.98% for the shipped step at its full width.

**Measured** (H100, docs/results.md "The fold scan at 1.7x its floor, and the folds at the recall target"):
the scan takes 602 us at 32 x 1M paged keys against a 358 us read of the codes (1.68x; the shipped scan of the
codes: 1.28x). Through the served group at 128K (kernels on the GPU) the folds at P = 1 serve 99.72 / 99.62%
(mean / 64K-128K) of the exact top-512, where the default codes at P = 4 serve 99.26 / 99.00%; their step is
1.41-1.43x DeepGEMM + the best top-k at 8 x 1M, 1.99-2.02x at 32 x 1M, 2.17-2.19x at 64 x 1M (the codes at P = 4:
1.85 / 2.25 / 2.44x). The codes stay the default until bundles record the folds' recall for the chooser.

The kernel (one launch for a step's stage 1, a second for its sampling pass):

- **Blocks and tiles.** One block of 512 threads a multiprocessor (:func:`launch_grid`) copies the int8 codebook
  (32 x 256 codewords of 4 int8, 32 KB) four times into shared memory once (``BOOK_AT_COPY``: a lookup's lanes
  share a bank two at most, and its byte offset is one byte-permute of the code), then takes the launch's tiles
  of rows in turn: for each, its request's 16 int8 folded queries and its slice of the page table.
- **Keys straight into fragments.** A warp scores 32 consecutive rows a step, as stage 2's int8 kernel
  scores 32 candidates: lane ``(g, t)`` loads bytes ``8t .. 8t + 7`` of row ``8 nt + g`` of the step (four
  256-byte loads a warp, whole sectors; two steps' loads in flight), looks each code up straight into the B
  fragment of ``mma.m16n8k32`` (s8 in, s32 out), the 16 folded queries the A side (one m-tile). No row list is
  read and no score written.
- **Epilogue.** The two slopes of each group on its accumulators, the groups summed over the quad's lanes by
  shuffles (a reduce-scatter: each lane then owns one row's score), the row kept where its score reaches the
  request's threshold, staged in shared memory and appended with one global atomic a block (the shipped
  scan's way, :mod:`~dsaindex.kernels.pq_scan_cuda`).
- **Sampling** (``sample_stride`` > 0): the same scores of rows ``0, stride, 2 stride, ...`` written out, from
  which :func:`~dsaindex.kernels.select.sample_thresholds` reads the threshold. The threshold and the kept rows
  come from one arithmetic.

Compiled at first use by NVRTC through torch, launched on the current stream (a CUDA graph captures it).
``tests/test_pq_fold_cuda.py`` runs this source on the CPU (tests/cuda_emulator.py) against
:func:`fold_scores_reference`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsaindex.kernels import nvrtc
from dsaindex.kernels.pq_stage2_cuda import S8_HELPERS

if TYPE_CHECKING:
    import torch

KERNEL = "pq_fold_scan"
THREADS = 512  # a block: one a multiprocessor (its four codebooks fill most of the shared memory)
FOLDS = 16  # folded queries: one m-tile of the tensor cores; the first half the positive heads' groups
ROUNDS = 3  # rounds of the groups' k-means (3 served as 10 did: docs/results.md)
LEAK = 0.05
SUBSPACES, CENTROIDS, DIM = 32, 256, 128
# warps of the operands' program (a request). On the H100 (results/fold_scan_diag_h100.json, 32 requests):
# 327.5 us at 4 warps (Triton's ptxas spills 18,760 bytes of stack a thread: the 64 x 128 float32 queries, held
# three times over), 49.8 us at 8, 122.9 us at 16; the torch ops take 250.0 us
OPERANDS_WARPS = 8
# the k-means products' precision in that program: "tf32" (the tensor cores; the folded queries stay float32) or
# "ieee" (float32, Triton's FMA loop). On the H100 the operands took 47.4 / 49.5 us (one request / 32, 64 heads) in
# float32 and 12.1 / 12.6 us with the products in tf32, which put every head of one request and 2,047 of 32 x 64 in
# the same fold as float32. The whole fold step at P = 1, C = 4,096 (`bench paged --stage1 folds --prefilter 1
# --exact-below 0 --grow-band 131072`, one run each): 0.143 -> 0.098 ms at 1 x 256K, 0.175 -> 0.128 ms at 1 x 1M,
# 0.853 -> 0.791 ms at 32 x 1M (docs/results/paged_folds_p1_{ieee,tf32}_h100.json); its GPU tests pass in both
OPERANDS_PRECISION = "tf32"
MAX_ROWS = 8192  # rows a block scans at most (its kept rows are staged in shared memory: 4 bytes each)
COPIES = 4  # of the codebook in a block's shared memory (the kernel's BOOK_AT_COPY)
BASE_SHARED = COPIES * SUBSPACES * CENTROIDS * 4 + FOLDS * DIM  # a block's codebooks and queries
SHARED = BASE_SHARED + MAX_ROWS * 4  # and its staged rows, 4 bytes a row it scans at most


def shared_bytes(block_rows: int) -> int:
    """Dynamic shared memory of a launch of ``block_rows`` rows a block (its staging holds every one of them)."""
    return BASE_SHARED + 4 * block_rows


def launch_grid(tiles: int, sms: int) -> int:
    """Blocks of a launch of ``tiles`` tiles: one a multiprocessor, as many as run at once (each fills its
    codebooks once and takes tiles in turn), no more than the tiles."""
    return max(1, min(tiles, sms))

_SOURCE = r"""
#ifndef SHARED_DYNAMIC
#define SHARED_DYNAMIC extern __shared__ __align__(16) int smem[]
#endif
#ifndef THREADS
#define THREADS 512
#endif
#define WARPS (THREADS / 32)
#define FOLDS 16
#define MAX_ROWS 8192
#ifndef DEPTH
#define DEPTH 2  // steps whose codes are in flight at once (3 and 4 were no faster on the H100)
#endif
#define FULL 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)
// four copies of the codebook, lane (g, t) reading copy g & 3. Copies 2m and 2m + 1 share block m of 64 KB, a row
// of 64 words a code: copy k holds codeword (s, c) at (k >> 1) * 16384 + c * 64 + (k & 1) * 32 + (s ^ 2k). A
// subspace's 4 copies sit in 4 banks, so only lanes g and g + 4 meet in a bank (2 wavefronts a lookup, against
// about 3 for one codebook swizzled by the code's low bits), and a lookup's byte offset is one byte-permute: the code as
// byte 1, the lane's copy and subspace in bytes 0 and 2. (SPLIT, a variant: in a step's first lookup lanes g >= 4
// read the second subspace, and in its second the first, so the 32 lanes read 32 banks, one wavefront; a select a
// lookup puts the words back in the MMA's order)
#define BOOK_WORDS (4 * 32 * 256)
#define BOOK_AT_COPY(k, s, c) (((k) >> 1) * 16384 + (c) * 64 + ((k) & 1) * 32 + ((s) ^ (2 * (k))))

""" + S8_HELPERS + r"""

extern "C" __global__ void __launch_bounds__(THREADS, 1) pq_fold_scan(
    const unsigned char* __restrict__ codes,  // [B, n_rows, 32] or [P, 64, 32] (paged) uint8
    const int* __restrict__ lengths,          // [B] valid rows per request
    const unsigned* __restrict__ codebook,    // [32, 256] int8 codewords of 4 (subspace-major), one word each
    const unsigned* __restrict__ queries,     // [B, 16, 32] the int8 folded queries, 4 dims a word
    const float* __restrict__ slopes,         // [B, 16, 2] each fold's slope above zero, below zero
    const float* __restrict__ thr,            // [B] thresholds (the scan)
    int* __restrict__ out_pos,                // [B, capacity] kept rows (the scan)
    int* __restrict__ count,                  // [B] appended counts, zeroed before (the scan)
    float* __restrict__ samples,              // [B, n_samples] sampled rows' scores, -inf past a length (sampling)
    const int* __restrict__ table,            // [B, table_width] physical page of each 64-row page (paged)
    int table_width, int n_rows, int capacity, int rows_per_block, int paged, int sample_stride, int n_samples,
    int batch, int tiles_x)                   // the launch's tiles: batch x tiles_x of rows_per_block indices
{
    SHARED_DYNAMIC;
    // the codebook (BOOK_AT_COPY); fold f's 32 words in 8 chunks of 16 bytes, chunk c at c ^ (f & 7)
    unsigned* book_s = reinterpret_cast<unsigned*>(smem);
    unsigned* q_s = book_s + BOOK_WORDS;
    int* staged = reinterpret_cast<int*>(q_s + FOLDS * 32);  // kept rows' offsets in the block
    __shared__ float up_s[FOLDS], down_s[FOLDS];
    __shared__ int pages_s[MAX_ROWS / 64];  // the tile's physical pages (a paged scan)
    __shared__ int st_n, st_base;
    const bool sampling = sample_stride > 0;
    const int stride = sampling ? sample_stride : 1;  // row of the i-th index
    // the codebook turned code-major: a thread reads 16 bytes, codewords (s, 4 c4 .. 4 c4 + 3)
#define FILL_BOOK { \
        const uint4* src = reinterpret_cast<const uint4*>(codebook); \
        constexpr int PER_THREAD = (32 * 64 + THREADS - 1) / THREADS; \
        uint4 four[PER_THREAD]; \
        _Pragma("unroll") \
        for (int k = 0; k < PER_THREAD; ++k) { \
            const int i = threadIdx.x + k * THREADS; \
            if (32 * 64 % THREADS == 0 || i < 32 * 64) four[k] = src[(i & 31) * 64 + (i >> 5)]; \
        } \
        _Pragma("unroll") \
        for (int k = 0; k < PER_THREAD; ++k) { \
            const int i = threadIdx.x + k * THREADS, s = i & 31, c = 4 * (i >> 5); \
            if (32 * 64 % THREADS == 0 || i < 32 * 64) STORE_WORDS(s, c, four[k]) \
        } }
#define STORE_WORDS(s, c, v4) { _Pragma("unroll") for (int copy = 0; copy < 4; ++copy) { \
        book_s[BOOK_AT_COPY(copy, s, c)] = v4.x; book_s[BOOK_AT_COPY(copy, s, c + 1)] = v4.y; \
        book_s[BOOK_AT_COPY(copy, s, c + 2)] = v4.z; book_s[BOOK_AT_COPY(copy, s, c + 3)] = v4.w; } }
    // a block fills its codebooks once and takes the launch's tiles of rows_per_block rows in turn: tile
    // blockIdx.x, then blockIdx.x + gridDim.x, ... (a grid of one block a tile takes one each)
    FILL_BOOK
    for (int tile = blockIdx.x; tile < batch * tiles_x; tile += gridDim.x) {
        const int b = tile / tiles_x, x = tile - b * tiles_x;
        // rows and indices in 32 bits (a request's rows, and a pool's, number under 2^31), byte offsets in 64
        const int length = lengths[b];
        const int limit = sampling ? n_samples : length;  // indices the launch covers
        const int first = x * rows_per_block;
        if (first >= limit) continue;
        const int stop = min(limit, first + rows_per_block);
        const int* table_b = table + (long long)b * table_width;
        __syncthreads();  // the codebooks filled; the block done with the last tile's queries, pages and staging
        if (threadIdx.x == 0) st_n = 0;
        // queries in the order the lanes' code bytes come in (stage 2's int8 order): the 32-dimension step s takes
        // subspaces 8t + 2s, 8t + 2s + 1 of lane t, so chunk c of a fold holds in its word t the 4 dims of
        // subspace 8t + c
        const unsigned* qb = queries + (long long)b * FOLDS * 32;
#pragma unroll
        for (int k = 0; k < (FOLDS * 32 + THREADS - 1) / THREADS; ++k) {
            const int i = threadIdx.x + k * THREADS;
            if (FOLDS * 32 % THREADS && i >= FOLDS * 32) break;
            const int f = i >> 5, sub = i & 31;
            q_s[f * 32 + (((sub & 7) ^ (f & 7)) << 2) + (sub >> 3)] = qb[i];
        }
        if (threadIdx.x < FOLDS) {
            up_s[threadIdx.x] = slopes[((long long)b * FOLDS + threadIdx.x) * 2];
            down_s[threadIdx.x] = slopes[((long long)b * FOLDS + threadIdx.x) * 2 + 1];
        }
        if (paged && !sampling)  // the tile's slice of the page table, read once
            for (int i = threadIdx.x; first + 64 * i < stop; i += THREADS) pages_s[i] = __ldg(table_b + (first >> 6) + i);
        __syncthreads();
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        const int j = lane >> 3, jr = lane & 7;  // ldmatrix: lane 8 j + jr gives row jr of matrix j
        const int fold = jr + 8 * (j & 1);  // the A row (fold) this lane's ldmatrix address gives
        const int own = (g & 3) * 8 + 2 * t + (g >> 2);  // the row of the step whose score this lane ends with
        const unsigned char* codes_b = (paged ? codes : codes + (long long)b * n_rows * 32) + 8 * t;
        const float t_b = sampling ? 0.0f : thr[b];
        const int step_rows = 32 * WARPS;
        // lane (g, t) loads bytes 8t .. 8t + 7 of the step's rows 8 nt + g: a warp's load of an n-tile reads 256
        // consecutive bytes. A scan's step (32 rows from a multiple of 32) sits in one page: its physical page
        // from the tile's slice in shared memory, the four n-tiles 256 bytes apart; a sampling step's rows are
        // apart, each read through the table
#define FETCH(into, at) { \
            const int s0 = (at); \
            if (!sampling) { \
                const unsigned p0 = paged && s0 < stop ? (unsigned)pages_s[(s0 - first) >> 6] * 64u + (s0 & 63) : s0; \
                const uint2* src = reinterpret_cast<const uint2*>(codes_b + (unsigned long long)(p0 + g) * 32u); \
                _Pragma("unroll") \
                for (int nt = 0; nt < 4; ++nt) \
                    into[nt] = s0 + 8 * nt + g < stop ? __ldg(src + 32 * nt) : make_uint2(0u, 0u); \
            } else { \
                _Pragma("unroll") \
                for (int nt = 0; nt < 4; ++nt) { \
                    const int idx = s0 + 8 * nt + g; \
                    const long long rr = (long long)idx * stride; \
                    into[nt] = make_uint2(0u, 0u); \
                    if (idx < stop && rr < length) { \
                        const long long phys = paged ? (long long)__ldg(table_b + (rr >> 6)) * 64 + (rr & 63) : rr; \
                        into[nt] = __ldg(reinterpret_cast<const uint2*>(codes_b + phys * 32)); \
                    } \
                } \
            } }
        // DEPTH steps' codes in flight (a block of 16 warps is all a multiprocessor holds: the loads in flight
        // are what keeps the memory busy): step i's in buffer i mod DEPTH, refilled with the codes of the step
        // DEPTH on once its lookups are done (a copy from buffer to buffer would wait for the load it copies)
        int base = first + 32 * warp;
        uint2 buf[DEPTH][4];
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) FETCH(buf[d], base + d * step_rows)
        const float ua = up_s[g], da = down_s[g], ub = up_s[g + 8], db = down_s[g + 8];
        // the folds' A fragments, the same every step
        unsigned a_frag[4][4];
#pragma unroll
        for (int s = 0; s < 4; ++s) ldsm_x4(a_frag[s], q_s + fold * 32 + (((2 * s + (j >> 1)) ^ (fold & 7)) << 2));
        // the byte offset of subspace 8t + i, code 0, in the lane's copy
        const char* book_bytes = reinterpret_cast<const char*>(book_s);
        unsigned col[8];
#ifdef SPLIT
        // col[2s]: the lane's first lookup of step s, subspace 8t + 2s + hi; col[2s + 1]: its second
        const unsigned hi = (unsigned)(g >> 2), first_sel = 0x7604u + (hi << 4), second_sel = 0x7614u - (hi << 4);
#pragma unroll
        for (int i = 0; i < 8; ++i)
            col[i] = 4u * (unsigned)BOOK_AT_COPY(g & 3, 8 * t + (i & ~1) + ((i & 1) ^ (int)hi), 0);
#else
#pragma unroll
        for (int i = 0; i < 8; ++i) col[i] = 4u * (unsigned)BOOK_AT_COPY(g & 3, 8 * t + i, 0);
#endif
        // the step of 32 rows from row ``at`` (this warp's), on the codes in ``code``, which it then refills with
        // the codes of the step DEPTH on
        auto step = [&](uint2 (&code)[4], const int at) {
            int acc[4][4];
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0;
#pragma unroll
            for (int s = 0; s < 4; ++s) {
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
                    // byte i of the lane's load: the code of subspace 8t + i; step s reads i = 2s, 2s + 1
                    const unsigned word = s < 2 ? code[nt].x : code[nt].y;
                    unsigned b0, b1;
#if defined(DIAG_NO_LOOKUP)  // the tools' attribution of the scan's time (tools/fold_scan.py): codes as operands
                    b0 = word;
                    b1 = word >> 8;
#elif defined(SPLIT)
                    const unsigned x = *reinterpret_cast<const unsigned*>(
                        book_bytes + __byte_perm(word, col[2 * s], first_sel + 32u * (s & 1)));
                    const unsigned y = *reinterpret_cast<const unsigned*>(
                        book_bytes + __byte_perm(word, col[2 * s + 1], second_sel + 32u * (s & 1)));
                    b0 = hi ? y : x;
                    b1 = hi ? x : y;
#else
                    // the code as byte 1 of the offset, the lane's copy and subspace in bytes 0 and 2
                    b0 = *reinterpret_cast<const unsigned*>(
                        book_bytes + __byte_perm(word, col[2 * s], 0x7604u + 32u * (s & 1)));
                    b1 = *reinterpret_cast<const unsigned*>(
                        book_bytes + __byte_perm(word, col[2 * s + 1], 0x7614u + 32u * (s & 1)));
#endif
#ifdef DIAG_NO_MMA  // the lookups without the tensor cores
                    acc[nt][s] += (int)(b0 ^ b1) + (int)a_frag[s][nt];
#else
                    mma_s8(acc[nt], a_frag[s], b0, b1);
#endif
                }
            }
            // the codes of the step DEPTH on in flight while this one's scores are reduced
            FETCH(code, at + DEPTH * step_rows)
#ifdef DIAG_NO_EPILOGUE  // the tools' attribution: every accumulator summed, no slopes, no reduction
            const float score = (float)(acc[0][0] + acc[1][1] + acc[2][2] + acc[3][3] + acc[0][3] + acc[1][2]);
#else
            // rows g (folds 0..7: positive) and g + 8 (negative) of the accumulators, columns 2t, 2t + 1
            float part[4][2];
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const float x = (float)acc[nt][c], y = (float)acc[nt][2 + c];
                    part[nt][c] = (x > 0.0f ? ua : da) * x + (y > 0.0f ? ub : db) * y;
                }
            }
            // lane g ends with the sum over the 16 folds of n-tile g & 3, column 2t + (g >> 2): row ``own``
            const float score = quad_column_sum(part, g);
#endif
            const int mine = at + own;
            const bool valid = mine < stop && (!sampling || (long long)mine * stride < length);
            if (sampling) {
                if (mine < stop) samples[(long long)b * n_samples + mine] = valid ? score : NEG_INF;
                return;
            }
            const bool keep = valid && score >= t_b;
            const unsigned mask = __ballot_sync(FULL, keep);
            if (mask) {
                const int leader = __ffs(mask) - 1;
                int slot0 = 0;
                if (lane == leader) slot0 = atomicAdd(&st_n, __popc(mask));  // shared memory: no wait on L2
                slot0 = __shfl_sync(FULL, slot0, leader);
                if (keep) staged[slot0 + __popc(mask & ((1u << lane) - 1u))] = (int)(mine - first);
            }
        };
        // every warp loops as often (stop is the block's), so each ballot sees whole warps; a step past the stop
        // scores zero codes and keeps none
        for (int step0 = first; step0 < stop; step0 += DEPTH * step_rows, base += DEPTH * step_rows) {
#pragma unroll
            for (int d = 0; d < DEPTH; ++d) step(buf[d], base + d * step_rows);
        }
        if (sampling) continue;
        __syncthreads();
        if (threadIdx.x == 0) st_base = st_n ? atomicAdd(count + b, st_n) : 0;
        __syncthreads();
        const long long out = (long long)b * capacity;
        for (int i = threadIdx.x; i < st_n; i += THREADS) {
            const int slot = st_base + i;
            if (slot < capacity) out_pos[out + slot] = (int)(first + staged[i]);
        }
    }
}
"""


def source() -> str:
    """The kernel's CUDA source."""
    return _SOURCE


def available() -> bool:
    """Whether the fold scan can run here: a CUDA device and a torch that compiles kernels with NVRTC."""
    return nvrtc.available()


def takes(heads: int, dim: int, subspaces: int, centroids: int, residual: bool) -> str | None:
    """Why folds cannot score these codes (None: they can): queries of 128 dims against product codes of 32 x 256
    centroids (4 dims a subspace), at least 2 heads."""
    if (dim, subspaces, centroids) != (DIM, SUBSPACES, CENTROIDS) or residual or heads < 2:
        return (f"folds score {DIM}-dim queries of 2 heads or more against product codes of {SUBSPACES} x "
                f"{CENTROIDS} centroids: got {dim} dims, {subspaces} x {centroids}{', residual' if residual else ''}"
                f"{f', {heads} heads' if heads < 2 else ''}")
    return None


def compiles(device: torch.device) -> bool:
    """Whether the kernel builds on ``device`` (once a process; False off CUDA or where NVRTC cannot)."""
    return nvrtc.compiles(source(), KERNEL, SHARED, device, *_NAMES)


_NAMES = ("the fold scan", "stage1='codes'")  # what a build failure says, and the way around it


def head_groups(queries: torch.Tensor, head_weights: torch.Tensor, folds: int = FOLDS,
                rounds: int = ROUNDS) -> torch.Tensor:
    """[B, H] int64: the fold of each head of each request. The heads of positive weight go to folds ``0 ..
    folds / 2 - 1``, the others to the rest; each side is clustered by k-means on the directions of its heads'
    queries (cosine), ``rounds`` rounds, started from heads spread evenly over the side's heads in their order
    (a side of fewer heads than folds starts some folds twice; those stay empty). Batched torch ops of fixed
    shapes: no host sync, so a CUDA graph captures it."""
    import torch

    b, h, _ = queries.shape
    half = folds // 2
    x = torch.nn.functional.normalize(queries.float(), dim=2)
    positive = head_weights.float() > 0  # [B, H]
    side_of_fold = torch.arange(folds, device=x.device) < half  # [G]: True for the positive side's folds
    allowed = positive[:, :, None] == side_of_fold[None, None, :]  # [B, H, G]
    # the starting heads: on each side, the heads whose rank among the side's is floor(i (n - 1) / (half - 1))
    start = torch.zeros(b, folds, h, device=x.device)
    for side, offset in ((positive, 0), (~positive, half)):
        rank = side.long().cumsum(1) - 1  # [B, H]
        n = side.long().sum(1, keepdim=True)  # [B, 1]
        want = (torch.arange(half, device=x.device)[None, :] * (n - 1).clamp_min(0)) // max(1, half - 1)  # [B, half]
        start[:, offset:offset + half] = ((rank[:, None, :] == want[:, :, None]) & side[:, None, :]).float()
    centers = torch.einsum("bgh,bhd->bgd", start, x)
    assign = torch.zeros(b, h, dtype=torch.long, device=x.device)
    for _ in range(rounds):
        sim = torch.einsum("bhd,bgd->bhg", x, centers).masked_fill(~allowed, float("-inf"))
        assign = sim.argmax(2)
        sums = torch.einsum("bhg,bhd->bgd", torch.nn.functional.one_hot(assign, folds).float(), x)
        norm = sums.norm(dim=2, keepdim=True)
        centers = torch.where(norm > 0, sums / norm.clamp_min(1e-30), centers)
    return assign


def fold_operands(queries: torch.Tensor, head_weights: torch.Tensor, codebook: torch.Tensor, folds: int = FOLDS,
                  rounds: int = ROUNDS, leak: float = LEAK,
                  fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fold scan's operands for ``queries`` [B, H, 128] and ``head_weights`` [B, H] against ``codebook``
    [32, 256, 4]: (folded queries [B, folds, 128] int8, slopes [B, folds, 2] float32, codewords [32, 256, 4] int8).
    Fold ``g`` is ``sum_{h in g} w_h q_h`` over the heads :func:`head_groups` gives it, times the codebook's
    per-subspace scales (so one integer dot product covers every subspace), scaled to 127; its scale moves into
    its slopes: ``(1 + leak, leak)`` above and below zero for the positive side's folds, ``(leak, 1 + leak)`` for
    the others'. Torch ops on any device (no sync); on a CUDA device (``fused`` None) or where ``fused``, one
    Triton launch (:func:`~dsaindex.kernels.pq_fold_kernel.fold_operands_kernel`, a program a request) computes
    the same up to float32 summation order (an int8 query within 1, a head's fold the same but at a near tie).
    Raises ``ValueError`` unless ``queries`` are [B, H, 128] and ``head_weights`` [B, H]."""
    import torch

    from dsaindex.kernels.pq_stage2_cuda import int8_codebook

    b, h, d = queries.shape
    if d != DIM or tuple(head_weights.shape) != (b, h) or folds % 2 or folds < 2:
        raise ValueError(f"fold operands: want queries [B, H, {DIM}], head_weights [B, H] and an even number of "
                         f"folds, got {tuple(queries.shape)}, {tuple(head_weights.shape)} and {folds}")
    book8, scale = int8_codebook(codebook)
    if queries.is_cuda if fused is None else fused:
        return (*_fold_operands_fused(queries, head_weights, scale.to(queries.device), folds, rounds, leak)[:2], book8)
    group = head_groups(queries, head_weights, folds, rounds)
    member = torch.nn.functional.one_hot(group, folds).float()  # [B, H, G]
    weighted = queries.to(torch.bfloat16).float() * head_weights.float()[:, :, None]
    folded = torch.einsum("bhg,bhd->bgd", member, weighted) * scale.to(weighted.device).repeat_interleave(
        DIM // SUBSPACES)[None, None, :]
    tau = folded.abs().amax(dim=2).clamp_min(1e-30) / 127.0  # [B, G]
    q8 = torch.round(folded / tau[..., None]).clamp(-127, 127).to(torch.int8).contiguous()
    positive = (torch.arange(folds, device=tau.device) < folds // 2)[None, :]
    up = torch.where(positive, 1.0 + leak, leak) * tau
    down = torch.where(positive, leak, 1.0 + leak) * tau
    return q8, torch.stack([up, down], dim=2).float().contiguous(), book8


def _fold_operands_fused(queries, head_weights, scale, folds, rounds, leak, num_warps: int = OPERANDS_WARPS,
                         precision: str | None = None):
    """(q8, slopes, groups [B, H] int32) in one Triton launch (:func:`fold_operands`); ``precision`` of the
    k-means products, None: :data:`OPERANDS_PRECISION` as it is at the call."""
    import torch
    import triton

    from dsaindex.kernels.pq_fold_kernel import fold_operands_kernel

    b, h, d = queries.shape
    q = queries.to(torch.bfloat16).contiguous()
    w = head_weights.float().contiguous()
    q8 = torch.empty(b, folds, d, dtype=torch.int8, device=q.device)
    slopes = torch.empty(b, folds, 2, dtype=torch.float32, device=q.device)
    groups = torch.empty(b, h, dtype=torch.int32, device=q.device)
    if b:
        fold_operands_kernel[(b,)](q, w, scale.float().contiguous(), q8, slopes, groups, h, float(leak),
                                   HP=max(16, triton.next_power_of_2(h)), D=d, DSUB=d // SUBSPACES, G=folds,
                                   ROUNDS=rounds, KMEANS=precision or OPERANDS_PRECISION, num_warps=num_warps)
    return q8, slopes, groups


def fold_scores_reference(codes: torch.Tensor, q8: torch.Tensor, slopes: torch.Tensor,
                          book8: torch.Tensor) -> torch.Tensor:
    """[B, N] float32: each key's fold score, ``sum_g slope_g(x_g) x_g`` with ``x_g`` the integer dot product of
    fold ``g`` with the key's int8 codewords (the kernel's arithmetic, summed in float64). ``codes`` [B, N, 32]."""
    import torch

    b, n, m = codes.shape
    keys = book8.long()[torch.arange(m, device=codes.device)[None, None, :], codes.long()].reshape(b, n, -1)
    dots = torch.einsum("bnd,bgd->bng", keys.double(), q8.double())  # exact: |dots| < 2**53
    s = slopes.double()
    return torch.where(dots > 0, dots * s[:, None, :, 0], dots * s[:, None, :, 1]).sum(-1).float()


def _check(codes, lengths, q8, slopes, book8, page_table) -> None:
    import torch

    b = q8.shape[0]
    want = {"codes": (torch.uint8, None), "lengths": (torch.int32, (b,)), "q8": (torch.int8, (b, FOLDS, DIM)),
            "slopes": (torch.float32, (b, FOLDS, 2)), "book8": (torch.int8, (SUBSPACES, CENTROIDS, DIM // SUBSPACES)),
            "page_table": (torch.int32, None)}
    given = {"codes": codes, "lengths": lengths, "q8": q8, "slopes": slopes, "book8": book8, "page_table": page_table}
    for name, t in given.items():
        if t is None:
            continue
        dtype, shape = want[name]
        if t.dtype != dtype or t.device != codes.device or not t.is_contiguous() or (
                shape is not None and tuple(t.shape) != shape):
            raise ValueError(f"{name}: got {t.dtype} {tuple(t.shape)} on {t.device} (contiguous: {t.is_contiguous()}), "
                             f"want {dtype} {shape or ''} contiguous on {codes.device}")
    if codes.shape[-1] != SUBSPACES or codes.data_ptr() % 8:
        raise ValueError(f"codes: want {SUBSPACES} bytes a key, starting on an 8-byte boundary")
    if not available() or codes.device.type != "cuda":
        raise ValueError("the fold scan needs a CUDA device and a CUDA build of torch with NVRTC "
                         "(torch.cuda._compile_kernel); use stage1='codes' elsewhere")


def launch_rows(batch: int, n: int, sms: int) -> int:
    """Rows a tile of the scan: :data:`MAX_ROWS`, halved (down to 2,048) while the launch has fewer than three
    tiles a multiprocessor, so that its blocks end together (shapes only: a CUDA graph captures one launch)."""
    rows = MAX_ROWS
    while rows > 2048 and batch * -(-n // rows) < 3 * sms:
        rows //= 2
    return rows


def _launch(codes, lengths, q8, slopes, book8, thr, out_pos, counts, samples, page_table, capacity: int,
            indices: int, block_rows: int, stride: int, n_samples: int) -> None:
    b = q8.shape[0]
    paged = page_table is not None
    n_rows = page_table.shape[1] * 64 if paged else codes.shape[1]
    if block_rows % THREADS or not 0 < block_rows <= MAX_ROWS:
        raise ValueError(f"block_rows: got {block_rows}, want a multiple of {THREADS} up to {MAX_ROWS}")
    kernel = nvrtc.compiled(source(), KERNEL, SHARED, nvrtc.device_index(codes.device), *_NAMES)
    table = page_table if paged else lengths
    tiles_x = max(1, -(-indices // block_rows))
    grid = launch_grid(b * tiles_x, nvrtc.multiprocessors(nvrtc.device_index(codes.device)))
    kernel(grid=(grid, 1, 1), block=(THREADS, 1, 1), shared_mem=shared_bytes(block_rows),
           args=[codes, lengths, book8, q8, slopes, thr, out_pos, counts, samples, table,
                 int(table.shape[-1]) if paged else 0, int(n_rows), int(capacity), int(block_rows), int(paged),
                 int(stride), int(n_samples), int(b), int(tiles_x)])


def pq_fold_samples(codes: torch.Tensor, lengths: torch.Tensor, q8: torch.Tensor, slopes: torch.Tensor,
                    book8: torch.Tensor, stride: int, n_samples: int, page_table: torch.Tensor | None = None,
                    block_rows: int = 2048) -> torch.Tensor:
    """[B, n_samples] float32: the fold scores of rows ``0, stride, 2 stride, ...`` of each request (-inf past its
    length), as the scan scores them. Operands as :func:`fold_operands`; ``codes`` [B, N, 32] or [P, 64, 32] uint8
    (``page_table`` [B, W] int32), ``lengths`` [B] int32, all contiguous on one CUDA device."""
    import torch

    _check(codes, lengths, q8, slopes, book8, page_table)
    if stride < 1 or n_samples < 1:
        raise ValueError(f"stride {stride} and n_samples {n_samples}: want both at least 1")
    samples = torch.empty(q8.shape[0], n_samples, dtype=torch.float32, device=codes.device)
    if q8.shape[0]:
        _launch(codes, lengths, q8, slopes, book8, samples, lengths, lengths, samples, page_table, 0, n_samples,
                block_rows, stride, n_samples)
    return samples


def pq_fold_scan(codes: torch.Tensor, lengths: torch.Tensor, q8: torch.Tensor, slopes: torch.Tensor,
                 book8: torch.Tensor, thr: torch.Tensor, out_pos: torch.Tensor, counts: torch.Tensor, n: int,
                 page_table: torch.Tensor | None = None, block_rows: int | None = None) -> None:
    """Append every one of the first ``n`` rows of each request whose fold score reaches ``thr`` [B] float32 to
    ``out_pos`` [B, capacity] int32, counting them in ``counts`` [B] int32 (zeroed before: past the capacity they
    are counted, not stored). ``block_rows``: rows a block (a multiple of :data:`THREADS` up to :data:`MAX_ROWS`; None:
    :func:`launch_rows`). Inputs as :func:`pq_fold_samples`."""
    _check(codes, lengths, q8, slopes, book8, page_table)
    b = q8.shape[0]
    if block_rows is None:
        block_rows = launch_rows(b, n, nvrtc.multiprocessors(nvrtc.device_index(codes.device)))
    if b and n > 0:
        _launch(codes, lengths, q8, slopes, book8, thr, out_pos, counts, thr, page_table, out_pos.shape[1], n,
                block_rows, 0, 0)


def pq_fold_topc(codes: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor, head_weights: torch.Tensor,
                 codebook: torch.Tensor, c: int, capacity: int, page_table: torch.Tensor | None = None,
                 max_len: int | None = None, grow: tuple[int, int] = (0, 1)) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1 on folds: every key whose fold score reaches a sampled threshold aiming at ``c`` (``grow`` (band,
    most): ``c`` and ``capacity`` grown by each request's length, as the codes' stage 1 grows them), in a buffer
    of ``capacity`` (x most) slots. ``codes`` [B, N, 32] or [P, 64, 32] uint8 (``page_table`` [B, W] int32),
    ``queries`` [B, H, 128], ``head_weights`` [B, H], ``codebook`` [32, 256, 4] (its int8 form cached), on one
    CUDA device. Returns (rows [B, capacity x most] int32, counts [B] int32): slots past a count are unset. One
    graph-capturable sequence: the operands (torch), the sampling launch, the threshold (one Triton launch,
    which also zeroes the counts), the scan."""
    import torch

    from dsaindex.kernels import select

    lengths = lengths.to(device=codes.device, dtype=torch.int32).contiguous()
    n_rows = codes.shape[1] if page_table is None else page_table.shape[1] * 64
    n = n_rows if max_len is None else min(max_len, n_rows)
    band, most = grow
    q8, slopes, book8 = fold_operands(queries, head_weights, codebook)
    stride = select.sample_stride(n)
    n_samples = -(-n // stride)
    table = None if page_table is None else page_table.contiguous()
    if codes.device.type != "cuda":  # no kernel here (a CPU run of the Triton path): its arithmetic in torch
        return _fold_topc_torch(codes, lengths, q8, slopes, book8, c, capacity, table, n, stride, grow)
    samples = pq_fold_samples(codes, lengths, q8, slopes, book8, stride, n_samples, table)
    b = q8.shape[0]
    rows = torch.empty(b, capacity * (most if band else 1), dtype=torch.int32, device=codes.device)
    counts = torch.empty(b, dtype=torch.int32, device=codes.device)
    thr = select.sample_thresholds(samples, lengths, stride, c, capacity, counts=counts, grow=grow)
    pq_fold_scan(codes, lengths, q8, slopes, book8, thr, rows, counts, n, table)
    return rows, counts


def _fold_topc_torch(codes, lengths, q8, slopes, book8, c, capacity, table, n, stride, grow):
    """:func:`pq_fold_topc` in torch ops: the same threshold rule over the same scores, rows kept in order."""
    import torch

    from dsaindex.kernels.select import thresholds_from_samples

    if table is not None:  # the requests' rows through their page tables
        codes = codes[table.long()].reshape(table.shape[0], table.shape[1] * 64, codes.shape[-1])
    view = codes[:, :n]
    scores = fold_scores_reference(view, q8, slopes, book8)
    at = torch.arange(n, device=view.device)[None, :]
    lengths = lengths.long()
    band, most = grow
    samples = scores[:, ::stride].masked_fill(at[:, ::stride] >= lengths[:, None], float("-inf"))
    thr = thresholds_from_samples(samples, lengths, stride, c, capacity, grow=grow)
    keep = (at < lengths[:, None]) & (scores >= thr[:, None])
    width = capacity * (most if band else 1)
    order = torch.where(keep, at, n).sort(dim=1).values[:, :width]
    rows = torch.where(order < n, order, -1).to(torch.int32)
    if rows.shape[1] < width:
        rows = torch.cat([rows, rows.new_full((rows.shape[0], width - rows.shape[1]), -1)], dim=1)
    return rows.contiguous(), keep.sum(1).to(torch.int32)


def fold_topc_reference(codes: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor,
                        head_weights: torch.Tensor, codebook: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``c`` rows per request by the fold score (the runtimes' torch path): (scores [B, c] float32, rows [B, c]
    int64; -inf / -1 past a short request's end). ``codes`` [B, N, 32]; the rest as :func:`pq_fold_topc`."""
    from dsaindex.kernels import select

    q8, slopes, book8 = fold_operands(queries, head_weights, codebook)
    return select.topk_of_prefixes(fold_scores_reference(codes, q8, slopes, book8), lengths, c)
