"""The report's PNG figures (matplotlib, Agg). Each function takes data already read back from the run
directories (see `ciders.report.html`), writes one PNG and returns its path; none reads files itself,
so the figures can be redrawn from any source of the same numbers."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

DPI = 110
# the r_FD class boundaries (ciders.core.metagrad.fd_class) drawn on the FD profile;
# docs/method.md#eq-7-finite-difference-meta-gradient-fd
THRESHOLDS = (0.1, 0.2)

# {method: [one {x: y} per seed]}: the shape every seed-band curve takes
Seeds = dict[str, list[dict[float, float]]]


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def _color(colors: dict[str, str] | None, method: str, i: int) -> str:
    return (colors or {}).get(method, f"C{i % 10}")


def _grid(n: int, ncols: int, w: float = 4.2, h: float = 3.2, layout: str | None = None):
    ncols = max(1, min(n, ncols))
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows), squeeze=False, layout=layout)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def seed_curves(panels: dict[str, Seeds], path: str | Path, xlabel: str = "round",
                colors: dict[str, str] | None = None, title: str = "") -> Path:
    """One panel per quantity: per method the mean over seeds, with the min-max band over seeds (the
    band is only drawn where every seed has the point, so a missing seed cannot fake a narrow band)."""
    fig, axes = _grid(len(panels), 3)
    for ax, (label, methods) in zip(axes, panels.items()):
        for i, (m, seeds) in enumerate(methods.items()):
            xs = sorted({x for s in seeds for x in s})
            mean = [np.mean([s[x] for s in seeds if x in s]) for x in xs]
            c = _color(colors, m, i)
            ax.plot(xs, mean, "o-", ms=3, color=c, label=f"{m} (n={len(seeds)})" if len(seeds) > 1 else m)
            full = [x for x in xs if all(x in s for s in seeds)]
            if len(seeds) > 1 and full:
                lo = [min(s[x] for s in seeds) for x in full]
                hi = [max(s[x] for s in seeds) for x in full]
                ax.fill_between(full, lo, hi, color=c, alpha=0.2, lw=0)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def nll_heatmaps(mats: dict[str, tuple[list[str], list[str], np.ndarray]], path: str | Path) -> Path:
    """Side-by-side L_ij heatmaps (rows: source messenger i, columns: target domain j) on one shared
    colour scale, each cell annotated, the diagonal outlined (the paper's Fig. 7)."""
    vals = np.concatenate([m[np.isfinite(m)] for _, _, m in mats.values()])
    vmin, vmax = (float(vals.min()), float(vals.max())) if vals.size else (0.0, 1.0)
    fig, axes = _grid(len(mats), 4, w=4.4, h=4.0, layout="constrained")
    im = None
    for ax, (method, (rows, cols, m)) in zip(axes, mats.items()):
        im = ax.imshow(np.ma.masked_invalid(m), cmap="viridis_r", vmin=vmin, vmax=vmax)
        mid = (vmin + vmax) / 2
        for i in range(m.shape[0]):
            for j in range(m.shape[1]):
                if np.isfinite(m[i, j]):
                    ax.text(j, i, f"{m[i, j]:.2f}", ha="center", va="center", fontsize=7,
                            color="white" if m[i, j] > mid else "black")
                if rows[i] == cols[j]:
                    ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec="red", lw=1.2))
        ax.set_xticks(range(len(cols)), cols, rotation=45, ha="right", fontsize=7)
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
        ax.set_xlabel("target domain j")
        if ax.get_subplotspec().is_first_col():
            ax.set_ylabel("source messenger i")
        ax.set_title(method, fontsize=10)
    fig.colorbar(im, ax=axes, shrink=0.8, label="response NLL L_ij")
    return _save(fig, path)


# (key of round_means, label, key of the psi reference drawn dashed beside it)
CONSENSUS = (("e_rae", "E-RAE", None), ("s_dr", "S-DR", "dr_ref"), ("s_ppr", "S-PPR", "ppr_ref"))


