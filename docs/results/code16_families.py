"""Codes of 16 bytes a key beyond plain RQ16, side by side on one capture store (results.md, "16 bytes a
key at 128K: the code families that were left"): held-out recall of the exact top-k after exact rerank.

Usage: ``python docs/results/code16_families.py STORE OUT.json DEVICE VARIANTS QUERIES TOPK CANDIDATES
[LAYERS]``, e.g. ``... /tmp/v2l out.json cuda base:16,ucb:15:1/1.5:gq:q8,kb:10:4096:1:256 128 512
1024,2048,4096``. ``VR_KEYS`` (default 262,144) training keys a layer, ``VR_BEAM`` (5) the beam.

Every code is a residual code trained in the space whitened by the score-aware metric. Variants:

* ``base:M``: RQ of M codebooks of 256 (M bytes);
* ``kb:COUNT:K[:COUNT:K...]``: RQ whose codebooks have K codewords each (K = 1024 or 4096: 10 or 12 bits;
  ``kb:10:4096:1:256`` is 10 x 12 + 8 = 128 bits), trained greedily, coded by beam search;
* ``lsq:M:R``: RQ's codebooks refitted jointly by least squares, R rounds of (refit, two sweeps of
  coordinate descent over the codes); held-out keys coded by beam search, then three sweeps;
* ``aniso:M:ETA``: keys coded under ``|r|^2 + (ETA - 1)(r . x/|x|)^2`` (the error along the key weighs ETA
  times more), RQ codebooks;
* ``mk:M:F``: the metric from each training query's top 2 x F x topk keys instead of 2 x topk;
* ``ucb:M:BETAS:TAUS:NORMS``: candidates ranked by the coarse score plus ``beta * tau_q * r_k``, r_k the
  key's whitened residual norm (``exact``, or ``qB``: one of 2**B levels, what a spare byte holds) and tau_q
  ``gq`` (the folded query's whitened norm over sqrt(D)) or ``oracle`` (the query's actual error spread);
  ``ucb:15:...:q8`` is 16 bytes;
* ``lin:M:BETAS:qB``: the same bonus as a codeword along the mean whitened folded query, so that the
  unchanged kernels would score it (M + 1 bytes);
* ``vr:M0:M1:F:PRED``: variable rate, every key M0 codebooks and a share F of them (those ``PRED`` ranks
  highest: ``norm`` the whitened norm, ``probe`` the best z-score against training queries, ``oracle`` the
  held-out keys in some exact top-k) M1; ``hit_covered`` is the share of held-out top-k keys refined.
"""

import json
import os
import sys
import time

import torch
from rq16_variants import scalar_levels, whitening  # the sibling script (this folder is on the path when run)

from dsaindex.artifacts.capture_store import CaptureStore
from dsaindex.pq import beam_search
from dsaindex.score import indexer_scores
from dsaindex.train.additive import full_spec, train_rq_torch
from dsaindex.train.pq_job import _subsample, metric_for_layer
from dsaindex.train.recall import evaluate_selection, held_out, layer_keys, split_sequences


def recon(x, books, beam, block=16384):
    out = []
    for i in range(0, x.shape[0], block):
        _, r = beam_search(x[i : i + block], books, beam)
        out.append(x[i : i + block] - r[:, 0])
    return torch.cat(out) if out else x[:0]


def aniso_search(x, books, beam, eta):
    """Beam search under ||r||^2 + (eta-1) (r . u)^2, u = x / |x|."""
    n, d = x.shape
    u = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    res = x[:, None, :]
    codes = torch.zeros(n, 1, 0, dtype=torch.long, device=x.device)
    norms = (books * books).sum(-1)
    for m in range(books.shape[0]):
        b, k = res.shape[1], books.shape[1]
        ru = (res * u[:, None, :]).sum(-1, keepdim=True)  # [n,b,1]
        cu = (u @ books[m].t())[:, None, :]  # [n,1,K]
        err = (res * res).sum(-1, keepdim=True) - 2 * res @ books[m].t() + norms[m] + (eta - 1) * (ru - cu) ** 2
        best = err.reshape(n, b * k).topk(min(beam, b * k), dim=1, largest=False).indices
        parent, code = best // k, best % k
        res = res.gather(1, parent[..., None].expand(-1, -1, d)) - books[m][code]
        codes = torch.cat([codes.gather(1, parent[..., None].expand(-1, -1, codes.shape[2])), code[..., None]], 2)
    return x - res[:, 0]


