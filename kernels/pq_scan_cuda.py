"""Stage 1's selecting scan as a CUDA kernel: int32 tables in shared memory, read without bank conflicts.

The Triton scan (:func:`dsaindex.kernels.pq_select.pq_linear_topc`, ``scan="triton"``) gathers each key's
32 table entries from L1 and runs at 2.0x the bytes floor at 32 x 1M keys on the H200, bound by the gathers
(docs/results.md, "Stage 1's lookups"). This kernel looks the codes up in shared memory instead:

- **Tables.** Each block writes its request's 32 int8 tables as int32 into shared memory, row ``c`` (a
  code) holding the 32 subspaces' entries twice over (64 columns, 64 KB).
- **Rotation.** Each thread scores one key at a time. Its 32 code bytes (two 16-byte loads past L1) are
  rotated by its lane index, so byte ``p`` holds subspace ``(p + lane) % 32``, whose entry sits at column
  ``p + lane``: its bank. At every lookup the 32 lanes of a warp read 32 different banks whatever their codes.
  One byte-permute makes the lookup's address (the code times the row, plus the lane's column), so a lookup
  is a permute, a shared load at an immediate offset, and an add.
- **Appends.** The rows that reach the request's threshold (from the sampling pass of the same step) are
  staged in shared memory (a shared atomic per warp) and appended to the request's buffer with one global
  atomic a block. With an atomic per warp to one counter per request, waited on by the whole warp, the scan
  waited on L2 more than on its codes.
- **Loads.** Each thread has its next two rows' codes in flight while it scores the current one; the
  block's slice of the page table is read once.
- **Blocks.** A block builds its tables once for all its rows. Blocks of more than 8,192 rows (up to
  :data:`MAX_SPAN`, 64K) run a form compiled apart (``source(long_blocks=True)``) that flushes its staged rows
  whenever the staging might not hold the next 2,048. :func:`launch_rows` picks the rows a block by the step's
  shape; the default caps them at 8,192: on the H100 blocks of 16K-64K rows were slower (453-473 us against 408
  at 32 x 1M, docs/results.md), so the longer form is kept for a card where that may differ, not used.
- **A variant, slower on the H100** (``#define COALESCED``, off; 428 us against 408 at 32 x 1M): a thread's two
  16-byte loads of its own row each read half of 32 sectors, so every sector crosses from L2 twice past L1 (2 GB
  for the 1 GB of codes at 32 x 1M, which may bound the read on the H200 before its HBM does). Under ``COALESCED`` a warp reads its 32 rows as two
  512-byte loads, lane ``l`` taking bytes ``16 l``, and neighbouring lanes swap halves with four shuffles, so
  each lane holds a whole row (the even lane row ``l / 2``, the odd one row ``16 + l / 2``).

- **Keys of 16 codes** (``source(code_bytes=16)``: PQ16 codes, or the group codes of a stage 1 on groups,
  :func:`dsaindex.pq.group_codes`): one 16-byte load a row, 16 lookups, each lane's bytes rotated by its lane
  mod 16, the tables repeated four times across a row's 64 columns, so lanes ``l`` and ``l + 16`` read the same
  table 16 banks apart. H100, 32 x 1M paged keys, 8,192 rows a block: 260.9 us against 418.9 for 32 codes, beside
  plain reads of 192.3 and 362.9 us (docs/results.md, "Stage 1 on 16 bytes a key").

Selection is the Triton scan's exactly: integer sums, kept where the sum reaches the threshold. Only the order
of the appended keys differs, which the next stage does not read.

**Measured** (H200, stage 1 alone at B x 1M paged keys, both passes, docs/results.md "Stage 1 in shared
memory"): 29 / 107 / 373 / 749 us at B = 1 / 8 / 32 / 64 against 32 / 138 / 497 / 989 us for the Triton scan,
the same keys kept; a read of the same codes with the lookups left out takes 304 us at 32 x 1M.

The source is compiled at first use by NVRTC through torch (``torch.cuda._compile_kernel``), once per process
and device: no compiler is needed beyond what a CUDA build of torch ships. It is launched on the current
stream, so a CUDA graph captures it. Without a GPU, ``tests/test_pq_scan_cuda.py`` runs this very source on the
CPU (a thread per CUDA thread, warps meeting at barriers) against the pass's specification.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsaindex.kernels import nvrtc

if TYPE_CHECKING:
    import torch

SCANS = ("auto", "triton", "cuda")  # "auto": the CUDA scan where it runs (see :func:`resolve_scan`), else Triton
KERNEL = "pq_scan_select"
SUBSPACES = 32  # code bytes a key the kernel reads by default
CODE_BYTES = (16, 32)  # the forms compiled: 16 or 32 one-byte codes a key
THREADS = 512
MAX_ROWS = 8192  # kept rows a block stages before it appends them: a block of up to as many rows flushes once
MAX_SPAN = 65536  # rows a block scans at most (its kept rows' offsets are 16 bits)
SHARED = 256 * 64 * 4 + MAX_ROWS * 4  # its dynamic shared memory: the int32 tables, the staged rows

_SOURCE = r"""
#ifndef SHARED_DYNAMIC
#define SHARED_DYNAMIC extern __shared__ __align__(16) int smem[]
#endif
#define THREADS 512
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 2
#endif
#define MAX_ROWS 8192
#define CHECK_ROWS 2048
#ifdef LONG_BLOCKS
#define MAX_SPAN 65536
#else
#define MAX_SPAN MAX_ROWS
#endif
#ifndef LOAD
#define LOAD __ldcg
#endif
#ifndef CODE_BYTES
#define CODE_BYTES 32
#endif
#define WORDS (CODE_BYTES / 4)
#if CODE_BYTES != 32 && CODE_BYTES != 16
#error "CODE_BYTES: 16 or 32 code bytes a row"
#endif
#if CODE_BYTES == 16 && defined(COALESCED)
#error "COALESCED reads rows of 32 code bytes"
#endif