def consensus(per_method: dict[str, tuple[list[dict], list[dict]]], path: str | Path,
              colors: dict[str, str] | None = None) -> Path:
    """E-RAE, S-DR and S-PPR per round (mean over clients, p10-p90 band) beside the idealised psi_t
    reference (DR_ref = 1 - psi_t, PPR_ref = psi_t), and the same against gamma_t (Figs. 4-5)."""
    fig, axes = plt.subplots(2, 3, figsize=(12.6, 6.4), squeeze=False)
    for i, (m, (means, ref)) in enumerate(per_method.items()):
        c = _color(colors, m, i)
        gamma = {r["round"]: r["gamma"] for r in ref}
        for col, (key, label, ref_key) in enumerate(CONSENSUS):
            rs = [r for r in means if key in r]
            t = np.array([r["round"] + 1 for r in rs])
            g = np.array([gamma.get(r["round"], np.nan) for r in rs])
            y, lo, hi = (np.array([r[k] for r in rs]) for k in (key, f"{key}_p10", f"{key}_p90"))
            top, bottom = axes[0][col], axes[1][col]
            top.plot(t, y, "o-", ms=3, color=c, label=m)
            top.fill_between(t, lo, hi, color=c, alpha=0.2, lw=0)
            # the p10-p90 range as a line beside the mean (a mean can lie outside it: few, skewed clients)
            bottom.vlines(g, lo, hi, color=c, alpha=0.8, lw=1)
            bottom.plot(g, y, "o", ms=3, color=c, alpha=0.8, label=m)
            if ref_key:
                rt = [r for r in ref if r["round"] + 1 <= (t.max() if t.size else 0)]
                top.plot([r["round"] + 1 for r in rt], [r[ref_key] for r in rt], "--", color=c,
                         label=f"{m}: {ref_key} (psi_t)")
                order = sorted(rt, key=lambda r: r["gamma"])
                bottom.plot([r["gamma"] for r in order], [r[ref_key] for r in order], "x--", color=c,
                            label=f"{m}: {ref_key} (psi_t)")
            top.set_title(f"{label} per round", fontsize=10)
            bottom.set_title(f"{label} against gamma_t", fontsize=10)
            top.set_xlabel("round")
            top.xaxis.set_major_locator(MaxNLocator(integer=True))
            bottom.set_xlabel("gamma_t")
            if len(set(g[np.isfinite(g)])) == 1:  # a constant gamma stacks the rounds on one x
                bottom.set_title(f"{label} against gamma_t (constant {g[0]:g}, one point per round)", fontsize=8.5)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
        ax.ticklabel_format(axis="y", useOffset=False)
    fig.tight_layout()
    return _save(fig, path)


def pca_paths(pcas: dict[str, dict], path: str | Path, labels: dict[str, str] | None = None) -> Path:
    """Per run: client-rounds in the plane of the first two principal components of the five
    statistics, coloured by client, with each client's early -> middle -> late centroid path (Fig. 6)."""
    fig, axes = _grid(len(pcas), 3, w=4.4, h=3.8)
    for ax, (name, p) in zip(axes, pcas.items()):
        clients = sorted({q["client"] for q in p["points"]})
        for i, cl in enumerate(clients):
            c, pts = f"C{i % 10}", [q for q in p["points"] if q["client"] == cl]
            ax.scatter([q["pc1"] for q in pts], [q["pc2"] for q in pts], s=12, color=c, alpha=0.35)
            cen = [p["centroids"][cl][ph] for ph in ("early", "middle", "late") if ph in p["centroids"].get(cl, {})]
            if cen:
                xy = np.array(cen)
                ax.plot(xy[:, 0], xy[:, 1], "-", color=c, lw=1.5,
                        label=(labels or {}).get(cl, cl))
                ax.scatter(xy[:, 0], xy[:, 1], color=c, s=[30, 50, 80][: len(xy)], edgecolor="black", zorder=3)
                ax.annotate("", xy[-1], xy[-2] if len(xy) > 1 else xy[-1],
                            arrowprops={"arrowstyle": "->", "color": c})
        ev = p.get("explained", [])
        ax.set_xlabel(f"PC1 ({100 * ev[0]:.0f}%)" if ev else "PC1")
        ax.set_ylabel(f"PC2 ({100 * ev[1]:.0f}%)" if len(ev) > 1 else "PC2")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, title="client (early→late)", title_fontsize=7)
    fig.tight_layout()
    return _save(fig, path)


def fd_profile(fds: dict[str, dict], path: str | Path, colors: dict[str, str] | None = None) -> Path:
    """Per FD run: the histogram of the per-step relative FD correction r_FD (log scale) and r_FD per
    step over rounds, both with the 0.1 / 0.2 class thresholds (Fig. 3)."""
    fig, axes = plt.subplots(len(fds), 2, figsize=(10, 3.2 * len(fds)), squeeze=False)
    for i, (m, fd) in enumerate(fds.items()):
        c = _color(colors, m, i)
        steps = [s for s in fd["per_step"] if np.isfinite(s["r_fd"])]
        r = np.clip(np.array([s["r_fd"] for s in steps], dtype=float), 1e-6, None)
        hist, over = axes[i]
        if r.size:
            lo, hi = np.log10(r.min()), np.log10(max(r.max(), 0.3))
            hist.hist(r, bins=np.logspace(lo, hi + 1e-9, 30), color=c, alpha=0.8)
            jitter = np.random.default_rng(0).uniform(-0.15, 0.15, r.size)
            over.scatter(np.array([s["round"] + 1 for s in steps]) + jitter, r, s=8, color=c, alpha=0.6)
        for th, ls in zip(THRESHOLDS, (":", "--")):
            hist.axvline(th, color="red", ls=ls, label=f"r_FD = {th}")
            over.axhline(th, color="red", ls=ls, label=f"r_FD = {th}")
        hist.set_xscale("log")
        over.set_yscale("log")
        hist.set(xlabel="r_FD per local step", ylabel="steps", title=f"{m}: r_FD histogram")
        over.set(xlabel="round", ylabel="r_FD", title=f"{m}: r_FD per step")
        over.xaxis.set_major_locator(MaxNLocator(integer=True))
        for ax in (hist, over):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)
