"""The figure of results.md, "IVF at 128K on v2, natural and synthetic": what learned routing gains per layer
over contiguous blocks and over plain means at a 16K budget, beside the most any router could gain over
blocks (100% minus blocks' recall). python docs/results/ivf_margins_plot.py (from the repo root)."""
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

BUDGET = "16384"
runs = {kind: json.load(open(f"docs/results/train_ivf_v2_128k_{kind}_h200.json")) for kind in ("natural", "synthetic")}

fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
for ax, (kind, run) in zip(axes, runs.items(), strict=True):
    rows = [(f"layer {layer}", r["recall"]) for layer, r in sorted(run["per_layer"].items(), key=lambda x: int(x[0]))]
    rows.append(("mean", run["mean"]))
    x = np.arange(len(rows))
    learned = np.array([100 * r["ivf-learned"][BUDGET] for _, r in rows])
    blocks = np.array([100 * r["blocks"][BUDGET] for _, r in rows])
    means = np.array([100 * r["ivf"][BUDGET] for _, r in rows])
    ax.bar(x - 0.27, 100 - blocks, 0.27, color="#dddddd", edgecolor="#999999", label="most any router can gain (100 - blocks)")
    ax.bar(x, learned - blocks, 0.27, color="#4c72b0", label="learned - blocks")
    ax.bar(x + 0.27, learned - means, 0.27, color="#55a868", label="learned - means")
    ax.axhline(10, color="#4c72b0", ls="--", lw=1)
    ax.axhline(2, color="#55a868", ls="--", lw=1)
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xticks(x, [name for name, _ in rows])
    ax.set_title(f"{kind} captures, 128K, budget 16K", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
axes[0].set_ylabel("recall of the exact top-512 (points)")
axes[0].text(0.75, 10.3, "asked: +10 over blocks", color="#4c72b0", fontsize=8)
axes[0].text(0.75, 2.3, "asked: +2 over means", color="#55a868", fontsize=8)
axes[1].legend(fontsize=8, loc="upper right")
fig.suptitle("v2 at 128K (H200): only layer 0 reaches back far enough for routing to matter", fontsize=11)
fig.tight_layout()
fig.savefig("docs/results/ivf_margins_v2_128k_h200.png", dpi=110)
