"""The decode step's exact rescoring (``fp8_gather_scores_paged``) and final top-k (``small_topk``) at a grown C's
shape, by launch: B requests of 1M keys in the engines' paged FP8 layout, 16,448 candidate positions each (C =
16,384 and a 64-key tail), top 2,048. CUDA-graph medians per call in us, and whether each launch gives the same
scores (to 1e-3) / the same top-k as the default's (a GPU; not part of the package). ``python3 tools/gather_sweep.py
[OUT.json]``."""

import json
import sys

import torch
from topk_warps import by_warps, median_us

from dsaindex.kernels.fp8_score import fp8_gather_scores_paged
from dsaindex.kernels.topk import small_topk

N, R, K, D, H = 1 << 20, 16448, 2048, 128, 64


def sweep(b: int) -> list[dict]:
    """Every launch of the gather and the top-k over ``b`` requests."""
    res = []
    g = torch.Generator(device="cuda").manual_seed(b)
    pages = b * N // 64
    cache = torch.randint(0, 120, (pages, 64 * (D + 4)), device="cuda", generator=g, dtype=torch.uint8)
    cache[:, 64 * D:].view(torch.float32).fill_(1.0)  # unit scales
    table = torch.randperm(pages, device="cuda", generator=g).view(b, -1).int()
    pos = torch.randint(0, N, (b, R), device="cuda", generator=g, dtype=torch.int32)
    q = torch.randn(b, H, D, device="cuda", generator=g).bfloat16()
    w = torch.rand(b, H, device="cuda", generator=g)
    want = fp8_gather_scores_paged(cache, table, pos, q, w)
    for block_n, warps in ((64, 4), (128, 4), (128, 8), (256, 8)):
        def gather(block_n=block_n, warps=warps):
            return fp8_gather_scores_paged(cache, table, pos, q, w, block_n=block_n, num_warps=warps)
        same = torch.allclose(gather(), want, rtol=1e-3, atol=1e-3)
        res.append(dict(batch=b, part="gather", block_n=block_n, num_warps=warps, same=same,
                        us=round(median_us(gather), 1)))
        print(res[-1], flush=True)
    res += by_warps(want, K, pos, set(small_topk(want, K, pos)[1][0].tolist()), batch=b, part="top-k")
    return res


def main() -> None:
    res = []
    for b in (8, 32, 64):
        res += sweep(b)
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
