"""``dsaindex train reuse`` / ``eval reuse``: cross-layer top-k overlap, reuse plans, the ``reuse`` kind."""

import itertools
import json

import numpy as np
import pytest

from helpers import run_cli


def brute_force(overlap: np.ndarray, keep: int) -> float:
    """Reference: the best retained recall over every kept set holding layer 0."""
    from dsaindex.train.reuse import retained_recall

    n = len(overlap)
    return max(retained_recall(overlap, [0, *rest]) for rest in itertools.combinations(range(1, n), keep - 1))


def random_overlap(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    o = rng.uniform(0.0, 1.0, (n, n))
    np.fill_diagonal(o, 1.0)
    return o


@pytest.mark.parametrize("n,seed", [(1, 0), (2, 1), (5, 2), (7, 3), (9, 4)])
def test_the_dynamic_program_is_optimal(n, seed):
    from dsaindex.train.reuse import best_plan, retained_recall

    o = random_overlap(n, seed)
    for keep in range(1, n + 1):
        kept = best_plan(o, keep)
        assert kept[0] == 0 and kept == sorted(set(kept)) and len(kept) == keep
        assert retained_recall(o, kept) == pytest.approx(brute_force(o, keep), abs=1e-12)


def test_plans_are_never_worse_than_evenly_spaced():
    from dsaindex.artifacts.kinds import ReuseParams
    from dsaindex.train.reuse import make_plans

    layers = [0, 1, 2, 3, 5, 6, 7, 8, 9, 11, 12]  # ids with gaps, as GLM-5 shared layers leave
    o = random_overlap(len(layers), 7)
    plans = make_plans(o, layers)
    assert sorted({p.retention for p in plans}) == ["1/2", "1/4", "1/8"]  # 1/16 would exceed 11 layers
    by = {(p.retention, p.method): p for p in plans}
    for r in ("1/2", "1/4", "1/8"):
        best, even = by[(r, "optimal")], by[(r, "even")]
        assert len(best.kept) == len(even.kept)
        assert best.recall >= even.recall - 1e-9
    assert by[("1/4", "even")].kept == [0, 5, 9]
    ReuseParams(plans_in_layer=0, layers=layers, topk=8, plans=[p.model_dump() for p in plans])  # consistent


def test_overlap_of_a_layer_with_itself_is_one():
    import torch

    from dsaindex.train.reuse import overlap_matrix

    a = torch.tensor([[0, 1, 2, 3], [4, 5, 6, -1]])
    b = torch.tensor([[0, 1, 9, 8], [4, 7, -1, -1]])
    o = overlap_matrix([a, b])
    assert o.shape == (2, 2) and o.dtype == np.float32
    assert o[0, 0] == pytest.approx(1.0) and o[1, 1] == pytest.approx(1.0)
    assert o[0, 1] == pytest.approx((2 / 4 + 1 / 2) / 2)  # share of b's sets inside a's
    assert o[1, 0] == pytest.approx((2 / 4 + 1 / 3) / 2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, routing_store):
    root = tmp_path_factory.mktemp("reusejob")
    store, bundle, plot = routing_store, root / "bundle", root / "heat.png"
    proc = run_cli("train", "reuse", str(store), "--out", str(bundle), "--queries", "24", "--plot", str(plot),
                   "--device", "cpu", "--no-register", "--json")
    assert proc.returncode == 0, proc.stderr
    return root, store, bundle, plot, json.loads(proc.stdout)


def test_train_writes_a_reuse_bundle_with_plans_and_overlap(trained):
    from dsaindex.artifacts.bundle import read_bundle

    root, store, bundle, plot, result = trained
    manifest, arrays = read_bundle(bundle)
    assert manifest.layer_ids == [0, 1, 2, 3] and {a.kind for a in manifest.layers.values()} == {"reuse"}
    overlap = arrays[0]["overlap"]
    assert overlap.shape == (4, 4) and overlap.dtype == np.float32
    np.testing.assert_allclose(np.diag(overlap), 1.0, atol=1e-6)
    assert ((overlap >= 0) & (overlap <= 1 + 1e-6)).all()
    assert all(arrays[layer] == {} for layer in (1, 2, 3))
    assert set(result["plans"]) == {"1/2", "1/4"}
    for p in result["plans"].values():
        assert p["kept"][0] == 0 and p["train_recall"] >= p["even_train_recall"] - 1e-9
        assert 0 < p["recall"] <= 1 and 0 < p["even_recall"] <= 1
        pattern = p["engine_config"]["index_topk_pattern"]
        assert [i for i, c in enumerate(pattern) if c == "F"] == p["kept"]
    assert plot.is_file() and plot.stat().st_size > 0


def test_eval_reproduces_the_held_out_recall_and_loads_through_the_runtime(trained):
    from dsaindex.artifacts.kinds import ReusePlans, ReuseRef
    from dsaindex.pipelines.capture.models import preset_config
    from dsaindex.runtime import load_bundle

    root, store, bundle, plot, result = trained
    proc = run_cli("eval", "reuse", str(bundle), "--store", str(store), "--queries", "24", "--device", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr
    again = json.loads(proc.stdout)["plans"]
    for r, p in result["plans"].items():
        assert again[r]["recall"] == pytest.approx(p["recall"], abs=1e-6)
        assert again[r]["even_recall"] == pytest.approx(p["even_recall"], abs=1e-6)
    loaded = load_bundle(bundle, preset_config("tiny-v32"))
    assert isinstance(loaded.layers[0], ReusePlans) and loaded.layers[0].plan("1/2").kept == result["plans"]["1/2"]["kept"]
    assert all(isinstance(loaded.layers[i], ReuseRef) and loaded.layers[i].plans_in_layer == 0 for i in (1, 2, 3))
    assert loaded.summary()["layers"]["0"]["plans"]["1/4"]["kept"] == [0]


def _rewrite(bundle, dest, edit):
    from dsaindex.artifacts.bundle import read_bundle, write_bundle

    manifest, arrays = read_bundle(bundle)
    layers = {k: a.model_copy(deep=True) for k, a in manifest.layers.items()}
    edit(layers, arrays)
    write_bundle(dest, manifest.model_copy(update={"layers": layers}), arrays)
    return dest


def test_a_bad_plan_is_refused_with_a_clear_message(trained, tmp_path):
    from dsaindex.errors import CorruptBundleError
    from dsaindex.pipelines.capture.models import preset_config
    from dsaindex.runtime import load_bundle

    root, store, bundle, plot, result = trained

    def wrong_source(layers, arrays):
        plan = next(p for p in layers["0"].params["plans"] if p["retention"] == "1/2" and p["method"] == "even")
        assert plan["kept"] == [0, 2]
        plan["sources"][-1] = 1  # layer 3 "reuses" layer 1, which keeps no indexer in this plan

    bad = _rewrite(bundle, tmp_path / "bad", wrong_source)
    with pytest.raises(CorruptBundleError, match=r"layer 3 reuses 1, but the nearest kept layer"):
        load_bundle(bad, preset_config("tiny-v32"))
    proc = run_cli("eval", "reuse", str(bad), "--store", str(store), "--queries", "4")
    assert proc.returncode == 2 and "nearest kept layer" in proc.stderr

    def too_many(layers, arrays):
        plan = next(p for p in layers["0"].params["plans"] if p["retention"] == "1/4" and p["method"] == "optimal")
        plan["kept"], plan["sources"] = [0, 2], [0, 0, 2, 2]

    with pytest.raises(CorruptBundleError, match=r"keeps 2 layers; a retention of 1/4 of 4 layers keeps 1"):
        load_bundle(_rewrite(bundle, tmp_path / "many", too_many), preset_config("tiny-v32"))

    def small_overlap(layers, arrays):
        arrays[0]["overlap"] = arrays[0]["overlap"][:3, :3]

    with pytest.raises(CorruptBundleError, match=r"must be \[4, 4\]"):
        load_bundle(_rewrite(bundle, tmp_path / "small", small_overlap), preset_config("tiny-v32"))


def test_bad_input_is_refused_before_work(trained, tmp_path):
    root, store, bundle, plot, result = trained
    proc = run_cli("train", "reuse", str(store), "--out", str(tmp_path / "b"), "--topk", "5000", "--no-register")
    assert proc.returncode == 2 and "--topk" in proc.stderr and not (tmp_path / "b").exists()
    proc = run_cli("train", "reuse", str(store), "--queries", "0", "--no-register")
    assert proc.returncode == 2 and "--queries 0 is below 1" in proc.stderr
    proc = run_cli("eval", "reuse", str(store), "--store", str(store))  # a store is not a bundle
    assert proc.returncode == 2
