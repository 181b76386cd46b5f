"""``dsaindex bench frontier``: served recall per operating point on held-out queries, step times against the
exact baseline, the Pareto front and the point chosen per batch x length (CPU: the kernels' torch references)."""

import itertools
import json

import pytest

from helpers import exact_fp8_topk, run_cli

TOPK, CANDIDATES, PREFILTERS, TARGET = 32, (64, 128, 256), (1, 4), 0.85
LAYERS = (0, 2)


@pytest.fixture(scope="module")
def bundles(routing_store, tmp_path_factory):
    """Two small codes of the shared tiny-v32 store: plain PQ32 and RQ8 (trained on its first four fifths)."""
    from dsaindex.train.pq_job import PQOptions, run_pq_job

    root = tmp_path_factory.mktemp("frontier")
    fast = {"trainer": "torch", "iterations": 2, "score_aware": False, "max_train_keys": 1024,
            "max_eval_queries": 4, "candidates": (64,), "device": "cpu"}
    pq, rq = root / "pq32", root / "rq8"
    run_pq_job(routing_store, PQOptions(subspaces=32, **fast), out=pq, register=False)
    run_pq_job(routing_store, PQOptions(subspaces=8, quantizer="rq", beam=2, **fast), out=rq, register=False)
    return pq, rq


@pytest.fixture(scope="module")
def frontier(routing_store, bundles, tmp_path_factory):
    """One timed run on the CPU: both bundles, C x P, two layers, B in {1, 4} (the direct step, then the
    cached step with the miss filter) at N = 2,048 keys."""
    root = tmp_path_factory.mktemp("frontier-run")
    out, md, png = root / "frontier.json", root / "frontier.md", root / "frontier.png"
    proc = run_cli("bench", "frontier", "--store", str(routing_store), "--artifacts", *map(str, bundles),
                   "--topk", str(TOPK), "--candidates", ",".join(map(str, CANDIDATES)),
                   "--prefilter", ",".join(map(str, PREFILTERS)), "--layers", ",".join(map(str, LAYERS)),
                   "--queries", "12", "--recall-target", str(TARGET), "--timing", "--keys", "2048",
                   "--batches", "1,4", "--device", "cpu", "--out", str(out), "--markdown", str(md), "--plot", str(png),
                   "--no-progress")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert json.loads(proc.stdout) == report
    return report, proc, md, png


def by_point(report):
    return {(r["bundle"], r["candidates"], r["prefilter"]): r for r in report["rows"]}


def test_one_row_per_bundle_and_point_with_each_steps_recall_and_time(frontier, bundles):
    report, _, _, _ = frontier
    rows = by_point(report)
    assert len(report["rows"]) == len(rows) == len(bundles) * len(CANDIDATES) * len(PREFILTERS)
    assert set(rows) == set(itertools.product(map(str, bundles), CANDIDATES, PREFILTERS))
    assert [b["code"] for b in report["bundles"]] == ["PQ32", "RQ8"]
    cases = {"1x2048", "4x2048"}
    assert [(c["batch"], c["step"]) for c in report["cases"]] == [(1, "direct"), (4, "filter")]
    for (_, c, p), row in rows.items():
        assert (row["stage2_keys"], row["cache_capacity"]) == (c * p, 2 * c)
        assert set(row["recall"]) == {"filter", "direct"}
        for rec in row["recall"].values():
            assert rec["queries"] == report["queries"] == sum(report["queries_by_layer"].values()) > 0
            assert set(rec["per_layer"]) == {str(layer) for layer in LAYERS}
            assert 0.0 < rec["mean"] <= 1.0 and 0.0 < rec["fetch_share"] <= 1.0
        assert set(row["median_ms"]) == set(row["speedup"]) == cases
        for key in cases:  # a speedup is the baseline of the same B x N over the point's step
            base = next(c["baseline"] for c in report["cases"] if f"{c['batch']}x{c['keys']}" == key)
            assert base["name"] == "torch_exact"
            assert row["speedup"][key] == pytest.approx(base["median_ms"] / row["median_ms"][key], abs=5.1e-4)


