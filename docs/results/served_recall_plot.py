"""The figure of results.md, "Stage 1 of the served step on v2 at 128K": held-out recall of the exact top-512
in the 64K-128K band per layer against the stage-1 factor, for RQ32 at C = 2,048 and RQ16 at C = 4,096.
python docs/results/served_recall_plot.py (from the repo root)."""
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

BAND = "k512@64K-128K"
cases = [("RQ32", 2048, "docs/results/train_rq32_served_recall_v2_128k_h200.json"),
         ("RQ16", 4096, "docs/results/train_rq16_served_recall_v2_128k_h200.json")]
fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
for ax, (code, c, path) in zip(axes, cases, strict=True):
    run = json.load(open(path))
    xs = [4, 8, 16]
    for layer, m in sorted(run["per_layer"].items(), key=lambda x: int(x[0])):
        ys = [100 * m[f"{BAND}/prefilter{p}@{c}"] for p in xs] + [100 * m[f"{BAND}/rerank@{c}"]]
        ax.plot(range(4), ys, marker="o", label=f"layer {layer}")
    ax.axhline(99, color="gray", ls=":", lw=1)
    ax.set_xticks(range(4), ["4 (default)", "8", "16", "every key"])
    ax.set_xlabel("stage 1 keeps P x C keys")
    ax.set_title(f"{code}, C = {c:,}", fontsize=10)
    ax.grid(alpha=0.3)
axes[0].set_ylabel("recall of the exact top-512, 64K-128K prefixes (%)")
axes[1].legend(fontsize=8, loc="lower right")
fig.suptitle("v2 at 128K (H200): the folded stage 1 drops the reach-back layers' keys", fontsize=11)
fig.tight_layout()
fig.savefig("docs/results/served_recall_v2_128k_h200.png", dpi=110)
