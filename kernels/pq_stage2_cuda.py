"""Stage 2 of the decode step as a CUDA kernel: codebooks in shared memory, keys decoded straight into
tensor-core fragments, score bins counted in a shared-memory histogram.

The Triton stage 2 (:func:`dsaindex.kernels.pq_select.pq_candidate_scores` / ``pq_candidate_bins``) gathers each
candidate's 32 codewords from L1 (32 scattered 8-byte loads a key, about one L1 wavefront each) and counts every
score bin with a global atomic (one a distinct bin of a tile with the dedup). At a C grown past 128K it was
0.71 ms of a 1.25 ms step at 32 x 1M on the H200 (docs/results.md, "C grown with the prefix"). This kernel:

- **Codebooks.** Each block copies the 32 x 256 codewords (4 bf16 each, 64 KB) into shared memory once, and
  every lookup is one 8-byte shared load.
- **Keys straight into fragments.** A warp scores 32 candidates at a time: four n-tiles of 8 candidates for
  ``mma.m16n8k16`` (bf16 in, float32 out), the heads as the M side (four m-tiles of 16). The K side (the key's
  128 dimensions) is taken in a permuted order: in each 16-dimension step, lane ``t`` of a quad holds the
  fragment positions ``2t, 2t+1, 2t+8, 2t+9``, and the permutation makes those one codeword's four values
  (subspace ``4 step + t``). So a lane's B fragment of a step is exactly one codeword, one shared load, and no
  key is ever written out. The queries are staged in shared memory in the same order (a dot product does not
  care), swizzled so that ``ldmatrix`` reads them without bank conflicts.
- **Scores.** ``sum_h w_h relu(q_h . k)``: the ReLU and weights on the accumulators, the heads summed over the
  quad's lanes by shuffles; each lane then owns one of the 32 candidates (its score, bin, histogram count).
- **Bins.** Each score's bin (the Triton kernel's ``score_bin``) is counted in a shared-memory histogram of
  the block, added to the request's global histogram once a non-empty bin at the block's end.

Scores are the Triton stage 2's up to float summation order; the bins and histogram are those of the scores it
writes. It takes the serving code (64 heads of 128 dimensions, 32 subspaces of 256 centroids, 4 dimensions a
subspace, not residual); :func:`takes` says why otherwise.

Compiled at first use by NVRTC through torch (``torch.cuda._compile_kernel``), launched on the current stream
(so a CUDA graph captures it). ``tests/test_pq_stage2_cuda.py`` runs this source on the CPU (a thread per CUDA
thread, the warp's fragments exchanged at a barrier as the tensor cores exchange them) against the torch
reference.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from dsaindex.kernels import nvrtc

if TYPE_CHECKING:
    import torch

# "auto": the CUDA kernel on 8-bit operands where it runs and pays (:func:`resolve_stage2`); "int8": that kernel by
# name (the tensor cores' s8 form, native on Hopper where e4m3's is lowered to f16); "cuda": its bf16 form
STAGE2S = ("auto", "triton", "cuda", "int8")
KERNEL = "pq_stage2"
THREADS = 256
HEADS, DIM, SUBSPACES, CENTROIDS = 64, 128, 32, 256
NBINS = 8192  # the score bins of pq_select.BIN_COUNT (checked there)
SHARED_SCORES = SUBSPACES * CENTROIDS * 8 + HEADS * DIM * 2  # codewords, queries
SHARED_BINS = SHARED_SCORES + NBINS * 4  # and the histogram
SHARED_SCORES8 = SUBSPACES * CENTROIDS * 4 + HEADS * DIM  # the int8 kernel's: codewords of one word, int8 queries
SHARED_BINS8 = SHARED_SCORES8 + NBINS * 4
PER_BLOCK = None  # candidates a block scores: None sizes it to the launch (:func:`block_size`)
# warps of int8_operands' program (a request's 64 x 128 queries). At 4 the GPU's Triton 3.6 compiles it to 255
# registers and 8 bytes of stack (spilled), at 16 to 128 and none (tools/triton_resources.py); the step's profile
# took 5.8-6.2 us for it on the H100 at 4 and 3.5-3.8 at 16 (2 and 32 x 1M, the grown step's profiles side by side:
# tools/decode_suite.sh, part "operands"; docs/results/profile_operands_warps_h100.json)
OPERANDS_WARPS = 16


# the tensor-core steps and the quad-column reduction both CUDA kernels of s8 MMAs use (this one's int8 form and
# kernels/pq_fold_cuda.py); FULL is defined before them
S8_HELPERS = r"""
#ifndef EMULATED
// c[16 x 8] += a[16 x 32] b[32 x 8]: s8 in, s32 out (PTX ISA fragment layouts of m16n8k32 .s8)
__device__ __forceinline__ void mma_s8(int* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// four 8 x 8 bf16 matrices from shared memory, lane 8 j + r giving row r of matrix j
__device__ __forceinline__ void ldsm_x4(unsigned* a, const void* row) {
    const unsigned at = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(at));
}
#endif
// the 8 lanes of a quad column (g) each hold 8 partial sums, part[nt][c] (columns 2t + c of n-tile nt of an
// m16n8 accumulator, summed over the lane's rows); a reduce-scatter in three exchanges leaves lane g the whole
// sum of n-tile g & 3, column 2t + (g >> 2): each exchange halves what a lane holds, keeping its own column's half
__device__ __forceinline__ float quad_column_sum(const float (&part)[4][2], const int g) {
    float r1[4], r2[2];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
        const float keep = (g & 4) ? part[nt][1] : part[nt][0], send = (g & 4) ? part[nt][0] : part[nt][1];
        r1[nt] = keep + __shfl_xor_sync(FULL, send, 16);
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const float keep = (g & 2) ? r1[k + 2] : r1[k], send = (g & 2) ? r1[k] : r1[k + 2];
        r2[k] = keep + __shfl_xor_sync(FULL, send, 8);
    }
    return ((g & 1) ? r2[1] : r2[0]) + __shfl_xor_sync(FULL, (g & 1) ? r2[0] : r2[1], 4);
}
"""

_SOURCE = r"""
#ifndef SHARED_DYNAMIC
#define SHARED_DYNAMIC extern __shared__ __align__(16) int smem[]
#endif
#ifndef THREADS
#define THREADS 256
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 2
#endif
#define WARPS (THREADS / 32)
#ifndef MTILES
#define MTILES 4
#endif
#define HEADS (16 * MTILES)
#define NBINS 8192
#define HALF_BINS 4096
#define BIN_OCTAVES 12.0f
#define BIN_TOP 1.0f
#define FULL 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

