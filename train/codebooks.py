"""Training of per-layer PQ codebooks for indexer keys (the codec itself is :mod:`dsaindex.pq`).

The coarse score of a key is the exact score of its decoded key (LeanSparse Eq. 6)::

    coarse[s, i] = sum_h w[s, h] * relu(sum_j q[s, h, j] . C_j[code[i, j]])

Two trainers behind :func:`train_codebooks`:

* ``faiss``: faiss-cpu's k-means per subspace (the reference trainer);
* ``torch``: batched Lloyd iterations over all subspaces at once (runs on the GPU; the H200 machine
  has no faiss GPU build).

Score-aware codebooks (``metric`` given): k-means under a per-subspace Mahalanobis metric
``A_j = E[g_j g_j^T]``, where ``g = sum_h w_h 1[q_h . k > 0] q_h`` is the gradient of the score with
respect to the key. A first-order score error is ``g . (k - k_hat)``, so this spends the codebook's
resolution on the directions queries actually read. Implemented by whitening each subspace with the
Cholesky factor of ``A_j``, running plain k-means, and mapping centroids back.
"""

from __future__ import annotations

import torch

from dsaindex.errors import DsaIndexError
from dsaindex.pq import PQSpec, nearest_centroids, split_subspaces, whitening

TRAINERS = ("faiss", "torch")


def check_keys(keys: torch.Tensor, spec: PQSpec, what: str = "keys") -> None:
    """Refuse inputs the trainers cannot use, with the fix."""
    if keys.dim() != 2 or keys.shape[1] != spec.dim:
        raise DsaIndexError(f"{what} have shape {tuple(keys.shape)}, expected [N, {spec.dim}].",
                            "train on keys of the store's own layers.")
    bad = ~torch.isfinite(keys).all(dim=1)
    if bool(bad.any()):
        raise DsaIndexError(
            f"{int(bad.sum())} of {keys.shape[0]} {what} hold NaN or inf (first at row {int(bad.nonzero()[0])}).",
            "recapture from a model whose indexer produces finite keys (check the dtype: fp16 overflows), "
            "or drop those sequences.",
        )
    need = spec.centroids * 4
    if keys.shape[0] < need:
        raise DsaIndexError(
            f"Only {keys.shape[0]} {what} to train {spec.centroids} centroids per subspace; at least {need} needed.",
            "capture more sequences (`dsaindex capture STORE --sequences N` resumes and extends the store).",
        )


def _lloyd_torch(x: torch.Tensor, k: int, iterations: int, seed: int, block: int = 1 << 17) -> torch.Tensor:
    """Batched k-means: x [M, N, d] -> centroids [M, k, d]. Init from distinct random rows.

    Assignment runs in blocks of rows so the [M, block, k] distance tensor stays bounded.
    """
    m, n, d = x.shape
    g = torch.Generator(device="cpu").manual_seed(seed)
    init = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(m)]).to(x.device)
    cent = torch.gather(x, 1, init.unsqueeze(-1).expand(m, k, d)).clone()
    for _ in range(iterations):
        sums = torch.zeros_like(cent)
        counts = torch.zeros(m, k, device=x.device)
        c_sq = (cent * cent).sum(-1).unsqueeze(1)  # [M, 1, k]
        for start in range(0, n, block):
            xb = x[:, start : start + block]
            assign = nearest_centroids(xb, cent, c_sq)  # [M, b]
            sums.scatter_add_(1, assign.unsqueeze(-1).expand(-1, -1, d), xb)
            counts.scatter_add_(1, assign, torch.ones_like(assign, dtype=torch.float32))
        empty = counts == 0
        cent = torch.where(empty.unsqueeze(-1), cent, sums / counts.clamp_min(1).unsqueeze(-1))
        if bool(empty.any()):  # re-seed empty clusters on random rows
            rows = torch.randint(0, n, (int(empty.sum()),), generator=g).to(x.device)
            sub = empty.nonzero()[:, 0]
            cent[empty] = x[sub, rows]
    return cent


def _kmeans_faiss(x: torch.Tensor, k: int, iterations: int, seed: int, gpu: bool = False) -> torch.Tensor:
    import faiss
    import numpy as np

    gpu = gpu and hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
    out = []
    for j in range(x.shape[0]):
        km = faiss.Kmeans(x.shape[2], k, niter=iterations, seed=seed + j, verbose=False, gpu=gpu,
                          max_points_per_centroid=1 << 30, min_points_per_centroid=1)
        km.train(np.ascontiguousarray(x[j].cpu().numpy(), dtype=np.float32))
        out.append(torch.from_numpy(km.centroids.copy()))
    return torch.stack(out)


