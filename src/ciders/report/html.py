"""`ciders report RUN_DIR|COMPARE_DIR|SWEEP_DIR|BILEVEL_DIR`: one self-contained HTML page (inline CSS, the
figures embedded as base64 PNG, no external resources) with the comparison / communication / sweep tables (HTML
tables, the seed std beside each mean of several seeds) and the figures of `ciders.report.figures`, written to
<dir>/report/index.html beside the fig_*.png it embeds. Figures draw record round t at x = t + 1
(`figures.ROUND_AXIS`), and leave out panels without information (`figures.informative`).

A run directory is shown as a one-method, one-seed group, so both kinds of directory share every
section; a section whose data the runs lack says so instead of failing."""

from __future__ import annotations

import base64
import html
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ciders.errors import CidersError
from ciders.fileio import check_output, output_dir, write_text
from ciders.report import diagnostics as dg
from ciders.report import figures, tables

MIB = 2**20  # bytes (ciders.federation.rundir.MIB)

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1400px; padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; margin-top: 2em; } h3 { font-size: 1.05em; }
table { border-collapse: collapse; margin: .6em 0; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f2f2f2; text-align: center; } td.num { text-align: right; font-variant-numeric: tabular-nums;
white-space: nowrap; } .sd { color: #666; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption, .note { color: #555; font-size: 12.5px; } .na { color: #a33; font-style: italic; }
pre { background: #f7f7f7; padding: .8em; overflow-x: auto; font-size: 12px; }
nav a { margin-right: 1em; }
"""

# sets data-images-ok="N/M" on <body> once the page has loaded, and logs every figure that did not
# decode, so a headless browser (the test) can tell that the embedded figures render
IMAGE_CHECK = """
window.addEventListener("load", function () {
  var imgs = document.images, ok = 0;
  for (var i = 0; i < imgs.length; i++) {
    if (imgs[i].complete && imgs[i].naturalWidth > 0) { ok++; }
    else { console.error("report: figure did not load: " + imgs[i].alt); }
  }
  document.body.dataset.imagesOk = ok + "/" + imgs.length;
});
"""


@dataclass
class Group:
    """One method's runs (one per seed): the unit every figure and table draws."""
    method: str
    seeds: list[int]
    runs: list[dg.Run]

    @property
    def ciders(self) -> bool:
        """CIDERS (consensus) runs have gamma > 0; the consensus statistics of the others are trivial."""
        return any((r.get("gamma") or 0) > 0 for run in self.runs for r in run.events("client"))

    def pooled(self) -> dg.Run:
        """All seeds' rows as one run: per-round statistics over clients x seeds (same config up to seed)."""
        return dg.Run(self.runs[0].root, self.runs[0].cfg, [r for run in self.runs for r in run.rows])


class Page:
    """The HTML being assembled, and the figures written beside it."""

    def __init__(self, folder: Path):
        self.folder, self.parts, self.toc, self.scope = folder, [], [], "this run"

    def add(self, text: str) -> None:
        self.parts.append(text)

    def section(self, title: str) -> None:
        anchor = f"s{len(self.toc)}"
        self.toc.append((anchor, title))
        self.add(f'<h2 id="{anchor}">{esc(title)}</h2>')

    def missing(self, what: str) -> None:
        self.add(f'<p class="na">{esc(what)}: not available in {self.scope}.</p>')

    def figure(self, name: str, draw: Callable[[Path], Path | None], caption: str) -> bool:
        """Draw and embed fig_<name>.png; False (nothing added) when `draw` left every panel out."""
        png = draw(self.folder / f"fig_{name}.png")
        if png is None:
            return False
        data = base64.b64encode(png.read_bytes()).decode("ascii")
        self.add(f'<figure><img alt="{esc(name)}" src="data:image/png;base64,{data}">'
                 f'<figcaption>{esc(caption)} ({esc(png.name)})</figcaption></figure>')
        return True

    def render(self, title: str, intro: str) -> str:
        nav = " ".join(f'<a href="#{a}">{esc(t)}</a>' for a, t in self.toc)
        return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
                f"<style>{CSS}</style></head>\n<body>\n<h1>{esc(title)}</h1>\n{intro}\n<nav>{nav}</nav>\n"
                + "\n".join(self.parts) + f"\n<script>{IMAGE_CHECK}</script>\n</body></html>\n")


def esc(x: object) -> str:
    return html.escape(str(x))


NUMERIC = re.compile(r"^\s*(–|-|[-+−]?(\d[\d,]*\.?\d*|\.\d+)([eE][-+]?\d+)?\s*%?(\s*(±|/).*)?)\s*$")


def _cell(c: str) -> str:
    """A cell, right-aligned (class num) when it shows a number (tags aside), e.g. '1.23 ± 0.04' or '–'."""
    return f'<td class="num">{c}</td>' if NUMERIC.match(re.sub("<[^>]+>", "", c)) else f"<td>{c}</td>"


def table(head: list[str], rows: list[list[str]], thead: str | None = None) -> str:
    """An HTML table; head and cells are already HTML (escape text with `esc`). `thead`: the header rows'
    HTML instead of one row from `head` (e.g. grouped columns)."""
    th = thead if thead is not None else "<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"
    body = "".join("<tr>" + "".join(_cell(c) for c in r) + "</tr>" for r in rows)
    return f"<table><thead>{th}</thead><tbody>{body}</tbody></table>"


def spread(key: str, a: dict | None) -> str:
    """A metric's mean over seeds, its seed std beside it when there are several seeds ('–' if none)."""
    if not a or a.get("mean") is None:
        return "–"
    n = a.get("n", len(a.get("values", [])) or 1)
    sd = f'<span class="sd"> ± {metric(key, a["std"])}</span>' if n > 1 and a.get("std") is not None else ""
    return metric(key, a["mean"]) + sd


def md_html(text: str) -> str:
    """The markdown that sweep.md / table.md / bilevel.md hold, as HTML: pipe tables become tables (the
    first row the header, the separator row dropped), **x** bold, <u>x</u> underlined, '### x' a heading,
    other lines paragraphs."""
    out, block = [], []

    def inline(t: str) -> str:
        t = esc(t.strip()).replace("&lt;u&gt;", "<u>").replace("&lt;/u&gt;", "</u>")
        return re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", t)

    def flush() -> None:
        if not block:
            return
        cells = [[c for c in ln.strip().strip("|").split("|")] for ln in block]
        rows = [r for r in cells[1:] if not all(re.fullmatch(r"\s*:?-{3,}:?\s*", c) for c in r)]
        out.append(table([inline(c) for c in cells[0]], [[inline(c) for c in r] for r in rows]))
        block.clear()

    for ln in text.splitlines():
        if ln.lstrip().startswith("|"):
            block.append(ln)
            continue
        flush()
        if ln.startswith("#"):
            out.append(f"<h3>{inline(ln.lstrip('#'))}</h3>")
        elif ln.strip():
            out.append(f'<p class="note">{inline(ln)}</p>')
    flush()
    return "\n".join(out)


def num(v: float | None, fmt: str = "{:.4g}") -> str:
    return "–" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt.format(v)


def metric(key: str, v: float | None) -> str:
    _, _, scale, fmt = tables.METRICS[key]
    return num(None if v is None else v * scale, fmt)


def label(key: str) -> str:
    name, sign, _, _ = tables.METRICS[key]
    return esc(name + {1: " ↑", -1: " ↓", 0: ""}[sign])


# ---- reading the directory ----------------------------------------------------------------------

def summary_of(run: dg.Run) -> dict | None:
    p = run.root / "summary.json"
    return json.loads(p.read_text()) if p.is_file() else None


def compare_groups(root: Path, info: dict) -> tuple[dict[str, Group], list[str]]:
    """The compare directory's runs by method, and the (method, seed) runs that could not be read."""
    groups, lost = {}, []
    pending = set(info.get("pending", ()))  # a comparison in progress: runs not finished yet are not drawn
    for m in info["methods"]:
        seeds, runs = [], []
        for s in info["seeds"]:
            if f"{m}/seed{s}" in pending:
                continue
            # the recorded path, unless the comparison directory was moved (then its own copy)
            here, recorded = root / m / f"seed{s}", info.get("runs", {}).get(m, {}).get(str(s))
            rd = here if here.is_dir() or not recorded else Path(recorded)
            try:
                runs.append(dg.load_run(rd))
                seeds.append(s)
            except FileNotFoundError:
                lost.append(f"{m} seed {s} ({rd})")
        if runs:
            groups[m] = Group(m, seeds, runs)
    return groups, lost


# ---- sections shared by both kinds of directory ---------------------------------------------------

def curves(page: Page, groups: dict[str, Group], colors: dict[str, str]) -> None:
    page.section("Training loss and evaluation curves")
    loss = {g.method: [{r["round"] + 1: r["loss"] for r in run.events("round") if _finite(r.get("loss"))}
                       for run in g.runs] for g in groups.values()}
    takd = {g.method: [{r["round"] + 1: r["loss"] for r in run.events("takd") if _finite(r.get("loss"))}
                       for run in g.runs] for g in groups.values()}
    panels = {"mean client training loss": loss, "server TAKD loss": takd}
    panels = {k: {m: s for m, s in v.items() if any(s)} for k, v in panels.items()}
    panels = {k: v for k, v in panels.items() if v}
    if not (panels and page.figure("loss", lambda p: figures.seed_curves(panels, p, colors=colors),
                                   "Per round; with several seeds their mean, band: min-max over seeds.")):
        page.missing("training loss (panels with one point or a constant value are left out)")
    evals: dict[str, dict] = {}
    for g in groups.values():
        for run in g.runs:
            per = {}
            for ev in run.events("eval"):
                for k, v in tables.metrics_of(ev).items():
                    per.setdefault(k, {})[ev["round"] + 1] = v * tables.METRICS[k][2]
            for k, xs in per.items():
                evals.setdefault(k, {}).setdefault(g.method, []).append(xs)
    by_label = {tables.METRICS[k][0]: evals[k] for k in tables.METRICS if k in evals}
    if not (by_label and page.figure(
            "eval", lambda p: figures.seed_curves(by_label, p, xlabel=figures.EVAL_AXIS, colors=colors),
            "Evaluations over rounds (0 = before training); with several seeds their mean, band: min-max.")):
        page.missing("evaluation curves (panels with one point or a constant value are left out)")


def _round_seconds(run: dg.Run) -> dict[int, float]:
    """{round: wall-clock seconds} from timing.jsonl (the wall clock is kept out of metrics.jsonl): each
    round's record {"round": t, "seconds": s}, from the round's start to its commit (its evaluation
    included); round -1 (pre-alignment and the first evaluation) is not a training round."""
    from ciders.fileio import read_jsonl

    p = run.root / "timing.jsonl"
    rows = read_jsonl(p) if p.is_file() else []
    return {r["round"]: float(r["seconds"]) for r in rows
            if isinstance(r.get("round"), int) and r["round"] >= 0 and "client" not in r and _finite(r.get("seconds"))}


def progress(run: dg.Run) -> list[dict]:
    """Per evaluation of the run: its rounds completed (record round + 1), the cumulative communication up
    to it in MiB (bytes down + up of every round record so far, all clients), the cumulative wall-clock
    seconds of the training rounds so far (None where a round's time is missing) and its metrics (scaled
    as tables.METRICS shows them). The evaluation before training (round -1) is at 0 MiB and 0 s."""
    mib, total = {-1: 0.0}, 0
    for r in sorted(run.events("round"), key=lambda r: r["round"]):
        total += sum(r.get("bytes_down", {}).values()) + sum(r.get("bytes_up", {}).values())
        mib[r["round"]] = total / MIB
    secs, clock, per = {-1: 0.0}, 0.0, _round_seconds(run)
    for t in range(max(per, default=-1) + 1):
        if t not in per:
            break
        clock += per[t]
        secs[t] = clock
    return [{"round": ev["round"] + 1, "mib": mib.get(ev["round"]), "seconds": secs.get(ev["round"]),
             "metrics": {k: v * tables.METRICS[k][2] for k, v in tables.metrics_of(ev).items()}}
            for ev in run.events("eval")]


def axis_label(key: str) -> str:
    """A metric's name and its direction, for a figure axis."""
    name, sign, _, _ = tables.METRICS[key]
    return name + {1: " (higher is better)", -1: " (lower is better)", 0: ""}[sign]


def efficiency(page: Page, groups: dict[str, Group], colors: dict[str, str]) -> None:
    """Quality against cumulative communication (MiB, up + down) and against training wall-clock seconds."""
    page.section("Quality against communication and wall-clock time")
    prog = {name: [progress(run) for run in g.runs] for name, g in groups.items()}
    keys = [k for k in tables.METRICS if any(k in e["metrics"] for runs in prog.values() for p in runs for e in p)]
    for name, (field, xlabel, what) in {
            "comm": ("mib", "cumulative communication, MiB (down + up, all clients)", "communication"),
            "wall": ("seconds", "wall-clock seconds of the training rounds", "wall-clock time")}.items():
        panels = [figures.Panel(f"{tables.METRICS[k][0]} against {what}", xlabel, axis_label(k), {
            m: [[(e[field], e["metrics"][k]) for e in p if e[field] is not None and k in e["metrics"]] for p in runs]
            for m, runs in prog.items()}) for k in keys]
        caption = ("Each evaluation (the first: before training, at 0) against the bytes of every round record "
                   "so far, down + up over all clients, in MiB; one line per seed." if name == "comm" else
                   "Each evaluation against the summed wall-clock time of the rounds so far (timing.jsonl: round "
                   "start to commit, evaluation included; pre-alignment and the first evaluation left out); one "
                   "line per seed.")
        if not (keys and page.figure(name, lambda p: figures.xy_panels(panels, p, colors=colors), caption)):
            page.missing(f"quality against {what} (needs two evaluations at different {what})")


def heatmaps(page: Page, groups: dict[str, Group]) -> None:
    page.section("Cross-domain NLL matrices")
    mats = {}
    for g in groups.values():
        cells = [m["cells"] for run in g.runs for m in [_last_matrix(run)] if m]
        if not cells:
            continue
        rows = sorted({s for c in cells for s in c})
        cols = sorted({t for c in cells for s in c for t in c[s]})
        stack = np.array([[[(c.get(s, {}).get(t) or {}).get("nll") for t in cols] for s in rows] for c in cells],
                         dtype=float)
        n = np.isfinite(stack).sum(0)  # seeds with the cell; a cell no seed has stays NaN (drawn blank)
        mean = np.where(n > 0, np.nansum(stack, 0) / np.maximum(n, 1), np.nan)
        mats[g.method if len(cells) == 1 else f"{g.method} (mean of {len(cells)} seeds)"] = (rows, cols, mean)
    if not mats:
        page.missing("NLL matrix (eval.tasks without nll_matrix)")
        return
    page.figure("nll", lambda p: figures.nll_heatmaps(mats, p),
                "L_ij of the final evaluation: AdapEmu with source messenger i on target domain j; "
                "shared colour scale, diagonal outlined.")


def consensus(page: Page, groups: dict[str, Group], colors: dict[str, str]) -> None:
    page.section("Consensus dynamics (E-RAE, S-DR, S-PPR)")
    ciders = {m: g for m, g in groups.items() if g.ciders}
    if not ciders:
        page.missing("consensus statistics (no run with gamma > 0)")
        return
    data = {m: (dg.round_means(g.pooled()), dg.psi_reference(g.runs[0])) for m, g in ciders.items()}
    if not page.figure("consensus", lambda p: figures.consensus(data, p, colors=colors),
                       "Mean over clients (and seeds) per round, band / bars: 10th-90th percentile; dashed: the "
                       "idealised reference (DR_ref = 1 - psi_t, PPR_ref = psi_t); then the same against gamma_t "
                       "(left out when gamma_t is constant)."):
        page.missing("consensus statistics with more than one round")


def pca(page: Page, groups: dict[str, Group]) -> None:
    page.section("PCA paths of the client statistics")
    pcas, labels = {}, {}
    for g in groups.values():
        p = dg.pca(g.runs[0]) if g.ciders else None
        if p:
            pcas[f"{g.method} seed {g.seeds[0]}"] = p
            data = g.runs[0].root / "data.json"
            names = json.loads(data.read_text()).get("client_label", {}) if data.is_file() else {}
            labels.update({c: f"{c} ({d})" for c, d in names.items()})
    if not pcas:
        page.missing("PCA (needs a CIDERS run with >= 3 client-rounds)")
        return
    page.figure("pca", lambda p: figures.pca_paths(pcas, p, labels), "Standardised PCA of ||c_i||, ||dc_i||, "
                "E-RAE, S-DR, S-PPR over client-rounds; lines: early -> middle -> late centroids per client.")


def fd(page: Page, groups: dict[str, Group], colors: dict[str, str]) -> None:
    page.section("Finite-difference correction profile")
    rows, pooled = [], {}
    for g in groups.values():
        for s, run in zip(g.seeds, g.runs):
            f = dg.fd_shares(run)
            if f:
                shares = [num(100 * f[c], "{:.1f}") for c in dg.FD_CLASSES]
                rows.append([esc(g.method), esc(s), esc(f["steps"]), *shares, f"{f['rounds_with_event']} / {f['rounds']}"])
        f = dg.fd_shares(g.pooled())
        if f:
            pooled[g.method] = f
    if not pooled:
        page.missing("FD correction (no second-order / FD run)")
        return
    page.figure("fd", lambda p: figures.fd_profile(pooled, p, colors=colors),
                "r_FD = ||FD correction|| / ||g|| per local step (all seeds), thresholds 0.1 / 0.2.")
    page.add(table(["method", "seed", "steps", "small % (≤ 0.1)", "moderate % (≤ 0.2)", "large % (> 0.2)",
                    "rounds with a moderate / large step"], rows))


def communication(page: Page, groups: dict[str, Group]) -> None:
    page.section("Communication")
    per = {}
    for g in groups.values():
        sums = [s for s in map(summary_of, g.runs) if s and s.get("client_rounds")]
        if sums:
            per[g.method] = {d: _mean_dict([{c: v / s["client_rounds"] for c, v in s["mib"]["by_component"][d].items()}
                                            for s in sums]) for d in ("down", "up")}
            per[g.method]["once"] = _mean_dict([s["mib"].get("first_contact", {}) for s in sums])
            per[g.method]["total"] = _mean_dict([{d: s["mib"][f"{d}_total"] for d in ("down", "up")} for s in sums])
    if not per:
        page.missing("communication (no summary.json)")
        return
    comps = {d: sorted({c for v in per.values() for c in v[d]}) for d in ("down", "up")}
    once = sorted({c for v in per.values() for c in v["once"]})
    head = ["method"] + [f"{d}: {esc(c)}" for d in ("down", "up") for c in comps[d] + ["total"]] + \
           [f"once: {esc(c)}" for c in once] + ["run total down", "run total up"]
    rows = [[esc(m)] + [num(v[d].get(c) if c != "total" else sum(v[d].values()), "{:.4f}") for d in ("down", "up")
                        for c in comps[d] + ["total"]] + [num(v["once"].get(c), "{:.3f}") for c in once]
            + [num(v["total"][d], "{:.3f}") for d in ("down", "up")] for m, v in per.items()]
    page.add('<p class="note">MiB per client-round by message component (mean over seeds); "once" columns: MiB per '
             'client downloaded only at first contact; run totals in MiB.</p>')
    page.add(table(head, rows))


def privacy(page: Page, root: Path, cfg) -> None:
    """The run's privacy settings and, with DP noise, epsilon(delta) spent after each round (docs/privacy.md)."""
    fed = getattr(cfg, "federation", None)
    if fed is None or not (getattr(fed, "secure_aggregation", False) or fed.dp.enabled):
        return
    page.section("Privacy")
    rows = [["secure aggregation", "on: the server saw only the sum of each round's updates" if fed.secure_aggregation
             else "off"], ["differential privacy", esc(fed.dp.mode)]]
    if fed.dp.enabled:
        server = [r for r in dg.load_run(root).events("server")]
        z = next((r.get("dp_noise_multiplier") for r in server if "dp_noise_multiplier" in r), None)
        rows += [["clipping norm C", num(fed.dp.clip)], ["noise multiplier z", num(z)], ["delta", num(fed.dp.delta)]]
    page.add(table(["setting", "value"], rows))
    spent = tables.privacy_spent(root)
    if spent:
        page.add('<p class="note">epsilon at dp.delta spent after each round (Opacus RDP accountant; central: the '
                 "federation's guarantee at sampling rate q; local: one client's, had it taken part every round).</p>")
        page.add(table(["round", "epsilon"], [[esc(t + 1), num(e)] for t, e in spent]))
    elif fed.dp.enabled:
        page.add('<p class="na">no noise (z = 0): clipping only, no finite epsilon</p>')


def config(page: Page, text: str, name: str) -> None:
    page.section("Configuration")
    page.add(f"<details><summary>{esc(name)}</summary><pre>{esc(text)}</pre></details>")


# ---- the two kinds of directory -------------------------------------------------------------------

def _figures(page: Page, groups: dict[str, Group]) -> None:
    colors = {m: f"C{i % 10}" for i, m in enumerate(groups)}
    curves(page, groups, colors)
    efficiency(page, groups, colors)
    heatmaps(page, groups)
    consensus(page, groups, colors)
    pca(page, groups)
    fd(page, groups, colors)


def compare_page(root: Path, page: Page) -> str:
    info = json.loads((root / "compare.json").read_text())
    groups, lost = compare_groups(root, info)
    page.scope = "these runs"
    agg = {m: {k: v for k, v in a.items() if k in tables.METRICS} for m, a in info.get("aggregate", {}).items()}
    keys = [k for k in tables.METRICS if any(k in v for v in agg.values())]
    page.section("Comparison table")
    if keys:
        rk = {k: tables.ranks(agg, k) for k in keys}
        control, marks = info.get("control"), tables.control_marks(info.get("against_control") or {})
        rows = []
        for m, v in agg.items():
            cells = [esc(f"{m} (control)" if m == control else m)]
            for k in keys:
                s = spread(k, v.get(k))
                r = rk[k].get(m)
                cells.append((f"<b>{s}</b>" if r == 1 else f"<u>{s}</u>" if r == 2 else s)
                             + (" †" if (m, k) in marks else ""))
            rows.append(cells)
        page.add(f'<p class="note">Final evaluation, mean ± sample std over seeds {esc(", ".join(map(str, info["seeds"])))}'
                 " (the std where a method has several seeds); <b>best</b>, <u>second</u> at the shown precision."
                 + (f" † : does not beat the {esc(control)} control (the same TAKD schedule, no client learning) "
                    "beyond the seed spread on that metric." if control in agg else "") + "</p>")
        page.add(table(["method"] + [label(k) for k in keys], rows))
    else:
        page.missing("comparison metrics")
    page.section("Per-seed metrics")
    per_seed = info.get("per_seed", {})
    rows = [[esc(m), esc(s)] + [metric(k, ms.get(k)) for k in keys]
            for m, seeds in per_seed.items() for s, ms in seeds.items()]
    page.add(table(["method", "seed"] + [label(k) for k in keys], rows) if rows else '<p class="na">none</p>')
    communication(page, groups)
    _figures(page, groups)
    if (root / "sweep.md").is_file():
        page.section("Sweep")
        page.add(md_html((root / "sweep.md").read_text()))
    if (root / "base_config.yaml").is_file():
        config(page, (root / "base_config.yaml").read_text(), "base_config.yaml (each method then fixes its own knobs)")
    if lost:
        page.add(f'<p class="na">runs not found: {esc("; ".join(lost))}</p>')
    pending = info.get("pending") or []
    if pending:
        page.add(f'<p class="na">in progress: {len(pending)} runs not finished yet, not shown '
                 f'({esc(", ".join(pending))})</p>')
    return (f"Comparison report: {info.get('config', root.name)} — {len(info['methods'])} methods × "
            f"{len(info['seeds'])} seeds" + (f" (in progress: {len(pending)} runs to go)" if pending else ""))


def run_page(root: Path, page: Page) -> str:
    run = dg.load_run(root)
    group = Group(run.method, [run.cfg.seed], [run])
    groups = {run.method: group}
    page.section("Final metrics")
    try:
        fm = tables.final_metrics(root)
        page.add(table(["metric", "value"], [[label(k), metric(k, v)] for k, v in fm.items() if k in tables.METRICS]))
    except ValueError as exc:
        page.missing(f"final metrics ({exc})")
    page.section("Evaluation before / after training")
    evs = run.events("eval")
    if len(evs) >= 2:
        before, after = tables.metrics_of(evs[0]), tables.metrics_of(evs[-1])
        keys = [k for k in tables.METRICS if k in before or k in after]
        page.add(table(["metric", f"round {evs[0]['round'] + 1} (before)", f"after round {evs[-1]['round'] + 1}"],
                       [[label(k), metric(k, before.get(k)), metric(k, after.get(k))] for k in keys]))
    else:
        page.missing("evaluation before and after training")
    communication(page, groups)
    privacy(page, root, run.cfg)
    _figures(page, groups)
    page.section("Diagnostics per round")
    means = {r["round"]: r for r in dg.round_means(run)}
    if means and group.ciders:
        ref = {r["round"]: r for r in dg.psi_reference(run)}
        cols = ("loss",) + dg.PCA_STATS
        rows = [[esc(t + 1), num(ref.get(t, {}).get("gamma"))] + [num(m.get(k)) for k in cols]
                + [num(ref.get(t, {}).get(k)) for k in ("dr_ref", "ppr_ref")] for t, m in means.items()]
        page.add(table(["round", "gamma_t"] + [esc(k) for k in cols] + ["DR_ref", "PPR_ref"], rows))
        page.add('<p class="note">Means over clients; DR_ref = 1 - psi_t, PPR_ref = psi_t (Prop. 2; docs/method.md#prop-2-psi_t-dr-and-ppr).</p>')
    else:
        page.missing("per-round consensus diagnostics (no CIDERS client rounds)")
    config(page, (root / "config.yaml").read_text(), "config.yaml")
    return f"Run report: {run.cfg.name} ({run.method}, seed {run.cfg.seed})"


SIZE_KEYS = ("stored_mib", "mib_down", "mib_up", "dp_epsilon")  # resources (and the privacy spent), not quality


def sweep_table(info: dict) -> str:
    """Rows: grid points; per method a column per metric of the sweep, mean with the seed std beside it
    (several seeds), the best method of each metric within a row in bold (by the metric's direction)."""
    keys, methods = [k for k, _ in info["grid"]], info["methods"]
    metrics = [k for k in info.get("metrics", []) if k in tables.METRICS]
    thead = ("<tr>" + "".join(f'<th rowspan="2">{esc(k)}</th>' for k in keys)
             + "".join(f'<th colspan="{len(metrics)}">{esc(m)}</th>' for m in methods) + "</tr><tr>"
             + "".join(f"<th>{label(k)}</th>" for _ in methods for k in metrics) + "</tr>")
    rows = []
    for row in info.get("rows", []):
        agg = row.get("aggregate", {})
        best = {}
        for k in metrics:
            vals = {m: agg.get(m, {}).get(k, {}).get("mean") for m in methods}
            vals = {m: float(metric(k, v)) for m, v in vals.items() if _finite(v)}
            if tables.METRICS[k][1] and len(set(vals.values())) > 1:
                best[k] = (max if tables.METRICS[k][1] > 0 else min)(vals, key=vals.get)
        cells = [esc(row.get("values", {}).get(k, "–")) for k in keys]
        for m in methods:
            for k in metrics:
                c = spread(k, agg.get(m, {}).get(k))
                cells.append(f"<b>{c}</b>" if best.get(k) == m else c)
        rows.append(cells)
    return table([], rows, thead=thead)


def _drop_ratio(row: dict) -> float | None:
    """The point's drop ratio: recorded by `ciders sweep`, else its grid value (drop_ratio, or 1 - beta)."""
    if _finite(row.get("drop_ratio")):
        return float(row["drop_ratio"])
    v = row.get("values", {})
    try:
        if "decomposition.drop_ratio" in v:
            return float(v["decomposition.drop_ratio"])
        if "decomposition.beta" in v:
            return 1 - float(v["decomposition.beta"])
    except ValueError:
        pass
    return None


def tradeoff_panels(info: dict) -> list[figures.Panel]:
    """The paper's Table V as figures: per quality metric of the sweep, its final value (mean over seeds,
    error bar: seed std) against the stored MiB of the edge model's LoRA, against the drop ratio and against
    the DP epsilon spent; one line per method and setting of the other grid keys."""
    rows, methods = info.get("rows", []), info["methods"]
    quality = [k for k in info.get("metrics", []) if k in tables.METRICS and k not in SIZE_KEYS and tables.METRICS[k][1]]
    if not quality:
        have = {k for r in rows for a in r.get("aggregate", {}).values() for k in a}
        quality = [k for k in ("ppl", "nll") if k in have][:1]
    # grid keys that only move a panel's x (the size, the privacy budget) are joined into one line, not split
    size = ("decomposition.drop_ratio", "decomposition.beta")
    moves_x = {"stored_mib": size, "drop_ratio": size,
               "dp_epsilon": ("federation.dp.target_epsilon", "federation.dp.noise_multiplier")}
    panels = []
    for q in quality:
        scale = tables.METRICS[q][2]
        for xname, what, xlabel in (
                ("stored_mib", "stored MiB", "stored edge LoRA, MiB (FP32, measured from the saved adapters)"),
                ("drop_ratio", "drop ratio", "drop ratio (1 - beta)"),
                ("dp_epsilon", "DP epsilon", "epsilon spent by the end of the run (at dp.delta; log scale)")):
            series: dict = {}
            other = [k for k, _ in info["grid"] if k not in moves_x[xname]]
            for r in rows:
                for m in methods:
                    a = r.get("aggregate", {}).get(m, {})
                    x = _drop_ratio(r) if xname == "drop_ratio" else a.get(xname, {}).get("mean")
                    if q not in a or not _finite(x):
                        continue
                    name = ", ".join([m] + [f"{k.rsplit('.', 1)[-1]}={r['values'][k]}" for k in other if k in r.get("values", {})])
                    err = a[q]["std"] * scale if a[q].get("n", 1) > 1 else 0.0
                    series.setdefault(name, [[]])[0].append((float(x), a[q]["mean"] * scale, err))
            panel = figures.Panel(f"{tables.METRICS[q][0]} against {what}", xlabel, axis_label(q), series,
                                  logx=xname == "dp_epsilon")
            ys = [y for _, y in panel.points()]
            if ys and min(ys) > 0 and max(ys) >= 10 * min(ys):  # e.g. a PPL that diverged at a small epsilon
                panel.logy, panel.ylabel = True, panel.ylabel + " (log scale)"
            panels.append(panel)
    return panels


def sweep_groups(root: Path, info: dict) -> tuple[dict[str, Group], list[str]]:
    """Every point's runs, a group per (method, point)."""
    groups, lost = {}, []
    for row in info.get("rows", []):
        d = root / row["point"]
        if not (d / "compare.json").is_file():
            lost.append(f"{row['point']} ({d})")
            continue
        gs, miss = compare_groups(d, json.loads((d / "compare.json").read_text()))
        short = ",".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in row.get("values", {}).items()) or row["point"]
        groups.update({f"{m} @ {short}": Group(f"{m} @ {short}", g.seeds, g.runs) for m, g in gs.items()})
        lost += miss
    return groups, lost