#ifndef EMULATED
// c[16 x 8] += a[16 x 16] b[16 x 8]: bf16 in, float32 out (PTX ISA fragment layouts of m16n8k16)
__device__ __forceinline__ void mma_bf16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif
""" + S8_HELPERS + r"""
// the Triton stage 2's score_bin: a signed log scale relative to the request's score bound
__device__ __forceinline__ int score_bin(float score, float bound) {
    const float ratio = fmaxf(fabsf(score) / bound, 1e-30f);
    float at = floorf((log2f(ratio) + (BIN_OCTAVES - BIN_TOP)) * ((float)HALF_BINS / BIN_OCTAVES));
    at = fminf(fmaxf(at, 0.0f), (float)(HALF_BINS - 1));
    return score >= 0.0f ? HALF_BINS + (int)at : HALF_BINS - 1 - (int)at;
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) pq_stage2(
    const unsigned char* __restrict__ codes,  // [B, n_rows, 32] or [P, 64, 32] (paged) uint8
    const int* __restrict__ rows,             // [B, n_out] candidate key positions (-1: none)
    const int* __restrict__ counts,           // [B] filled slots of each request's rows
    const uint2* __restrict__ codebook,       // [32 x 256] codewords, 4 bf16 each (subspace-major)
    const unsigned* __restrict__ queries,     // [B, 64, 64] bf16 pairs (a request's 64 heads x 128 dims)
    const float* __restrict__ weights,        // [B, 64]
    float* __restrict__ out_score,            // [B, n_out] (want_scores): -inf where no key
    int* __restrict__ out_bins,               // [B, n_out] (want_bins): each scored key's bin
    int* __restrict__ scratch,                // [B, NBINS + 4] (want_bins): the histogram, added to
    const int* __restrict__ table,            // [B, table_width] physical page of each 64-row page (paged)
    int table_width, int n_rows, int n_out, int per_block, int paged, int want_scores, int want_bins,
    double key_bound,
    const float* __restrict__ bounds)         // [B] the bins' score bound of each request (INT8; else computed)
{
    SHARED_DYNAMIC;
#ifdef INT8
    // INT8: codewords of 4 int8 (one word), code-major; queries 64 heads x 128 int8, head h 8 chunks of 16 bytes
    // at chunk c ^ (h & 7); the codebook's per-subspace scales are folded into the queries, each head's scale into
    // its weight, so a score is sum_h w_h relu(q8_h . k8) with integer products
    unsigned* book_s = reinterpret_cast<unsigned*>(smem);  // codeword (s, c) at c * 32 + (s ^ (c & 7))
    unsigned* q_s = book_s + 32 * 256;
    int* hist_s = reinterpret_cast<int*>(q_s + HEADS * 32);
#else
    uint2* book_s = reinterpret_cast<uint2*>(smem);     // codeword (s, c) at c * 32 + s
    unsigned* q_s = reinterpret_cast<unsigned*>(smem) + 2 * 32 * 256;  // head h: 16 chunks of 4 words, chunk c at c ^ (h & 7)
    int* hist_s = reinterpret_cast<int*>(q_s + HEADS * 64);
#endif
    __shared__ float w_s[HEADS];
#ifndef INT8
    __shared__ float norm_s[HEADS];
#endif
    const int b = blockIdx.y;
    const long long row0 = (long long)b * n_out;
    const long long first = (long long)blockIdx.x * per_block;
    const long long stop = min((long long)n_out, first + per_block);
    const long long end = min((long long)min(counts[b], n_out), stop);
    if (want_scores) {  // the unfilled slots of the block's range
        for (long long i = max(first, end) + threadIdx.x; i < stop; i += THREADS) out_score[row0 + i] = NEG_INF;
    }
    if (first >= end) return;  // the whole block: nothing filled in its range
#ifdef INT8
    {  // the codebook turned code-major, each code's row of 32 words swizzled by the code's low bits (codeword (s, c)
       // at c * 32 + (s ^ (c & 7))): a thread reads 16 bytes, codewords (s, 4 c4 .. 4 c4 + 3), lanes taking
       // consecutive subspaces so that their shared stores land in different banks; its loads before its stores
        const uint4* src = reinterpret_cast<const uint4*>(codebook);
        constexpr int PER_THREAD = 32 * 64 / THREADS;
        uint4 four[PER_THREAD];
#pragma unroll
        for (int k = 0; k < PER_THREAD; ++k) {
            const int i = threadIdx.x + k * THREADS;
            four[k] = src[(i & 31) * 64 + (i >> 5)];
        }
#pragma unroll
        for (int k = 0; k < PER_THREAD; ++k) {
            const int i = threadIdx.x + k * THREADS, s = i & 31, c = 4 * (i >> 5);
            book_s[c * 32 + (s ^ (c & 7))] = four[k].x;
            book_s[(c + 1) * 32 + (s ^ ((c + 1) & 7))] = four[k].y;
            book_s[(c + 2) * 32 + (s ^ ((c + 2) & 7))] = four[k].z;
            book_s[(c + 3) * 32 + (s ^ ((c + 3) & 7))] = four[k].w;
        }
    }
    // queries in the order the lanes' code bytes come in: lane t of a quad loads bytes 8t .. 8t + 7 of its
    // candidate's code row (subspaces 8t .. 8t + 7), and a 32-dimension step s takes two of them, subspace 8t + 2s at
    // the fragment positions 4t .. 4t + 3 and 8t + 2s + 1 at 16 + 4t .. 16 + 4t + 3. So the step's 16-byte chunk c
    // (2s, 2s + 1) holds in its word t the 4 dims of subspace 8t + c, and no lane trades code bytes with another;
    // chunk c of head h at c ^ (h & 7) (ldmatrix)
    const unsigned* qb = queries + (long long)b * HEADS * 32;
#pragma unroll
    for (int k = 0; k < HEADS * 32 / THREADS; ++k) {
        const int i = threadIdx.x + k * THREADS;
        const int h = i >> 5, sub = i & 31;
        q_s[h * 32 + (((sub & 7) ^ (h & 7)) << 2) + (sub >> 3)] = qb[i];
    }
#else
    {  // the codebook turned code-major: a thread reads 16-byte pairs of codewords (s, c), (s, c + 1), lanes
       // taking consecutive subspaces so that their shared stores land in consecutive banks; all its loads
       // issued before any store (a block's setup is latency, not bytes)
        const uint4* src = reinterpret_cast<const uint4*>(codebook);
        constexpr int PER_THREAD = 32 * 128 / THREADS;
        uint4 pair[PER_THREAD];
#pragma unroll
        for (int k = 0; k < PER_THREAD; ++k) {
            const int i = threadIdx.x + k * THREADS;
            pair[k] = src[(i & 31) * 128 + (i >> 5)];
        }
#pragma unroll
        for (int k = 0; k < PER_THREAD; ++k) {
            const int i = threadIdx.x + k * THREADS, s = i & 31, c = 2 * (i >> 5);
            book_s[c * 32 + s] = make_uint2(pair[k].x, pair[k].y);
            book_s[(c + 1) * 32 + s] = make_uint2(pair[k].z, pair[k].w);
        }
    }
    // queries: in each 16-dimension step, the even words (dims 4t, 4t + 1) form chunk 2 step and the odd words
    // (dims 4t + 2, 4t + 3) chunk 2 step + 1, so the A fragment's positions 2t.. / 2t + 8.. are the dims of
    // codeword t of the step, as the B fragment's are
    const unsigned* qb = queries + (long long)b * HEADS * 64;
#pragma unroll
    for (int k = 0; k < HEADS * 64 / THREADS; ++k) {
        const int i = threadIdx.x + k * THREADS;
        const int h = i >> 6, word = i & 63, step = word >> 3, in_step = word & 7;
        const int chunk = 2 * step + (in_step & 1);
        q_s[h * 64 + ((chunk ^ (h & 7)) << 2) + (in_step >> 1)] = qb[i];
    }
#endif
    if (threadIdx.x < HEADS) w_s[threadIdx.x] = weights[(long long)b * HEADS + threadIdx.x];
    if (want_bins) {
        for (int i = threadIdx.x; i < NBINS; i += THREADS) hist_s[i] = 0;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#ifdef INT8
    __syncthreads();
    const float bound = fmaxf(bounds[b], 1e-30f);
#else
    for (int h = warp; h < HEADS; h += WARPS) {  // |q_h| of the bins' bound, from the bf16 queries
        float ss = 0.0f;
        for (int i = lane; i < 64; i += 32) {
            const unsigned v = qb[h * 64 + i];
            const float lo = __uint_as_float(v << 16), hi = __uint_as_float(v & 0xffff0000u);
            ss += lo * lo + hi * hi;
        }
        for (int off = 16; off; off >>= 1) ss += __shfl_xor_sync(FULL, ss, off);
        if (lane == 0) norm_s[h] = sqrtf(ss);
    }
    __syncthreads();
    float bound = 0.0f;
    for (int h = 0; h < HEADS; ++h) bound += fabsf(w_s[h]) * norm_s[h];
    bound = fmaxf(bound * (float)key_bound, 1e-30f);
#endif
    // a step of a warp: 32 candidates, four n-tiles of 8; the lane owns the score of n-tile g & 3, column
    // 2t + (g >> 2), and decodes column g of each n-tile, owned by lane (nt + 4 (g & 1)) * 4 + (g >> 1)
    const int own = (g & 3) * 8 + 2 * t + (g >> 2);
    const int j = lane >> 3, jr = lane & 7;  // ldmatrix: lane 8 j + jr gives row jr of matrix j
    const int* rows_b = rows + row0;
    const int* table_b = table + (long long)b * table_width;
    const unsigned char* codes_b = (paged ? codes : codes + (long long)b * n_rows * 32) + 8 * t;
#ifdef INT8
    const int first_sub = 8 * t;  // the lane's subspaces: 8t + i at lookup i
#else
    const int first_sub = 4 * g + t;  // the subspace of the lane's first lookup (then + 4 each, mod 32)
#endif
    const int stride = 32 * WARPS;
    // a pipeline over the warp's steps: the candidates' positions read two steps ahead, their code rows one
    // step ahead (each lane of a quad reads 8 of the 32 code bytes of the quad's candidate: 2 registers a
    // n-tile in flight, the quad trading bytes at decode), so the code loads' latency hides behind a step
    int base = (int)first + 32 * warp;
    int p_cur = base + own < (int)end ? rows_b[base + own] : -1;
    int p_nxt = base + stride + own < (int)end ? rows_b[base + stride + own] : -1;
    uint2 cur[4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
        const int pos = __shfl_sync(FULL, p_cur, (nt + 4 * (g & 1)) * 4 + (g >> 1));
        cur[nt] = make_uint2(0u, 0u);
        if (pos >= 0) {
            const int r = paged ? table_b[pos >> 6] * 64 + (pos & 63) : pos;
            cur[nt] = __ldg(reinterpret_cast<const uint2*>(codes_b + (size_t)r * 32));
        }
    }
    for (; base < (int)end; base += stride) {
        const int ahead = base + 2 * stride + own;
        const int p_far = ahead < (int)end ? rows_b[ahead] : -1;
        int r_nxt[4];  // the next step's code rows (-1: no key)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            const int pos = __shfl_sync(FULL, p_nxt, (nt + 4 * (g & 1)) * 4 + (g >> 1));
            r_nxt[nt] = pos < 0 ? -1 : (paged ? table_b[pos >> 6] * 64 + (pos & 63) : pos);
        }
#ifdef INT8
        unsigned kf[4][8];  // n-tile nt's codeword of subspace 8 t + j: the B fragment of step s is j = 2 s, 2 s + 1
#else
        unsigned kf[4][8][2];
#endif
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
#ifdef INT8
            // byte i of the lane's own load: the code of subspace 8t + i, looked up in subspace order straight into
            // the fragments. The 8 lanes that share t read the same subspace at once, in the banks their codes'
            // low bits choose (the codebook's swizzle): about 2.5-way on random codes, less where they share codes
            // (one address is read once). No rotation to undo: stage 2 alone at 32 x 1M took 151.8 us against 154.6
            // with the lookups rotated by g (32 banks a lookup) and put back by three rounds of selects (H100,
            // docs/results/stage2_parts_swizzle_h100.json)
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const unsigned code = ((i < 4 ? cur[nt].x : cur[nt].y) >> (8 * (i & 3))) & 255u;
                kf[nt][i] = book_s[code * 32 + first_sub + (i ^ (code & 7u))];
            }
#else
            // byte k of (hi:lo): the code of subspace 4k + t, this lane's column of every step, gathered from
            // the quad: lane tt holds words 2 tt, 2 tt + 1 of the row (steps 2 tt, 2 tt + 1)
            unsigned lo = 0u, hi = 0u;
#pragma unroll
            for (int d = 0; d < 4; ++d) {
                const unsigned tt = (unsigned)(t ^ d);
                const unsigned send = __byte_perm(cur[nt].x, cur[nt].y, tt | ((tt + 4u) << 4)) & 0xffffu;
                const unsigned got = d ? __shfl_xor_sync(FULL, send, d) : send;
                if (tt < 2u) lo |= got << (16u * (tt & 1u));
                else hi |= got << (16u * (tt & 1u));
            }
            // rotated by g steps, so that lookup i reads subspace 4 ((i + g) % 8) + t: the 32 lanes of a warp read
            // 32 different subspaces, and a code's 32 codewords sit side by side (a row of 256 bytes), so every
            // lookup's bank is its subspace's whatever the codes
            if (g & 4) {
                const unsigned x = lo;
                lo = hi;
                hi = x;
            }
            const unsigned shift = 8u * (unsigned)(g & 3);
            const unsigned rlo = __funnelshift_r(lo, hi, shift), rhi = __funnelshift_r(hi, lo, shift);
            uint2 u[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const unsigned code = ((i < 4 ? rlo : rhi) >> (8 * (i & 3))) & 255u;
                u[i] = book_s[code * 32 + ((first_sub + 4 * i) & 31)];
            }
            // u[i] is step (i + g) % 8's codeword: rotate it into step order
            uint2 v[8], x[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = (g & 1) ? u[(k + 7) & 7] : u[k];
#pragma unroll
            for (int k = 0; k < 8; ++k) x[k] = (g & 2) ? v[(k + 6) & 7] : v[k];
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const uint2 y = (g & 4) ? x[(k + 4) & 7] : x[k];
                kf[nt][k][0] = y.x;
                kf[nt][k][1] = y.y;
            }
#endif
        }
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {  // the next step's codes in flight while this one is scored
            cur[nt] = make_uint2(0u, 0u);
            if (r_nxt[nt] >= 0) cur[nt] = __ldg(reinterpret_cast<const uint2*>(codes_b + (size_t)r_nxt[nt] * 32));
        }
        const int mine = base + own;
        const int pos_own = p_cur;
        p_cur = p_nxt;
        p_nxt = p_far;
        float part[4][2];
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) part[nt][0] = part[nt][1] = 0.0f;
#pragma unroll 1
        for (int mt = 0; mt < MTILES; ++mt) {  // 16 heads at a time (MTILES: a tool's narrower form)
            const int h = mt * 16 + jr + 8 * (j & 1);
#ifdef INT8
            int iacc[4][4];
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) iacc[nt][0] = iacc[nt][1] = iacc[nt][2] = iacc[nt][3] = 0;
#pragma unroll
            for (int step = 0; step < 4; ++step) {
                unsigned a[4];
                ldsm_x4(a, q_s + h * 32 + (((2 * step + (j >> 1)) ^ (h & 7)) << 2));
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) mma_s8(iacc[nt], a, kf[nt][2 * step], kf[nt][2 * step + 1]);
            }
            float acc[4][4];
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[nt][e] = (float)iacc[nt][e];
            }