// a staged row (its sum << 16 | its offset in the block) stored at ``slot`` of its request's buffer; past the
// buffer it is counted, not stored (the caller sees the overflow)
__device__ __forceinline__ void append(unsigned e, int slot, long long first, long long out, int capacity,
                                       float* __restrict__ out_score, int* __restrict__ out_pos) {
    if (slot < capacity) {
        out_score[out + slot] = (float)((int)e >> 16);
        out_pos[out + slot] = (int)(first + (e & 0xffffu));
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 2) pq_scan_select(
    const unsigned char* __restrict__ codes,  // [B, n_rows, CODE_BYTES] or [P, 64, CODE_BYTES] (paged) uint8
    const int* __restrict__ lengths,          // [B] valid rows per request
    const signed char* __restrict__ lut,      // [B, CODE_BYTES, 256] int8 tables
    const float* __restrict__ thr,            // [B] thresholds of the sampling pass
    float* __restrict__ out_score,            // [B, capacity]
    int* __restrict__ out_pos,                // [B, capacity]
    int* __restrict__ count,                  // [B] appended counts (zeroed by the sampling pass)
    const int* __restrict__ table,            // [B, table_width] physical page of each 64-row page (paged)
    int table_width, int n_rows, int capacity, int rows_per_block, int paged)
{
    // lut_s[c * 64 + col] = table (col mod CODE_BYTES) at code c, as int32: the columns repeat the tables, so a
    // lane whose bytes are rotated by its lane index (mod CODE_BYTES) finds code position p's table at column
    // p + lane, and the 32 lanes of a warp read 32 different banks at every lookup whatever their codes
    // the block's kept rows are staged in shared memory and appended to the request's buffer with one atomic
    // a flush: an atomic per warp, to one counter per request, waited on by the whole warp, made the scan wait
    // on L2 more than on its codes. A block of up to MAX_ROWS rows flushes once, at its end; a longer one (up to
    // 64K rows under LONG_BLOCKS, its tables built once) checks every CHECK_ROWS rows and flushes where the
    // next rows could overflow the staging
    SHARED_DYNAMIC;
    int* lut_s = smem;
    unsigned* staged = reinterpret_cast<unsigned*>(smem + 256 * 64);  // a kept row: its sum << 16 | its offset
    __shared__ int pages_s[MAX_SPAN / 64];
    __shared__ int st_n, st_base;
    const int b = blockIdx.y;
    const long long length = lengths[b];
    const long long first = (long long)blockIdx.x * rows_per_block;
    if (first >= length) return;  // the whole block: a grid sized for the longest request
    if (threadIdx.x == 0) st_n = 0;  // before the barrier below
    const long long stop = min(length, first + rows_per_block);
    if (paged) {  // the block's slice of the page table, read once
        for (int i = threadIdx.x; i < MAX_SPAN / 64 && first + 64LL * i < stop; i += blockDim.x)
            pages_s[i] = table[(long long)b * table_width + (first >> 6) + i];
    }
    // the codes of this thread's next PREFETCH_ROWS rows are in flight while it scores the current one; the
    // first ones are asked for before the tables are built (their pages read from global memory: the slice
    // above is visible after the barrier only)
    long long r = first + threadIdx.x;
    const int lane = threadIdx.x & 31;
    uint4 v0 = make_uint4(0u, 0u, 0u, 0u), v1 = v0;
#if PREFETCH_ROWS == 2
    uint4 n0 = v0, n1 = v0;
#endif
#define ROW_OF(rr, page) (paged ? (long long)(page) * 64 + ((rr) & 63) : (long long)b * n_rows + (rr))
#define PAGE_G(rr) (paged ? table[(long long)b * table_width + ((rr) >> 6)] : 0)
#define PAGE_S(rr) (paged ? pages_s[((rr) - first) >> 6] : 0)
#ifdef COALESCED
    // a warp's 32 rows (1 KB, within one page) in two 512-byte loads, lane l taking bytes 16 l of each, so
    // every sector a load touches is read whole (a row a lane reads half of each sector twice, past L1); lane
    // l then holds half l % 2 of rows l / 2 and 16 + l / 2, and one exchange with its neighbour (below) gives
    // each lane a whole row: the even lane row l / 2, the odd one row 16 + l / 2
#define FETCH(rr, PAGE, a, c) { \
        const long long g0 = (rr) - lane; \
        if (g0 < stop) { \
            const uint4* grp = reinterpret_cast<const uint4*>(codes + ROW_OF(g0, PAGE(g0)) * 32); \
            if (g0 + (lane >> 1) < stop) a = LOAD(grp + lane); \
            if (g0 + 16 + (lane >> 1) < stop) c = LOAD(grp + 32 + lane); \
        } }
#else
#define FETCH(rr, PAGE, a, c) \
    if ((rr) < stop) { \
        const uint4* row = reinterpret_cast<const uint4*>(codes + ROW_OF(rr, PAGE(rr)) * CODE_BYTES); \
        a = LOAD(row); \
        if (CODE_BYTES == 32) c = LOAD(row + 1); \
    }
#endif
    FETCH(r, PAGE_G, v0, v1)
#if PREFETCH_ROWS == 2
    FETCH(r + blockDim.x, PAGE_G, n0, n1)
#endif
    const unsigned* src = reinterpret_cast<const unsigned*>(lut + (long long)b * CODE_BYTES * 256);
    // word i: subspace i % CODE_BYTES, codes 4 (i / CODE_BYTES) + 0..3
    for (int i = threadIdx.x; i < CODE_BYTES * 64; i += blockDim.x) {
        const int s = i % CODE_BYTES, c4 = (i / CODE_BYTES) * 4;
        const unsigned w = src[s * 64 + i / CODE_BYTES];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int v = (int)(signed char)((w >> (8 * j)) & 0xffu);
#pragma unroll
            for (int col = s; col < 64; col += CODE_BYTES) lut_s[(c4 + j) * 64 + col] = v;
        }
    }
    __syncthreads();
    const float t = thr[b];
    // the lane's rotation: lane mod CODE_BYTES bytes, as whole words then bits
    const unsigned ws = ((unsigned)lane % CODE_BYTES) >> 2, bs = ((unsigned)lane & 3u) * 8u;
    const unsigned base = (unsigned)lane * 4u;  // byte offset of the lane's first column in a code's row
    const char* lut_bytes = reinterpret_cast<const char*>(lut_s);
