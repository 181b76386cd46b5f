"""``dsaindex bench decode``: the recall path on real capture + bundle (CPU), and the report table."""

import pytest

from helpers import run_cli


@pytest.fixture(scope="module")
def store_and_bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("benchdecode")
    store, bundle = root / "store", root / "bundle"
    proc = run_cli("capture", str(store), "-m", "preset:tiny-v32", "-n", "5", "--seq-len", "1024",
                   "--chunk-len", "512", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("train", "pq", str(store), "--out", str(bundle), "--iterations", "6", "--eval-queries", "8",
                   "--candidates", "128", "--no-register", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    return store, bundle


def test_recall_of_the_batched_path_on_held_out_queries(store_and_bundle):
    from dsaindex.pipelines.bench.decode import recall_on_store

    # the kernels' torch references (the kernels are compared with them in test_kernel_select.py)
    store, bundle = store_and_bundle
    wide = recall_on_store(store, bundle, topk=32, candidates=1024, prefilter=1, cache=1024, min_prefix=256,
                           max_queries=6, device="cpu", use_triton=False)
    narrow = recall_on_store(store, bundle, topk=32, candidates=96, prefilter=2, cache=96, min_prefix=512,
                             max_queries=6, device="cpu", use_triton=False)
    assert set(wide["per_layer"]) == {"0", "1", "2", "3"}
    # every key a candidate and no filter: exhaustive selection (FP8 ties aside)
    assert wide["mean"]["recall_rerank"] >= 0.99
    # the direct step reranks the top C and its boundary bin's ties: never below reranking the top C
    assert wide["mean"]["recall_direct"] >= 0.99
    assert narrow["mean"]["recall_direct"] >= narrow["mean"]["recall_rerank"] - 0.01
    assert 0.6 <= narrow["mean"]["recall_rerank"] <= 1.0 and narrow["mean"]["recall_filter"] <= 1.0
    assert 0.0 < narrow["mean"]["fetch_share_cold"] <= 1.0
    assert all(v["mean_prefix"] >= 512 for v in narrow["per_layer"].values())


def test_markdown_table_lists_every_case():
    from dsaindex.pipelines.bench.decode import markdown_table

    row = {"batch": 8, "keys": 262144, "median_ms": {"pq_warm": 0.5, "pq_cold": 0.9, "pq_direct": 0.45,
                                                   "triton_fp8_logits": 0.8,
                                                   "exact_fp8_triton": 1.0, "torch_exact": 3.0, "exact_path": 0.6, "policy": 0.5,
                                                   "engine_paged": 0.4},
           "hbm_floor_ms": {"exact_fp8": 0.07, "pq32": 0.02}, "speedup_vs_exact_fp8": {"pq_warm": 2.0},
           "policy": {"path": "pq"}}
    with_deepgemm = dict(row, batch=32, median_ms=dict(row["median_ms"], deepgemm_logits=0.25,
                                                        deepgemm_logits_topk=0.75, deepgemm_logits_fast_topk=0.5),
                         speedup_vs_deepgemm_topk={"pq_warm": 1.5, "policy": 1.5, "engine_paged": 1.9})
    table = markdown_table({"rows": [row, with_deepgemm]})
    lines = table.strip().splitlines()
    assert len(lines) == 4 and "| 8 | 262,144 | 0.500 | 0.900 | 0.450 | n/a | n/a | n/a | 0.800 | 1.000 | 3.000 |" in lines[2]
    assert lines[2].endswith("| n/a | 2.00x | 0.600 | pq, 0.500 | n/a | 0.400 | n/a |")  # no DeepGEMM: said, not invented
    assert "| 32 | 262,144 | 0.500 | 0.900 | 0.450 | 0.250 | 0.750 | 0.500 | 0.800 | 1.000 | 3.000 |" in lines[3]
    assert lines[3].endswith("| 1.50x | 2.00x | 0.600 | pq, 0.500 | 1.50x | 0.400 | 1.90x |")


def test_direct_break_even_is_the_largest_batch_up_to_which_direct_wins():
    from dsaindex.pipelines.bench.decode import direct_break_even

    def row(b, n, warm, direct):
        return {"batch": b, "keys": n, "median_ms": {"pq_warm": warm, "pq_direct": direct}}

    rows = [row(1, 1024, 0.1, 0.07), row(2, 1024, 0.13, 0.1), row(4, 1024, 0.16, 0.17), row(8, 1024, 0.2, 0.15),
            row(1, 64, 0.1, 0.2)]
    assert direct_break_even(rows) == {"64": None, "1024": 2}  # 8 wins again, but 4 broke the run


def test_bench_decode_needs_a_gpu_or_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = run_cli("bench", "decode", "--batches", "1", "--keys", "4096")
    assert proc.returncode == 2 and proc.stderr.startswith("error: bench decode needs a CUDA device")


def test_recall_inputs_are_checked_before_any_timing(store_and_bundle, tmp_path):
    store, bundle = store_and_bundle
    missing = run_cli("bench", "decode", "--recall-store", str(store), "--artifacts", str(tmp_path / "nothing"))
    assert missing.returncode == 2
    assert missing.stderr.splitlines()[0].startswith(f"error: No artifact bundle at {tmp_path / 'nothing'}.")
    not_pq = run_cli("bench", "decode", "--recall-store", str(store), "--artifacts", str(store))
    assert not_pq.returncode == 2 and "not a dsaindex artifact bundle" in not_pq.stderr.splitlines()[0]


def test_code_bytes_are_checked_before_any_timing():
    for bad in ("12", "256"):
        proc = run_cli("bench", "decode", "--subspaces", bad)
        assert proc.returncode == 2
        assert proc.stderr.startswith(f"error: --subspaces {bad} is not a power of two dividing the keys' 128 dims.")


def test_pq_from_parses_batch_limits_and_names_a_bad_item():
    from dsaindex.errors import DsaIndexError
    from dsaindex.pipelines.bench.decode import parse_batch_limits

    assert parse_batch_limits("32:262144, 64:131072") == {32: 262144, 64: 131072}
    assert parse_batch_limits("") == {}
    with pytest.raises(DsaIndexError, match="'32-262144' is not BATCH:KEYS"):
        parse_batch_limits("32-262144")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_torch_exact_baseline_in_bf16_agrees_with_the_core_score(seed):
    import torch

    from dsaindex.pipelines.bench.decode import torch_exact_scores
    from dsaindex.score import indexer_scores

    g = torch.Generator().manual_seed(seed)
    b, n, h, d = 3, 200, 8, 32
    keys = torch.randn(b, n, d, generator=g).to(torch.bfloat16)
    q = torch.randn(b, h, d, generator=g).to(torch.bfloat16)
    w = torch.rand(b, h, generator=g) * h**-0.5 * d**-0.5
    got = torch_exact_scores(keys, q, w)
    assert got.dtype == torch.bfloat16 and got.shape == (b, n)
    # one query per request: the core's [1, H, D] x [N, D] score of each request, in fp32
    want = torch.stack([indexer_scores(q[i : i + 1], keys[i], w[i : i + 1])[0] for i in range(b)])
    torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=1e-5)  # bf16 tolerances


@pytest.mark.gpu
def test_torch_exact_baseline_is_the_step_it_replaced_on_the_gpu():
    """The timed baseline's scores are bit for bit the inline expression ``bench decode`` timed before."""
    import torch

    from dsaindex.pipelines.bench.decode import torch_exact_scores

    g = torch.Generator(device="cuda").manual_seed(0)
    keys = torch.randn(2, 4096, 128, device="cuda", generator=g).to(torch.bfloat16)
    q = torch.randn(2, 64, 128, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.rand(2, 64, device="cuda", generator=g) * 64**-0.5 * 128**-0.5
    before = (torch.relu(torch.bmm(keys, q.transpose(1, 2))) @ w.to(torch.bfloat16).unsqueeze(-1)).squeeze(-1)
    assert torch.equal(torch_exact_scores(keys, q, w), before)
