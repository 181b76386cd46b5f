"""Stage 1's selecting pass as a CUDA kernel (:mod:`dsaindex.kernels.pq_scan_cuda`), its own source run on the
CPU by a warp-synchronous emulator (``tests/cuda_emulator.py``: a thread per CUDA thread, barriers for the
block and warp meeting points), against the pass's specification: every row of a request whose integer
table sum reaches its threshold is appended once with that sum; the count includes rows past the buffer.
The GPU tests in ``test_kernel_select.py`` compare the compiled kernel with the Triton pass."""

import numpy as np
import pytest
from cuda_emulator import compiler, run_scan

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler to run the emulated kernel")


def _inputs(b, n, m, seed):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (b, n, m), dtype=np.uint8)
    lut = rng.integers(-127, 128, (b, m, 256), dtype=np.int8)
    return codes, lut


def _sums(codes, lut):
    """[B, N] integer score of every row: the sum of its M table entries."""
    b, n, m = codes.shape
    return lut[np.arange(b)[:, None, None], np.arange(m)[None, None, :], codes].astype(np.int64).sum(-1)


def _thresholds(sums, lengths, share):
    """A threshold per request keeping about ``share`` of its rows (-inf for the last: it takes every row)."""
    thr = [float(np.quantile(sums[i, :n], 1 - share)) for i, n in enumerate(lengths)]
    thr[-1] = float("-inf")
    return np.asarray(thr, dtype=np.float32)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("variant", ["", "#define COALESCED 1\n", "#define COALESCED 1\n#define PREFETCH_ROWS 1\n",
                                     "#define CODE_BYTES 16\n"])
