"""Prefill IVF candidate lists on Triton: for each query of a chunk, the key positions its exact
scoring reads (sinks, the open window, then the members of the best-routed clusters up to a budget).

:func:`ivf_candidates_reference` is the spec (rank the clusters, fill the budget in rank order, the
last cluster cut); :func:`ivf_candidates` builds the same set per query in one launch (a weighted k-th
search instead of a sort; slots in cluster order), with int32 positions for the scoring kernels. The
jit code is in :mod:`dsaindex.kernels.ivf_select_kernel`.
"""

from __future__ import annotations

import torch

from dsaindex.kernels import checks


def ivf_candidates_reference(scores: torch.Tensor | None, positions: torch.Tensor, starts: torch.Tensor | None,
                             order: torch.Tensor | None, upto: int, sinks: int, budget: int) -> torch.Tensor:
    """[Q, budget] int64 candidate positions (-1 = unused) of queries at ``positions`` [Q].

    Keys ``[0, upto)`` are clustered: cluster ``c`` holds ``order[starts[c]:starts[c + 1]]``, routed by
    ``scores`` [Q, C] (None, or C = 0: nothing is clustered yet). The first ``sinks`` keys and the open
    window ``[max(upto, sinks), position]`` take the first slots (the newest ``budget`` of them if they
    alone overflow); the members of clusters in descending score order fill the rest, the last cluster
    cut at the budget."""
    dev = positions.device
    visible = positions.long() + 1
    n_sink = visible.clamp(max=sinks)
    open_lo = max(upto, sinks)
    n_open = (visible - open_lo).clamp_min(0)
    reserved = n_sink + n_open
    slot = torch.arange(budget, device=dev)[None, :]
    i = slot + (reserved - budget).clamp_min(0)[:, None]  # index into [sinks, open window]
    table = torch.where(i < n_sink[:, None], i, open_lo + i - n_sink[:, None])
    table = table.masked_fill(i >= reserved[:, None], -1)
    if scores is None or starts is None or starts.numel() <= 1:
        return table
    sizes = starts.diff()
    ranked = scores.argsort(dim=1, descending=True)
    ranked_sizes = sizes[ranked]
    cum = ranked_sizes.cumsum(1)
    t = (slot - reserved[:, None]).clamp_min(0)
    r = torch.searchsorted(cum, t.contiguous(), right=True)
    inside = (slot >= reserved[:, None]) & (r < ranked.shape[1])
    r = r.clamp(max=ranked.shape[1] - 1)
    c = ranked.gather(1, r)
    offset = t - (cum.gather(1, r) - ranked_sizes.gather(1, r))
    members = order[(starts[c] + offset).clamp(max=order.numel() - 1)]
    return torch.where(inside, members, table)


def ivf_candidates(scores: torch.Tensor | None, positions: torch.Tensor, starts: torch.Tensor | None,
                   order: torch.Tensor | None, upto: int, sinks: int, budget: int,
                   max_size: int | None = None) -> torch.Tensor:
    """:func:`ivf_candidates_reference` in one Triton launch: [Q, budget] int32, the same set of positions
    per query (ties between equally scored clusters aside), in cluster order. ``max_size``: the largest
    cluster (computed from ``starts`` if not given: a host synchronization). At most 16384 clusters.
    Raises ``ValueError`` on an input of the wrong dtype, shape or device."""
    import triton

    from dsaindex.kernels.ivf_select_kernel import ivf_candidates_kernel

    checks.rank("positions", positions, 1, "Q")
    checks.at_least("budget", budget, 1)
    q = positions.shape[0]
    dev = positions.device
    clustered = scores is not None and starts is not None and starts.numel() > 1
    n_clusters = starts.numel() - 1 if clustered else 0
    if clustered:
        checks.shape("scores", scores, (q, n_clusters), "Q, C")
        checks.dtype("scores", scores, torch.float32)
        checks.at_most("clusters", n_clusters, 16384, "one program holds a query's cluster scores")
        checks.same_device(scores=scores, positions=positions, starts=starts, order=order)
    else:  # reserved slots only: the kernel reads no cluster
        scores = torch.empty(q, 1, dtype=torch.float32, device=dev)
        starts = torch.zeros(2, dtype=torch.long, device=dev)
        order = torch.zeros(1, dtype=torch.long, device=dev)
    out = torch.empty(q, budget, dtype=torch.int32, device=dev)
    if q == 0:
        return out
    c_pad = max(16, triton.next_power_of_2(max(1, n_clusters)))
    if max_size is None:
        max_size = int(starts.diff().max()) if clustered else 1
    pick = torch.empty(q, c_pad * 3, dtype=torch.int32, device=dev)
    ivf_candidates_kernel[(q,)](
        scores.contiguous(), positions.long().contiguous(), starts.long().contiguous(), order.long().contiguous(),
        out, pick, n_clusters, upto, sinks, budget, C_PAD=c_pad, BLOCK_S=1024,
        SIZE_PAD=max(16, triton.next_power_of_2(max(1, max_size))), num_warps=8 if c_pad >= 4096 else 4)
    return out
