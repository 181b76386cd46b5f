"""Threshold top-k of score rows against the exhaustive top-k (CPU through TRITON_INTERPRET=1, or the GPU)."""

import os

import pytest
import torch

pytest.importorskip("triton")

from dsaindex.kernels.topk import rows_topk, rows_topk_reference  # noqa: E402

CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)
DEV = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("n,lengths,k", [(5000, [5000, 100, 3001], 64), (20000, [20000, 19999], 512),
                                         (700, [1, 700], 16)])
def test_rows_topk_selects_the_exhaustive_top_k(n, lengths, k):
    g = torch.Generator().manual_seed(n)
    logits = torch.randn(len(lengths), n, generator=g).to(DEV)
    lengths = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    values, columns, counts = rows_topk(logits, lengths, k, block_n=256, iters=2, return_counts=True)
    want_values, want_columns = rows_topk_reference(logits, lengths, k)
    assert values.shape == (len(lengths), k) and columns.dtype == torch.int64
    for b in range(len(lengths)):
        got = set(columns[b].tolist()) - {-1}
        assert got == set(want_columns[b].tolist()) - {-1}, b
        assert int(counts[b]) >= min(k, int(lengths[b]))  # the threshold let enough through
    torch.testing.assert_close(values.sort(1).values, want_values.sort(1).values)  # the same k, in column order