def sweep_page(root: Path, page: Page) -> str:
    info = json.loads((root / "sweep.json").read_text())
    page.scope = "this sweep"
    page.section("Sweep table")
    seeds = ", ".join(map(str, info.get("seeds", [])))
    page.add(f'<p class="note">Final evaluation per grid point, mean over seeds {esc(seeds)} with the sample std '
             "beside it where there are several seeds; <b>best</b> method of each metric within a row.</p>")
    page.add(sweep_table(info))
    page.section("Quality against stored size and drop ratio (Table V), and against the privacy spent")
    if not page.figure("tradeoff", lambda p: figures.xy_panels(tradeoff_panels(info), p, ncols=2),
                       "Final metric of each grid point (mean over seeds, bar: seed std) against the stored FP32 "
                       "LoRA MiB of the edge model (adapters/messenger + student), against the drop ratio and, in a "
                       "sweep over federation.dp, against the epsilon spent; a panel whose axis does not vary or "
                       "that has one point is left out."):
        page.missing("quality against stored size or drop ratio (needs points that differ in it)")
    groups, lost = sweep_groups(root, info)
    colors = {m: f"C{i % 10}" for i, m in enumerate(groups)}
    efficiency(page, groups, colors)
    page.add('<p class="note">Each point is a comparison directory; `ciders report` on one draws its figures: '
             + esc(", ".join(r["point"] for r in info.get("rows", []))) + "</p>")
    if lost:
        page.add(f'<p class="na">runs not found: {esc("; ".join(lost))}</p>')
    return f"Sweep report: {info.get('config', root.name)}"


