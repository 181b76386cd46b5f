"""Rules of coarse-to-fine selection shared by the evaluation, the runtime and the kernels' references.

LeanSparse's miss filter (§5): of the top-C candidates by coarse score, a candidate that is not in the
device cache (a miss) is read from the host only when its coarse score reaches the k-th largest
candidate score minus one sample standard deviation of the candidates' scores; cache hits are always
kept. The width of that margin, in standard deviations, is a parameter here (``width``): a wider margin
fetches more misses and loses less recall. LeanSparse's 1 lost 0.72 points of warm-cache recall at
118K-token prefixes of the reference checkpoint (OPQ32, C=2048; 0.06 at 12K); 1.5, the default, lost
0.09 there while fetching 28% of the candidates per step, against 33% with no filter
(docs/results.md, warm-cache decode recall). The kernel :func:`dsaindex.kernels.decode_plan.decode_plan`
applies the same rule in one launch. (torch is imported where it is used: the CLI reads the default
width without loading it.)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# stage 1 of a decode step keeps PREFILTER x C keys for the full coarse score: at 114K prefixes 2 loses 2.1-2.2
# points of recall against 4 (H200, OPQ32 and RQ32 warm replays, docs/results.md), so 4 everywhere by default
PREFILTER = 4
FILTER_WIDTH = 1.5  # the margin below the k-th coarse score, in standard deviations (LeanSparse: 1)
# decode steps with at most this many live requests read their candidates' exact keys straight from the host
# store, with no device cache or miss filter (``PQDecodeGroup(direct_upto=...)``; ``bench decode`` measures it)
DIRECT_UPTO = 2  # H200, 1M keys: faster at 1 and 2 requests, even at 4, slower at 8 (bench decode)
# the held-out recall of the exact top-k each decode layer must reach when its C is chosen from its bundle's
# measured recall (``dsaindex serve --candidates auto``; ``dsaindex.runtime.serving.candidates_for_recall``)
RECALL_TARGET = 0.995
# the engine plugins' exact path: a decode step of B requests whose longest has N keys is scored exactly (the
# engine's own DeepGEMM logits + top-k) when B x (N - PAGED_EXACT_OFFSET x the stage-1 width) is at most
# PAGED_EXACT_BELOW. The codes' step costs each request a fixed part that grows with its stage 1 (P x C keys
# ranked, decoded, rescored) and saves a share of every key's bytes. Read off the H200 grids of `bench paged
# --exact-below 0` at C = 4,096 / 4 x C, C = 2,048 / 16 x C and C = 4,096 / 8 x C, N in 64K-1M, B in 1-64: the
# codes win at 8 x 1M and 32 x 512K with a 16K stage 1, lose at 8 x 512K and 64 x 256K; with a 32K stage 1 they
# lose up to 64 x 256K and tie at 8 x 1M; every step of one request is faster exactly. Since stage 2 keeps
# its candidates by score bins at small B (``PagedCacheSelector(top_c="auto")``, no top-C kernel),
# the codes' step wins from 3 x 1M and 64 x 256K (16K stage 1; `bench paged --top-c bins,topk`), so the bound
# came down from 5M to 2.25M. Both paths timed at every point of B in 1-64 x N in 256K-1M (`bench paged
# --exact-below 1T`, H200, docs/results/bench_paged_exact_rule_p{4,8}_fused_h200.json): with a 16K stage 1 the
# codes win at 2 x 1M, 8 x 512K and 64 x 256K and lose at 1 x 1M, 4 x 512K (by 2%) and 32 x 256K; with a 32K
# stage 1 they win at 4 x 1M and 32 x 512K and lose at 2 x 1M, 16 x 512K and every B at 256K. An offset of 14
# stage-1 widths puts every one of those points on its faster side (12 and 2.25M sent 2 x 1M to the exact path
# at 0.99x where the codes gave 1.06x). With stage 2's boundary in a launch of its own the codes also win at
# 4 x 512K (16K stage 1: 0.126 ms against 0.132) and tie DeepGEMM at 2 x 1M (32K: 0.128 against 0.131 exact),
# while 2 x 512K, 32 x 256K and 16 x 512K (32K) stay exact: a bound of 1,088K keys
# (docs/results/bench_paged_defaults_boundary_h200.json)
PAGED_EXACT_BELOW = 17 << 16
PAGED_EXACT_OFFSET = 14
# where C grows by length (``DSAINDEX_LONG_PREFIX=grow``) a request's share of the codes' step grows with its
# growth g: stage 2 scores g x the stage-1 width by score bins at any batch, while stage 1 still scans every key
# once. The offset of a grown step is (PAGED_GROWN_OFFSET x g + PAGED_GROWN_EXTRA x (g - 1)) stage-1 widths.
# History: +1.5 with the Triton stage 2 (H200); -2 once the CUDA stage 2 cut the grown step by a third (H100);
# -12 (on an offset of 14) once stage 2's operands took one launch (H100,
# docs/results/paged_rule_fused_operands_h100.json). With the final top-k spread over programs for up to 32
# requests (kernels.topk.RADIX_UP_TO_ROWS) the codes' step lost another 17-29 us a step, and both paths were timed
# on the H200, where DeepGEMM gains most on the codes' step (bench paged --exact-below 1T, C = 4,096, 4 x C,
# band 128K; docs/results/paged_rule_radix_topk_h200.json): the codes win at 2 x 1M (1.07x), 8 x 512K (1.06x) and
# 32 x 256K (1.04x), lose at 1 x 1M (0.84x-0.86x) and 4 x 512K (0.95x). One offset for every g cannot hold both
# 4 x 512K exact and 32 x 256K by the codes (14 g + x (g - 1) needs x >= -13.7 for the first, x < -14.1 for the
# second), so a grown step has an offset of its own: 9 g - 4.5 (g - 1) is 13.5 widths at 256K (codes from 28
# requests) and 22.5 at 512K and 1M (exact up to 7 x 512K and 1 x 1M). On the H100 the codes win further down
# (1.04x-1.26x at 16-28 x 256K and 5-7 x 512K, docs/results/paged_rule_radix_topk_h100.json): the rule keeps
# the H200's sides, where the exact path is the harder one to beat. Within the band (g = 1) the grown offset
# of 9 widths, like 14, leaves every step exact at a 128K band.
PAGED_GROWN_OFFSET = 9
PAGED_GROWN_EXTRA = -4.5
# the fold scan's stage 1 (``stage1="folds"``) costs a step a fixed part the codes' does not: its operands (the
# heads grouped and folded, one Triton program a request, ~12 us at any batch with tf32 k-means), a sampling launch
# and its threshold. On the H100 at C = 4,096, P = 1, band 128K (docs/results/paged_folds_p1_tf32_h100.json) the
# folds' step is 0.110 + 0.0216 B ms at 1M keys against DeepGEMM's 0.058 + 0.0525 B (even at 1.7 requests, 1.65M
# keys), and 0.105 + 0.0069 B ms at 256K against 0.057 + 0.0133 B (even at 7.5 requests, 1.53M keys). A folds
# step's exact-path bound is DSAINDEX_EXACT_BELOW plus this many keys (the fixed part in keys DeepGEMM reads in its
# time); its offsets are the codes' (stage 2 is the same kernels).
PAGED_FOLDS_EXTRA_BELOW = 2 << 18
# what one decode query's served step costs at 1M keys with C grown past a 128K band, for ranking operating points
# of different stage 1s against each other: stage 1's scan of every key by what it scores, plus stage 2's share
# per key of its stage-1 width P x C, C as grown at 1M (8 x past COST_BAND, up to what the final top-k's one program
# holds: runtime.paged_select.growth_limit, 16,384 keys for a C that is a power of two). Read off the per-query
# medians of `bench paged --batches 32 --keys 1048576 --candidates 4096 --grow-band 131072 --exact-below 0` on the
# H100 (CUDA graphs): the codes at P = 1, 2, 4 take 18.6, 20.4, 23.8 us, the folds at P = 1, 2 26.6, 28.6 us
# (docs/results/paged_grown_stage1_*_h100.json); with the operands' k-means in tf32 the folds at P = 1 took 24.7 us
# (docs/results/paged_folds_p1_tf32_h100.json). C = 2,048 at P = 4 took 24.1 us
# (docs/results/paged_codes_p4_c2048_rule_h100.json), as C = 4,096 at P = 4: at 1M both grow to 16,384.
STAGE1_SCAN_US = {"codes": 16.9, "folds": 23.0}
STAGE2_US_PER_KEY = 1.06e-4
COST_BAND = 1 << 17  # the band past which C grew in those runs: 8 x at 1M keys


# how many keys a decode step's stage 1 passes to stage 2. The kernels keep every key whose stage-1 score reaches a
# threshold read off strided samples at the rank of STAGE1_OVERSAMPLE x the target P x C
# (:func:`dsaindex.kernels.select.thresholds_from_samples`): 1.5 P x C keys in expectation, a request's count
# spread by about 1 / sqrt(rank), the rank 1.5 P x C x 8,192 / N (14% at P x C = 4,096 of 1M keys); a request of
# at most twice the target keeps every key (its buffer). The torch paths, and the served recall a bundle records
# at training, keep that expected count, the top ``stage1_kept`` keys by the same score, so the recall a server
# is chosen by is the recall its GPU step serves on average.
STAGE1_OVERSAMPLE = 1.5


def stage1_kept(target: int, keys: int) -> int:
    """Keys stage 1 keeps of a request's ``keys`` when it aims at ``target`` (P x C): all of them up to twice the
    target, else ``ceil(STAGE1_OVERSAMPLE x target)``."""
    return keys if keys <= 2 * target else math.ceil(STAGE1_OVERSAMPLE * target)


def stage1_kept_counts(targets: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """:func:`stage1_kept` per request: ``targets`` and ``keys`` [B] integer tensors; int64 [B]."""
    import torch

    targets, keys = targets.long(), keys.long()
    return torch.where(keys <= 2 * targets, keys, torch.ceil(STAGE1_OVERSAMPLE * targets.double()).long())


def step_cost_us(stage1: str, width: int) -> float:
    """The served step's expected device time a query at 1M keys (H100, :data:`STAGE1_SCAN_US`): ``stage1``'s
    scan (``codes`` or ``folds``) and stage 2 over a stage-1 width of ``width`` keys (P x C, C as grown at 1M:
    :func:`dsaindex.runtime.operating_points.expected_step_us` grows it)."""
    return STAGE1_SCAN_US[stage1] + STAGE2_US_PER_KEY * width


# the held-out recall of the exact top-k a prefill layer's IVF budget must reach when the budget is chosen from
# its bundle's recorded recall (``dsaindex serve`` without --ivf-budget)
PREFILL_RECALL_TARGET = 0.95


def check_filter_width(width: float) -> float:
    """``width`` as a float, or ``ValueError`` naming the fix when it is negative or not finite."""
    width = float(width)
    if not (width >= 0.0 and width != float("inf")):
        raise ValueError(f"filter width {width}: the miss filter's margin is a finite number of standard "
                         "deviations, at least 0 (1 is LeanSparse's; turn the filter off to fetch every miss)")
    return width


def miss_filter_keep(cand_scores: torch.Tensor, valid: torch.Tensor, k: int, width: float = FILTER_WIDTH) -> torch.Tensor:
    """Candidates the miss filter keeps (before cache hits are added back).

    Parameters
    ----------
    cand_scores : [B, C] float32 coarse scores of each row's candidates, sorted descending
    valid : [B, C] bool, False for empty candidate slots (their scores are ignored)
    k : keys the step selects
    width : the margin below the k-th score, in standard deviations of the candidates' scores

    Returns
    -------
    [B, C] bool. A row with fewer than ``k`` candidates has a k-th score of -inf and keeps all its
    valid ones; the standard deviation is the sample one over the valid candidates.
    """
    import torch

    c = cand_scores.shape[1]
    n_valid = valid.sum(1, keepdim=True).clamp_min(2)
    mean = torch.where(valid, cand_scores, torch.zeros_like(cand_scores)).sum(1, keepdim=True) / n_valid
    var = (torch.where(valid, cand_scores - mean, torch.zeros_like(cand_scores)) ** 2).sum(1, keepdim=True)
    std = (var / (n_valid - 1)).sqrt()
    kth = cand_scores[:, min(k, c) - 1 : min(k, c)]
    return valid & (cand_scores >= kth - width * std)


def grown_offset_words() -> str:
    """The grown step's exact-path offset in stage-1 widths, as the startup text and settings table say it."""
    sign = "+" if PAGED_GROWN_EXTRA >= 0 else "-"
    return f"({PAGED_GROWN_OFFSET} g {sign} {abs(PAGED_GROWN_EXTRA):g} (g - 1))"
