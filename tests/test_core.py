"""The domain core: geometry, the exact score and causal top-k, FP8 ue8m0, the Hadamard basis."""

import math

import pytest
import torch

from dsaindex.errors import UnsupportedModelError
from dsaindex.geometry import IndexerGeometry, geometry_from_config, visible_key_count
from dsaindex.quant import fp8_dequantize, fp8_quantize, hadamard_matrix, to_basis, ue8m0_exponent
from dsaindex.score import causal_mask, causal_topk, indexer_scores, topk_agree


def reference_scores(q, k, w):
    """Loop form of sum_h w_h relu(q_h . k), straight from the definition."""
    S, H, _ = q.shape
    out = torch.zeros(S, k.shape[0], dtype=torch.float64)
    for s in range(S):
        for h in range(H):
            out[s] += w[s, h].double() * torch.relu(k.double() @ q[s, h].double())
    return out


@pytest.mark.parametrize("S,H,T,D", [(1, 1, 1, 4), (19, 3, 99, 8), (7, 8, 333, 128)])
def test_indexer_scores_match_definition(S, H, T, D):
    g = torch.Generator().manual_seed(S * 1000 + T)
    q, k, w = torch.randn(S, H, D, generator=g), torch.randn(T, D, generator=g), torch.randn(S, H, generator=g)
    got = indexer_scores(q, k, w, query_block=5)
    torch.testing.assert_close(got.double(), reference_scores(q, k, w), rtol=1e-5, atol=1e-4)


def test_indexer_scores_accept_noncontiguous_and_bf16():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 11, 2, 16, generator=g)[:, :, 0].to(torch.bfloat16)  # non-contiguous view [4, 11, 16]
    q = q.permute(0, 1, 2)
    k = torch.randn(16, 23, generator=g).t().to(torch.bfloat16)  # [23, 16] transposed view
    w = torch.randn(4, 11, generator=g)
    torch.testing.assert_close(indexer_scores(q, k, w).double(), reference_scores(q.float(), k.float(), w), rtol=1e-4, atol=1e-3)


def test_causal_rules():
    pos = torch.tensor([0, 3, 6, 7, 8])
    assert visible_key_count(pos).tolist() == [1, 4, 7, 8, 9]
    # V4 entries: entry e covers tokens [4e, 4e+4) and is visible once complete: e < (pos+1)//4
    assert visible_key_count(pos, 4).tolist() == [0, 1, 1, 2, 2]
    mask = causal_mask(pos, 3, key_stride=4)
    assert mask.tolist() == [[False] * 3, [True, False, False], [True, False, False], [True, True, False], [True, True, False]]


def test_causal_topk_marks_short_prefixes():
    scores = torch.arange(20.0).repeat(3, 1)  # later keys score higher
    values, idx = causal_topk(scores, torch.tensor([2, 10, 19]), k=5)
    assert idx[0].tolist() == [2, 1, 0, -1, -1] and math.isinf(values[0, 3])
    assert idx[1].tolist() == [10, 9, 8, 7, 6]
    assert idx[2].tolist() == [19, 18, 17, 16, 15]
    _, idx4 = causal_topk(scores[:, :5], torch.tensor([2, 10, 19]), k=3, key_stride=4)
    assert idx4[0].tolist() == [-1, -1, -1] and idx4[1].tolist() == [1, 0, -1] and idx4[2].tolist() == [4, 3, 2]


def test_topk_agree_accepts_ties_only():
    scores = torch.tensor([[5.0, 4.0, 3.0, 3.0, 1.0]])
    assert topk_agree(scores, torch.tensor([[0, 1, 2]]), torch.tensor([[0, 1, 3]])).item()  # tie at k-th
    assert not topk_agree(scores, torch.tensor([[0, 1, 2]]), torch.tensor([[0, 1, 4]])).item()
    # keys outside the prefix are ignored when visible counts are given
    assert topk_agree(scores, torch.tensor([[1, 0, -1]]), torch.tensor([[0, 1, 4]]), torch.tensor([2])).item()