def test_rows_topk_gives_int32_columns_equal_to_its_int64_ones():
    """``index_dtype=torch.int32``: the same columns (-1 past a short row), written as int32 by the kernel."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3000, generator=g).to(DEV)
    lengths = torch.tensor([3000, 40], dtype=torch.int32, device=DEV)
    _, wide = rows_topk(logits, lengths, 64, block_n=256, iters=2)
    values, narrow = rows_topk(logits, lengths, 64, block_n=256, iters=2, index_dtype=torch.int32)
    # the same set (on a GPU the appending pass's atomics order the buffer, so two calls may order it apart)
    assert narrow.dtype == torch.int32 and torch.equal(narrow.long().sort(1).values, wide.sort(1).values)
    assert (narrow[1, 40:] == -1).all() and (values[1, 40:] == float("-inf")).all()
    with pytest.raises(ValueError, match="index_dtype"):
        rows_topk(logits, lengths, 64, index_dtype=torch.float32)


def test_rows_topk_checks_its_inputs():
    with pytest.raises(ValueError, match="logits"):
        rows_topk(torch.zeros(2, 10, dtype=torch.float64, device=DEV), torch.tensor([10, 10]), 4)
    with pytest.raises(ValueError, match="lengths"):
        rows_topk(torch.zeros(2, 10, device=DEV), torch.tensor([10]), 4)


@pytest.mark.parametrize("b,n,k", [(3, 100, 7), (2, 5000, 512), (1, 40, 64), (4, 16384, 2048), (2, 32768, 4096)])
def test_small_topk_selects_the_k_largest(b, n, k):
    from dsaindex.kernels.topk import small_topk, small_topk_reference

    g = torch.Generator().manual_seed(n)
    values = torch.randn(b, n, generator=g)
    values[0, : max(0, n - k // 2)] = float("-inf")  # a short row, its k / 2 values last: -inf comes back as -1
    payload = torch.randint(0, 1 << 40, (b, n), generator=g)
    values, payload = values.to(DEV), payload.to(DEV)
    got_v, got_p = small_topk(values, k, payload)
    want_v, want_p = small_topk_reference(values, k, payload)
    assert torch.equal(got_v.sort(1).values, want_v.sort(1).values)
    for row in range(b):
        assert set(got_p[row].tolist()) == set(want_p[row].tolist()), row
    cols_v, cols = small_topk(values, k)  # no payload: the columns
    live = cols >= 0
    assert torch.equal(values.gather(1, cols.clamp_min(0))[live], cols_v[live])
    assert (~live).sum() == (~torch.isfinite(want_v)).sum()
    # a row's real entries lead, its -inf padding follows (what an engine reads as its first n slots)
    for row in range(b):
        n_live = int(live[row].sum())
        assert live[row, :n_live].all() and not live[row, n_live:].any(), row
        assert (got_p[row, :n_live] >= 0).all() and (got_p[row, n_live:] == -1).all(), row


def test_small_topk_takes_ties_in_column_order():
    from dsaindex.kernels.topk import small_topk

    values = torch.tensor([[1.0, 3.0, 2.0, 2.0, 2.0, 0.5]], device=DEV)
    got_v, got_c = small_topk(values, 3)
    assert got_c.tolist() == [[1, 2, 3]] and got_v.tolist() == [[3.0, 2.0, 2.0]]
    with pytest.raises(ValueError, match="row length"):
        small_topk(torch.zeros(1, 40000, device=DEV), 4)


def test_small_topk_takes_ties_in_column_order_across_a_long_row():
    """A row longer than one compaction chunk (4,096 entries) whose k-th value is tied thousands of times:
    exactly k entries come back, every one above the tie and the first tied ones by column, in column
    order; slots past the count stay unread."""
    from dsaindex.kernels.topk import small_topk

    g = torch.Generator().manual_seed(5)
    values = torch.randint(0, 8, (2, 10000), generator=g).float()
    counts = torch.tensor([10000, 7000], dtype=torch.int32)
    values[1, 7000:] = 1e30  # past the count: never read
    payload = torch.arange(10000, dtype=torch.int32).repeat(2, 1) + 5
    k = 3000
    got_v, got_p = small_topk(values.to(DEV), k, payload.to(DEV), counts=counts.to(DEV))
    for row in range(2):
        live = values[row, : int(counts[row])]
        kth = live.sort(descending=True).values[k - 1]
        above = (live > kth).nonzero().squeeze(1)
        tied = (live == kth).nonzero().squeeze(1)[: k - above.numel()]
        want = torch.cat([above, tied]).sort().values + 5
        assert got_p[row].tolist() == want.tolist(), row
        assert torch.equal(got_v[row].cpu(), live[want - 5])


def test_split_tail_block_holds_a_row_just_past_a_power_of_two():
    from dsaindex.kernels.topk import split_tail_block

    assert split_tail_block(16704) == (16384, 512)  # a grown C's final row: 16,384 candidates, ties, the page
    assert split_tail_block(16384) == (16384, 0) and split_tail_block(16385) == (16384, 16)
    assert split_tail_block(4416) == (4096, 512)  # a fixed C's: 4,096 candidates, 256 tie slots, the open page
    assert split_tail_block(16384 + 2048) == (16384, 2048) and split_tail_block(16384 + 2049) == (32768, 0)
    assert split_tail_block(2100) == (2048, 64) and split_tail_block(1100) == (2048, 0)  # small rows: whole


@pytest.mark.parametrize("n,counts", [(16704, None), (16704, [16704, 16000, 16385, 900]),
                                      (4416, [4416, 4000, 4100, 300])])
def test_small_topk_split_tail_equals_the_whole_block(n, counts):
    """A row of 16,704 slots searched as 16,384 + a 512-slot tail (4,416 as 4,096 + 512): the same entries as the
    whole next-power block and the reference, with the k-th value in the tail, tied across the boundary, a short
    row, and filled counts that end before, at and past the main block."""
    from dsaindex.kernels.topk import small_topk, small_topk_reference, split_tail_block

    k = 2048
    main, tail = split_tail_block(n)
    assert tail == 512
    g = torch.Generator().manual_seed(11)
    values = torch.randn(4, n, generator=g)
    values[1, main:] += 3.0  # the tail holds the top of the row: the k-th value's rank crosses the boundary
    values[2] = torch.randint(0, 40, (n,), generator=g).float()  # ties everywhere, the k-th one among them
    values[3, : n - 300] = float("-inf")  # a short row: fewer live entries than k, all in the tail
    payload = torch.randint(0, 1 << 30, (4, n), generator=g, dtype=torch.int32)
    cnt = None if counts is None else torch.tensor(counts, dtype=torch.int32)
    ref_values = values if cnt is None else values.masked_fill(torch.arange(n)[None, :] >= cnt[:, None],
                                                               float("-inf"))
    want_v, want_p = small_topk_reference(ref_values, k, payload)
    dev_cnt = None if cnt is None else cnt.to(DEV)
    split_v, split_p = small_topk(values.to(DEV), k, payload.to(DEV), counts=dev_cnt, split_tail=True)
    whole_v, whole_p = small_topk(values.to(DEV), k, payload.to(DEV), counts=dev_cnt, split_tail=False)
    assert torch.equal(split_p, whole_p) and torch.equal(split_v, whole_v)  # slot for slot, ties too
    for row in (0, 1, 3):  # distinct values (row 3's -inf aside): the reference's set
        assert set(split_p[row].tolist()) == set(want_p[row].tolist()), row
    assert torch.equal(split_v[2].sort().values.cpu(), want_v[2].sort().values)  # ties: the same values


def test_the_final_top_k_picks_its_form_by_rows_and_row_length(monkeypatch):
    """final_topk's defaults: up to RADIX_UP_TO_ROWS rows of at least RADIX_FROM_SLOTS entries are spread over
    programs (radix_topk); more rows of a grown C's 16,704 slots take one program a row with a 512-slot tail; a
    fixed C's 4,416 stay one whole 8,192-slot block. Each form selects the reference's entries."""
    import dsaindex.kernels.topk as topk
    import dsaindex.kernels.topk_kernel as topk_kernel

    launched = []
    row_kernel, radix = topk_kernel.row_topk_kernel, topk.radix_topk

    class Recorded:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched.append(("row", kw["BLOCK"], kw["TAIL"]))
                return row_kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(topk_kernel, "row_topk_kernel", Recorded())
    monkeypatch.setattr(topk, "radix_topk", lambda *a, **kw: launched.append(("radix",)) or radix(*a, **kw))
    monkeypatch.setattr(topk, "RADIX_UP_TO_ROWS", 2)  # 2 rows, not 32: the interpreter is slow
    g = torch.Generator().manual_seed(5)
    for rows, n, want in ((2, 16704, ("radix",)), (3, 16704, ("row", 16384, 512)), (2, 4416, ("row", 8192, 0))):
        values = torch.randn(rows, n, generator=g)
        payload = torch.randint(0, 1 << 30, (rows, n), generator=g, dtype=torch.int32)
        launched.clear()
        got_v, got_p = topk.final_topk(values.to(DEV), 2048, payload.to(DEV), index_dtype=torch.int32)
        assert launched == [want], (rows, n, launched)
        want_v, want_p = topk.small_topk_reference(values, 2048, payload)
        for row in range(rows):
            assert set(got_p[row].tolist()) == set(want_p[row].tolist()), (rows, n, row)
        assert torch.equal(got_v.sort(1).values.cpu(), want_v.sort(1).values)


def test_sample_thresholds_kernel_equals_the_torch_rule():
    from dsaindex.kernels.select import sample_thresholds, thresholds_from_samples

    g = torch.Generator().manual_seed(0)
    samples = torch.randn(3, 8192, generator=g)
    lengths = torch.tensor([1 << 20, 5000, 1 << 19], dtype=torch.int32)
    for stride in (128, 64):
        # the kernel ignores samples past a request's length whatever they hold; the torch rule wants -inf there
        past = torch.arange(8192)[None, :] * stride >= lengths[:, None]
        s, n = samples.to(DEV), lengths.to(DEV)
        want = thresholds_from_samples(samples.masked_fill(past, float("-inf")).to(DEV), n, stride, 2048, 16384)
        counts = torch.full((3,), 7, dtype=torch.int32, device=DEV)
        assert torch.equal(sample_thresholds(s, n, stride, 2048, 16384, counts=counts), want)
        assert counts.tolist() == [0, 0, 0]  # zeroed in the same launch
    # a strided view of whole score rows is read in place
    rows = torch.randn(2, 8192 * 16, generator=g).to(DEV)
    n = torch.tensor([8192 * 16, 70000], dtype=torch.int32, device=DEV)
    view = rows[:, ::16]
    past = torch.arange(8192, device=DEV)[None, :] * 16 >= n[:, None]
    want = thresholds_from_samples(view.contiguous().masked_fill(past, float("-inf")), n, 16, 2048, 16384)
    assert torch.equal(sample_thresholds(view, n, 16, 2048, 16384), want)


def test_sample_thresholds_grow_each_requests_target_by_its_length():
    """``grow`` (band, most): each request's target and capacity as ``grown_counts`` makes them, so its threshold
    is the torch rule's at its own grown target (a request within its grown capacity: -inf)."""
    from dsaindex.kernels.select import grown_counts, sample_thresholds, thresholds_from_samples

    g = torch.Generator().manual_seed(1)
    samples = torch.randn(4, 8192, generator=g)
    lengths = torch.tensor([1 << 20, 300_000, 100_000, 3_000], dtype=torch.int32)
    stride, target, capacity, band, most = 128, 2048, 4096, 131072, 8
    past = torch.arange(8192)[None, :] * stride >= lengths[:, None]
    got = sample_thresholds(samples.to(DEV), lengths.to(DEV), stride, target, capacity, grow=(band, most)).cpu()
    mults = (grown_counts(1, lengths, band, most)).tolist()
    assert mults == [8, 4, 1, 1]
    for i, m in enumerate(mults):
        want = thresholds_from_samples(samples[i : i + 1].masked_fill(past[i : i + 1], float("-inf")),
                                       lengths[i : i + 1], stride, target * m, capacity * m)
        assert torch.equal(got[i : i + 1], want), i
    assert torch.isneginf(got[3]) and not torch.isneginf(got[:3]).any()


