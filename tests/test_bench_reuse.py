"""The decode-reuse benchmark's stack: its weight model, its schedules (IndexCache and the MLI lag) and
that each layer attends the selection its schedule names, computed from the source layer's input."""

import pytest
import torch

from dsaindex.pipelines.bench.reuse import Stack, _table, arms, weight_bytes


def test_weight_model_grows_with_the_experts_the_batch_hits():
    one, many = weight_bytes(1), weight_bytes(32)
    assert one["pre"] == many["pre"]
    experts_one = (one["post"] - weight_bytes(0)["post"]) / (3 * 7168 * 2048)
    assert 7.0 < experts_one < 7.4  # 32 local experts x (1 - (1 - 8/256)^8)
    assert 31.0 < (many["post"] - weight_bytes(0)["post"]) / (3 * 7168 * 2048) <= 32.0
    tp = weight_bytes(1, "tp")  # tensor parallel: an eighth of everything, 8 experts hit by one token
    assert abs(tp["post"] - (weight_bytes(0, "tp")["post"] + 3 * 7168 * 2048)) < 3 * 7168 * 2048 * 0.01
    assert tp["pre"] == one["pre"] // 8


def test_arms_keep_the_same_indexers_and_lag_by_one_kept_layer():
    table = {(arm, n): (kept, src) for arm, n, kept, src in arms(8, [1, 2, 4])}
    assert table[("indexcache", 2)] == ([0, 2, 4, 6], [0, 0, 2, 2, 4, 4, 6, 6])
    assert table[("mli", 2)] == ([0, 2, 4, 6], [0, 0, 0, 2, 2, 4, 4, 6])
    assert table[("mli", 1)][1] == [0, 0, 1, 2, 3, 4, 5, 6]
    for n in (1, 2, 4):
        assert table[("mli", n)][0] == table[("indexcache", n)][0]


def test_each_layer_attends_its_sources_selection_of_that_layers_input():
    stack = Stack(batch=2, context=4096, indexer="torch", device="cpu", scale=16)
    finals = {}
    for arm, n, kept, sources in arms(6, [1, 2]):
        trace: list = []
        finals[(arm, n)] = stack.step(kept, sources, lag=arm == "mli", trace=trace)
        inputs = {layer: x_in for layer, _, x_in, _, _ in trace}
        own = {layer: mine for layer, _, _, _, mine in trace if mine is not None}
        assert sorted(own) == kept  # every kept layer ran its indexer, and only those
        for layer, src, _, attended, _ in trace:
            assert src == sources[layer] and attended is own[src]
        for layer, chosen in own.items():  # the selection is the exact top-k of the layer's own input
            assert torch.equal(chosen, stack.select(inputs[layer]))
            assert chosen.shape == (2, 2048)
    assert not torch.allclose(finals[("mli", 2)], finals[("indexcache", 2)])
    assert not torch.allclose(finals[("indexcache", 1)], finals[("indexcache", 2)])


def test_table_has_a_line_per_arm():
    rows = [{"batch": 1, "retention": f"1/{n}", "arm": arm, "kept": kept, "ms_per_step": 2.0 + n, "tokens_per_s": 1.0,
             "speedup_vs_all_indexers": 1.1, "mli_over_indexcache": 1.2} for arm, n, kept, _ in arms(8, [1, 2])]
    lines = _table(rows).splitlines()
    assert len(lines) == 2 + 4 and lines[1] == "|" + "---|" * 8
    assert lines[3].startswith("| 1 | 1/1 | mli | 8 | 3.000 |") and lines[3].endswith("| 1.100x | 1.200x |")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_torch_indexer_selects_the_top_k_of_the_core_score(device):
    from dsaindex.score import indexer_scores, topk_agree

    stack = Stack(batch=2, context=4096, indexer="torch", device=device, scale=16)
    x = stack.x0
    q = ((x @ stack.wi_a) @ stack.wi_b).reshape(2, stack.index_heads, -1)
    w = (x @ stack.wi_w).float() * (q.shape[1] * q.shape[2]) ** -0.5
    chosen = stack.select(x)
    for b in range(2):
        scores = indexer_scores(q[b : b + 1], stack.keys[b], w[b : b + 1]).cpu()
        want = scores.topk(stack.topk, dim=1).indices
        assert topk_agree(scores, chosen[b : b + 1].cpu(), want).all()  # ties at the k-th score aside
