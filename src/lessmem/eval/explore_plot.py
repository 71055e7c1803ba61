"""The explorer's picture: 128 weights original vs reconstructed, and SNR vs bits.

Top panels: each of the first 128 weights of row 0 as a dot,
its reconstruction as a cross, the error as a red bar between them, dashed lines at the
group boundaries — once with groups, once per-tensor. Bottom: SNR (dB) against bits,
one curve per group size. A symlog y axis keeps ordinary weights visible beside 100×
outliers.
"""

from __future__ import annotations


def plot_explorer(path, outlier: dict, curves: dict, title: str = "") -> str:
    """Write the PNG to ``path`` (matplotlib, Agg backend) and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(11, 11), gridspec_kw={"height_ratios": [1, 1, 1.1]})
    orig = outlier["row0_original"]
    n = len(orig)
    xs = list(range(n))
    big = max(abs(v) for v in orig)
    g = outlier["group"]
    for ax, key in zip(axes[:2], (f"g{g}", "per_tensor"), strict=True):
        r = outlier[key]
        rec = r["row0"]
        pairs = list(zip(orig, rec, strict=True))
        ax.vlines(xs, [min(p) for p in pairs], [max(p) for p in pairs],
                  colors="tab:red", linewidth=1.6, label="quantization error", zorder=1)
        ax.scatter(xs, orig, s=14, color="tab:blue", label="original fp16 weight", zorder=2)
        ax.scatter(xs, rec, s=18, marker="x", color="tab:orange", label="reconstructed value", zorder=3)
        bounds = range(g, n, g) if key != "per_tensor" else ()
        for b in bounds:
            ax.axvline(b - 0.5, color="gray", linestyle="--", linewidth=1)
        for c in outlier["outlier_cols"]:
            ax.annotate("outlier", (c, orig[c]), textcoords="offset points", xytext=(4, 4), fontsize=8)
        if big > 8:
            ax.set_yscale("symlog", linthresh=3)
        ax.set_xlim(-1, n)
        ax.set_ylabel("weight (symlog)" if big > 8 else "weight")
        ax.set_title(f"{outlier['scheme']} int{outlier['bits']} {r['granularity']}: "
                     f"{r['bits_per_weight']:.3g} bits/weight, SNR {r['snr_db']:.1f} dB, "
                     f"max |err| {r['max_abs_err']:.3g}"
                     + (f"  (ordinary weights: {r['snr_db_ordinary']:.1f} dB)" if outlier["outlier_cols"] else ""),
                     fontsize=10)
    axes[1].set_xlabel(f"first {n} weights of row 0" + (" — dashed lines: group boundaries" if g < n else ""))
    ax = axes[2]
    for label, pts in curves.items():
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xlabel("bits")
    ax.set_ylabel("SNR (dB)")
    ax.set_title("SNR vs bits per group size (symmetric)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=4)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", fontsize=8, ncol=3)
    fig.suptitle(title or "quantization error explorer", fontsize=11, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return str(path)