def test_the_scan_appends_every_row_at_or_above_the_threshold_once(paged, variant):
    """The int32 tables are read at a column rotated by the lane, each lane's code bytes rotated to match:
    every lookup must land on the subspace its byte came from. ``COALESCED``: a warp's rows read in two
    512-byte loads and exchanged between neighbouring lanes, each lane scoring another row than the one it
    would read alone (the lengths end inside a warp's rows and inside a page). ``CODE_BYTES 16``: keys of 16
    codes, each lane's bytes rotated by its lane mod 16, lanes l and l + 16 reading the same table at
    columns 16 apart."""
    m = 16 if "CODE_BYTES 16" in variant else 32
    b, n = 3, 1300
    codes, lut = _inputs(b, n, m, seed=m + paged)
    lengths = np.asarray([n, n - 333, 41], dtype=np.int32)
    sums = _sums(codes, lut)
    thr = _thresholds(sums, lengths, 0.2)
    table = None
    if paged:  # the codes kept per physical 64-row page, behind a shuffled page table
        pages = -(-n // 64)
        padded = np.zeros((b, pages * 64, m), dtype=np.uint8)
        padded[:, :n] = codes
        perm = np.random.default_rng(7).permutation(b * pages)
        store = np.empty((b * pages, 64, m), dtype=np.uint8)
        store[perm] = padded.reshape(b * pages, 64, m)
        codes, table = store, perm.reshape(b, pages).astype(np.int32)
    scores, rows, counts = run_scan(codes, lengths, lut, thr, capacity=n, n=n, page_table=table, defines=variant)
    for i in range(b):
        want = np.nonzero(sums[i, : lengths[i]] >= thr[i])[0]
        got = rows[i, : counts[i]]
        assert counts[i] == len(want) and np.array_equal(np.sort(got), want), i
        assert np.array_equal(scores[i, : counts[i]], sums[i, got].astype(np.float32)), i
        assert (rows[i, counts[i]:] == -1).all()  # nothing written past the count
    assert counts[-1] == lengths[-1]  # -inf: every row of the short request


def test_rows_past_the_buffer_are_counted_not_stored():
    b, n, m, capacity = 2, 3000, 32, 100
    codes, lut = _inputs(b, n, m, seed=3)
    lengths = np.asarray([n, 2500], dtype=np.int32)
    sums = _sums(codes, lut)
    thr = np.asarray([np.quantile(sums[0], 0.5), np.quantile(sums[1, :2500], 0.5)], dtype=np.float32)
    scores, rows, counts = run_scan(codes, lengths, lut, thr, capacity=capacity, n=n, rows_per_block=2048)
    for i in range(b):
        passing = set(np.nonzero(sums[i, : lengths[i]] >= thr[i])[0].tolist())
        assert counts[i] == len(passing) > capacity
        stored = rows[i].tolist()
        assert len(set(stored)) == capacity and set(stored) <= passing
        assert np.array_equal(scores[i], sums[i, rows[i]].astype(np.float32))


def test_the_scan_stages_a_whole_block_of_kept_rows():
    """At -inf every row of a block is kept: the block's staging must hold all of them, and the appends of
    both blocks land once each (rows of the second block carry their offset past the first)."""
    from dsaindex.kernels.pq_scan_cuda import MAX_ROWS

    b, n, m = 1, MAX_ROWS + 300, 32
    codes, lut = _inputs(b, n, m, seed=5)
    sums = _sums(codes, lut)
    thr = np.asarray([-np.inf], dtype=np.float32)
    scores, rows, counts = run_scan(codes, np.asarray([n], dtype=np.int32), lut, thr, capacity=n, n=n,
                                    rows_per_block=MAX_ROWS)
    assert counts[0] == n and np.array_equal(np.sort(rows[0]), np.arange(n))
    assert np.array_equal(scores[0], sums[0, rows[0]].astype(np.float32))


@pytest.mark.parametrize("share", [None, 0.3])
def test_a_long_block_flushes_its_staging_before_it_overflows(share):
    """A block of more rows than its staging holds (the LONG_BLOCKS form: tables built once for up to MAX_SPAN
    rows) flushes the kept rows as it goes: at -inf (``share`` None) every row is kept, so it must flush
    several times; each kept row lands once with its sum and its own position, and the count covers them all."""
    from dsaindex.kernels.pq_scan_cuda import MAX_ROWS, MAX_SPAN

    b, n, m = 2, 3 * MAX_ROWS + 700, 32
    codes, lut = _inputs(b, n, m, seed=11)
    sums = _sums(codes, lut)
    lengths = np.asarray([n, n - 5000], dtype=np.int32)
    if share is None:
        thr = np.full(b, -np.inf, dtype=np.float32)
    else:
        thr = np.asarray([np.quantile(sums[i, :k], 1 - share) for i, k in enumerate(lengths)], dtype=np.float32)
    scores, rows, counts = run_scan(codes, lengths, lut, thr, capacity=n, n=n, rows_per_block=MAX_SPAN,
                                    defines="#define LONG_BLOCKS 1\n")
    for i in range(b):
        want = np.nonzero(sums[i, : lengths[i]] >= thr[i])[0]
        got = rows[i, : counts[i]]
        assert counts[i] == len(want) and np.array_equal(np.sort(got), want), i
        assert np.array_equal(scores[i, : counts[i]], sums[i, got].astype(np.float32)), i


def test_a_block_takes_the_most_rows_that_leave_the_launch_its_waves():
    """The scan's rows a block by the step's shape: a power of two between MIN_ROWS and MAX_SPAN, the largest
    that keeps WAVES waves of blocks (two a multiprocessor); never fewer rows for a larger step. Below MIN_ROWS,
    down to FEW_ROWS, only where the launch would otherwise leave multiprocessors without a block."""
    from dsaindex.kernels.pq_scan_cuda import FEW_ROWS, LAUNCH_ROWS, MAX_SPAN, MIN_ROWS, WAVES, launch_rows

    sms = 132
    last = 0
    for batch in (1, 2, 4, 8, 16, 32, 64, 128):
        rows = launch_rows(batch, 1 << 20, sms, MAX_SPAN)
        assert FEW_ROWS <= rows <= MAX_SPAN and rows & (rows - 1) == 0 and rows >= last
        blocks = batch * -(-(1 << 20) // rows)
        assert rows >= MIN_ROWS or blocks <= 2 * sms  # shorter blocks only to give every multiprocessor one
        assert rows <= MIN_ROWS or blocks >= WAVES * 2 * sms
        assert rows == MAX_SPAN or batch * -(-(1 << 20) // (2 * rows)) < WAVES * 2 * sms  # twice as many: too few
        last = rows
    # one request of 1M keys: 128 blocks of 8,192 rows leave 4 of 132 multiprocessors idle, 256 of 4,096 none;
    # two requests keep 8,192 (256 blocks)
    assert launch_rows(1, 1 << 20, sms) == 4096 and launch_rows(2, 1 << 20, sms) == MIN_ROWS
    assert launch_rows(1, 1 << 20, 100) == MIN_ROWS  # 128 blocks already cover 100 multiprocessors
    assert launch_rows(1, 1000, sms, MAX_SPAN) == FEW_ROWS and launch_rows(4096, 1 << 20, sms, MAX_SPAN) == MAX_SPAN
    assert launch_rows(4096, 1 << 20, sms) == LAUNCH_ROWS  # the default's cap
