"""The PQ codec of indexer keys: shape, subspace split, score-aware whitening, encode and decode.

A key of D dims is cut into M subspaces of D/M dims; each subspace has K (at most 256) centroids, so a
key becomes M one-byte codes (PQ32 on 128-d keys: 32 bytes instead of the engines' 132). Training
(:mod:`dsaindex.train.codebooks`) produces a :class:`PQCodec`; the runtime, the kernels and the evaluation
encode and decode with the same object, so none of them imports training code.

Score-aware codebooks carry a per-subspace metric ``A_j`` (see :mod:`dsaindex.train.codebooks`); a key is
encoded to the centroid nearest under that metric, which is plain nearest-centroid search after
whitening both sides with the Cholesky factor of ``A_j``.

OPQ codecs carry an orthogonal ``rotation`` R [D, D] learned before PQ (:func:`dsaindex.train.codebooks.train_rotation`):
the codes are of the rotated keys ``k @ R.T``. :meth:`PQCodec.encode` rotates keys first and
:meth:`PQCodec.decode` rotates reconstructions back, so decoded keys live in the original space and score
against raw queries as before. A kernel that scores codes from the codebooks directly (lookup tables, decoded
tiles) rotates the queries instead, once per step (:meth:`PQCodec.rotate_queries`): ``q . k = (q R^T) . (k R^T)``.
:func:`rotate` is the one implementation of that product.

Residual codecs (``PQCodec(residual=True)``, RQ) give each of the M bytes a codebook of whole D-dimensional
codewords instead of a slice of the key: a key is the sum of its M codewords, coded one codebook after
another on what the earlier ones left (:func:`beam_search`, keeping the ``beam`` best partial codes).
``codebooks`` is then [M, K, D], in the keys' own space; a score-aware residual codec carries the full
[1, D, D] metric and encodes under it (:func:`residual_encode`). Its score against a query is still a sum of
M table lookups, so the decode runtime's coarse stages take either form (see
:mod:`dsaindex.kernels.pq_select`); only the page encoder differs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsaindex.errors import DsaIndexError


@dataclass(frozen=True)
class PQSpec:
    """Shape of a product quantizer: ``subspaces`` x ``centroids`` over keys of ``dim`` dims."""

    dim: int
    subspaces: int = 32
    centroids: int = 256

    def __post_init__(self):
        if self.subspaces <= 0 or self.dim % self.subspaces:
            raise DsaIndexError(
                f"Key dim {self.dim} is not divisible by {self.subspaces} subspaces.",
                f"pick --subspaces among the divisors of {self.dim} (e.g. 16, 32, 64 for 128-d keys).",
            )
        if not 2 <= self.centroids <= 256:
            raise DsaIndexError(f"{self.centroids} centroids do not fit 8-bit codes.", "use at most 256 centroids.")

    @property
    def sub_dim(self) -> int:
        return self.dim // self.subspaces

    @property
    def bytes_per_key(self) -> int:
        return self.subspaces  # one uint8 code per subspace

    @classmethod
    def of(cls, codebooks: torch.Tensor) -> PQSpec:
        """The spec of ``codebooks`` [M, K, D/M]."""
        m, k, d = codebooks.shape
        return cls(dim=m * d, subspaces=m, centroids=k)


def split_subspaces(x: torch.Tensor, spec: PQSpec) -> torch.Tensor:
    """[N, D] -> [M, N, D/M] (a copy in fp32)."""
    return x.float().reshape(x.shape[0], spec.subspaces, spec.sub_dim).transpose(0, 1).contiguous()


def whitening(metric: torch.Tensor | None, spec: PQSpec, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-subspace (L^T, L^-T) with ``A_j + eps I = L L^T``; None for the plain (Euclidean) metric."""
    if metric is None:
        return None
    a = metric.double().to(device)
    eye = torch.eye(spec.sub_dim, dtype=torch.float64, device=device)
    scale = a.diagonal(dim1=1, dim2=2).mean(-1).clamp_min(1e-12)
    a = a / scale[:, None, None] + 1e-3 * eye  # normalize each block; regularize rank-deficient ones
    chol = torch.linalg.cholesky(a)  # [M, d, d]
    lt = chol.transpose(1, 2)
    return lt.float(), torch.linalg.inv(lt).float()