#else
            float acc[4][4];
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
#pragma unroll
            for (int step = 0; step < 8; ++step) {
                unsigned a[4];
                ldsm_x4(a, q_s + h * 64 + (((2 * step + (j >> 1)) ^ (h & 7)) << 2));
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) mma_bf16(acc[nt], a, kf[nt][step][0], kf[nt][step][1]);
            }
#endif
            const float wa = w_s[mt * 16 + g], wb = w_s[mt * 16 + g + 8];  // heads of rows g and g + 8
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                part[nt][0] += wa * fmaxf(acc[nt][0], 0.0f) + wb * fmaxf(acc[nt][2], 0.0f);
                part[nt][1] += wa * fmaxf(acc[nt][1], 0.0f) + wb * fmaxf(acc[nt][3], 0.0f);
            }
        }
        // part[nt][c]: the lane's partial sums over its rows of heads
        const float score = quad_column_sum(part, g);
        if (mine < (int)end) {
            const bool valid = pos_own >= 0;
            if (want_scores) out_score[row0 + mine] = valid ? score : NEG_INF;
            if (want_bins && valid) {
                const int bin = score_bin(score, bound);
                out_bins[row0 + mine] = bin;
                atomicAdd(hist_s + bin, 1);
            }
        }
    }
    if (want_bins) {  // the block's histogram into the request's: one atomic a non-empty bin
        __syncthreads();
        int* hist = scratch + (long long)b * (NBINS + 4);
        for (int i = threadIdx.x; i < NBINS; i += THREADS) {
            const int v = hist_s[i];
            if (v) atomicAdd(hist + i, v);
        }
    }
}
"""


_SOURCE8 = "#define INT8 1\n" + _SOURCE


def source(int8: bool = False) -> str:
    """The kernel's CUDA source (``int8``: the form on 8-bit operands, :func:`int8_operands`)."""
    return _SOURCE8 if int8 else _SOURCE


