"""The DeepGEMM baseline: the engines' paged layout and masking on any machine, DeepGEMM's logits against
the core's exact score on a GPU where it imports."""

import pytest
import torch

from dsaindex.kernels import deepgemm
from dsaindex.quant import fp8_dequantize, fp8_quantize
from dsaindex.score import indexer_scores


def fp8_keys(batch, n, dim=128, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    codes, scales = fp8_quantize(torch.randn(batch, n, dim, generator=g) * 3)
    return codes.view(torch.uint8).to(device), scales.squeeze(-1).to(device)


def queries(batch, heads=8, dim=128, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, dim, generator=g).to(device),
            (torch.rand(batch, heads, generator=g) * heads**-0.5 * dim**-0.5).to(device))


def test_paged_cache_holds_each_request_page_by_page():
    keys, scales = fp8_keys(3, 192)
    cache, table = deepgemm.paged_cache(keys, scales)
    assert cache.shape == (9, 64, 1, 132) and cache.dtype == torch.uint8 and table.tolist()[2] == [6, 7, 8]
    page = cache[table[1, 2]].reshape(-1)  # request 1, keys 128..191
    assert torch.equal(page[: 64 * 128].view(64, 128), keys[1, 128:192])
    assert torch.equal(page[64 * 128 :].view(torch.float32), scales[1, 128:192])
    with pytest.raises(ValueError, match="multiple of the page size 64"):
        deepgemm.paged_cache(keys[:, :100], scales[:, :100])


def test_references_are_the_core_score_with_fp8_queries_masked_past_each_length():
    keys, scales = fp8_keys(2, 256)
    q, w = queries(2)
    lengths = torch.tensor([256, 77])
    got = deepgemm.paged_logits_reference(keys, scales, lengths, q, w, 256)
    q8 = q.to(torch.float8_e4m3fn).float()
    for b in range(2):
        exact = indexer_scores(q8[b : b + 1], fp8_dequantize(keys[b].view(torch.float8_e4m3fn), scales[b, :, None]),
                               w[b : b + 1])[0]
        n = int(lengths[b])
        torch.testing.assert_close(got[b, :n], exact[:n], rtol=1e-5, atol=1e-6)
        assert torch.isinf(got[b, n:]).all()
    prefill = deepgemm.prefill_logits_reference(keys[0], scales[0], q, w, torch.tensor([5, 200]))
    exact = indexer_scores(q8[1:2], fp8_dequantize(keys[0].view(torch.float8_e4m3fn), scales[0, :, None]), w[1:2])[0]
    torch.testing.assert_close(prefill[1, :200], exact[:200], rtol=1e-5, atol=1e-6)
    assert torch.isinf(prefill[0, 5:]).all() and torch.isfinite(prefill[0, :5]).all()


def test_unavailable_says_why():
    reason = deepgemm.unavailable()
    if torch.cuda.is_available() and reason is None:
        pytest.skip("DeepGEMM runs here")
    assert isinstance(reason, str) and reason


needs_deepgemm = pytest.mark.skipif(deepgemm.unavailable() is not None,
                                    reason=f"DeepGEMM cannot run here: {deepgemm.unavailable()}")


def close_rows(got, want):
    """DeepGEMM's relative difference metric (1 - cosine-like similarity) on the finite entries."""
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)
    x, y = got[finite].double(), want[finite].double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


@pytest.mark.gpu
@needs_deepgemm
def test_paged_logits_match_the_core_exact_score():
    keys, scales = fp8_keys(5, 4096, device="cuda")
    q, w = queries(5, heads=64, device="cuda")
    lengths = torch.tensor([4096, 1, 999, 64, 3001], dtype=torch.int32, device="cuda")
    cache, table = deepgemm.paged_cache(keys, scales)
    got = deepgemm.paged_logits(cache, table, lengths, q, w, 4096)
    want = deepgemm.paged_logits_reference(keys, scales, lengths, q, w, 4096)
    assert close_rows(got, want) < 1e-4


@pytest.mark.gpu
@needs_deepgemm
def test_prefill_logits_match_the_core_exact_score():
    keys, scales = fp8_keys(1, 8192, device="cuda")
    q, w = queries(300, heads=64, device="cuda")
    lengths = torch.randint(1, 8193, (300,), generator=torch.Generator().manual_seed(2)).to(torch.int32).cuda()
    got = deepgemm.prefill_logits(keys[0], scales[0], q, w, lengths)
    want = deepgemm.prefill_logits_reference(keys[0], scales[0], q, w, lengths)
    assert close_rows(got, want) < 1e-4