def aniso_recon(x, books, beam, eta, block=8192):
    return torch.cat([aniso_search(x[i : i + block], books, beam, eta) for i in range(0, x.shape[0], block)])


def codes_of(x, books, beam, block=16384):
    return torch.cat([beam_search(x[i : i + block], books, beam)[0][:, 0] for i in range(0, x.shape[0], block)])


def ucb_recall(data, hk, coarse, rn, beta, topk, cands, device, tau_kind="oracle", white=None):
    hits = {c: [] for c in cands}
    for i in range(data.queries.shape[0]):
        s0, n = int(data.key_start[i]), int(data.visible[i])
        q, w = data.queries[i : i + 1].to(device), data.head_weights[i : i + 1].to(device)
        ex = indexer_scores(q, hk[s0 : s0 + n], w)[0]
        ap = indexer_scores(q, coarse[s0 : s0 + n], w)[0]
        if tau_kind == "oracle":
            tau = (ex - ap).std() / rn[s0 : s0 + n].pow(2).mean().sqrt()
        elif tau_kind == "gq":  # |L^-1 g| / sqrt(D), g = sum_h w_h q_h
            g = (w[0, :, None] * q[0]).sum(0)
            tau = torch.linalg.solve(white.t(), g[:, None]).norm() if False else (g @ torch.linalg.inv(white).t()).norm()
            tau = tau / g.numel() ** 0.5
        elif tau_kind == "spread":  # std of the approximate scores of the prefix
            tau = ap.std()
        elif tau_kind == "top":  # the approximate top-C score spread
            tv = ap.topk(min(4 * topk, n)).values
            tau = tv[0] - tv[-1]
        adj = ap + beta * tau * rn[s0 : s0 + n]
        truth = ex.topk(topk).indices
        for c in cands:
            if not topk < c < n:
                continue
            cand = adj.topk(c).indices
            mask = torch.zeros(n, dtype=torch.bool, device=device)
            mask[cand] = True
            hits[c].append(float(mask[truth].float().mean()))
    return {f"rerank@{c}": round(sum(v) / max(1, len(v)), 5) for c, v in hits.items()}


def icm(x, books, codes, sweeps):
    """Coordinate descent on the joint code: each codebook's code re-chosen given the others."""
    m_books = books.shape[0]
    ar = torch.arange(m_books, device=x.device)
    norms = (books * books).sum(-1)
    for _ in range(sweeps):
        for m in range(m_books):
            full = books[ar[None, :], codes].sum(1)  # [n, D]
            r = x - full + books[m][codes[:, m]]
            codes[:, m] = (norms[m][None] - 2 * r @ books[m].t()).argmin(1)
    return codes


def icm_blocks(x, books, codes, sweeps, block=65536):
    for i in range(0, x.shape[0], block):
        codes[i : i + block] = icm(x[i : i + block], books, codes[i : i + block], sweeps)
    return codes


def ls_update(x, codes, k, lam=1e-3):
    n, m = codes.shape
    d = x.shape[1]
    idx = codes + torch.arange(m, device=x.device)[None] * k  # [n, m]
    mk = m * k
    btb = torch.zeros(mk * mk, device=x.device)
    for i in range(0, n, 32768):
        ii = idx[i : i + 32768]
        pair = (ii[:, :, None] * mk + ii[:, None, :]).reshape(-1)
        btb += torch.bincount(pair, minlength=mk * mk).float()
    btb = btb.view(mk, mk)
    btx = torch.zeros(mk, d, device=x.device).index_add_(0, idx.reshape(-1), x.repeat_interleave(m, 0))
    reg = lam * btb.diagonal().mean()
    sol = torch.linalg.solve(btb.double() + reg * torch.eye(mk, device=x.device, dtype=torch.float64), btx.double())
    return sol.float().view(m, k, d)