def takes(heads: int, dim: int, subspaces: int, centroids: int, residual: bool) -> str | None:
    """Why the CUDA stage 2 cannot score these codes (None: it can): 64 heads of 128 dims, 32 subspaces of
    256 centroids (4 dims a subspace), a product (not residual) code."""
    if (heads, dim, subspaces, centroids) != (HEADS, DIM, SUBSPACES, CENTROIDS) or residual:
        return (f"the CUDA stage 2 scores {HEADS} heads of {DIM} dims against product codes of {SUBSPACES} x "
                f"{CENTROIDS} centroids: got {heads} heads, {dim} dims, {subspaces} x {centroids}"
                f"{', residual' if residual else ''}")
    return None


def block_size(batch: int, slots: int, sms: int) -> int:
    """Candidates a block scores for ``batch`` requests of ``slots`` stage-1 slots on ``sms`` multiprocessors:
    about two blocks a multiprocessor over the half of the slots a stage 1 fills, a power of two from 1,024 to
    8,192 (shapes only: a CUDA graph captures one launch). H100, 32 requests of 96K candidates: 251 / 246 us at
    4,096 / 8,192 a block; at 24K candidates 1,024-4,096 a block within 5%."""
    want = batch * slots // 2 // max(1, 2 * sms)
    size = 1024
    while size < want and size < 8192:
        size *= 2
    return size


