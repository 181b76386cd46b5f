"""Routing-encoder training (train/ivf.py): the step kept is the one that routes held-aside queries best."""

import torch

from dsaindex.artifacts.kinds import IVFIndexSettings
from dsaindex.train.ivf import IVFOptions, routing_hit_rate, sequence_groups, train_encoder, validation_budget

D, H = 32, 4


def sequence(seed, n=3000, q=60):
    g = torch.Generator().manual_seed(seed)
    centers = torch.nn.functional.normalize(torch.randn(30, D, generator=g), dim=1) * 3
    keys = centers[torch.randint(0, 30, (n,), generator=g)] * torch.rand(n, 1, generator=g) * 2
    keys = keys + 0.4 * torch.randn(n, D, generator=g)
    positions = torch.randint(600, n, (q,), generator=g).tolist()
    queries = keys[torch.randint(0, n, (q, H), generator=g)] + 0.3 * torch.randn(q, H, D, generator=g)
    return keys, positions, queries, torch.rand(q, H, generator=g)


def test_training_keeps_the_best_validated_step_and_never_loses_to_the_means():
    opts = IVFOptions(IVFIndexSettings(window=256, cluster_size=32, refit_every=1024), features=16, hidden=32, steps=60,
                      groups_per_step=8, eval_every=10, val_budget=256)
    fit = [grp for s in (1, 2) for grp in sequence_groups(*sequence(s), topk=32, opts=opts)]
    val = sequence_groups(*sequence(3), topk=32, opts=opts)
    assert fit and val and all(torch.allclose(g.target.sum(1), torch.ones(len(g.target))) for g in fit)
    params, summary = train_encoder(fit, D, opts, val_groups=val)
    start, kept = summary["val_hit_rate@256_start"], summary["val_hit_rate@256_kept"]
    assert kept >= start and summary["kept_step"] % 10 == 0
    assert abs(routing_hit_rate(params, val, 256, 32) - kept) < 1e-4  # the parameters returned are the kept ones
    if summary["kept_step"] == 0:
        assert not params["out_weight"].any()  # the plain means
    assert summary["loss_end"] < summary["loss_start"]


def test_validation_budget_is_one_that_leaves_clusters_out():
    opts = IVFOptions(IVFIndexSettings(window=256, cluster_size=32, refit_every=1024))
    val = sequence_groups(*sequence(3), topk=32, opts=opts)
    clusters = sorted(int(g.version.clusters) for g in val for _ in range(int(g.queries.shape[0])))
    median = clusters[len(clusters) // 2]
    assert validation_budget(val, 32, [256, 512, 8192]) == 256  # the smallest: 8 clusters, fewer than most queries see
    # a budget that holds every cluster would keep the plain means whatever training does
    assert routing_hit_rate(init_means(), val, 32 * (clusters[-1] + 1), 32) == 1.0
    assert validation_budget(val, 32, [32 * median, 65536]) == median // 2 * 32
    assert validation_budget(val, 32) == median // 2 * 32


def init_means():
    from dsaindex.train.ivf import init_encoder

    return init_encoder(D, 16, 32)
