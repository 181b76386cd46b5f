"""The runtime chooses the reference checkpoint's decode-time top-k inside transformers generation."""

import inspect

import pytest
import torch

from dsaindex.pipelines.models import REFERENCE_DIR

pytestmark = pytest.mark.skipif(not (REFERENCE_DIR / "config.json").is_file(), reason="no reference checkpoint")

TOPK = 32


def _text(skip: int, n: int) -> torch.Tensor:
    data = inspect.getsource(inspect).encode()[skip : skip + n]
    return torch.tensor([256] + list(data), dtype=torch.long)


@pytest.fixture(scope="module")
def model_and_layers():
    """The reference model at top-32 and PQ32 codebooks trained on its keys of another text."""
    from dsaindex.hooks import ModuleHooks
    from dsaindex.indexer import mla_indexer_tensors
    from dsaindex.pipelines.models import load_model
    from dsaindex.pipelines.reference_train import set_index_topk
    from dsaindex.pq import PQCodec, PQSpec
    from dsaindex.quant import to_basis
    from dsaindex.train.pq import train_codebooks

    net = load_model("reference", dtype="float32").model
    set_index_topk(net, TOPK)
    keys: dict[int, torch.Tensor] = {}
    with ModuleHooks() as hooks, torch.no_grad():
        for i, layer in enumerate(net.model.layers):
            def grab(mod, a, i=i):
                cos, sin = a["position_embeddings"]
                k, _, _ = mla_indexer_tensors(mod, "half_split_head", a["hidden_states"], a["q_resid"], cos, sin)
                keys[i] = to_basis(k[0].float(), "hadamard")
            hooks.register(layer.self_attn.indexer, pre=grab)
        net(input_ids=_text(20_000, 3000).unsqueeze(0), use_cache=False)
    layers = {i: PQCodec(train_codebooks(k, PQSpec(dim=128, subspaces=32), "torch", 8)) for i, k in keys.items()}
    return net, layers


def test_all_keys_as_candidates_reproduces_exhaustive_generation(model_and_layers):
    from dsaindex.runtime.transformers_adapter import greedy_agreement

    net, layers = model_and_layers
    result = greedy_agreement(net, layers, _text(0, 300), 16, candidates=1024, use_triton=False)
    assert result["teacher_forced"]["token_agreement"] >= 15 / 16
    assert set(result["selection_recall"]) == {"0", "1", "2", "3"}
    assert min(result["selection_recall"].values()) >= 0.97, result["selection_recall"]


def test_coarse_to_fine_keeps_most_of_the_models_own_selection(model_and_layers):
    from dsaindex.runtime.transformers_adapter import RuntimeSelection, greedy_agreement

    net, layers = model_and_layers
    result = greedy_agreement(net, layers, _text(5000, 400), 16, candidates=2 * TOPK, use_triton=False)
    assert 0.6 <= min(result["selection_recall"].values()) <= 1.0
    assert sum(result["selection_recall"].values()) / 4 >= 0.8, result["selection_recall"]
    assert result["teacher_forced"]["token_agreement"] >= 0.75
    # the hooks are gone after the context: the model selects on its own again
    with RuntimeSelection(net, layers, 1, 64, use_triton=False):
        pass
    assert all(not m.self_attn.indexer._forward_hooks for m in net.model.layers)


def test_artifacts_missing_a_layer_are_refused(model_and_layers):
    from dsaindex.runtime.loader import ArtifactMismatchError
    from dsaindex.runtime.transformers_adapter import RuntimeSelection

    net, layers = model_and_layers
    with pytest.raises(ArtifactMismatchError, match=r"no layer \[3\]"):
        RuntimeSelection(net, {k: v for k, v in layers.items() if k != 3}, 1, 64)
