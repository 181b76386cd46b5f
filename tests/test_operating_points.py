"""The operating-point table: a bundle's recorded metric names read once into typed points."""

from __future__ import annotations

from dsaindex.runtime.operating_points import OperatingPoints, band_start


def test_points_take_the_lower_of_overall_and_the_longest_well_populated_band():
    head = "layer3/k512"
    metrics = {
        f"{head}/rerank@2048": 0.999, f"{head}/prefilter4@2048": 0.990, f"{head}/prefilter16@2048": 0.997,
        f"{head}/prefilter4@4096": 0.996,
        f"{head}@16K-32K/queries": 40, f"{head}@16K-32K/prefilter4@2048": 0.950,  # shorter band: not read
        f"{head}@64K-128K/queries": 12, f"{head}@64K-128K/prefilter4@2048": 0.980,
        f"{head}@64K-128K/prefilter16@2048": 0.999,  # above overall: overall decides
        f"{head}@128K-256K/queries": 3, f"{head}@128K-256K/prefilter4@2048": 0.5,  # too few queries
        "layer4/k512/prefilter4@1024": 0.9, "layer3/k256/prefilter4@1024": 0.8, "layer3/k512/direct@2048": 0.1,
    }
    table = OperatingPoints.from_metrics(metrics)
    assert table.prefilters(3, 512) == [4, 16]
    assert table.recall(3, 512, 4) == {2048: 0.980, 4096: 0.996}
    assert table.recall(3, 512, 16) == {2048: 0.997}
    assert table.recall(3, 512, None) == {2048: 0.999}  # rerank points
    (point,) = [p for p in table.of(3, 512, 4) if p.candidates == 2048]
    assert (point.band, point.band_recall, point.overall, point.stage2_keys) == ("64K-128K", 0.980, 0.990, 8192)
    assert table.recall(4, 512, 4) == {1024: 0.9} and table.recall(3, 256, 4) == {1024: 0.8}
    assert table.of(5, 512) == [] and OperatingPoints.from_metrics({}).points == ()


def test_band_names_order_by_their_first_key():
    assert [band_start(b) for b in ("0-16K", "64K-128K", "512K-1M", "1M-max")] == [0, 65536, 524288, 1 << 20]