def available() -> bool:
    """Whether the CUDA stage 2 can run here: a CUDA device and a torch that compiles kernels with NVRTC."""
    return nvrtc.available()


def compiles(device: torch.device, int8: bool = False) -> bool:
    """Whether the kernel compiles on ``device`` (compiled once a process; False where NVRTC cannot build it)."""
    return nvrtc.compiles(source(int8), KERNEL, SHARED_BINS, device, *_NAMES)


# "auto" takes the CUDA stage 2 for a launch over at least this many candidate slots (B x R, shapes only, so a
# CUDA graph captures one kernel): one request of a grown C (R = 64K slots at 256K keys, 128K at 1M) and up. H100,
# the plugins' grown step at one request, the int8 kernel against Triton's stage 2 in one run: 1 x 1M 101.1 against
# 110.9 us (stage 2 alone 15.1 against 28.8), 1 x 512K 94.5 against 104.7; a fixed C at 8 x 1M (8 x 32K slots)
# 0.215 against 0.222 ms, 32 x 1M 0.596 against 0.646. Below it (a fixed C's 32K slots of one request, 32 blocks
# of 1,024) Triton's smaller programs fill more of the GPU (not measured)
CUDA_FROM_SLOTS = 1 << 16


def resolve_stage2(stage2: str, heads: int, dim: int, subspaces: int, centroids: int, residual: bool,
                   device: torch.device, slots: int | None = None) -> str:
    """The kernel ``stage2`` names for a launch over ``slots`` candidate slots (B x R; None: any): ``"auto"`` is
    ``"int8"`` from :data:`CUDA_FROM_SLOTS` slots where :func:`takes` allows it and it compiles on ``device``
    (``"cuda"`` where only the bf16 form compiles), else ``"triton"``; ``"cuda"`` or ``"int8"`` where it cannot run
    raises ``ValueError`` (at any size: they are asked for by name)."""
    if stage2 not in STAGE2S:
        raise ValueError(f"stage2: got {stage2!r}, want one of {', '.join(STAGE2S)}")
    if stage2 == "triton":
        return stage2
    why = takes(heads, dim, subspaces, centroids, residual)
    if stage2 == "auto":
        if slots is not None and slots < CUDA_FROM_SLOTS or why is not None:
            return "triton"
        # the int8 form first: 179 against 246 us of stage 2 at 32 x 1M (H100), the same served recall at 128K
        return "int8" if compiles(device, int8=True) else "cuda" if compiles(device) else "triton"
    kind = "the int8 CUDA stage 2" if stage2 == "int8" else "the CUDA stage 2"
    if why is not None:
        raise ValueError(why)
    if device.type != "cuda" or not available():
        raise ValueError(f"{kind} needs a CUDA device and a CUDA build of torch with NVRTC; use "
                         "stage2='triton' elsewhere")
    return stage2


