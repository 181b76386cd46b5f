"""``bench paged --artifacts``: the points it times are the ones the engine plugins serve a bundle with."""

import pytest

from dsaindex.errors import DsaIndexError
from dsaindex.pipelines.bench.paged import plugin_points, point_label
from tests.test_runtime_loader import pq_bundle

TOPK = 32  # the tiny preset's top-k


def _metrics():
    """Layer 0 reaches 99.5% only by the folds (and records a 64K-128K band); layers 1-3 by the codes at 4 x C."""
    head = f"layer0/k{TOPK}"
    metrics = {f"{head}/prefilter4@256": 0.990, f"{head}/prefilter8@256": 0.993, f"{head}/folds1@256": 0.997,
               f"{head}@64K-128K/queries": 20, f"{head}@64K-128K/folds1@256": 0.996,
               f"{head}@64K-128K/prefilter4@256": 0.98, f"{head}@64K-128K/prefilter8@256": 0.99}
    for layer in (1, 2, 3):
        metrics.update({f"layer{layer}/k{TOPK}/prefilter4@128": 0.998, f"layer{layer}/k{TOPK}/prefilter4@256": 0.999})
    return metrics


def test_the_points_are_the_plugins_defaults_and_follow_their_variables(tmp_path):
    pq_bundle(tmp_path / "b", metrics=_metrics())
    chosen = plugin_points(str(tmp_path / "b"), "preset:tiny-v32", device="cpu")
    assert chosen["topk"] == TOPK and chosen["recall_target"] == 0.995
    assert chosen["points"] == {0: (256, 1, "folds", 131072), 1: (128, 4, "codes", 0), 2: (128, 4, "codes", 0),
                                3: (128, 4, "codes", 0)}
    assert chosen["recall"][0] == pytest.approx(0.996) and chosen["recall"][1] == pytest.approx(0.998)
    assert set(chosen["codecs"]) == {0, 1, 2, 3} and chosen["codecs"][0].codebooks.shape[0] == 32
    assert point_label(chosen["points"][0]) == "C=256 P=1 folds grow>131072"
    assert point_label(chosen["points"][1]) == "C=128 P=4 codes fixed"
    # the plugins' variables move the points as they move a server's
    fixed = plugin_points(str(tmp_path / "b"), "preset:tiny-v32", environ={"DSAINDEX_LONG_PREFIX": "fixed"},
                          device="cpu")
    assert fixed["points"][0] == (256, 1, "folds", 0)
    lower = plugin_points(str(tmp_path / "b"), "preset:tiny-v32", environ={"DSAINDEX_RECALL_TARGET": "0.98"},
                          device="cpu")
    assert lower["points"][0] == (256, 4, "codes", 131072)
    # where the plugins would refuse to start, so does the benchmark, with their fix
    with pytest.raises(DsaIndexError, match="Layer 0 .* short of the 99.50%") as err:
        plugin_points(str(tmp_path / "b"), "preset:tiny-v32", environ={"DSAINDEX_STAGE1": "codes"}, device="cpu")
    assert "folds" in err.value.fix


def test_a_bundle_of_another_model_is_refused(tmp_path):
    pq_bundle(tmp_path / "b", metrics=_metrics())
    with pytest.raises(DsaIndexError):
        plugin_points(str(tmp_path / "b"), "preset:tiny-v4", device="cpu")


def test_each_distinct_point_is_timed_once_and_a_layer_is_the_mean(tmp_path, monkeypatch):
    """The GPU's timers replaced by a clock of the point's keys: each distinct point is timed once, every layer
    takes its point's time, the step's time is their mean and the ratio is against the one baseline."""
    import torch

    from dsaindex.pipelines.bench import paged

    pq_bundle(tmp_path / "b", metrics=_metrics())
    chosen = plugin_points(str(tmp_path / "b"), "preset:tiny-v32", device="cpu")
    timed = []
    state = (torch.zeros(4, 64, 132, dtype=torch.uint8), None, None, None, None, None, None)
    monkeypatch.setattr(paged, "_paged_state", lambda *a: state)
    monkeypatch.setattr(paged, "_time_deepgemm", lambda *a, **k: ({"deepgemm_best": 1.0}, {}, {}, None, None))

    def clock(state, rows, codec, schedule, graphs, profile, topk, **settings):
        timed.append((settings["candidates"], settings["prefilter"], settings["stage1"], settings["grow_band"],
                      settings["exact_below"], settings["keys_on_host"]))
        return settings["prefilter"] * settings["candidates"] / 1024, "cuda-graph", None

    monkeypatch.setattr(paged, "_time_selector", clock)
    monkeypatch.setattr("dsaindex.runtime.mapped.host_mapped_zeros", lambda shape, dtype, device: torch.zeros(shape, dtype=dtype))
    row = paged.time_defaults_case(8, 1 << 20, 64, TOPK, chosen, graphs=True)
    assert [t[:4] for t in timed] == [(256, 1, "folds", 131072), (128, 4, "codes", 0)]
    assert row["layer_ms"] == {"0": 0.25, "1": 0.5, "2": 0.5, "3": 0.5}
    assert row["median_ms"]["plugin_defaults"] == pytest.approx(0.4375, abs=1e-4)
    assert row["speedup_vs_deepgemm"]["plugin_defaults"] == pytest.approx(1 / 0.4375, abs=1e-3)
    assert [p["layers"] for p in row["points"]] == [[0], [1, 2, 3]]
    assert {p["path"] for p in row["points"]} == {"pq"}  # 8 x 1M is past the exact path's bound
    table = paged.defaults_markdown({"points": {str(k): {} for k in range(4)}, "rows": [row]})
    assert "| 8 | 1,048,576 | 1.000 | 0.438 | 2.29x | 0.250 pq | 0.500 pq | 0.500 pq | 0.500 pq |" in table
    # the keys in host memory too: each point again, as the plugins build it there (never the exact path)
    timed.clear()
    row = paged.time_defaults_case(1, 1 << 16, 64, TOPK, chosen, graphs=True, places=("device", "host"))
    assert [t[4:] for t in timed] == [(chosen["exact_below"], False)] * 2 + [(0, True)] * 2
    assert {p["path"] for p in row["points"]} == {"exact"} and {p["path_host"] for p in row["points"]} == {"pq"}
    assert row["layer_ms_host"] == row["layer_ms"] and set(row["speedup_vs_deepgemm"]) == {"plugin_defaults",
                                                                                         "plugin_defaults_host"}
    assert row["gpu_bytes_per_key_and_layer"]["plugin_defaults_host"] < row["gpu_bytes_per_key_and_layer"]["exact"] / 4
    table = paged.defaults_markdown({"points": {str(k): {} for k in range(4)}, "keys_on": ["device", "host"],
                                     "rows": [row]})
    assert "| 1 | 65,536 | 1.000 | 0.438 | 2.29x | 0.250 exact | 0.500 exact | 0.500 exact | 0.500 exact | 0.438 | 2.29x |" in table
