"""The core's exact score and causal top-k equal what each model's own indexer module selects.

Tiny random-weight configs of the real transformers classes; the tap recomputes keys, queries and
head weights from each indexer's inputs, the core scores them, and the selected sets must equal the
module's output (up to ties at the k-th score).
"""

import pytest
import torch

from dsaindex.geometry import geometry_from_config, visible_key_count
from dsaindex.pipelines.capture.tap import IndexerTap
from dsaindex.score import causal_topk, indexer_scores, topk_agree
from helpers import PRESETS


def selected_by_module(output: torch.Tensor, num_keys: int) -> torch.Tensor:
    """The module's selection as [B, S, k] indices (-1 = none), whether it returned indices or a mask."""
    if output.dtype in (torch.int32, torch.int64):
        return output.long()
    chosen = torch.isfinite(output) & (output == 0)  # additive mask: 0 kept, -inf dropped
    k = int(chosen.sum(-1).max())
    idx = torch.where(chosen, torch.arange(num_keys), torch.full_like(chosen, -1, dtype=torch.long))
    return idx.sort(-1, descending=True).values[..., :k]


@pytest.mark.parametrize("ref", PRESETS)
@pytest.mark.parametrize("batch,seq_len", [(1, 77), (2, 131)])
def test_core_topk_equals_module_topk(loaded_models, ref, batch, seq_len):
    model = loaded_models[ref].model
    geometry = geometry_from_config(model.config)
    records = []
    ids = torch.randint(0, 256, (batch, seq_len), generator=torch.Generator().manual_seed(seq_len))
    with IndexerTap(model, geometry, records.append) as tap, torch.no_grad():
        tap.keep_selected = True
        model(ids)
    assert sorted(r.layer for r in records) == list(geometry.indexer_layers)
    positions = torch.arange(seq_len)
    for rec in records:
        assert rec.keys.shape == (batch, geometry.keys_for_tokens(seq_len), geometry.head_dim)
        assert rec.queries.shape == (batch, seq_len, geometry.n_heads, geometry.head_dim)
        for b in range(batch):
            scores = indexer_scores(rec.queries[b], rec.keys[b], rec.head_weights[b])
            _, ours = causal_topk(scores, positions, geometry.topk, geometry.key_stride)
            theirs = selected_by_module(rec.selected[b], scores.shape[1])
            agree = topk_agree(scores, ours, theirs, visible_key_count(positions, geometry.key_stride))
            assert bool(agree.all()), f"{ref} layer {rec.layer}: {int((~agree).sum())} queries disagree"
            # selection is non-trivial: far more keys than top-k by the end of the sequence
            assert geometry.visible_keys(seq_len - 1) > geometry.topk


def test_bf16_model_agrees(loaded_models):
    """Keys are recomputed in the module's dtype, so a bf16 model agrees as exactly as an fp32 one."""
    import copy

    model = copy.deepcopy(loaded_models["preset:tiny-v32"].model).to(torch.bfloat16)
    geometry = geometry_from_config(model.config)
    records = []
    ids = torch.randint(0, 256, (1, 97), generator=torch.Generator().manual_seed(5))
    with IndexerTap(model, geometry, records.append) as tap, torch.no_grad():
        tap.keep_selected = True
        model(ids)
    positions = torch.arange(97)
    for rec in records:
        scores = indexer_scores(rec.queries[0], rec.keys[0], rec.head_weights[0])
        _, ours = causal_topk(scores, positions, geometry.topk)
        assert bool(topk_agree(scores, ours, rec.selected[0].long(), visible_key_count(positions)).all())


def test_tap_switch_and_detach(loaded_models):
    model = loaded_models["preset:tiny-v32"].model
    geometry = geometry_from_config(model.config)
    records = []
    ids = torch.randint(0, 256, (1, 20))
    with IndexerTap(model, geometry, records.append) as tap, torch.no_grad():
        tap.enabled = False
        model(ids)
        assert records == []
        tap.enabled = True
        tap.query_rows = torch.tensor([3, 7])
        model(ids)
    assert len(records) == len(geometry.indexer_layers)
    assert records[0].queries.shape[1] == 2 and records[0].keys.shape[1] == 20
    records.clear()
    with torch.no_grad():
        model(ids)  # hooks removed on exit
    assert records == []
