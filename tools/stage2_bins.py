"""Stage 2 of a decode step at a fixed and a grown C (32 x 1M keys, stage 1 aiming at 16K and 64K keys, random
codes): its scores alone and with score bins, each by the Triton kernel (one histogram atomic per distinct bin of a
tile) and the CUDA one (codebooks and the histogram in shared memory), and the bins where every score crowds into a
few bins (a bound 10^4 too wide). Medians of 30 calls
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
from dsaindex.kernels.pq_stage2_cuda import compiles, pq_stage2
from dsaindex.pipelines.bench.timing import event_median_ms

SMALL = os.environ.get("SMALL") == "1"


def median_ms(fn, reps: int = 30) -> float:
    """CUDA-event median of ``fn`` (one untimed call first); on the CPU check, one call and no time."""
    if SMALL:
        fn()
        return 0.0
    return event_median_ms(fn, reps)


def stage2_calls(state: dict, band: int, c: int, scratch: torch.Tensor) -> dict:
    """The calls timed at one C: name -> a call of stage 2 over that C's stage-1 rows, by each kernel (Triton;
    the CUDA one where it runs, with its block size varied too)."""
    codes, q, w, cb16, lengths, kb = (state[k] for k in ("codes", "q", "w", "cb16", "lengths", "kb"))
    rows1, counts1 = state["rows1"], state["counts1"]
    grow = (band, 4) if band else (0, 1)

    def bins(bound: float, kernel: str):
        return lambda: pq_candidate_bins(codes, rows1, counts1, q, w, cb16, bound, c, c + 256, scratch,
                                         lengths=lengths, grow=grow, stage2=kernel)

    kernels = ("triton", "cuda") if compiles(codes.device) else ("triton",)
    calls = {}
    for kernel in kernels:
        calls[f"scores_{kernel}"] = lambda k=kernel: pq_candidate_scores(codes, rows1, q, w, cb16, counts=counts1,
                                                                          block_n=128, stage2=k)
        calls[f"bins_{kernel}"] = bins(kb, kernel)
        calls[f"bins_crowded_{kernel}"] = bins(kb * 1e4, kernel)
    if "cuda" in kernels:
        out = torch.empty(rows1.shape, dtype=torch.float32, device=codes.device)
        for per_block in (1024, 4096):
            calls[f"scores_cuda_{per_block}_a_block"] = lambda pb=per_block: pq_stage2(
                codes, rows1, counts1, q, w, cb16, scores=out, per_block=pb)
    return calls


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
        if compiles(state["codes"].device):  # the two kernels' bins and boundaries side by side
            (_, b_t, sel_t), (_, b_c, sel_c) = (
                pq_candidate_bins(state["codes"], state["rows1"], state["counts1"], state["q"], state["w"],
                                  state["cb16"], state["kb"], width, width + 256, scratch, stage2=kernel)
                for kernel in ("triton", "cuda"))
            live = torch.arange(b_t.shape[1], device=dev)[None, :] < state["counts1"][:, None]
            res[f"{name}_bins_equal_share"] = float((b_t == b_c)[live].float().mean())
            res[f"{name}_boundary_bin_most_apart"] = int((sel_t[:, 0] - sel_c[:, 0]).abs().max())
    text = json.dumps(res, indent=1)
    print(text)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