#ifdef LONG_BLOCKS
    const bool checks = stop - first > MAX_ROWS;  // the same for every thread of the block
#endif
    // every thread of the block loops as often (stop is the block's), so each ballot sees whole warps
    for (long long row0 = first; row0 < stop; row0 += blockDim.x, r += blockDim.x) {
        // every CHECK_ROWS rows of a long block: flush where the staging might not hold the next CHECK_ROWS. The
        // count thread 0 reads at the barrier may miss the rows the other warps staged since the last check (at
        // most CHECK_ROWS), so the staging holds 2 CHECK_ROWS more than the count it flushes past
#ifdef LONG_BLOCKS
        if (checks && row0 > first && (row0 - first) % CHECK_ROWS == 0 &&
            __syncthreads_or(threadIdx.x == 0 && *(volatile int*)&st_n > MAX_ROWS - 2 * CHECK_ROWS)) {
            if (threadIdx.x == 0) st_base = atomicAdd(count + b, st_n);
            __syncthreads();
            const int n_st = st_n, at0 = st_base;
            for (int i = threadIdx.x; i < n_st; i += blockDim.x)
                append(staged[i], at0 + i, first, (long long)b * capacity, capacity, out_score, out_pos);
            __syncthreads();  // every staged row read before the staging restarts
            if (threadIdx.x == 0) st_n = 0;
            __syncthreads();
        }
#endif
#ifdef COALESCED
        const bool odd = lane & 1;
        const long long rs = r - lane + (odd ? 16 : 0) + (lane >> 1);  // the row this lane scores
        const uint4 give = odd ? v0 : v1;  // the half its neighbour's row needs
        uint4 got;
        got.x = __shfl_xor_sync(0xffffffffu, give.x, 1);
        got.y = __shfl_xor_sync(0xffffffffu, give.y, 1);
        got.z = __shfl_xor_sync(0xffffffffu, give.z, 1);
        got.w = __shfl_xor_sync(0xffffffffu, give.w, 1);
        const uint4 lo = odd ? got : v0, hi = odd ? v1 : got;
        unsigned w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#else
        const long long rs = r;
#if CODE_BYTES == 32
        unsigned w[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#else
        unsigned w[4] = {v0.x, v0.y, v0.z, v0.w};
#endif
#endif
        const bool valid = rs < stop;
#if PREFETCH_ROWS == 2
        v0 = n0;
        v1 = n1;
        FETCH(r + 2LL * blockDim.x, PAGE_S, n0, n1)
#else
        FETCH(r + blockDim.x, PAGE_S, v0, v1)
#endif
        int score = 0;
        if (valid) {
            unsigned u[WORDS];  // rotate the words left by ws (a select a word a round), then the bytes by bs bits
#pragma unroll
            for (int k = 0; k < WORDS; ++k) u[k] = (ws & 1u) ? w[(k + 1) % WORDS] : w[k];
#pragma unroll
            for (int k = 0; k < WORDS; ++k) w[k] = (ws & 2u) ? u[(k + 2) % WORDS] : u[k];
#if WORDS == 8
#pragma unroll
            for (int k = 0; k < WORDS; ++k) u[k] = (ws & 4u) ? w[(k + 4) % WORDS] : w[k];
#else
#pragma unroll
            for (int k = 0; k < WORDS; ++k) u[k] = w[k];
#endif
#pragma unroll
            for (int k = 0; k < WORDS; ++k) w[k] = __funnelshift_r(u[k], u[(k + 1) % WORDS], bs);
            // now byte p of w holds subspace (p + lane) % CODE_BYTES's code; one byte-permute makes its row's
            // byte address plus the lane's column offset: {base, code, 0, 0}
#pragma unroll
            for (int k = 0; k < WORDS; ++k) {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const unsigned at = __byte_perm(w[k], base, 0x5504u + 16u * j);
                    score += *reinterpret_cast<const int*>(lut_bytes + at + 4 * (4 * k + j));
                }
            }
        }
        const float s = (float)score;
        const bool keep = valid && s >= t;
        const unsigned mask = __ballot_sync(0xffffffffu, keep);
        if (mask) {
            const int leader = __ffs(mask) - 1;
            int slot0 = 0;
            if (lane == leader) slot0 = atomicAdd(&st_n, __popc(mask));  // shared memory: no wait on L2
            slot0 = __shfl_sync(0xffffffffu, slot0, leader);
            if (keep) {  // |sum| <= CODE_BYTES x 127 fits 16 bits, the row's offset in the block (< MAX_SPAN) too
                const int slot = slot0 + __popc(mask & ((1u << lane) - 1u));
                staged[slot] = ((unsigned)score << 16) | (unsigned)(rs - first);
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) st_base = st_n ? atomicAdd(count + b, st_n) : 0;
    __syncthreads();
    const long long out = (long long)b * capacity;
    for (int i = threadIdx.x; i < st_n; i += blockDim.x)
        append(staged[i], st_base + i, first, out, capacity, out_score, out_pos);
}
"""


def source(long_blocks: bool = False, code_bytes: int = SUBSPACES) -> str:
    """The kernel's CUDA source; ``long_blocks``: its form for blocks of more than :data:`MAX_ROWS` rows (up to
    :data:`MAX_SPAN`, flushing their staging as they go), compiled apart so the default's code is unchanged;
    ``code_bytes``: its form for keys of 16 codes (a lane's bytes rotated by its lane mod 16) or 32."""
    if code_bytes not in CODE_BYTES:
        raise ValueError(f"code_bytes: got {code_bytes}, want one of {CODE_BYTES}")
    return (("#define LONG_BLOCKS 1\n" if long_blocks else "")
            + (f"#define CODE_BYTES {code_bytes}\n" if code_bytes != SUBSPACES else "") + _SOURCE)


def check_scan(scan: str) -> None:
    if scan not in SCANS:
        raise ValueError(f"scan: got {scan!r}, want one of {', '.join(SCANS)}")


def available() -> bool:
    """Whether the CUDA scan can run here: a CUDA device and a torch that compiles kernels with NVRTC."""
    return nvrtc.available()


def takes(subspaces: int, centroids: int, int_tables: bool) -> str | None:
    """Why the CUDA scan cannot read these codes (None: it can): 16 or 32 one-byte codes a key, int8 tables."""
    if subspaces not in CODE_BYTES or centroids != 256 or not int_tables:
        return (f"the CUDA scan looks up int8 tables of 256 centroids, 16 or 32 subspaces: got {subspaces} "
                f"subspaces, {centroids} centroids, {'int8' if int_tables else 'float'} tables")
    return None


def resolve_scan(scan: str, subspaces: int, centroids: int, int_tables: bool, device: torch.device) -> str:
    """The kernel ``scan`` names here: "auto" is "cuda" where :func:`takes` and :func:`available` allow it on
    ``device`` and it compiles, else "triton"; "cuda" where it cannot run raises ``ValueError``."""
    check_scan(scan)
    if scan == "triton":
        return scan
    why = takes(subspaces, centroids, int_tables)
    if scan == "auto":  # compiled here, once a process, so a machine whose NVRTC cannot build it falls back, not fails
        return "cuda" if why is None and nvrtc.compiles(source(), KERNEL, SHARED, device, *_NAMES) else "triton"
    if why is not None:
        raise ValueError(why)
    return scan


_NAMES = ("the CUDA scan", "scan='triton'")  # what a build failure says, and the way around it


MIN_ROWS = 8192  # rows a block takes at least (below, its 64 KB of tables cost more than its rows' reads)
# ... unless the launch would have fewer blocks than multiprocessors: then down to this many. H100, the plugins'
# grown step at 1 x 1M on the codes (128 blocks of 8,192 rows on 132 multiprocessors): 97.5 us at 4,096 rows a
# block against 100.0 at 8,192 and 100.4 at 2,048; at 2 x 1M (256 blocks) 4,096 lost, 122.9 against 119.8 us
# (tools/decode_suite.sh, part "scan-small"; docs/results/paged_scan_min_{4096,2048,default}_h100.json)
FEW_ROWS = 4096
LAUNCH_ROWS = MAX_ROWS  # rows a block takes at most by default (longer blocks: slower on the H100)
WAVES = 4  # blocks a launch keeps at least, in waves of two a multiprocessor, where its blocks can grow


def launch_rows(batch: int, n: int, sms: int, most: int | None = None) -> int:
    """Rows a block of the scan takes for ``batch`` requests of ``n`` rows on ``sms`` multiprocessors: the most,
    a power of two from :data:`MIN_ROWS` to ``most`` (default :data:`LAUNCH_ROWS`, at most :data:`MAX_SPAN`),
    that still leaves :data:`WAVES` waves of blocks (two a multiprocessor), so a block builds its tables once
    for as many rows as the launch can spare while the hardware still balances its blocks; below
    :data:`MIN_ROWS`, down to :data:`FEW_ROWS`, while the launch has fewer blocks than multiprocessors (one
    request of 1M keys). Shapes only: a CUDA graph captures one launch."""
    rows = LAUNCH_ROWS if most is None else most
    while rows > MIN_ROWS and batch * -(-n // rows) < WAVES * 2 * sms:
        rows //= 2
    while rows > FEW_ROWS and batch * -(-n // rows) < sms:
        rows //= 2
    return rows


def pq_scan_select(codes: torch.Tensor, lengths: torch.Tensor, lut: torch.Tensor, thr: torch.Tensor,
                   buf_scores: torch.Tensor, buf_pos: torch.Tensor, counts: torch.Tensor,
                   page_table: torch.Tensor | None, n: int, block_rows: int | None = None) -> None:
    """Append every one of the first ``n`` rows of each request whose integer score reaches ``thr`` to its
    buffer, as the Triton selecting pass does. ``codes`` [B, N, M] or [P, 64, M] uint8, M 16 or 32 (``page_table``
    [B, W] int32); ``lengths`` [B] int32; ``lut`` [B, M, 256] int8; ``thr`` [B] float32; ``buf_scores`` [B, cap]
    float32, ``buf_pos`` [B, cap] int32, ``counts`` [B] int32 (zeroed by the sampling pass before it), all
    contiguous on one CUDA device; ``block_rows`` a multiple of 64 up to :data:`MAX_SPAN` (None:
    :func:`launch_rows`). Raises ``ValueError`` otherwise."""
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
    if m not in CODE_BYTES or lut.shape[1:] != (m, 256):
        raise ValueError(f"lut: got shape {tuple(lut.shape)} for {m} code bytes, want 16 or 32 code bytes and "
                         f"[B, {m}, 256] tables")
    if codes.data_ptr() % 16:
        raise ValueError("codes must start on a 16-byte boundary (the kernel reads 16 bytes at a time)")
    if block_rows is None:
        block_rows = launch_rows(b, n, nvrtc.multiprocessors(nvrtc.device_index(codes.device)))
    if block_rows % 64 or not 0 < block_rows <= MAX_SPAN:
        raise ValueError(f"block_rows: got {block_rows}, want a multiple of 64 up to {MAX_SPAN} (whole pages a block)")
    paged = page_table is not None
    n_rows = page_table.shape[1] * 64 if paged else codes.shape[1]
    index = nvrtc.device_index(codes.device)
    kernel = nvrtc.compiled(source(block_rows > MAX_ROWS, m), KERNEL, SHARED, index, *_NAMES)
    table = page_table if paged else lengths
    kernel(grid=(max(1, -(-n // block_rows)), b, 1), block=(THREADS, 1, 1), shared_mem=SHARED,
           args=[codes, lengths, lut, thr, buf_scores, buf_pos, counts, table, int(table.shape[-1]) if paged else 0,
                 int(n_rows), int(buf_scores.shape[1]), int(block_rows), int(paged)])
