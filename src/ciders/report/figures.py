"""The report's PNG figures (matplotlib, Agg). Each function takes data already read back from the run
directories (see `ciders.report.html`), writes one PNG and returns its path; none reads files itself,
so the figures can be redrawn from any source of the same numbers."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
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

# The round convention of every figure: metrics.jsonl numbers rounds from 0 and writes what precedes the
# first round (pre-alignment, the evaluation before training) as round -1; the figures draw record round t
# at x = t + 1, so a per-round statistic sits at its 1-based round and an evaluation at the number of rounds
# completed (0: before training), the same x for the same round everywhere.
ROUND_AXIS = "round (1 = the first)"
EVAL_AXIS = "rounds completed (0 = before training)"

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


def informative(points) -> bool:
    """Whether a panel's (x, y) points say anything: at least two finite points, and neither axis
    constant (a constant gamma_t stacks every round on one x; one point is no curve)."""
    pts = [(float(x), float(y)) for x, y in points
           if isinstance(x, numbers.Real) and isinstance(y, numbers.Real) and np.isfinite(x) and np.isfinite(y)]
    return len(pts) >= 2 and len({x for x, _ in pts}) > 1 and len({y for _, y in pts}) > 1


def seed_curves(panels: dict[str, Seeds], path: str | Path, xlabel: str = ROUND_AXIS,
                colors: dict[str, str] | None = None, title: str = "") -> Path | None:
    """One panel per quantity: per method the mean over seeds, with the min-max band over seeds (the
    band is only drawn where every seed has the point, so a missing seed cannot fake a narrow band).
    Panels that carry no information (`informative`) are left out; None when none is left."""
    panels = {k: v for k, v in panels.items()
              if informative([(x, y) for seeds in v.values() for s in seeds for x, y in s.items()])}
    if not panels:
        return None
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


@dataclass
class Panel:
    """One x-y panel: per series (a legend entry) one or more lines (e.g. one per seed), each a list of
    (x, y) or (x, y, yerr) points; yerr > 0 is drawn as an error bar."""
    title: str
    xlabel: str
    ylabel: str
    series: dict[str, list[list[tuple]]] = field(default_factory=dict)
    logx: bool = False  # a logarithmic x axis (epsilon spans orders of magnitude)
    logy: bool = False  # a logarithmic y axis (a quality that spans orders of magnitude, e.g. a diverged PPL)

    def points(self) -> list[tuple]:
        return [p[:2] for lines in self.series.values() for line in lines for p in line]


def xy_panels(panels: list[Panel], path: str | Path, colors: dict[str, str] | None = None,
              ncols: int = 3) -> Path | None:
    """Quality against a resource (communication, wall clock, stored MiB, drop ratio): per series its
    lines, points joined in x order. Panels without information (`informative`) are left out; None
    when none is left."""
    panels = [p for p in panels if informative(p.points())]
    if not panels:
        return None
    fig, axes = _grid(len(panels), ncols, w=4.6, h=3.4)
    for ax, p in zip(axes, panels):
        for i, (name, lines) in enumerate(p.series.items()):
            c = _color(colors, name, i)
            for j, line in enumerate(lines):
                pts = sorted(q for q in line if np.isfinite(q[0]) and np.isfinite(q[1]))
                if not pts:
                    continue
                x, y = [q[0] for q in pts], [q[1] for q in pts]
                err = [q[2] if len(q) > 2 else 0.0 for q in pts]
                lab = (f"{name} (n={len(lines)})" if len(lines) > 1 else name) if j == 0 else None
                if any(e > 0 for e in err):
                    ax.errorbar(x, y, yerr=err, fmt="o-", ms=3, capsize=3, color=c, label=lab)
                else:
                    ax.plot(x, y, "o-", ms=3, color=c, alpha=0.9 if len(lines) == 1 else 0.6, label=lab)
        ax.set_title(p.title, fontsize=10)
        if p.logx:
            ax.set_xscale("log")
        if p.logy:
            ax.set_yscale("log")
        ax.set_xlabel(p.xlabel)
        ax.set_ylabel(p.ylabel, fontsize=8.5)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5)
        if not p.logy:
            ax.ticklabel_format(axis="y", useOffset=False)
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
              colors: dict[str, str] | None = None) -> Path | None:
    """E-RAE, S-DR and S-PPR per round (mean over clients, p10-p90 band) beside the idealised psi_t
    reference (DR_ref = 1 - psi_t, PPR_ref = psi_t), and the same against gamma_t (Figs. 4-5). A panel
    without information is left out (`informative`: e.g. the gamma_t row of a constant gamma, or one
    round); None when none is left."""
    data = {}  # (row, key) -> [(method, colour, x, y, lo, hi, reference rows)]
    for i, (m, (means, ref)) in enumerate(per_method.items()):
        c = _color(colors, m, i)
        gamma = {r["round"]: r["gamma"] for r in ref}
        for key, _, ref_key in CONSENSUS:
            rs = [r for r in means if key in r]
            t = np.array([r["round"] + 1 for r in rs], dtype=float)  # rounds completed, as every figure
            g = np.array([gamma.get(r["round"], np.nan) for r in rs], dtype=float)
            y, lo, hi = (np.array([r[k] for r in rs], dtype=float) for k in (key, f"{key}_p10", f"{key}_p90"))
            rt = [r for r in ref if r["round"] + 1 <= (t.max() if t.size else 0)] if ref_key else []
            data.setdefault(("top", key), []).append((m, c, t, y, lo, hi, rt))
            data.setdefault(("bottom", key), []).append((m, c, g, y, lo, hi, rt))
    keep = [(row, key, label, ref_key) for row in ("top", "bottom") for key, label, ref_key in CONSENSUS
            if informative([(x, v) for *_, xs, ys, _lo, _hi, _rt in data.get((row, key), []) for x, v in zip(xs, ys)])]
    if not keep:
        return None
    fig, axes = _grid(len(keep), 3, w=4.2, h=3.2)
    for ax, (row, key, label, ref_key) in zip(axes, keep):
        for m, c, x, y, lo, hi, rt in data[(row, key)]:
            if row == "top":
                ax.plot(x, y, "o-", ms=3, color=c, label=m)
                ax.fill_between(x, lo, hi, color=c, alpha=0.2, lw=0)
                if ref_key:
                    ax.plot([r["round"] + 1 for r in rt], [r[ref_key] for r in rt], "--", color=c,
                            label=f"{m}: {ref_key} (psi_t)")
            else:
                # the p10-p90 range as a line beside the mean (a mean can lie outside it: few, skewed clients)
                ax.vlines(x, lo, hi, color=c, alpha=0.8, lw=1)
                ax.plot(x, y, "o", ms=3, color=c, alpha=0.8, label=m)
                if ref_key:
                    order = sorted(rt, key=lambda r: r["gamma"])
                    ax.plot([r["gamma"] for r in order], [r[ref_key] for r in order], "x--", color=c,
                            label=f"{m}: {ref_key} (psi_t)")
        if row == "top":
            ax.set_title(f"{label} per round", fontsize=10)
            ax.set_xlabel(ROUND_AXIS)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        else:
            ax.set_title(f"{label} against gamma_t", fontsize=10)
            ax.set_xlabel("gamma_t")
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
        over.set(xlabel=ROUND_AXIS, ylabel="r_FD", title=f"{m}: r_FD per step")
        over.xaxis.set_major_locator(MaxNLocator(integer=True))
        for ax in (hist, over):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        if len({s["round"] for s in steps}) < 2:  # one round: the per-round panel says nothing more
            over.set_visible(False)
    fig.tight_layout()
    return _save(fig, path)
