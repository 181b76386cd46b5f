"""Triton kernel: the int8 stage 2's per-step operands of each request, in one launch (jit code only)."""

import triton
import triton.language as tl


@triton.jit
def round_half_even(x):
    # torch.round: x - floor(x) is exact below 2^23, and |x| <= 127 here
    low = tl.floor(x)
    frac = x - low
    odd = (low - 2.0 * tl.floor(low * 0.5)) != 0.0
    return low + tl.where((frac > 0.5) | ((frac == 0.5) & odd), 1.0, 0.0)


@triton.jit
def int8_operands_kernel(
    q_ptr,  # [B, H, D] bf16 queries
    w_ptr,  # [B, H] float32 head weights
    scale_ptr,  # [D / DSUB] float32: each codebook subspace's scale (its int8 codewords times it are its codewords)
    q8_ptr,  # [B, H, D] int8 out: each head's folded query scaled to 127
    w8_ptr,  # [B, H] float32 out: each head's weight times its scale
    bound_ptr,  # [B] float32 out: sum_h |w_h| |q_h| key_bound, the score bins' scale
    key_bound,
    H: tl.constexpr,
    D: tl.constexpr,
    DSUB: tl.constexpr,
):
    # one program a request: the arithmetic of pq_stage2_cuda.int8_operands_reference, in its order, where that
    # was about twenty torch launches of a few microseconds each
    b = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, H)
    dims = tl.arange(0, D)
    at = b * H * D + heads[:, None] * D + dims[None, :]
    q = tl.load(q_ptr + at).to(tl.float32)
    folded = q * tl.load(scale_ptr + dims // DSUB)[None, :]
    tau = tl.math.div_rn(tl.maximum(tl.max(tl.abs(folded), axis=1), 1e-30), 127.0)  # [H]
    r = round_half_even(tl.math.div_rn(folded, tau[:, None]))
    r = tl.minimum(tl.maximum(r, -127.0), 127.0)
    tl.store(q8_ptr + at, r.to(tl.int8))
    w = tl.load(w_ptr + b * H + heads)
    tl.store(w8_ptr + b * H + heads, w * tau)
    norms = tl.sqrt(tl.sum(q * q, axis=1))
    tl.store(bound_ptr + b, tl.maximum(tl.sum(tl.abs(w) * norms, axis=0) * key_bound, 1e-30))