def _bilevel_curves(runs: dict[str, dict[str, list[Path]]]) -> dict:
    """{panel: {method: [{round: value} per seed]}}: the evaluation metric per grid point, and C_x* per round."""
    from ciders.fileio import read_jsonl

    panels: dict = {}
    for point, methods in runs.items():
        for m, dirs in methods.items():
            for d in dirs:
                rows = read_jsonl(d / "metrics.jsonl")
                # x = record round + 1, as every figure (figures.ROUND_AXIS): the evaluation before training at 0
                ev = {r["round"] + 1: 100 * r.get("accuracy", r.get("balanced_accuracy", float("nan")))
                      for r in rows if r["event"] == "eval"}
                cov = {r["round"] + 1: r["covering_x"] for r in rows if r["event"] == "round"}
                panels.setdefault(f"{point}: accuracy %", {}).setdefault(m, []).append(ev)
                panels.setdefault(f"{point}: C_x*", {}).setdefault(m, []).append(cov)
    return panels


def bilevel_page(root: Path, page: Page) -> str:
    """A RABO-family directory: a table (`ciders bilevel --seeds/--grid`, table.json), an experiment
    (bilevel.json: one directory per method) or one method's run (final.safetensors)."""
    page.scope = "this bilevel run"
    if (root / "table.json").is_file():
        info = json.loads((root / "table.json").read_text())
        body, title = md_html((root / "table.md").read_text()), f"RABO-family table: {root.name}"
        runs = {pt: {m: sorted((root / pt).glob(f"seed*/{m}")) for m in info["methods"]} for pt in info["points"]}
    elif (root / "bilevel.json").is_file():
        info = json.loads((root / "bilevel.json").read_text())
        body, title = md_html((root / "bilevel.md").read_text()), f"RABO-family experiment: {root.name}"
        runs = {"run": {m: [root / m] for m in info}}
    else:
        summary = json.loads((root / "summary.json").read_text()) if (root / "summary.json").is_file() else {}
        body, title = f"<pre>{esc(json.dumps(summary, indent=2))}</pre>", f"RABO-family run: {root.name}"
        runs = {"run": {summary.get("method", root.name): [root]}}
    page.section("Table")
    page.add(body)
    page.section("Learning curves")
    panels = _bilevel_curves(runs)
    if not (panels and page.figure(
            "bilevel_curves", lambda path: figures.seed_curves(panels, path, xlabel=figures.EVAL_AXIS),
            "per method: mean over seeds (band: min-max) of the evaluation metric and of C_x* per round (x: rounds "
            "completed, 0 = before training; a panel with one point or a constant value is left out)")):
        page.missing("per-round metrics")
    return title


