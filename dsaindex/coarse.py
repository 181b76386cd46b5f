"""Rules of coarse-to-fine selection shared by the evaluation, the runtime and the kernels' references.

LeanSparse's miss filter (§5): of the top-C candidates by coarse score, a candidate that is not in the
device cache (a miss) is read from the host only when its coarse score reaches the k-th largest
candidate score minus one sample standard deviation of the candidates' scores; cache hits are always
kept. The kernel :func:`dsaindex.kernels.decode_plan.decode_plan` applies the same rule in one launch.
"""

from __future__ import annotations

import torch


def miss_filter_keep(cand_scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """Candidates the miss filter keeps (before cache hits are added back).

    Parameters
    ----------
    cand_scores : [B, C] float32 coarse scores of each row's candidates, sorted descending
    valid : [B, C] bool, False for empty candidate slots (their scores are ignored)
    k : keys the step selects

    Returns
    -------
    [B, C] bool. A row with fewer than ``k`` candidates has a k-th score of -inf and keeps all its
    valid ones; the standard deviation is the sample one over the valid candidates.
    """
    c = cand_scores.shape[1]
    n_valid = valid.sum(1, keepdim=True).clamp_min(2)
    mean = torch.where(valid, cand_scores, torch.zeros_like(cand_scores)).sum(1, keepdim=True) / n_valid
    var = (torch.where(valid, cand_scores - mean, torch.zeros_like(cand_scores)) ** 2).sum(1, keepdim=True)
    std = (var / (n_valid - 1)).sqrt()
    kth = cand_scores[:, min(k, c) - 1 : min(k, c)]
    return valid & (cand_scores >= kth - std)
