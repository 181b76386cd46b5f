"""Served recall of stage-1 scores the runtime does not ship, through ``dsaindex bench frontier`` on the torch
reference path (stage 2, its bins and the exact rescoring as served; not part of the package).

``VARIANT=... python3 tools/stage1_variants.py bench frontier --store STORE --artifacts BUNDLE ...``, VARIANT one of:

- ``codes``: stage 1 as shipped (the keys' codes; the baseline of the same run's path);
- ``groups``: the runtime's ``stage1="groups"`` (group codes, each group's mean of equally weighted centroids),
  here on the reference path: a check of the tool against ``bench frontier --stage1 groups``;
- ``weighted``: group codes (:func:`~dsaindex.pq.group_centroids`), the groups' means weighted by how often the
  request's codes use each centroid (the runtime's ``stage1="groups"`` weighs them equally);
- ``bound``: each group scored by its best centroid (an upper bound of the codes' score) instead of its mean;
- ``pq16``: a PQ16 code of its own (plain k-means, 256 centroids on each pair of the codes' subspaces, trained on
  the first request's decoded keys), the bytes a group code has;
- ``cascade``: group codes keep ``WIDEN`` (default 2) x the stage-1 width, the codes' score keeps the width
  among those (a three-stage step);
- ``folds``: the codes, scored by ``FOLDS`` (default 2) folded queries instead of one, each the weighted sum of
  a group of heads (:func:`head_groups` by ``GROUPING``, k-means in ``ROUNDS`` rounds, default 10), a ReLU on
  each: ``sum_g W_g relu(s_g / W_g) + LEAK sum_g s_g``, ``W_g`` the group's summed weight (``LEAK``, default
  0.05, orders the keys every fold scores below zero). ``FOLDS=64`` is the full ReLU score of the decoded keys,
  the bound of any fold.

The numbers in docs/results.md ("Stage 1 on 16 bytes a key") came from it."""

import os
import sys

import torch

from dsaindex.kernels import pq_select
from dsaindex.kernels import select as select_kernels
from dsaindex.pq import group_centroids

VARIANTS = ("codes", "groups", "weighted", "bound", "pq16", "cascade", "folds")
VARIANT = os.environ.get("VARIANT", "codes")
WIDEN = float(os.environ.get("WIDEN", "2"))
FOLDS = int(os.environ.get("FOLDS", "2"))
GROUPING = os.environ.get("GROUPING", "kmeans")
LEAK = float(os.environ.get("LEAK", "0.05"))
ROUNDS = int(os.environ.get("ROUNDS", "10"))
shipped = pq_select.pq_linear_scores_reference
_made: dict = {}


def kmeans(x: torch.Tensor, k: int = 256, iters: int = 12, seed: int = 0) -> torch.Tensor:
    """x [S, N, d] -> k centroids of each slice [S, k, d] (Lloyd's iterations)."""
    g = torch.Generator().manual_seed(seed)
    c = x[:, torch.randperm(x.shape[1], generator=g)[:k].to(x.device)].clone()
    for _ in range(iters):
        a = torch.cdist(x, c).argmin(2)
        sums = torch.zeros_like(c).scatter_add_(1, a[:, :, None].expand_as(x), x)
        n = torch.zeros(c.shape[:2], device=x.device).scatter_add_(1, a, torch.ones(a.shape, device=x.device))
        c = torch.where(n[:, :, None] > 0, sums / n.clamp_min(1)[:, :, None], c)
    return c


def _groups(codes: torch.Tensor, codebooks: torch.Tensor, weighted: bool) -> tuple[torch.Tensor, torch.Tensor]:
    key = (codebooks.data_ptr(), weighted)
    if key not in _made:
        m, k, _ = codebooks.shape
        flat = codes.reshape(-1, m).long().T.contiguous()
        use = torch.zeros(m, k, device=codes.device).scatter_add_(1, flat, torch.ones(flat.shape, device=codes.device))
        _made[key] = group_centroids(codebooks, use + 1 if weighted else None)
    return _made[key]


def cosine_kmeans(x: torch.Tensor, k: int) -> torch.Tensor:
    """Cluster of each of the rows ``x`` [n, d] among ``k`` by ``ROUNDS`` rounds of k-means on their directions,
    started from rows spread over ``x``: [n] int64."""
    x = torch.nn.functional.normalize(x.float(), dim=1)
    c = x[torch.linspace(0, len(x) - 1, min(k, len(x))).long()]
    for _ in range(ROUNDS):
        a = (x @ c.T).argmax(1)
        sums = torch.zeros_like(c).index_add_(0, a, x)
        c = torch.where(sums.norm(dim=1, keepdim=True) > 0, torch.nn.functional.normalize(sums, dim=1), c)
    return a