def test_small_topk_is_exact_on_structured_rows():
    """Rows whose every 8th entry is the lowest or the highest (what a sampled search would trip on) still
    get their exact top-k."""
    from dsaindex.kernels.topk import small_topk, small_topk_reference

    g = torch.Generator().manual_seed(1)
    values = torch.rand(2, 16384, generator=g) + 1.0
    values[:, ::8] = -torch.rand(2, 2048, generator=g)  # the sampled entries are the lowest
    values[1, ::8] = 10.0 + torch.rand(2048, generator=g)  # or the highest
    values = values.to(DEV)
    got_v, got_c = small_topk(values, 1500)
    want_v, want_c = small_topk_reference(values, 1500)
    assert torch.equal(got_v.sort(1).values, want_v.sort(1).values)
    for row in range(2):
        assert set(got_c[row].tolist()) == set(want_c[row].tolist())


def test_small_topk_reads_only_the_filled_slots():
    """With ``counts``, slots past a row's count are never read: garbage there (here huge values) changes
    nothing, and a row with fewer filled slots than k pads with -inf / -1."""
    from dsaindex.kernels.topk import small_topk, small_topk_reference

    g = torch.Generator().manual_seed(3)
    values = torch.randn(3, 700, generator=g)
    payload = torch.randint(0, 1 << 20, (3, 700), generator=g, dtype=torch.int32)
    counts = torch.tensor([700, 300, 20], dtype=torch.int32)
    filled = torch.arange(700)[None, :] < counts[:, None]
    want_v, want_p = small_topk_reference(values.masked_fill(~filled, float("-inf")), 64, payload)
    garbage = values.masked_fill(~filled, 1e30)
    got_v, got_p = small_topk(garbage.to(DEV), 64, payload.to(DEV), counts=counts.to(DEV))
    for row in range(3):
        assert sorted(got_p[row].tolist()) == sorted(want_p[row].tolist())
        assert sorted(got_v[row].tolist()) == sorted(want_v[row].tolist())
    assert (got_p[2] == -1).sum() == 64 - 20