def mixed_rq(xt, plan, beam, device, seed):
    """RQ whose codebooks have the sizes in plan: list of (count, K)."""
    books = []
    res = xt
    from dsaindex.train.pq import _lloyd_torch
    for count, k in plan:
        for _ in range(count):
            b = _lloyd_torch(res[None], k, 20, seed + len(books))[0]
            books.append(b)
            res = res - greedy_recon_one(res, b)
    return books


def greedy_recon_one(r, b, block=32768):
    out = []
    nb = (b * b).sum(-1)
    for i in range(0, r.shape[0], block):
        out.append(b[(nb[None] - 2 * r[i : i + block] @ b.t()).argmin(1)])
    return torch.cat(out)


def mixed_recon(x, books, beam, block=8192):
    """Beam search over codebooks of different sizes."""
    outs = []
    for i in range(0, x.shape[0], block):
        xb = x[i : i + block]
        n, d = xb.shape
        res = xb[:, None, :]
        for b in books:
            k = b.shape[0]
            bb = res.shape[1]
            err = (res * res).sum(-1, keepdim=True) - 2 * res @ b.t() + (b * b).sum(-1)
            best = err.reshape(n, bb * k).topk(min(beam, bb * k), dim=1, largest=False).indices
            parent, code = best // k, best % k
            res = res.gather(1, parent[..., None].expand(-1, -1, d)) - b[code]
        outs.append(xb - res[:, 0])
    return torch.cat(outs)


