"""The figure of results.md, \"16 bytes a key at 128K\": python docs/results/code16_families_plot.py (from the repo root)."""
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

a = json.load(open("docs/results/code16_bonus_aniso_metric_v2_128k_h200.json"))["summary"]
b = json.load(open("docs/results/code16_wide_codebooks_lsq_v2_128k_h200.json"))["summary"]
k = "k512/rerank@2048"
rows = [
 ("RQ16 (run A)", a["base:16"][k], "A"),
 ("RQ15 + residual-norm byte, bonus 1.5", a["ucb:15:0.5/0.75/1/1.5:gq:q8"]["q8/gq/b1.5/rerank@2048"], "A"),
 ("RQ15 + bonus as a codeword", a["lin:15:0.5/1:q8/b0.5"][k], "A"),
 ("RQ16, anisotropic coding (eta 2)", a["aniso:16:2"][k], "A"),
 ("RQ16, metric over 8x top-k", a["mk:16:4"][k], "A"),
 ("RQ16 (run B)", b["base:16"][k], "B"),
 ("RQ16, trained greedily", b["kb:16:256"][k], "B"),
 ("12 x 10-bit + 1 byte", b["kb:12:1024:1:256"][k], "B"),
 ("10 x 12-bit + 1 byte", b["kb:10:4096:1:256"][k], "B"),
 ("9 x 12-bit + 2 x 10-bit", b["kb:9:4096:2:1024"][k], "B"),
 ("RQ16 + joint LS refit (LSQ-like)", b["lsq:16:4"][k], "B"),
]
fig, ax = plt.subplots(figsize=(8, 5))
names = [r[0] for r in rows][::-1]
vals = [100 * r[1] for r in rows][::-1]
cols = ["#4c72b0" if r[2] == "A" else "#55a868" for r in rows][::-1]
ax.barh(names, vals, color=cols)
for i, v in enumerate(vals):
    ax.text(v + 0.01, i, f"{v:.2f}%", va="center", fontsize=8)
ax.axvline(99.5, color="red", ls="--", lw=1)
ax.text(99.5, len(rows) - 0.4, " target 99.5%", color="red", fontsize=8)
ax.axvline(100 * b["base:24"][k], color="gray", ls=":", lw=1)
ax.text(100 * b["base:24"][k], -0.9, " RQ24 (24 B)", color="gray", fontsize=8)
ax.set_xlim(98.2, 100.0)
ax.set_xlabel("held-out recall of the exact top-512 at C = 2,048 (%), mean of 4 layers")
ax.set_title("16 bytes a key, v2 at 128K (H200): every code family short of 99.5%", fontsize=10)
fig.tight_layout()
fig.savefig("docs/results/code16_families_v2_128k_h200.png", dpi=110)