def write_report(path: str | Path, out: str | Path | None = None, force: bool = False) -> Path:
    """Write <out or path>/report/index.html (+ fig_*.png) for a run, compare, sweep or bilevel directory.
    The report directory must be new, empty or an earlier report (`fileio.check_output`) unless `force`."""
    root = Path(path)
    if (root / "compare.json").is_file():
        build = compare_page
    elif (root / "table.json").is_file() or (root / "bilevel.json").is_file() or (root / "final.safetensors").is_file():
        build = bilevel_page
    elif (root / "metrics.jsonl").is_file():
        build = run_page
    elif (root / "sweep.json").is_file():
        build = sweep_page
    else:
        raise CidersError(f"{root} is neither a run directory (metrics.jsonl) nor a comparison (compare.json), "
                          "sweep (sweep.json) or bilevel (table.json, bilevel.json) directory")
    folder = Path(out or root) / "report"
    check_output(folder, "report", force, ("index.html",))
    # built aside, then moved in: an earlier report's figures that this one does not redraw go, nothing else
    with output_dir(folder, "report") as tmp:
        page = Page(tmp)
        title = build(root, page)
        intro = f'<p class="note">Directory: {esc(root.resolve())}. Figures: {esc(folder)}.</p>'
        write_text(tmp / "index.html", page.render(title, intro))
    return folder / "index.html"


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _last_matrix(run: dg.Run) -> dict | None:
    """The nll_matrix of the latest evaluation that has one (a skipped matrix has no cells)."""
    ms = [ev["nll_matrix"] for ev in run.events("eval") if ev.get("nll_matrix", {}).get("cells")]
    return ms[-1] if ms else None


def _mean_dict(ds: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for d in ds for k in d}
    return {k: float(np.mean([d[k] for d in ds if k in d])) for k in sorted(keys)}