def test_fp8_ue8m0_roundtrip():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(257, 128, generator=g) * torch.logspace(-3, 3, 257).unsqueeze(1)
    codes, scales = fp8_quantize(x)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (257, 1)
    log2 = torch.log2(scales)
    assert torch.equal(log2, log2.round()), "ue8m0 scales must be powers of two"
    amax = x.abs().amax(-1, keepdim=True)
    assert bool((amax / scales <= 448).all()) and bool((amax / scales > 224).all()), "smallest power of two"
    rel = ((fp8_dequantize(codes, scales) - x).abs() / amax).max()
    assert rel < 2**-4, f"e4m3 relative error {rel}"
    exp = ue8m0_exponent(scales)
    torch.testing.assert_close(torch.exp2(exp.float() - 127), scales)
    # as engines store a key: its 128 FP8 bytes, then its scale as one float32 (132 bytes)
    assert codes.view(torch.uint8).shape == (257, 128) and scales.float().contiguous().view(torch.uint8).shape == (257, 4)


def test_hadamard_basis_keeps_scores():
    h = hadamard_matrix(128)
    torch.testing.assert_close(h @ h.t(), torch.eye(128), atol=1e-6, rtol=0)
    g = torch.Generator().manual_seed(1)
    q, k, w = torch.randn(9, 4, 128, generator=g), torch.randn(50, 128, generator=g), torch.rand(9, 4, generator=g)
    raw = indexer_scores(q, k, w)
    rotated = indexer_scores(to_basis(q, "hadamard"), to_basis(k, "hadamard"), w)
    torch.testing.assert_close(rotated, raw, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(to_basis(k, "hadamard"), k)
    with pytest.raises(ValueError):
        hadamard_matrix(96)


def test_geometry_of_presets():
    from dsaindex.pipelines.capture.models import preset_config

    v32 = geometry_from_config(preset_config("tiny-v32"))
    assert (v32.family, v32.indexer_layers, v32.n_heads, v32.head_dim, v32.key_stride) == (
        "deepseek_v32", (0, 1, 2, 3), 8, 128, 1)
    assert v32.rope_layout == "half_split_head"
    glm = geometry_from_config(preset_config("tiny-glm5"))
    assert glm.indexer_layers == (0, 1, 3) and glm.rope_layout == "interleaved_head"
    v4 = geometry_from_config(preset_config("tiny-v4"))
    assert v4.indexer_layers == (1, 3) and v4.key_stride == 4 and v4.rope_layout == "interleaved_tail"
    assert v4.keys_for_tokens(1023) == 255 and v4.visible_keys(7) == 2
    assert IndexerGeometry.from_dict(v4.to_dict()) == v4


def test_geometry_refuses_non_dsa_models():
    with pytest.raises(UnsupportedModelError, match="llama"):
        geometry_from_config({"model_type": "llama", "num_hidden_layers": 2})
    with pytest.raises(UnsupportedModelError, match="no indexer"):
        geometry_from_config({"model_type": "deepseek_v32", "num_hidden_layers": 2, "index_n_heads": 0})
    with pytest.raises(UnsupportedModelError, match="no layer"):
        geometry_from_config({"model_type": "glm_moe_dsa", "num_hidden_layers": 2, "index_n_heads": 4,
                              "index_head_dim": 64, "index_topk": 8, "qk_rope_head_dim": 16,
                              "indexer_types": ["shared", "shared"]})


def test_batched_index_scores_is_the_exact_score_per_batch_row():
    """The chunked, differentiable form the trainers and distillation use is the oracle's score."""
    import torch

    from dsaindex.score import batched_index_scores, indexer_scores

    g = torch.Generator().manual_seed(3)
    q, k, w = torch.randn(3, 7, 5, 16, generator=g), torch.randn(3, 19, 16, generator=g), torch.randn(3, 7, 5, generator=g)
    got = batched_index_scores(q, k, w)
    assert got.shape == (3, 7, 19) and got.dtype == torch.float32
    for b in range(3):
        torch.testing.assert_close(got[b], indexer_scores(q[b], k[b], w[b]))
    q.requires_grad_(True)
    batched_index_scores(q, k, w).sum().backward()  # gradients reach the queries
    assert q.grad is not None and q.grad.abs().sum() > 0
