"""Plot how the router spreads tokens over experts during training.

Reads the JSON-lines statistics file written by fairseq_moe's task
(``--moe-stats-file``), one object per ``--moe-stats-interval`` updates::

    {"update": 150, "layers": {"encoder.layers.1.moe": [f_0, ..., f_E-1], ...}}

where f_e is the share of routing assignments that went to expert e in that
window. Draws one stacked-area subplot per MoE layer (x = update).

Standalone use:  python plot_expert_load.py expert_load.jsonl expert_load.png
"""

import json
import math
import sys
from pathlib import Path


def read_stats(path):
    """{layer: (updates, [[f_0..f_E-1] per record])}, records in update order."""
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
    records.sort(key=lambda r: r["update"])
    layers = {}
    for rec in records:
        for name, fractions in rec["layers"].items():
            updates, rows = layers.setdefault(name, ([], []))
            updates.append(rec["update"])
            rows.append(fractions)
    return layers


def _layer_order(name):
    # encoder before decoder, then by layer index, so the grid reads top-down.
    side = 0 if name.startswith("encoder") else 1
    digits = [int(tok) for tok in name.split(".") if tok.isdigit()]
    return side, digits, name


def plot_expert_load(stats_file, png_file, title=None):
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    layers = read_stats(stats_file)
    if not layers:
        raise ValueError(f"{stats_file} holds no expert-load records")
    names = sorted(layers, key=_layer_order)
    n_experts = max(len(rows[0]) for _, rows in layers.values())
    cols = min(2, len(names))
    rows_n = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(6.5 * cols, 3.2 * rows_n), squeeze=False,
                             sharex=True, sharey=True)
    colors = plt.get_cmap("tab10" if n_experts <= 10 else "tab20")
    for ax, name in zip(axes.flat, names):
        updates, rows = layers[name]
        per_expert = list(zip(*rows))  # transpose: one series per expert
        ax.stackplot(updates, per_expert, colors=[colors(e % colors.N) for e in range(len(per_expert))],
                     labels=[f"expert {e}" for e in range(len(per_expert))], alpha=0.9)
        # Perfect balance would put every boundary on a multiple of 1/E.
        for k in range(1, len(per_expert)):
            ax.axhline(k / len(per_expert), color="white", lw=0.5, ls=":")
        ax.set_title(name, fontsize=10)
        ax.set_ylim(0, 1)
        ax.set_xlim(min(updates), max(updates) if len(updates) > 1 else min(updates) + 1)
        ax.set_ylabel("share of assignments")
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("update")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    legend_rows = math.ceil(n_experts / 8)
    fig.suptitle(title or "Expert load per MoE layer during training")
    fig.tight_layout(rect=(0, 0, 1, 1 - (0.06 + 0.04 * legend_rows) / rows_n))
    fig.legend(handles, labels, loc="upper center", ncol=min(n_experts, 8), fontsize=8,
               bbox_to_anchor=(0.5, 1 - 0.06 / rows_n), frameon=False)
    Path(png_file).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_file, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return Path(png_file)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(plot_expert_load(sys.argv[1], sys.argv[2]))
