"""``dsaindex bench prefill-select`` on the CPU (torch scoring): the report's shape and its arithmetic."""


from helpers import run_cli


def test_prefill_select_report(tmp_path):
    from dsaindex.pipelines.bench.prefill import markdown_table, run_bench

    # 4,608: above the longest prefix (4,096 + a chunk of 256), the smallest budget that holds every key (on
    # the CPU the refine scores every slot of a query's candidate list, used or not)
    report = run_bench([2048, 4096], chunk=256, budgets=[512, 4608], topk=32, store=None, layer=None, heads=4,
                       window=256, cluster_size=32, refit_every=1024, refit_iterations=1, repeats=1, device="cpu",
                       use_triton=False, key_storage="float32")
    assert [r["prefix"] for r in report["rows"]] == [2048, 4096]
    for row in report["rows"]:
        big = row["ivf"]["4608"]
        assert big["recall_check"] == 1.0  # a budget above the prefix holds every key: exhaustive
        small = row["ivf"]["512"]
        assert 0 < small["recall_check"] <= 1
        m = row["maintenance"]
        # a chunk's maintenance: its sealing, plus a share of the refit that ran in this run (1 every 4 chunks)
        assert m["last_refit_s"] > 0 and m["per_chunk_s"] > m["seal_per_chunk_s"] > 0
        assert m["per_chunk_s"] < m["seal_per_chunk_s"] + m["last_refit_s"]
        # the share of the saved selection time maintenance costs: a number exactly where IVF saved time
        saved = row["exhaustive_seconds"] - small["seconds"]
        share = small["maintenance_share"]
        assert (share is not None) == (saved > 0)
        assert share is None or share > 0
    assert report["index"]["refits"] == 4  # keys up to 4096 + 256, a refit every 1024
    assert markdown_table(report).count("\n") == 4
    assert all(row["deepgemm"] == {"skipped": "not on a CUDA device"} for row in report["rows"])
    assert "| 2K | n/a | n/a |" in markdown_table(report)  # no DeepGEMM figures invented on the CPU


def test_prefill_select_keeps_the_runtimes_fp8_keys_by_default():
    """By default the index keeps its keys as the runtime's prefill index does (FP8 alone), and selects the
    same way: a budget above the prefix is still exhaustive."""
    from dsaindex.pipelines.bench.prefill import run_bench

    report = run_bench([2048], chunk=256, budgets=[2304], topk=32, store=None, layer=None, heads=4, window=256,
                       cluster_size=32, refit_every=1024, refit_iterations=1, repeats=1, device="cpu",
                       use_triton=False)
    assert report["index"]["key_storage"] == "fp8" and report["index"]["refits"] == 2
    assert report["rows"][0]["ivf"]["2304"]["recall_check"] == 1.0


def test_prefill_select_refuses_a_key_storage_it_cannot_run():
    proc = run_cli("bench", "prefill-select", "--device", "cpu", "--prefixes", "2048", "--chunk", "256",
                   "--key-storage", "streamed")
    assert proc.returncode == 2, proc.stderr
    assert "--key-storage 'streamed'" in proc.stderr and "Traceback" not in proc.stderr


def test_prefill_select_names_a_missing_store(tmp_path):
    proc = run_cli("bench", "prefill-select", "--store", str(tmp_path / "missing"), "--device", "cpu",
                   "--prefixes", "2048", "--chunk", "256")
    assert proc.returncode == 2, proc.stderr
    assert "missing" in proc.stderr and "Traceback" not in proc.stderr