def served_shares(store_path, bundle, report, candidates, prefilter, step):
    """Per measured layer, the share of each held-out query's exact top-k that the runtime's group selects,
    one request per group with its keys appended (the group encodes them), judged against the exhaustive
    FP8 top-k: the command's recall computed another way."""
    from dsaindex.artifacts.bundle import read_bundle
    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.runtime.host_store import HostKeyStore
    from dsaindex.runtime.loader import place_layers
    from dsaindex.runtime.pq_batch import PQDecodeGroup
    from dsaindex.train.recall import held_out

    store = CaptureStore.open(store_path)
    manifest, arrays = read_bundle(bundle)
    codecs = place_layers(manifest, arrays)
    k, shares = report["topk"], {}
    for layer in report["layers"]:
        data = held_out(store, layer, report["sequences"], report["min_prefix"],
                        store.manifest.model.geometry.key_format, max_queries=report["queries_per_layer"])
        for i in range(data.queries.shape[0]):
            start, n = int(data.key_start[i]), int(data.visible[i])
            keys, q, w = data.keys[start : start + n], data.queries[i : i + 1], data.head_weights[i : i + 1]
            assert n >= report["min_prefix"] > candidates
            group = PQDecodeGroup(codecs[layer], HostKeyStore(n // 64 + 1, keys.shape[1], pin=False), 1, n, k,
                                  candidates=candidates, prefilter=prefilter, cache_capacity=2 * candidates,
                                  filter_width=report["filter_width"], device="cpu", use_triton=False,
                                  direct_upto=1 if step == "direct" else 0)
            group.admit(0)
            group.append(0, keys)
            picked, _ = group.select(q, w)
            truth = exact_fp8_topk([keys], q, w, k)
            shares.setdefault(str(layer), []).append(len(set(picked[0].tolist()) & set(truth[0].tolist())) / k)
    return shares


@pytest.mark.parametrize("step", ["filter", "direct"])
def test_recall_is_what_the_served_group_selects(frontier, routing_store, bundles, step):
    from dsaindex.artifacts.bundle import read_manifest
    from dsaindex.train.recall import prefix_band

    report, _, _, _ = frontier
    # the bundles were trained on this store: only the sequences they held out are measured
    assert report["sequences"] == read_manifest(bundles[0]).lineage.eval_sequences
    assert report["held_out"].startswith("the held-out sequences")
    pq = str(bundles[0])
    row = by_point(report)[(pq, 128, 4)]
    shares = served_shares(routing_store, pq, report, 128, 4, step)
    assert {layer: len(v) for layer, v in shares.items()} == report["queries_by_layer"]
    every = [s for v in shares.values() for s in v]
    rec = row["recall"][step]
    assert rec["mean"] == pytest.approx(sum(every) / len(every), abs=2e-6)
    for layer, v in shares.items():
        assert rec["per_layer"][layer] == pytest.approx(sum(v) / len(v), abs=2e-6)
    # the tiny store's prefixes all lie in the first band, so the longest band is every query
    assert rec["band"] == prefix_band(report["min_prefix"]) == "0-16K"
    assert (rec["band_mean"], rec["band_queries"]) == (rec["mean"], rec["queries"])
    assert min(every) < 1.0  # a point that loses keys: the comparison is not trivially 1 == 1


def test_recall_does_not_fall_as_c_grows_at_a_fixed_stage_1(frontier, bundles):
    report, _, _, _ = frontier
    rows = by_point(report)
    for bundle, p, step in itertools.product(map(str, bundles), PREFILTERS, ("filter", "direct")):
        means = [rows[(bundle, c, p)]["recall"][step]["mean"] for c in CANDIDATES]
        assert means == sorted(means), (bundle, p, step, means)
    assert len({r["recall"]["filter"]["mean"] for r in report["rows"]}) > 2  # the points do differ


def test_the_chosen_point_is_the_fastest_reaching_the_target_and_the_front_is_undominated(frontier):
    report, proc, _, _ = frontier
    rows = report["rows"]
    chosen_some = split = False
    for case in report["cases"]:
        key, step = f"{case['batch']}x{case['keys']}", case["step"]
        reaching = [i for i, r in enumerate(rows)
                    if r["recall"][step]["mean"] >= TARGET and r["recall"][step]["band_mean"] >= TARGET]
        split |= 0 < len(reaching) < len(rows)
        fastest = min(reaching, key=lambda i: (rows[i]["median_ms"][key], rows[i]["stage2_keys"], i), default=None)
        assert case["chosen"] == fastest
        chosen_some |= fastest is not None
        if fastest is not None:
            point = case["chosen_point"]
            assert (point["bundle"], point["candidates"], point["prefilter"]) == \
                (rows[fastest]["bundle"], rows[fastest]["candidates"], rows[fastest]["prefilter"])
            assert f"{point['code']} C={point['candidates']} P={point['prefilter']}" in proc.stderr
        pts = [(min(r["recall"][step]["mean"], r["recall"][step]["band_mean"]), r["speedup"][key]) for r in rows]

        def beats(a, b):
            return a[0] >= b[0] and a[1] >= b[1] and a != b

        front = case["front"]
        assert front and all(not any(beats(pts[j], pts[i]) for j in range(len(pts))) for i in front)
        assert all(any(beats(pts[i], pts[j]) for i in front) for j in range(len(pts)) if j not in front)
    assert chosen_some and split  # the target keeps some points and drops others
    assert len([line for line in proc.stderr.splitlines() if line.startswith("B=")]) == len(report["cases"])


def test_markdown_and_plot_are_written(frontier):
    report, _, md, png = frontier
    table = md.read_text()
    for r in report["rows"]:
        assert f"| {r['bundle']} | {r['code']} | {r['candidates']} | {r['prefilter']} |" in table
    assert "| 4 | 2,048 | filter |" in table and "| 1 | 2,048 | direct |" in table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and report["plot"] == str(png)


def test_without_timing_the_recall_still_runs_and_the_choice_is_by_stage_2_work(routing_store, bundles, tmp_path):
    out = tmp_path / "recall.json"
    proc = run_cli("bench", "frontier", "-s", str(routing_store), "-a", str(bundles[0]), "--topk", str(TOPK),
                   "--candidates", "64,256", "--prefilter", "1,4", "--layers", "1", "--queries", "8",
                   "--batches", "8", "--keys", "4096", "--recall-target", "0.5", "--no-timing", "--device", "cpu", "--out", str(out),
                   "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "note: the timing part is skipped (--no-timing)" in proc.stderr
    report = json.loads(out.read_text())
    assert report["timing"]["skipped"] == "--no-timing" and report["steps"] == ["filter"]
    assert all("median_ms" not in r and set(r["recall"]) == {"filter"} for r in report["rows"])
    (case,) = report["cases"]
    good = [i for i, r in enumerate(report["rows"]) if min(r["recall"]["filter"]["mean"],
                                                             r["recall"]["filter"]["band_mean"]) >= 0.5]
    assert case["chosen"] == min(good, key=lambda i: (report["rows"][i]["stage2_keys"], i))


def test_the_direct_steps_recall_with_c_grown_past_a_band_is_measured_and_recorded(routing_store, bundles, tmp_path):
    """``--grow-band``: the direct step's C grows with each query's prefix past the band, as a server grows it
    past its bundle's measured prefixes; the recall of that rule is at least the fixed C's, above it where
    the prefixes pass the band, and the JSON says which rule it measured. A batch past ``--direct-upto``
    whose requests pass the band is a direct step too, as the server runs it."""
    means = {}
    for band, batch in ((0, 1), (64, 1), (64, 8)):
        out = tmp_path / f"grow{band}_{batch}.json"
        proc = run_cli("bench", "frontier", "-s", str(routing_store), "-a", str(bundles[0]), "--topk", str(TOPK),
                       "--candidates", "64", "--prefilter", "1", "--layers", "1", "--queries", "8", "--batches",
                       str(batch), "--keys", "4096", "--no-timing", "--device", "cpu", "--grow-band", str(band),
                       "--out", str(out), "--no-progress")
        assert proc.returncode == 0, proc.stderr
        report = json.loads(out.read_text())
        assert report["grow_band"] == band and report["steps"] == ["direct"]
        assert [case["step"] for case in report["cases"]] == ["direct"]
        assert report["min_prefix"] >= 2 * 64  # every query's coded prefix is past the band: its C grows
        means[band, batch] = report["rows"][0]["recall"]["direct"]["mean"]
    assert means[64, 1] > means[0, 1] and means[64, 8] == means[64, 1], means


def test_pareto_front_keeps_only_points_nothing_beats():
    from dsaindex.pipelines.bench.frontier import pareto_front

    points = [(0.90, 3.0), (0.95, 2.0), (0.95, 1.5), (0.99, 1.0), (0.85, 2.5), (0.99, 1.0)]
    # (0.95, 1.5) and (0.85, 2.5) are beaten; equal points do not beat each other
    assert pareto_front(points) == [0, 1, 3, 5]


@pytest.fixture(scope="module")
def other_model_store(tmp_path_factory):
    store = tmp_path_factory.mktemp("glm5") / "store"
    proc = run_cli("capture", str(store), "-m", "preset:tiny-glm5", "-n", "2", "--seq-len", "64", "--chunk-len", "64",
                   "--queries", "2", "--windows", "0", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    return store


def test_bad_input_is_refused_with_the_fix_before_any_work(routing_store, bundles, other_model_store, tmp_path):
    base = ("bench", "frontier", "--topk", str(TOPK), "--candidates", "64", "--prefilter", "4", "--device", "cpu",
            "--no-progress")
    cases = [
        (("-s", str(routing_store), "-a", str(tmp_path / "nothing")), f"No artifact bundle at {tmp_path / 'nothing'}"),
        (("-s", str(other_model_store), "-a", str(bundles[0])), "was trained for"),
        (("-s", str(routing_store), "-a", str(bundles[0]), "--candidates", "16,64"), "--candidates 16 is below the top-k"),
        (("-s", str(routing_store), "-a", str(bundles[0]), "--prefilter", "0"), "--prefilter '0' holds 0"),
        (("-s", str(routing_store), "-a", str(bundles[0]), "--layers", "9"), "no code for layer(s) [9]"),
        (("-s", str(routing_store), "-a", str(bundles[0]), "--timing", "--keys", "64"), "C = 64 is not below N = 64"),
        (("-s", str(routing_store), "-a", str(bundles[0]), "--no-timing", "--plot", str(tmp_path / "p.png")),
         "--plot draws speedup against recall"),
        (("-s", str(routing_store)), "No bundle to measure."),
        (("-s", str(routing_store), "-a", str(bundles[0]), "--stage2", "fp8"), "--stage2 'fp8' is not a stage-2 kernel"),
        (("-s", str(routing_store), "-a", str(bundles[0]), "--stage1", "half"), "--stage1 'half' is not a stage-1 code"),
        (("-s", str(routing_store), "-a", str(bundles[1]), "--stage1", "groups"), "the layer holds residual codes"),
    ]
    for args, problem in cases:
        proc = run_cli(*base, *args)
        assert proc.returncode == 2, (args, proc.stderr)
        first = proc.stderr.splitlines()[0]
        assert first.startswith("error: ") and problem in first and " Fix: " in first, (args, first)
        assert "Traceback" not in proc.stderr and not proc.stdout
    assert not (tmp_path / "p.png").exists()


def test_the_servers_defaults_are_measured_beside_the_grid(frontier, bundles):
    """Each bundle's row of what a server takes with no decode flags (the loader's choice per layer at the
    recall target) carries the recall that choice serves on the held-out queries, or the refusal a server
    would stop with; the summary says it."""
    from dsaindex.artifacts.bundle import read_bundle
    from dsaindex.runtime.loader import LoadedArtifacts, decode_settings, place_layers
    from dsaindex.runtime.settings import DecodeSettings

    report, proc, _, _ = frontier
    assert [d["bundle"] for d in report["defaults"]] == [str(b) for b in bundles]
    for d, path in zip(report["defaults"], bundles, strict=True):
        manifest, arrays = read_bundle(path)
        loaded = LoadedArtifacts(manifest=manifest, path=path, layers=place_layers(manifest, arrays))
        loaded.layers = {layer: codec for layer, codec in loaded.layers.items() if layer in LAYERS}
        try:
            c, p, kind = decode_settings(DecodeSettings(recall_target=TARGET), loaded, manifest.model.geometry.topk)
        except Exception as err:  # noqa: BLE001 - the refusal a server stops with
            assert d == {"bundle": str(path), "refused": str(err)}
            continue
        assert d["points"] == {str(layer): {"candidates": c[layer], "prefilter": p[layer], "stage1": kind[layer]}
                               for layer in c}
        assert set(d["recall"]) == set(report["steps"])
        for recall in d["recall"].values():
            assert 0.0 <= recall["mean"] <= 1.0 and recall["queries"] == report["queries"]
        # timed as a server runs it: each layer at its own point, a layer's share the mean of theirs
        bases = {f"{c['batch']}x{c['keys']}": c["baseline"]["median_ms"] for c in report["cases"]}
        assert set(d["median_ms"]) == set(d["speedup"]) == set(d["point_ms"]) == set(bases)
        for case, base in bases.items():
            ms = d["point_ms"][case]
            assert set(ms) == {f"C={c[layer]} P={p[layer]} {kind[layer]}" for layer in c}
            mean = sum(ms[f"C={c[layer]} P={p[layer]} {kind[layer]}"] for layer in c) / len(c)
            assert d["median_ms"][case] == pytest.approx(mean, abs=1e-4)
            # the JSON rounds a speedup to 3 decimals: on a CPU one may be 0.02
            assert d["speedup"][case] == pytest.approx(base / d["median_ms"][case], rel=2e-3, abs=6e-4)
        assert f"serve's defaults for {path}: " in proc.stderr and "a layer's step 1 x 2048: " in proc.stderr