def main():
    path, out, device, variants = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
    queries, topk = int(sys.argv[5]), int(sys.argv[6])
    cands = tuple(int(c) for c in sys.argv[7].split(","))
    store = CaptureStore.open(path)
    layers = [int(x) for x in sys.argv[8].split(",")] if len(sys.argv) > 8 else list(store.layers)
    nkeys = int(os.environ.get("VR_KEYS", 262144))
    beam = int(os.environ.get("VR_BEAM", 5))
    key_format = store.manifest.model.geometry.key_format
    train, held = split_sequences(store.committed.sequences)
    per_layer = {}

    def one_layer(layer):  # every closure below binds this layer's own data
        t0 = time.time()
        raw = store.keys(layer)
        every = layer_keys(store, layer, train, key_format, raw)
        metrics = {}

        def metric_of(mk):
            if mk not in metrics:
                metrics[mk] = metric_for_layer(store, layer, train, key_format, full_spec(every.shape[1], 256), 256,
                                               topk * mk, device=device, raw=raw)
            return metrics[mk]

        metric = metric_of(1)
        data = held_out(store, layer, held, 4 * topk, key_format, queries, raw)
        probes = held_out(store, layer, train, 4 * topk, key_format, 256, raw)
        hk = data.keys.to(device).float()
        keys = _subsample(every, nkeys, layer).to(device).float()
        white, unwhite = whitening(metric, 1e-3, device)
        xt, xh = keys @ white, hk @ white
        cache = {}

        def rq(m, x=None, tag=None):
            key = (m, tag)
            if key not in cache:
                cache[key] = train_rq_torch(xt if x is None else x, m, 256, 20, beam, seed=layer + 7 * m,
                                            device=device).codebooks
            return cache[key]

        # importance predictors
        def probe_imp(k_raw):
            q, w = probes.queries.to(device), probes.head_weights.to(device)
            s = torch.cat([indexer_scores(q, k_raw[i : i + 65536], w) for i in range(0, k_raw.shape[0], 65536)], 1)
            return s

        st = probe_imp(keys)
        mu, sd = st.mean(1, keepdim=True), st.std(1, keepdim=True)
        imp_t_probe = ((st - mu) / sd).amax(0)
        imp_h_probe = ((probe_imp(hk) - mu) / sd).amax(0)
        del st
        # oracle: held keys in the exact top-k of any held-out query
        hit = torch.zeros(hk.shape[0], dtype=torch.bool, device=device)
        for i in range(data.queries.shape[0]):
            s0, n = int(data.key_start[i]), int(data.visible[i])
            sc = indexer_scores(data.queries[i : i + 1].to(device), hk[s0 : s0 + n], data.head_weights[i : i + 1].to(device))
            hit[s0 + sc[0].topk(topk).indices] = True
        imps = {"norm": (xt.norm(dim=-1), xh.norm(dim=-1)), "probe": (imp_t_probe, imp_h_probe)}
        print(f"layer {layer}: setup {time.time() - t0:.1f}s, oracle hit share {hit.float().mean():.4f}", flush=True)
        for variant in variants:
            t1 = time.time()
            parts = variant.split(":")
            bytes_ = None
            if parts[0] == "base":
                m = int(parts[1])
                y = recon(xh, rq(m), beam)
                bytes_ = m
            elif parts[0] == "mk":  # metric from each training query's top 2 x mk x topk keys
                m, mk = int(parts[1]), int(parts[2])
                w2, u2 = whitening(metric_of(mk), 1e-3, device)
                b = train_rq_torch(keys @ w2, m, 256, 20, beam, seed=layer + 7 * m, device=device).codebooks
                y = (recon(hk @ w2, b, beam) @ u2) @ white
                bytes_ = m
            elif parts[0] == "ucb":  # rank by approx + beta * tau_q * r_k
                m = int(parts[1])
                taus = parts[3].split("/") if len(parts) > 3 else ["oracle"]
                norms_ = parts[4].split("/") if len(parts) > 4 else ["exact"]
                yt = recon(xt, rq(m), beam)
                rt = (xt - yt).norm(dim=-1)
                y = recon(xh, rq(m), beam)
                rn = (xh - y).norm(dim=-1)
                coarse = y @ unwhite
                out_rows = {}
                for nk in norms_:
                    if nk == "exact":
                        r_used = rn
                    elif nk.startswith("q"):
                        lv = scalar_levels(rt, 2 ** int(nk[1:]))
                        r_used = lv[(rn[:, None] - lv[None]).abs().argmin(1)]
                    elif nk == "code":  # mean training residual norm per last code
                        ct = codes_of(xt, rq(m), beam)[:, -1]
                        ch = codes_of(xh, rq(m), beam)[:, -1]
                        tab = torch.zeros(256, device=device).scatter_add_(0, ct, rt)
                        cnt = torch.zeros(256, device=device).scatter_add_(0, ct, torch.ones_like(rt))
                        r_used = (tab / cnt.clamp_min(1))[ch]
                    for tk in taus:
                        for beta in [float(b) for b in parts[2].split("/")]:
                            r = ucb_recall(data, hk, coarse, r_used, beta, topk, cands, device, tk, white)
                            out_rows[f"{nk}/{tk}/b{beta}"] = r
                            print(layer, variant, nk, tk, beta, r, flush=True)
                per_layer.setdefault(variant, {})[layer] = {f"{n}/{k}": v for n, r in out_rows.items() for k, v in r.items()}
                continue
            elif parts[0] == "lin":  # the bonus as a codeword along the mean whitened folded query
                m = int(parts[1])
                nk = parts[3] if len(parts) > 3 else "q8"
                gp = (probes.head_weights.to(device)[:, :, None] * probes.queries.to(device).float()).sum(1)
                gt = gp @ torch.linalg.inv(white).t()
                un = gt / gt.norm(dim=-1, keepdim=True)
                u = un.mean(0)
                u = u / u.norm()
                cbar = float((un @ u).mean())
                yt = recon(xt, rq(m), beam)
                rt = (xt - yt).norm(dim=-1)
                y0 = recon(xh, rq(m), beam)
                rn = (xh - y0).norm(dim=-1)
                if nk.startswith("q"):
                    lv = scalar_levels(rt, 2 ** int(nk[1:]))
                    rn = lv[(rn[:, None] - lv[None]).abs().argmin(1)]
                for beta in [float(b) for b in parts[2].split("/")]:
                    y = y0 + (beta / (cbar * xh.shape[1] ** 0.5)) * rn[:, None] * u[None]
                    rec = evaluate_selection(data, y @ unwhite, (topk,), cands, device=device)
                    row = {k: round(v, 5) for k, v in rec.items() if "rerank" in k or "direct" in k}
                    row["cbar"] = round(cbar, 4)
                    row["bytes"] = m + 1
                    per_layer.setdefault(f"{variant}/b{beta}", {})[layer] = row
                    print(layer, variant, beta, {k: v for k, v in row.items() if "@" not in k.split("/")[0]}, flush=True)
                continue
            elif parts[0] == "kb":  # kb:COUNT:K[:COUNT:K...]
                nums = [int(v) for v in parts[1:]]
                plan = list(zip(nums[::2], nums[1::2], strict=True))
                books = mixed_rq(xt, plan, beam, device, layer)
                y = mixed_recon(xh, books, beam)
                bytes_ = sum(c * (k.bit_length() - 1) for c, k in plan) / 8
            elif parts[0] == "lsq":  # lsq:M:ROUNDS
                m, rounds = int(parts[1]), int(parts[2])
                books = rq(m).clone()
                ct = codes_of(xt, books, beam)
                for _ in range(rounds):
                    books = ls_update(xt, ct, 256)
                    ct = icm_blocks(xt, books, ct, 2)
                ch = icm_blocks(xh, books, codes_of(xh, books, beam), 3)
                ar = torch.arange(m, device=device)
                y = torch.cat([books[ar[None, :], ch[i : i + 65536]].sum(1) for i in range(0, ch.shape[0], 65536)])
                bytes_ = m
            elif parts[0] == "aniso":
                m, eta = int(parts[1]), float(parts[2])
                y = aniso_recon(xh, rq(m), beam, eta)
                bytes_ = m
            elif parts[0] == "vr":
                m0, m1, f, pred = int(parts[1]), int(parts[2]), float(parts[3]), parts[4]
                b0 = rq(m0)
                if pred == "oracle":
                    it, ih = imps["probe"]
                    thr = torch.quantile(it[:: max(1, it.numel() // 100000)], 1 - f)
                    sel_t, sel_h = it >= thr, hit
                else:
                    it, ih = imps[pred]
                    thr = torch.quantile(it[:: max(1, it.numel() // 100000)], 1 - f)
                    sel_t, sel_h = it >= thr, ih >= thr
                rt = xt[sel_t] - recon(xt[sel_t], b0, beam)
                b1 = rq(m1 - m0, rt, (m0, m1, f, pred))
                y = recon(xh, b0, beam)
                rh = xh[sel_h] - y[sel_h]
                y[sel_h] += recon(rh, b1, beam)
                frac = float(sel_h.float().mean())
                bytes_ = m0 + frac * (m1 - m0)
                # recall of oracle hits by the selection
            else:
                raise SystemExit(variant)
            rec = evaluate_selection(data, y @ unwhite, (topk,), cands, device=device)
            row = {k: round(v, 5) for k, v in rec.items() if ("rerank" in k or "direct" in k or "queries" in k)
                   and "@" not in k.split("/")[0]}
            row.update({k: round(v, 5) for k, v in rec.items() if "rerank" in k and "64K-128K" in k})
            row["bytes"] = round(bytes_, 3)
            row["white_mse"] = round(float(((xh - y) ** 2).sum(-1).mean() / (xh**2).sum(-1).mean()), 5)
            if parts[0] == "vr":
                row["hit_covered"] = round(float((sel_h & hit).sum() / hit.sum().clamp_min(1)), 4)
            row["s"] = round(time.time() - t1, 1)
            per_layer.setdefault(variant, {})[layer] = row
            print(layer, variant, row, flush=True)
    for layer in layers:
        one_layer(layer)
    summary = {}
    for variant, rows in per_layer.items():
        names = set.intersection(*(set(r) for r in rows.values()))
        summary[variant] = {n: round(sum(r[n] for r in rows.values()) / len(rows), 5) for n in sorted(names)}
        print("SUMMARY", variant, summary[variant], flush=True)
    with open(out, "w") as f:
        json.dump({"summary": summary, "per_layer": per_layer}, f, indent=1)


if __name__ == "__main__":
    main()