def rotate(x: torch.Tensor, rotation: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x`` [..., D] into an OPQ codec's code space: ``x @ rotation.T`` as one [prod(...), D] x [D, D]
    product in ``dtype`` (``rotation`` [D, D], moved to ``x``'s device and ``dtype`` if elsewhere); ``x``
    itself when ``rotation`` is None. No host synchronization and an output shaped by ``x`` alone
    (CUDA-graph safe). The decode runtime rotates its bf16 queries in bf16 with a bf16 rotation: one
    GEMM launch, for the coarse stages only (the exact rescoring reads the raw queries)."""
    if rotation is None:
        return x
    dim = x.shape[-1]
    flat = x.reshape(-1, dim).to(dtype) @ rotation.to(x.device, dtype).t()
    return flat.reshape(x.shape)


def check_rotation(rotation: torch.Tensor, dim: int, tolerance: float = 1e-3) -> None:
    """Refuse a rotation that is not an orthogonal [dim, dim] float matrix with finite entries."""
    fix = ("pass the [D, D] rotation learned with these codebooks (`train_rotation`, stored per layer as the "
           "bundle array 'rotation'), or None for plain PQ.")
    if rotation.dim() != 2 or tuple(rotation.shape) != (dim, dim):
        raise DsaIndexError(f"The PQ rotation has shape {list(rotation.shape)}; the codebooks cover keys of "
                            f"D={dim}, so it must be [{dim}, {dim}].", fix)
    if not rotation.is_floating_point():
        raise DsaIndexError(f"The PQ rotation is {rotation.dtype}; it must be a float matrix.", fix)
    r = rotation.detach().double()
    if not bool(torch.isfinite(r).all()):
        raise DsaIndexError("The PQ rotation holds NaN or inf.", fix)
    error = float((r @ r.t() - torch.eye(dim, dtype=torch.float64, device=r.device)).abs().max())
    if error > tolerance:
        raise DsaIndexError(f"The PQ rotation is not orthogonal (R R^T differs from I by up to {error:.3g}, more "
                            f"than {tolerance:g}): codes of rotated keys would no longer score like the keys.", fix)


def encode(
    keys: torch.Tensor, codebooks: torch.Tensor, metric: torch.Tensor | None = None, block: int = 65536,
    rotation: torch.Tensor | None = None,
) -> torch.Tensor:
    """Nearest centroid per subspace (under ``metric`` if given) of the keys, rotated first by ``rotation``
    [D, D] if given (OPQ: codes of ``keys @ rotation.T``). keys [N, D] -> codes [N, M] uint8."""
    spec = PQSpec.of(codebooks)
    white = whitening(metric, spec, keys.device)
    cb = codebooks.to(keys.device).float()
    if white is not None:
        cb = torch.bmm(cb, white[0].transpose(1, 2))
    cb_sq = (cb * cb).sum(-1).unsqueeze(1)  # [M, 1, K]
    codes = torch.empty(keys.shape[0], spec.subspaces, dtype=torch.uint8, device=keys.device)
    for start in range(0, keys.shape[0], block):
        x = split_subspaces(rotate(keys[start : start + block], rotation), spec)
        if white is not None:
            x = torch.bmm(x, white[0].transpose(1, 2))
        codes[start : start + block] = nearest_centroids(x, cb, cb_sq).t().to(torch.uint8)
    return codes


DISTANCE_BYTES = {"cpu": 8 << 20, "cuda": 2 << 30}  # one block's [M, rows, K] float32 distances


def nearest_centroids(x: torch.Tensor, cb: torch.Tensor, cb_sq: torch.Tensor | None = None) -> torch.Tensor:
    """Index of each row's nearest centroid per subspace: x [M, n, d], cb [M, K, d] -> [M, n] int64
    (``cb_sq``: the centroids' squared norms [M, 1, K], if already at hand).

    The [M, rows, K] distances are made a block of rows at a time, sized for the device: on a CPU a block
    that stays in cache (a few hundred rows at M = 32, K = 256: 16x faster on one core than blocks of 64K
    rows, whose gigabytes of distances are paged in and out at every block), on a GPU large ones."""
    m, n, _ = x.shape
    k = cb.shape[1]
    if cb_sq is None:
        cb_sq = (cb * cb).sum(-1).unsqueeze(1)
    cb_t = cb.transpose(1, 2).contiguous()
    budget = DISTANCE_BYTES["cuda" if x.is_cuda else "cpu"]
    rows = max(1, budget // (m * k * 4))
    if rows >= n:
        return torch.baddbmm(cb_sq, x, cb_t, alpha=-2).argmin(-1)
    out = torch.empty(m, n, dtype=torch.int64, device=x.device)
    for start in range(0, n, rows):
        out[:, start : start + rows] = torch.baddbmm(cb_sq, x[:, start : start + rows], cb_t, alpha=-2).argmin(-1)
    return out


def decode(codes: torch.Tensor, codebooks: torch.Tensor, rotation: torch.Tensor | None = None) -> torch.Tensor:
    """codes [N, M] uint8 -> reconstructed keys [N, D] float32, rotated back to the original space
    (``@ rotation``) when the codes are of rotated keys."""
    m, _, d = codebooks.shape
    cb = codebooks.to(codes.device).float()
    parts = cb[torch.arange(m, device=codes.device).unsqueeze(0), codes.long()]  # [N, M, d]
    out = parts.reshape(codes.shape[0], m * d)
    return out if rotation is None else out @ rotation.to(out.device, torch.float32)


def quantization_mse(keys: torch.Tensor, codebooks: torch.Tensor, codes: torch.Tensor | None = None,
                     rotation: torch.Tensor | None = None) -> float:
    """Mean squared reconstruction error per key (sum over dims), fp32 (codes of the rotated keys when
    ``rotation`` is given; the error is the same in either space)."""
    codes = encode(keys, codebooks, rotation=rotation) if codes is None else codes
    return float(((decode(codes, codebooks, rotation) - keys.float()) ** 2).sum(-1).mean())


def relative_mse(keys: torch.Tensor, codebooks: torch.Tensor, rotation: torch.Tensor | None = None) -> float:
    """Reconstruction MSE over the keys' mean squared norm (0 = perfect)."""
    return quantization_mse(keys, codebooks, rotation=rotation) / max(float((keys.float() ** 2).sum(-1).mean()),
                                                                       math.ulp(1.0))


GROUPS = 16  # groups a subspace's centroids fall in for a 16-byte stage 1: a code's group fills a nibble


def balanced_assign(cost: torch.Tensor) -> torch.Tensor:
    """cost [M, K, G] (item k of problem m placed in group g) -> group of each item [M, K] int64, every group
    taking exactly K / G items. Rounds of proposals: each unplaced item asks for its cheapest group with room,
    and each group keeps the cheapest of those asking, as many as it has room for (at least one item is
    placed a round, so it ends)."""
    m, k, g = cost.shape
    if k % g:
        raise ValueError(f"{k} items do not split into {g} equal groups")
    dev = cost.device
    assign = torch.full((m, k), -1, dtype=torch.long, device=dev)
    room = torch.full((m, g), k // g, dtype=torch.long, device=dev)
    rows = torch.arange(m, device=dev)[:, None]
    span = torch.arange(k, device=dev)[None, :]
    while bool((assign < 0).any()):
        free = assign < 0
        c = cost.masked_fill((room <= 0)[:, None, :], float("inf"))
        pick = torch.where(free, c.argmin(2), g)  # placed items ask for group g: past every real one
        asked = torch.where(free, c.gather(2, c.argmin(2, keepdim=True)).squeeze(2), float("inf"))
        by_cost = asked.argsort(dim=1, stable=True)
        order = by_cost.gather(1, pick.gather(1, by_cost).argsort(dim=1, stable=True))  # by group, then by cost
        grp = pick.gather(1, order)
        counts = torch.zeros(m, g + 1, dtype=torch.long, device=dev).scatter_add_(1, grp, torch.ones_like(grp))
        start = counts.cumsum(1) - counts
        rank = span - start.gather(1, grp)
        take = (grp < g) & (rank < room.gather(1, grp.clamp_max(g - 1)))
        assign[rows.expand(m, k)[take], order[take]] = grp[take]
        room -= torch.zeros(m, g + 1, dtype=torch.long, device=dev).scatter_add_(1, grp, take.long())[:, :g]
    return assign


def group_centroids(codebooks: torch.Tensor, weights: torch.Tensor | None = None, groups: int = GROUPS,
                    iters: int = 25, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each subspace's K centroids in ``groups`` groups of K / groups, by k-means on the centroids with equal
    groups (:func:`balanced_assign`), weighted by ``weights`` [M, K] (how often each code is used; default
    equal). Returns (group of each centroid [M, K] int64, each group's weighted mean [M, groups, d] float32).
    Deterministic for a given ``seed``."""
    m, k, d = codebooks.shape
    cb = codebooks.float()
    w = torch.ones(m, k, device=cb.device) if weights is None else weights.to(cb.device, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    first = torch.stack([torch.randperm(k, generator=gen)[:groups] for _ in range(m)]).to(cb.device)
    means = cb.gather(1, first[:, :, None].expand(m, groups, d)).clone()
    assign = None
    for _ in range(iters):
        new = balanced_assign(torch.cdist(cb, means) ** 2)
        mass = torch.zeros(m, groups, device=cb.device).scatter_add_(1, new, w)
        sums = torch.zeros(m, groups, d, device=cb.device).scatter_add_(1, new[:, :, None].expand(m, k, d),
                                                                       cb * w[:, :, None])
        means = sums / mass.clamp_min(1e-12)[:, :, None]
        if assign is not None and torch.equal(new, assign):
            break
        assign = new
    return new, means


def pair_codebooks(means: torch.Tensor) -> torch.Tensor:
    """Group means [M, G, d] (G = 16) -> the codebooks of the group codes, [M / 2, G * G, 2 d]: codeword ``b``
    of pair ``p`` is group ``b >> 4`` of subspace ``2 p`` beside group ``b & 15`` of subspace ``2 p + 1``
    (:func:`group_codes`), so a group code is a product code of M / 2 subspaces and 256 centroids."""
    m, g, d = means.shape
    if m % 2 or g != GROUPS:
        raise ValueError(f"group means {list(means.shape)}: want an even M and {GROUPS} groups")
    hi = means[0::2, :, None, :].expand(m // 2, g, g, d)
    lo = means[1::2, None, :, :].expand(m // 2, g, g, d)
    return torch.cat([hi, lo], dim=3).reshape(m // 2, g * g, 2 * d).contiguous()


def check_groups(subspaces: int, centroids: int, residual: bool = False) -> None:
    """Raise :class:`DsaIndexError` naming the fix unless a code of ``subspaces`` x ``centroids`` (a residual
    code when ``residual``) can be served with stage 1 on group codes: a product code, even M, 256 centroids."""
    if residual:
        raise DsaIndexError("stage1='groups' groups a product code's centroids; the layer holds residual codes (RQ).",
                            "pass stage1='codes'.")
    if subspaces % 2 or centroids != GROUPS * GROUPS:
        raise DsaIndexError(f"stage1='groups' pairs the subspaces' 16 groups of 256 centroids; the codec has "
                            f"{subspaces} subspaces of {centroids}.", "pass stage1='codes'.")


def stage1_groups(codebooks: torch.Tensor, residual: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a stage 1 on group codes needs of product ``codebooks`` [M, K, d] (even M, K = 256, not a residual
    code, else :class:`DsaIndexError` naming the fix, :func:`check_groups`): (the group of each centroid [M, K]
    int64, the pair codebooks [M / 2, 256, 2 d] float32, their largest codeword norm per pair [M / 2], the int8
    tables' bound)."""
    check_groups(codebooks.shape[0], codebooks.shape[1], residual)
    assign, means = group_centroids(codebooks)
    books = pair_codebooks(means)
    return assign, books, books.norm(dim=2).amax(dim=1)


def group_codes(codes: torch.Tensor, assign: torch.Tensor) -> torch.Tensor:
    """codes [..., M] uint8 -> group codes [..., M / 2] uint8: byte ``p`` holds subspace ``2 p``'s group in its
    high nibble and subspace ``2 p + 1``'s in its low one (``assign`` [M, K]: :func:`group_centroids`)."""
    m = codes.shape[-1]
    g = assign[torch.arange(m, device=codes.device), codes.long()]  # [..., M]
    return ((g[..., 0::2] << 4) | g[..., 1::2]).to(torch.uint8)


def beam_search(x: torch.Tensor, codebooks: torch.Tensor, beam: int,
                state: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual coding of ``x`` [n, D] by the whole-key codebooks [M, K, D] not yet used in ``state``, keeping
    the ``beam`` best partial codes at each codebook. ``state`` (codes [n, b, m] int64, residuals [n, b, D])
    continues an earlier search over the first m codebooks (training adds one codebook at a time). Returns
    (codes [n, b, M] int64, residuals [n, b, D]), beams best first."""
    n, d = x.shape
    if state is None:
        codes, res = torch.zeros(n, 1, 0, dtype=torch.long, device=x.device), x[:, None, :]
    else:
        codes, res = state
    norms = (codebooks * codebooks).sum(-1)  # [M, K]
    for m in range(codes.shape[2], codebooks.shape[0]):
        b, k = res.shape[1], codebooks.shape[1]
        err = (res * res).sum(-1, keepdim=True) - 2 * res @ codebooks[m].t() + norms[m]  # [n, b, K]
        best = err.reshape(n, b * k).topk(min(beam, b * k), dim=1, largest=False).indices  # ascending error
        parent, code = best // k, best % k
        res = res.gather(1, parent[..., None].expand(-1, -1, d)) - codebooks[m][code]
        codes = torch.cat([codes.gather(1, parent[..., None].expand(-1, -1, codes.shape[2])), code[..., None]], dim=2)
    return codes, res


def residual_whitening(metric: torch.Tensor | None, dim: int, device: torch.device | str) -> torch.Tensor | None:
    """The [D, D] map ``L`` (``A + eps I = L L^T``, normalized as :func:`whitening` does) under which a
    score-aware residual code's distances are Euclidean: keys and codewords are coded as ``x @ L``. None
    for the plain metric. ``metric`` is the full [1, D, D] one."""
    if metric is None:
        return None
    lt, _ = whitening(metric, PQSpec(dim=dim, subspaces=1), device)
    return lt[0].t().contiguous()


def residual_encode(keys: torch.Tensor, codebooks: torch.Tensor, metric: torch.Tensor | None = None, beam: int = 5,
                    block: int = 16384) -> torch.Tensor:
    """Residual codes [N, M] uint8 of ``keys`` [N, D]: beam search of width ``beam`` over the whole-key
    ``codebooks`` [M, K, D] (moved to the keys' device), under the full ``metric`` [1, D, D] if given (both
    sides mapped by :func:`residual_whitening`), in blocks of ``block`` rows."""
    dim = codebooks.shape[2]
    books = codebooks.to(keys.device, torch.float32)
    white = residual_whitening(metric, dim, keys.device)
    if white is not None:
        books = books @ white
    codes = torch.empty(keys.shape[0], codebooks.shape[0], dtype=torch.uint8, device=keys.device)
    for start in range(0, keys.shape[0], block):
        x = keys[start : start + block].float()
        codes[start : start + block] = beam_search(x if white is None else x @ white, books, beam)[0][:, 0]
    return codes


def residual_decode(codes: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
    """codes [N, M] uint8 -> keys [N, D] float32: the sum of each key's M codewords of ``codebooks`` [M, K, D]."""
    cb = codebooks.to(codes.device).float()
    return cb[torch.arange(cb.shape[0], device=codes.device).unsqueeze(0), codes.long()].sum(1)


@dataclass
class PQCodec:
    """One layer's key code: what training produces, a bundle stores and the runtime serves.

    Product form (default): codebooks [M, K, D/M] float32; metric : optional [M, D/M, D/M] float32
    (score-aware encoding); rotation : optional [D, D] float32 orthogonal (OPQ: the codes are of
    ``keys @ rotation.T``; checked on construction, a :class:`DsaIndexError` otherwise).

    Residual form (``residual=True``, RQ): codebooks [M, K, D] whole-key codewords in the keys' space, a key
    the sum of its M codewords; metric : optional full [1, D, D] (score-aware encoding); no rotation; codes
    are found by beam search of width ``beam``. Both forms cost M bytes per key and score as M table lookups.
    """

    codebooks: torch.Tensor
    metric: torch.Tensor | None = None
    rotation: torch.Tensor | None = None
    residual: bool = False
    beam: int = 5

    def __post_init__(self):
        fix = ("pass codebooks [M, K, D/M] with an optional metric [M, D/M, D/M] for a product code, or "
               "residual=True with codebooks [M, K, D] and an optional metric [1, D, D].")
        if self.codebooks.dim() != 3:
            raise DsaIndexError(f"Codebooks of shape {list(self.codebooks.shape)} are not [M, K, d].", fix)
        m, k, d = self.codebooks.shape
        if self.residual:
            if self.rotation is not None:
                raise DsaIndexError("A residual code was given an OPQ rotation; its codewords span the whole key.",
                                    "drop the rotation (train RQ without --rotate).")
            if self.beam < 1:
                raise DsaIndexError(f"The residual code's beam is {self.beam}.", "pass a beam of 1 or more (5 is usual).")
            want = (1, d, d)
        else:
            want = (m, d, d)
        if self.metric is not None and tuple(self.metric.shape) != want:
            raise DsaIndexError(f"The {'residual' if self.residual else 'product'} code's metric has shape "
                                f"{list(self.metric.shape)}; with codebooks {list(self.codebooks.shape)} it must be "
                                f"{list(want)}.", fix)
        if not 2 <= k <= 256:
            raise DsaIndexError(f"{k} codewords per codebook do not fit 8-bit codes.", "use at most 256 codewords.")
        if self.rotation is not None:
            check_rotation(self.rotation, self.dim)
            self.rotation = self.rotation.float()

    @property
    def dim(self) -> int:
        """D, the dims of the keys coded."""
        m, _, d = self.codebooks.shape
        return d if self.residual else m * d

    @property
    def spec(self) -> PQSpec:
        """The product code's shape (a residual code has no subspaces: :class:`DsaIndexError`)."""
        if self.residual:
            raise DsaIndexError("A residual code has no subspace split.", "read .dim and .subspaces instead.")
        return PQSpec.of(self.codebooks)

    @property
    def subspaces(self) -> int:
        """M: subspaces (product form) or codebooks (residual form), one byte each per key."""
        return int(self.codebooks.shape[0])

    @property
    def label(self) -> str:
        """``PQ32``, ``OPQ32`` or ``RQ32``, with `` score-aware`` when it has a metric."""
        name = "RQ" if self.residual else "OPQ" if self.rotation is not None else "PQ"
        return f"{name}{self.subspaces}{' score-aware' if self.metric is not None else ''}"

    @property
    def nbytes(self) -> int:
        """Bytes of the parameters (float32)."""
        extra = sum(0 if t is None else t.numel() for t in (self.metric, self.rotation))
        return 4 * (self.codebooks.numel() + extra)

    def encode(self, keys: torch.Tensor) -> torch.Tensor:
        """keys [N, D] (original space) -> codes [N, M] uint8 (see :func:`encode`; rotated first for OPQ;
        :func:`residual_encode` for the residual form)."""
        if self.residual:
            return residual_encode(keys, self.codebooks, self.metric, self.beam)
        return encode(keys, self.codebooks, self.metric, rotation=self.rotation)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [N, M] uint8 -> keys [N, D] float32 in the original space (rotated back for OPQ; the sum of
        the codewords for the residual form)."""
        if self.residual:
            return residual_decode(codes, self.codebooks)
        return decode(codes, self.codebooks, self.rotation)

    def rotate_queries(self, queries: torch.Tensor) -> torch.Tensor:
        """Queries [..., D] into the code space, ``queries @ rotation.T`` (float32; the input itself without a
        rotation), for scores computed from the codebooks directly: ``rotate_queries(q) . C[codes]`` equals
        ``q . decode(codes)``. See :func:`rotate`."""
        return rotate(queries, self.rotation)

    def relative_mse(self, keys: torch.Tensor) -> float:
        """Plain (Euclidean) reconstruction error of ``keys`` [N, D] over their mean squared norm (see
        :func:`relative_mse`)."""
        if self.residual:
            x = keys.float()
            err = ((self.decode(self.encode(x)) - x) ** 2).sum(-1).mean()
            return float(err / (x**2).sum(-1).mean().clamp_min(math.ulp(1.0)))
        return relative_mse(keys, self.codebooks, self.rotation)

    def to(self, device: torch.device | str) -> PQCodec:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return PQCodec(self.codebooks.to(device), move(self.metric), move(self.rotation), self.residual, self.beam)