def head_groups(queries: torch.Tensor, head_weights: torch.Tensor, g: int) -> torch.Tensor:
    """[B, H] group of each head of each request, as ``GROUPING`` says: ``signed`` (the positive-weight heads in the
    first g / 2 groups and the others in the rest, each side by :func:`cosine_kmeans`), ``signed-contiguous`` (each
    side in the heads' order), ``contiguous`` (the heads' order), else :func:`cosine_kmeans` of all heads."""
    b, h, _ = queries.shape
    if g >= h or GROUPING == "contiguous":
        return (torch.arange(h, device=queries.device) * g // h)[None, :].expand(b, h)
    out = torch.empty(b, h, dtype=torch.long, device=queries.device)
    signed = GROUPING.startswith("signed")
    half = max(1, g // 2) if signed else g
    for i in range(b):
        every = torch.ones(h, dtype=torch.bool, device=out.device)
        sides = ((head_weights[i] > 0, 0), (head_weights[i] <= 0, half)) if signed else ((every, 0),)
        for side, base in sides:
            heads = side.nonzero().flatten()
            if len(heads) == 0:
                continue
            if GROUPING == "signed-contiguous":
                out[i, heads] = base + torch.arange(len(heads), device=out.device) * half // len(heads)
            else:
                out[i, heads] = base + cosine_kmeans(queries[i, heads], half)
    return out


def folded_scores(codes, queries, head_weights, codebooks, g: int) -> torch.Tensor:
    """``sum_g W_g relu(s_g / W_g) + LEAK sum_g s_g`` of the codes: s_g the group's folded query against the decoded
    key, W_g the group's summed weight (so ``relu(s_g)`` where W_g > 0, ``min(s_g, 0)`` where not)."""
    b, n, m = codes.shape
    group = head_groups(queries, head_weights, g)  # [B, H]
    one_hot = torch.nn.functional.one_hot(group, g).float()  # [B, H, G]
    out = torch.zeros(b, n, device=codes.device)
    for i in range(g):
        w = head_weights.float() * one_hot[:, :, i]
        part = shipped(codes, queries, w, codebooks)
        positive = (w.sum(1) > 0)[:, None]  # a head's weight may be negative
        out += torch.where(positive, part.clamp_min(0), part.clamp_max(0)) + LEAK * part
    return out


def scores(codes: torch.Tensor, queries: torch.Tensor, head_weights: torch.Tensor,
           codebooks: torch.Tensor, variant: str = VARIANT) -> torch.Tensor:
    """Stage-1 scores [B, N] of ``codes`` [B, N, M] under ``variant`` (the shipped function's arguments)."""
    if variant in ("codes", "cascade"):
        return shipped(codes, queries, head_weights, codebooks)
    if variant == "folds":
        return folded_scores(codes, queries, head_weights, codebooks, FOLDS)
    m, k, d = codebooks.shape
    b, n, _ = codes.shape
    at = torch.arange(m, device=codes.device)[None, None, :]
    if variant == "pq16":
        x = codebooks[at, codes.long()].reshape(b * n, m // 2, 2 * d).transpose(0, 1).contiguous()
        key = (codebooks.data_ptr(), "pq16")
        if key not in _made:
            _made[key] = kmeans(x[:, torch.randperm(x.shape[1], generator=torch.Generator().manual_seed(1))[:60000].to(x.device)])
        books = _made[key]
        code16 = torch.cat([torch.cdist(x[:, i : i + 65536], books).argmin(2) for i in range(0, x.shape[1], 65536)], 1)
        lut = pq_select.folded_lookup_tables(queries, head_weights, books)
        return lut.unsqueeze(1).expand(b, n, m // 2, k).gather(3, code16.T.reshape(b, n, m // 2, 1)).squeeze(-1).sum(-1)
    assign, means = _groups(codes, codebooks, weighted=variant == "weighted")
    if variant == "bound":
        lut = pq_select.folded_lookup_tables(queries, head_weights, codebooks)
        member = torch.nn.functional.one_hot(assign, means.shape[1]).bool()
        lut = lut[:, :, :, None].masked_fill(~member[None], float("-inf")).amax(2)
    else:
        folded = torch.einsum("bh,bhd->bd", head_weights.float(), queries.float()).view(b, m, d)
        lut = torch.einsum("bmd,mgd->bmg", folded, means)
    group = assign[at, codes.long()]
    return lut.unsqueeze(1).expand(b, n, m, lut.shape[2]).gather(3, group.unsqueeze(-1)).squeeze(-1).sum(-1)


def cascade_topc(codes, lengths, queries, head_weights, codebooks, c):
    """Stage 1 in two passes: the group codes keep WIDEN x ``c`` rows, the codes' own score ``c`` of them."""
    _, rows = select_kernels.topk_of_prefixes(scores(codes, queries, head_weights, codebooks, "groups"),
                                              lengths, int(WIDEN * c))
    full = shipped(codes, queries, head_weights, codebooks)
    n = full.shape[1]  # the empty slots (-1) mark a column past the keys
    kept = full.new_zeros(full.shape[0], n + 1, dtype=torch.bool).scatter_(1, torch.where(rows >= 0, rows, n),
                                                                          True)[:, :n]
    return select_kernels.topk_of_prefixes(full.masked_fill(~kept, float("-inf")), lengths, c)


def reference_step(step):
    """``served_step`` on the torch reference path, whatever the device."""
    def run(*args, **kwargs):
        args = list(args)
        if len(args) > 10:
            args[10] = False
        else:
            kwargs["use_triton"] = False
        return step(*args, **kwargs)
    return run


def main() -> None:
    if VARIANT not in VARIANTS:
        raise SystemExit(f"VARIANT={VARIANT}: want one of {', '.join(VARIANTS)}")
    import dsaindex.pipelines.bench.decode as decode
    import dsaindex.runtime.pq_batch as pq_batch
    from dsaindex.cli import main as cli

    pq_select.pq_linear_scores_reference = scores
    if VARIANT == "cascade":
        pq_batch.pq_linear_topc_reference = cascade_topc
    decode.served_step = reference_step(decode.served_step)
    sys.argv = ["dsaindex", *sys.argv[1:]]
    cli()


if __name__ == "__main__":
    main()
