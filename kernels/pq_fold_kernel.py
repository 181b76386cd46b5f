"""The fold scan's operands in one Triton launch (:func:`dsaindex.kernels.pq_fold_cuda.fold_operands`): a
request's heads grouped by sign and direction, folded, scaled to int8, in one program a request instead of
about thirty torch launches."""

import triton
import triton.language as tl

from dsaindex.kernels.pq_stage2_kernel import round_half_even


@triton.jit
def fold_operands_kernel(
    q_ptr,  # [B, H, D] bf16 queries
    w_ptr,  # [B, H] float32 head weights
    scale_ptr,  # [D / DSUB] float32: each codebook subspace's scale
    q8_ptr,  # [B, G, D] int8 out: the folded queries, each scaled to 127
    slopes_ptr,  # [B, G, 2] float32 out: each fold's slope above and below zero, times its scale
    group_ptr,  # [B, H] int32 out: each head's fold
    H,
    leak,
    HP: tl.constexpr,  # H padded to a power of two, at least 16 (a tensor-core side)
    D: tl.constexpr,
    DSUB: tl.constexpr,
    G: tl.constexpr,
    ROUNDS: tl.constexpr,
    KMEANS: tl.constexpr = "ieee",  # the k-means products' precision; the folds themselves in full float32
):
    # the arithmetic of pq_fold_cuda.head_groups and fold_operands, in their order; the k-means products on the
    # tensor cores in ``KMEANS`` (pq_fold_cuda.OPERANDS_PRECISION; tf32: a head's fold may differ from the float32
    # grouping at a near tie), the folded queries in full float32 ("ieee")
    b = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HP)
    dims = tl.arange(0, D)
    folds = tl.arange(0, G)
    live = heads < H
    q = tl.load(q_ptr + b * H * D + heads[:, None] * D + dims[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    w = tl.load(w_ptr + b * H + heads, mask=live, other=0.0)
    x = q / tl.maximum(tl.sqrt(tl.sum(q * q, axis=1)), 1e-12)[:, None]  # torch's normalize
    positive = (w > 0) & live
    negative = (w <= 0) & live
    HALF: tl.constexpr = G // 2
    on_positive = folds < HALF  # [G]: the positive side's folds
    # the starting heads: on each side, rank floor(i (n - 1) / (HALF - 1)) among the side's heads
    rank = tl.where(positive, tl.cumsum(positive.to(tl.int32), axis=0), tl.cumsum(negative.to(tl.int32), axis=0)) - 1
    n_pos = tl.sum(positive.to(tl.int32), axis=0)
    n_neg = tl.sum(negative.to(tl.int32), axis=0)
    i = tl.where(on_positive, folds, folds - HALF)
    want = i * tl.maximum(tl.where(on_positive, n_pos, n_neg) - 1, 0) // tl.maximum(HALF - 1, 1)  # [G]
    same_side = (on_positive[:, None] == positive[None, :]) & live[None, :]  # [G, HP]
    start = (same_side & (rank[None, :] == want[:, None])).to(tl.float32)
    centers = tl.dot(start, x, input_precision=KMEANS)  # [G, D]
    allowed = positive[:, None] == on_positive[None, :]  # [HP, G]
    member = tl.zeros((HP, G), dtype=tl.float32)
    assign = tl.zeros((HP,), dtype=tl.int32)
    for _ in tl.static_range(ROUNDS):
        sim = tl.where(allowed, tl.dot(x, tl.trans(centers), input_precision=KMEANS), float("-inf"))
        assign = tl.argmax(sim, axis=1).to(tl.int32)
        member = ((assign[:, None] == folds[None, :]) & live[:, None]).to(tl.float32)
        sums = tl.dot(tl.trans(member), x, input_precision=KMEANS)  # [G, D]
        norm = tl.sqrt(tl.sum(sums * sums, axis=1))
        centers = tl.where(norm[:, None] > 0, sums / tl.maximum(norm, 1e-30)[:, None], centers)
    tl.store(group_ptr + b * H + heads, assign, mask=live)
    weighted = q * w[:, None]
    folded = tl.dot(tl.trans(member), weighted, input_precision="ieee") * tl.load(scale_ptr + dims // DSUB)[None, :]
    tau = tl.math.div_rn(tl.maximum(tl.max(tl.abs(folded), axis=1), 1e-30), 127.0)  # [G]
    r = round_half_even(tl.math.div_rn(folded, tau[:, None]))
    r = tl.minimum(tl.maximum(r, -127.0), 127.0)
    tl.store(q8_ptr + b * G * D + folds[:, None] * D + dims[None, :], r.to(tl.int8))
    up = tl.where(on_positive, 1.0 + leak, leak) * tau
    down = tl.where(on_positive, leak, 1.0 + leak) * tau
    tl.store(slopes_ptr + b * G * 2 + folds * 2, up)
    tl.store(slopes_ptr + b * G * 2 + folds * 2 + 1, down)