def train_codebooks(
    keys: torch.Tensor,
    spec: PQSpec,
    trainer: str = "faiss",
    iterations: int = 20,
    seed: int = 0,
    metric: torch.Tensor | None = None,
    device: str = "cpu",
) -> torch.Tensor:
    """Train PQ codebooks.

    Parameters
    ----------
    keys : [N, D] float keys (in the basis and precision the engine stores)
    metric : optional [M, d, d] per-subspace PSD matrices for score-aware training
    trainer : ``faiss`` (CPU; its GPU build when ``device`` is CUDA and one imports) or ``torch`` (any device)

    Returns
    -------
    codebooks [M, K, D/M] float32 on CPU
    """
    check_keys(keys, spec)
    if trainer not in TRAINERS:
        raise DsaIndexError(f"Unknown PQ trainer {trainer!r}.", f"use one of {', '.join(TRAINERS)}.")
    dev = torch.device(device if trainer == "torch" else "cpu")
    x = split_subspaces(keys.to(dev), spec)
    white = whitening(metric, spec, dev)
    if white is not None:
        x = torch.bmm(x, white[0].transpose(1, 2))  # rows x -> L^T x
    if trainer == "torch":
        cent = _lloyd_torch(x, spec.centroids, iterations, seed)
    else:  # faiss on the CPU, or on the GPU where a faiss GPU build imports and a CUDA device was asked for
        cent = _kmeans_faiss(x, spec.centroids, iterations, seed, gpu=str(device).startswith("cuda")).to(dev)
    if white is not None:
        cent = torch.bmm(cent, white[1].transpose(1, 2))  # c' -> L^-T c'
    return cent.float().cpu()


def score_gradient_metric(
    queries: torch.Tensor, head_weights: torch.Tensor, keys_per_query: list[torch.Tensor], spec: PQSpec
) -> torch.Tensor:
    """Per-subspace ``E[g_j g_j^T]`` over (query, key) pairs, ``g = sum_h w_h 1[q_h . k > 0] q_h``.

    Parameters
    ----------
    queries : [S, H, D]; head_weights : [S, H]
    keys_per_query : S tensors [n_s, D]: the keys each query's score error matters for (for example its
        exact top candidates)

    Returns
    -------
    [M, D/M, D/M] float64, on the queries' device
    """
    acc = torch.zeros(spec.subspaces, spec.sub_dim, spec.sub_dim, dtype=torch.float64, device=queries.device)
    pairs = 0
    for s, keys in enumerate(keys_per_query):
        q = queries[s].float()  # [H, D]
        active = (keys.float() @ q.t() > 0).float()  # [n, H]
        g = (active * head_weights[s].float()) @ q  # [n, D]
        gs = g.reshape(g.shape[0], spec.subspaces, spec.sub_dim).transpose(0, 1).double()  # [M, n, d]
        acc += torch.bmm(gs.transpose(1, 2), gs)
        pairs += g.shape[0]
    return acc / max(1, pairs)


def balanced_pca_rotation(keys: torch.Tensor, spec: PQSpec) -> torch.Tensor:
    """An orthogonal [D, D] whose rows are the keys' principal directions, dealt to the subspaces so each
    gets a similar product of variances (OPQ's eigenvalue allocation: the largest direction goes to the
    subspace with the smallest log-variance sum that still has room)."""
    x = keys.double() - keys.double().mean(0, keepdim=True)
    values, vectors = torch.linalg.eigh(x.t() @ x / max(1, x.shape[0] - 1))
    order = values.argsort(descending=True)
    slots: list[list[int]] = [[] for _ in range(spec.subspaces)]
    load = [0.0] * spec.subspaces
    for i in order.tolist():
        room = [j for j in range(spec.subspaces) if len(slots[j]) < spec.sub_dim]
        j = min(room, key=lambda s: load[s])
        slots[j].append(i)
        load[j] += float(torch.log(values[i].clamp_min(1e-12)))
    rows = [vectors[:, i] for s in slots for i in s]
    return torch.stack(rows).float()


def train_rotation(keys: torch.Tensor, spec: PQSpec, trainer: str = "torch", rounds: int = 6, iterations: int = 4,
                   seed: int = 0, device: str = "cpu") -> torch.Tensor:
    """OPQ (non-parametric, Ge et al. 2013): an orthogonal R [D, D] such that PQ of the rotated keys
    ``keys @ R.T`` reconstructs them best. Starts from :func:`balanced_pca_rotation`, then alternates PQ
    codebooks on the rotated keys and R from the orthogonal Procrustes problem ``min ||X R^T - Y||``
    (``Y`` the rotated keys' reconstructions: R^T = U V^T for X^T Y = U S V^T). The score is unchanged by
    R when queries are rotated the same way (``q . k = (R q) . (R k)``). Returns R on CPU."""
    from dsaindex.pq import decode, encode, rotate

    check_keys(keys, spec)
    dev = torch.device(device if trainer == "torch" else "cpu")
    x = keys.float().to(dev)
    rot = balanced_pca_rotation(x, spec).to(dev)
    for r in range(rounds):
        xr = rotate(x, rot)
        codebooks = train_codebooks(xr, spec, trainer, iterations, seed + r, None, device).to(dev)
        y = decode(encode(xr, codebooks), codebooks)  # the reconstructions in the rotated space
        u, _, vh = torch.linalg.svd(x.t().double() @ y.double())
        rot = (u @ vh).t().float()
    return rot.cpu()