_NAMES = ("the CUDA stage 2", "stage2='triton'")  # what a build failure says, and the way around it


def int8_codebook(codebook: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A codebook [32, 256, 4] as the int8 kernel reads it: (codewords [32, 256, 4] int8, each subspace's scale
    [32] float32), each subspace scaled to its largest magnitude (127). Cached per codebook tensor (its storage
    and version), so a step pays it once."""
    import torch

    key = (codebook.data_ptr(), codebook._version, str(codebook.device), tuple(codebook.shape))
    hit = _BOOKS8.get(key)
    if hit is not None and hit[0]() is codebook:
        return hit[1], hit[2]
    cb = codebook.float()
    scale = cb.abs().amax(dim=(1, 2)).clamp_min(1e-30) / 127.0
    book8 = torch.round(cb / scale[:, None, None]).clamp(-127, 127).to(torch.int8).contiguous()
    if len(_BOOKS8) > 64:
        _BOOKS8.clear()
    _BOOKS8[key] = (weakref.ref(codebook), book8, scale)
    return book8, scale


_BOOKS8: dict = {}


def score_bound(queries: torch.Tensor, head_weights: torch.Tensor, key_bound: float) -> torch.Tensor:
    """[B] float32: ``sum_h |w_h| |q_h| * key_bound``, a bound of every stage-2 score of a request whose
    decoded keys have norms at most ``key_bound`` (the scale of :func:`~dsaindex.kernels.pq_select.score_bins`;
    every stage 2 bins by it)."""
    import torch

    norms = queries.to(torch.bfloat16).float().norm(dim=2)
    return ((head_weights.float().abs() * norms).sum(1) * key_bound).clamp_min(1e-30)


def int8_operands_reference(queries: torch.Tensor, head_weights: torch.Tensor, codebook: torch.Tensor,
                            key_bound: float) -> tuple[torch.Tensor, ...]:
    """The int8 kernel's operands for ``queries`` [B, 64, 128] and ``head_weights`` [B, 64] against ``codebook``
    [32, 256, 4]: (queries [B, 64, 128] int8, weights [B, 64] float32, codewords [32, 256, 4] int8, bounds [B]
    float32). The codebook's per-subspace scales multiply the queries' dimensions (so one integer dot product
    covers every subspace), each head is then scaled to 127 and its scale moves into its weight (a ReLU commutes
    with a positive scale): ``sum_h w_h relu(q_h . k)`` is ``sum_h w8_h relu(q8_h . k8)`` up to the rounding.
    ``bounds``: the bins' scale, ``sum_h |w_h| |q_h| key_bound`` of the bf16 queries, as the other kernels'.
    Torch ops on any device: the spec of :func:`int8_operands`."""
    import torch

    book8, scale = int8_codebook(codebook)
    q = queries.to(torch.bfloat16).float()
    folded = q * scale.repeat_interleave(DIM // SUBSPACES)[None, None, :]
    tau = folded.abs().amax(dim=2).clamp_min(1e-30) / 127.0
    q8 = torch.round(folded / tau[..., None]).clamp(-127, 127).to(torch.int8).contiguous()
    w = head_weights.float()
    return q8, (w * tau).contiguous(), book8, score_bound(queries, w, key_bound).contiguous()


def int8_operands(queries: torch.Tensor, head_weights: torch.Tensor, codebook: torch.Tensor, key_bound: float,
                  fused: bool | None = None) -> tuple[torch.Tensor, ...]:
    """:func:`int8_operands_reference` of a decode step: on a CUDA device (``fused`` None) or where ``fused``, in
    one Triton launch (:func:`~dsaindex.kernels.pq_stage2_kernel.int8_operands_kernel`) instead of about twenty
    torch ones; the codebook's int8 form is cached as there. The same operands, up to the last bit of a float32
    quotient (torch may divide by multiplying by the reciprocal): an int8 query within 1 of the reference's,
    weights and bounds within an ulp."""
    import torch

    if fused is None:
        fused = queries.is_cuda
    if not fused:
        return int8_operands_reference(queries, head_weights, codebook, key_bound)
    from dsaindex.kernels.pq_stage2_kernel import int8_operands_kernel

    b, h, d = queries.shape
    if (h, d) != (HEADS, DIM) or tuple(head_weights.shape) != (b, h):
        raise ValueError(f"int8 operands: want queries [B, {HEADS}, {DIM}] and head_weights [B, {HEADS}], got "
                         f"{tuple(queries.shape)} and {tuple(head_weights.shape)}")
    book8, scale = int8_codebook(codebook)
    q = queries.to(torch.bfloat16).contiguous()
    w = head_weights.float().contiguous()
    q8 = torch.empty(b, h, d, dtype=torch.int8, device=q.device)
    w8 = torch.empty(b, h, dtype=torch.float32, device=q.device)
    bounds = torch.empty(b, dtype=torch.float32, device=q.device)
    if b:
        int8_operands_kernel[(b,)](q, w, scale.to(q.device), q8, w8, bounds, float(key_bound), H=h, D=d,
                                   DSUB=DIM // SUBSPACES, num_warps=OPERANDS_WARPS)
    return q8, w8, book8, bounds


def int8_scores_reference(codes: torch.Tensor, rows: torch.Tensor, queries: torch.Tensor, head_weights: torch.Tensor,
                          codebook: torch.Tensor) -> torch.Tensor:
    """Stage 2's scores [B, R] float32 as the int8 kernel computes them (-inf where ``rows`` is -1): the operands
    of :func:`int8_operands`, ``sum_h w8_h relu(q8_h . k8)`` with the integer products exact. ``codes`` [B, N, 32]
    uint8, ``rows`` [B, R] int; the rest as :func:`int8_operands`. Torch ops on any device: the int8 kernel's
    spec, and what a CPU run of ``stage2="int8"`` scores with."""
    import torch

    if tuple(codebook.shape) != (SUBSPACES, CENTROIDS, DIM // SUBSPACES) or queries.shape[-1] != DIM:
        raise ValueError(f"the int8 stage 2 scores {DIM}-dim queries against product codes of {SUBSPACES} x "
                         f"{CENTROIDS} centroids: got {queries.shape[-1]} dims and a codebook of shape "
                         f"{tuple(codebook.shape)}")
    q8, w8, book8, _ = int8_operands(queries, head_weights, codebook, 1.0)
    b, r = rows.shape
    picked = codes.gather(1, rows.clamp_min(0).long()[:, :, None].expand(b, r, codes.shape[2])).long()  # [B, R, M]
    keys = book8.long()[torch.arange(SUBSPACES, device=codes.device)[None, None, :], picked]  # [B, R, M, DIM / M]
    dots = torch.einsum("brd,bhd->brh", keys.reshape(b, r, DIM), q8.long()).double()
    out = (dots.clamp_min(0) * w8.double()[:, None, :]).sum(-1).float()
    return torch.where(rows >= 0, out, torch.full_like(out, float("-inf")))


def pq_stage2(codes: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor, queries: torch.Tensor,
              head_weights: torch.Tensor, codebook: torch.Tensor, scores: torch.Tensor | None = None,
              bins: torch.Tensor | None = None, scratch: torch.Tensor | None = None,
              page_table: torch.Tensor | None = None, key_bound: float = 1.0, per_block: int | None = PER_BLOCK,
              int8: bool = False) -> None:
    """Score the first ``counts[b]`` candidate ``rows`` [B, R] int32 (-1: none) of each request against its
    ``queries`` [B, 64, 128] bf16 with ``head_weights`` [B, 64] float32 through ``codebook`` [32, 256, 4] bf16:
    ``scores`` [B, R] float32 (optional: -inf where no key), ``bins`` [B, R] int32 and ``scratch`` [B, NBINS + 4]
    int32 (optional, together: each scored key's bin, counted into the histogram ``scratch[:, :NBINS]``) with
    ``key_bound`` the bins' scale. ``codes`` [B, N, 32] or [P, 64, 32] uint8 (``page_table`` [B, W] int32);
    every tensor contiguous on one CUDA device; ``per_block``: candidates a block scores (None: :func:`block_size`).
    ``int8``: score on 8-bit operands (:func:`int8_operands`: the tensor cores' s8 form, half the ``mma`` and
    half the shared-memory bytes of the bf16 one; scores within the operands' rounding of the bf16 ones).
    Raises ``ValueError`` otherwise."""
    import torch

    if not available() or codes.device.type != "cuda":
        raise ValueError("the CUDA stage 2 needs a CUDA device and a CUDA build of torch with NVRTC "
                         "(torch.cuda._compile_kernel); use stage2='triton' elsewhere")
    if (bins is None) != (scratch is None):
        raise ValueError("bins and scratch go together: the histogram counts the bins written")
    if scores is None and bins is None:
        raise ValueError("nothing to write: pass scores, or bins and scratch")
    b, r = rows.shape
    want = {"codes": (torch.uint8, None), "rows": (torch.int32, (b, r)), "counts": (torch.int32, (b,)),
            "queries": (torch.bfloat16, (b, HEADS, DIM)), "head_weights": (torch.float32, (b, HEADS)),
            "codebook": (torch.bfloat16, (SUBSPACES, CENTROIDS, DIM // SUBSPACES)),
            "scores": (torch.float32, (b, r)), "bins": (torch.int32, (b, r)), "scratch": (torch.int32, (b, NBINS + 4)),
            "page_table": (torch.int32, (b, None))}
    given = {"codes": codes, "rows": rows, "counts": counts, "queries": queries, "head_weights": head_weights,
             "codebook": codebook, "scores": scores, "bins": bins, "scratch": scratch, "page_table": page_table}
    for name, t in given.items():
        if t is None:
            continue
        dtype, shape = want[name]
        ok_shape = shape is None or (t.dim() == len(shape)
                                     and all(s is None or s == n for s, n in zip(shape, t.shape, strict=True)))
        if t.dtype != dtype or t.device != codes.device or not t.is_contiguous() or not ok_shape:
            raise ValueError(f"{name}: got {t.dtype} {tuple(t.shape)} on {t.device} (contiguous: {t.is_contiguous()}), "
                             f"want {dtype} {shape} contiguous on {codes.device}")
    if codes.shape[-1] != SUBSPACES or codes.data_ptr() % 16:
        raise ValueError(f"codes: want {SUBSPACES} bytes a key, starting on a 16-byte boundary")
    if per_block is None:
        per_block = block_size(b, r, nvrtc.multiprocessors(nvrtc.device_index(codes.device)))
    if per_block <= 0 or per_block % (32 * THREADS // 32):
        raise ValueError(f"per_block: got {per_block}, want a positive multiple of {THREADS} (32 candidates a warp)")
    if b == 0 or r == 0:
        return
    paged = page_table is not None
    n_rows = page_table.shape[1] * 64 if paged else codes.shape[1]
    bounds = counts  # read by the int8 kernel only
    if int8:
        queries, head_weights, codebook, bounds = int8_operands(queries, head_weights, codebook, key_bound)
    kernel = nvrtc.compiled(source(int8), KERNEL, SHARED_BINS, nvrtc.device_index(codes.device), *_NAMES)
    if int8:
        shared = SHARED_BINS8 if bins is not None else SHARED_SCORES8
    else:
        shared = SHARED_BINS if bins is not None else SHARED_SCORES
    kernel(grid=(-(-r // per_block), b, 1), block=(THREADS, 1, 1), shared_mem=shared,
           args=[codes, rows, counts, codebook, queries, head_weights, scores if scores is not None else rows,
                 bins if bins is not None else rows, scratch if scratch is not None else rows,
                 page_table if paged else counts, int(page_table.shape[1]) if paged else 0, int(n_rows), int(r),
                 int(per_block), int(paged), int(scores is not None), int(bins is not None), float(key_bound),
                 bounds])
