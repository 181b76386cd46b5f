"""Stage 2 of a decode step at a fixed and a grown C (32 x 1M keys, stage 1 aiming at 16K and 64K keys, random
codes): its scores alone, with score bins (one histogram atomic a candidate), with one atomic per distinct bin of a
tile (``dedup``), and both where every score crowds into a few bins (a bound 10^4 too wide). Medians of 30 calls
(a GPU; not part of the package). ``python3 tools/stage2_bins.py [OUT.json]``; ``SMALL=1`` with
``TRITON_INTERPRET=1`` checks the script on a CPU at a small size. The numbers in docs/results.md ("C grown with
the prefix past the measured band") came from it."""

import json
import os
import sys

import torch

from dsaindex.kernels.pq_select import (
    BIN_COUNT,
    _stage1,
    decoded_key_bound,
    pq_candidate_bins,
    pq_candidate_scores,
)
from dsaindex.pipelines.bench.timing import event_median_ms

SMALL = os.environ.get("SMALL") == "1"


def median_ms(fn, reps: int = 30) -> float:
    """CUDA-event median of ``fn`` (one untimed call first); on the CPU check, one call and no time."""
    if SMALL:
        fn()
        return 0.0
    return event_median_ms(fn, reps)


def stage2_calls(state: dict, band: int, c: int, scratch: torch.Tensor) -> dict:
    """The calls timed at one C: name -> a call of stage 2 over that C's stage-1 rows."""
    codes, q, w, cb16, lengths, kb = (state[k] for k in ("codes", "q", "w", "cb16", "lengths", "kb"))
    rows1, counts1 = state["rows1"], state["counts1"]
    grow = (band, 4) if band else (0, 1)

    def bins(bound: float, dedup: bool):
        return lambda: pq_candidate_bins(codes, rows1, counts1, q, w, cb16, bound, c, c + 256, scratch,
                                         lengths=lengths, grow=grow, dedup=dedup)

    return {"scores": lambda: pq_candidate_scores(codes, rows1, q, w, cb16, counts=counts1, block_n=128),
            "bins": bins(kb, False), "bins_crowded": bins(kb * 1e4, False),
            "bins_dedup": bins(kb, True), "bins_crowded_dedup": bins(kb * 1e4, True)}


def main() -> None:
    dev = "cpu" if SMALL else "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    b, n, m, k, h, d = (2, 8192, 32, 256, 64, 128) if SMALL else (32, 1 << 20, 32, 256, 64, 128)
    c1, c, band = (256, 64, 2048) if SMALL else (16384, 4096, 1 << 17)
    cb = torch.randn(m, k, d // m, device=dev, generator=g) * 0.3
    state = {"codes": torch.randint(0, k, (b, n, m), device=dev, generator=g, dtype=torch.int32).to(torch.uint8),
             "q": torch.randn(b, h, d, device=dev, generator=g).to(torch.bfloat16),
             "w": torch.rand(b, h, device=dev, generator=g) * 0.1,
             "lengths": torch.full((b,), n, dtype=torch.int32, device=dev),
             "kb": decoded_key_bound(cb), "cb16": cb.to(torch.bfloat16)}
    norms = cb.norm(dim=2).amax(dim=1)
    scratch = torch.zeros(b, BIN_COUNT + 4, dtype=torch.int32, device=dev)
    res = {}
    for name, grown in (("fixed", 0), ("grown", band)):
        state["rows1"], state["counts1"] = _stage1(state["codes"], state["lengths"], state["q"], state["w"], cb, c1,
                                                   norms, None, n, None, "auto", (grown, 4) if grown else (0, 1))
        res[f"{name}_stage1_kept_mean"] = float(state["counts1"].float().mean())
        width = c * (4 if grown else 1)
        for tag, call in stage2_calls(state, grown, width, scratch).items():
            res[f"{name}_{tag}_ms"] = median_ms(call)
    text = json.dumps(res, indent=1)
    print(text)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