@pytest.mark.parametrize("n,k,block,counts,bits", [(16704, 2048, 1024, None, 11), (16704, 2048, 2048, None, 8),
                                                    (4416, 2048, 1024, [4416, 3000, 2048, 100], 11),
                                                    (5000, 512, 256, [5000, 4999, 513, 512], 8),
                                                    (5000, 512, 256, [5000, 4999, 513, 512], 11),
                                                    (700, 64, 1024, None, 11), (40, 64, 16, None, 8)])
def test_radix_topk_takes_small_topks_entries(n, k, block, counts, bits):
    """The radix select spread over programs keeps the entries small_topk keeps, ties included (the first ones by
    column): distinct values, a row whose top sits in its last program, ties everywhere, fewer finite entries than
    k; rows longer than and shorter than a program, counts at and below k; real entries first, then -inf / -1."""
    from dsaindex.kernels.topk import radix_topk, small_topk

    g = torch.Generator().manual_seed(n + k)
    values = torch.randn(4, n, generator=g)
    values[1, -min(n, 300):] += 4.0  # the top of the row in its last program(s)
    values[2] = torch.randint(0, 9, (n,), generator=g).float()  # ties: the k-th value is shared by many
    values[3, : max(0, n - k // 3)] = float("-inf")  # fewer finite entries than k
    payload = torch.randint(0, 1 << 40, (4, n), generator=g)
    cnt = None if counts is None else torch.tensor(counts, dtype=torch.int32).to(DEV)
    x, pay = values.to(DEV), payload.to(DEV)
    want_v, want_p = small_topk(x, k, pay, counts=cnt)
    got_v, got_p = radix_topk(x, k, pay, counts=cnt, block=block, digit_bits=bits)
    for row in range(4):
        assert sorted(got_p[row].tolist()) == sorted(want_p[row].tolist()), row
        assert sorted(got_v[row].tolist()) == sorted(want_v[row].tolist()), row
        live = got_p[row] >= 0
        n_live = int(live.sum())
        assert live[:n_live].all() and (got_v[row, n_live:] == float("-inf")).all(), row  # real entries lead
    cols_v, cols = radix_topk(x, k, counts=cnt, block=block, index_dtype=torch.int32, digit_bits=bits)  # columns
    assert cols.dtype == torch.int32
    live = cols >= 0
    assert torch.equal(x.gather(1, cols.long().clamp_min(0))[live], cols_v[live])


@pytest.mark.parametrize("bits", [8, 11])
def test_radix_topk_leaves_a_kept_scratch_zeroed_for_the_next_select(bits):
    """A caller's scratch (the paged step keeps one a batch size, with no fill kernel a step) comes back zeroed
    after a select, so a second select of other rows through it picks what a fresh scratch picks; a scratch of the
    wrong width is refused by name."""
    from dsaindex.kernels.topk import radix_scratch, radix_scratch_words, radix_topk

    g = torch.Generator().manual_seed(bits)
    first, second = torch.randn(3, 5000, generator=g).to(DEV), torch.randn(3, 5000, generator=g).to(DEV)
    second[1] = torch.randint(0, 5, (5000,), generator=g).float().to(DEV)  # ties at the k-th value
    scratch = radix_scratch(3, DEV, bits)
    assert scratch.shape == (3, radix_scratch_words(bits))
    radix_topk(first, 700, block=256, digit_bits=bits, scratch=scratch)
    assert not scratch.any()
    got_v, got_p = radix_topk(second, 700, block=256, digit_bits=bits, scratch=scratch)
    want_v, want_p = radix_topk(second, 700, block=256, digit_bits=bits)
    assert torch.equal(got_p.sort(1).values, want_p.sort(1).values)
    assert torch.equal(got_v.sort(1).values, want_v.sort(1).values)
    assert not scratch.any()
    with pytest.raises(ValueError, match="scratch"):
        radix_topk(second, 700, digit_bits=bits, scratch=radix_scratch(3, DEV, 19 - bits))


def test_radix_topk_checks_its_inputs():
    from dsaindex.kernels.topk import radix_topk

    with pytest.raises(ValueError, match="values"):
        radix_topk(torch.zeros(2, 10, dtype=torch.float64, device=DEV), 4)
    with pytest.raises(ValueError, match="block"):
        radix_topk(torch.zeros(2, 10, device=DEV), 4, block=100)
    with pytest.raises(ValueError, match="digit_bits"):
        radix_topk(torch.zeros(2, 10, device=DEV), 4, digit_bits=4)
    with pytest.raises(ValueError, match="counts"):
        radix_topk(torch.zeros(2, 10, device=DEV), 4, counts=torch.zeros(3, dtype=torch.int32, device=DEV))


def test_the_final_top_k_kernels_compile_for_sm90_and_the_new_forms_keep_off_the_stack():
    """Triton's own ptxas compiles the step's final top-k and stage 2's operands for sm_90 on any machine: every launch
    form compiles, and the split row (16,384 + 512 slots at 16 warps), the radix kernels and the operands at 16 warps
    use no stack (no spilled registers)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import triton

    bins = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (os.access(bins / "ptxas", os.X_OK) and os.access(bins / "cuobjdump", os.X_OK)):
        pytest.skip("this Triton ships no ptxas / cuobjdump")
    root = Path(__file__).resolve().parents[1]
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"triton_resources_{os.getpid()}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DSAINDEX_GRID_ORDER")}
    proc = subprocess.run([sys.executable, str(root / "tools" / "triton_resources.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=600)  # compiled, not interpreted
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = {r["kernel"]: r for r in json.loads(out.read_text())}
    out.unlink()
    assert len(seen) == 14
    for name, r in seen.items():
        assert 0 < r["registers"] <= 65536 // (32 * r["num_warps"]), name
    assert seen["small_topk 16704 as 16384 + 512"]["stack_bytes"] == 0
    assert all(r["stack_bytes"] == 0 for name, r in seen.items() if name.startswith("radix_topk")), seen
    assert seen["int8_operands at 16 warps"]["stack_bytes"] == 0


@pytest.mark.skipif(CUDA, reason="records the interpreter's launches")
def test_the_launch_recorder_keeps_each_distinct_launch_with_its_types_and_constexprs():
    """tools/triton_resources.Launches: a launch's argument types and constexprs as a compile needs them, the same
    launch twice kept once, another shape kept apart, and the interpreter as it was afterwards."""
    import sys
    from pathlib import Path

    from triton.runtime import interpreter

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from triton_resources import Launches

    from dsaindex.kernels.topk import small_topk

    before = interpreter.GridExecutor.__call__
    x = torch.randn(2, 300)
    with Launches() as seen:
        small_topk(x, 16, torch.arange(600, dtype=torch.int32).view(2, 300), index_dtype=torch.int32)
        small_topk(x, 16, torch.arange(600, dtype=torch.int32).view(2, 300), index_dtype=torch.int32)
        small_topk(torch.randn(2, 5000), 16)
    assert interpreter.GridExecutor.__call__ is before
    assert [r["kernel"] for r in seen.rows] == ["row_topk_kernel", "row_topk_kernel"]
    first = seen.rows[0]
    assert first["module"] == "dsaindex.kernels.topk_kernel" and first["num_warps"] == 4
    assert first["signature"]["val_ptr"] == "*fp32" and first["signature"]["pay_ptr"] == "*i32"
    assert first["signature"]["out_pay_ptr"] == "*i32" and first["signature"]["n"] == "i32"
    assert first["constexprs"]["BLOCK"] == 512 and first["constexprs"]["HAS_PAYLOAD"] is True
    assert seen.rows[1]["constexprs"]["BLOCK"] == 8192 and seen.rows[1]["signature"]["out_pay_ptr"] == "*i64"


@pytest.mark.skipif(CUDA or not os.environ.get("DSAINDEX_GRID_ORDER"), reason="DSAINDEX_GRID_ORDER is not set")
def test_the_out_of_order_mode_reorders_programs_and_atomic_lanes():
    """Under DSAINDEX_GRID_ORDER (tests/conftest.py) the interpreter neither runs programs 0, 1, 2, ... in turn nor
    gives an atomic's lanes their turns in lane order, and each program still sees its own id: the appended ids
    are all there, in another order (a Triton whose interpreter changed would leave the mode doing nothing)."""
    import triton
    import triton.language as tl

    @triton.jit
    def append_ids(out_ptr, counter_ptr):
        lane = tl.arange(0, 8)
        slot = tl.atomic_add(counter_ptr + lane * 0, 1)
        tl.store(out_ptr + slot, tl.program_id(0) * 8 + lane)

    out = torch.full((32,), -1, dtype=torch.int32)
    counter = torch.zeros(1, dtype=torch.int32)
    append_ids[(4,)](out, counter)
    assert sorted(out.tolist()) == list(range(32)) and int(counter) == 32
    assert out[:8].tolist() != list(range(8))  # neither program 0 first nor its lanes in order
    assert [v // 8 for v in out.tolist()] != sorted(v // 8 for v in out.tolist())  # programs not in turn

