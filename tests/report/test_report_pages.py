"""`ciders report` on a run, a comparison and a sweep written by the real engine, compare and sweep code over a
model-free task (no training of a model): HTML tables (not markdown), the Table V figure of a sweep, quality
against communication and wall-clock time, uninformative panels left out, one round convention, and every page
checked twice: always by parsing it (each image decodes, each table has its rows) and, where a Chromium is
installed, by loading it in headless Chromium (no image with naturalWidth 0, the same row counts)."""

from __future__ import annotations

import base64
import io
import json
import math
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from PIL import Image

from ciders.config import load_config
from ciders.experiments.sweep import run_sweep
from ciders.fileio import read_jsonl
from ciders.report import diagnostics as dg
from ciders.report import figures
from ciders.report.html import _bilevel_curves, md_html, progress, write_report
from synthetic import VectorTask

SETS = ["federation.clients=3", "federation.rounds=3", "algorithm.local_steps=2", "algorithm.optimizer=sgd",
        "algorithm.lr=0.05", "algorithm.gamma=0.3"]
METHODS, SEEDS, DROPS = ["ciders-fo", "fedavg"], [0, 1], ["0.2", "0.5"]


class PplTask(VectorTask):
    """VectorTask evaluated like the LLM task (a global NLL / perplexity that grows with the drop ratio) and
    saving a messenger adapter whose size shrinks with it, as a compressed edge model's would."""

    def __init__(self, cfg):
        super().__init__(cfg.federation.clients, seed=cfg.seed)
        self.drop = cfg.decomposition.split_kwargs().get("drop_ratio", 0.2)

    def evaluate(self, t, server, personalized):
        nll = super().evaluate(t, server, personalized)["global_loss"] * (1 + self.drop)
        return {"global": {"nll": nll, "ppl": math.exp(nll), "tokens": 100}}

    def finalize(self, out, server, extra):
        from safetensors.torch import save_file

        d = Path(out) / "adapters" / "messenger"
        d.mkdir(parents=True, exist_ok=True)
        save_file({"w": torch.zeros(int(2**18 * (1 - self.drop)))}, str(d / "adapter_model.safetensors"))


def sweep(out: Path, grid, seeds=SEEDS, sets=SETS) -> Path:
    run_sweep(load_config(None, sets), grid, METHODS, seeds, out, make_task=lambda c, o: PplTask(c),
              log=lambda s: None, progress=False, control=None)  # the control row: tests/experiments/test_compare.py
    return out


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory) -> Path:
    return sweep(tmp_path_factory.mktemp("sweep") / "s", [("decomposition.drop_ratio", DROPS)])


# ---- reading a page back --------------------------------------------------------------------------

class Page(HTMLParser):
    """The <img> sources, and per <table> its section (the <h2> above it), header and body rows."""

    def __init__(self, text: str):
        super().__init__()
        self.imgs, self.tables, self.section, self._h2, self._cell = [], [], "", False, None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.imgs.append(a.get("src", ""))
        elif tag == "h2":
            self._h2, self.section = True, ""
        elif tag == "table":
            self.tables.append({"section": self.section, "head": [], "rows": [], "part": None})
        elif tag in ("thead", "tbody") and self.tables:
            self.tables[-1]["part"] = tag
        elif tag == "tr" and self.tables and self.tables[-1]["part"] == "tbody":
            self.tables[-1]["rows"].append([])
        elif tag in ("td", "th") and self.tables:
            self._cell = {"text": "", "class": a.get("class", ""), "tag": tag}

    def handle_endtag(self, tag):
        if tag == "h2":
            self._h2 = False
        elif tag in ("td", "th") and self._cell is not None and self.tables:
            t = self.tables[-1]
            (t["rows"][-1] if t["part"] == "tbody" and t["rows"] else t["head"]).append(self._cell)
            self._cell = None

    def handle_data(self, data):
        if self._h2:
            self.section += data
        if self._cell is not None:
            self._cell["text"] += data

    def table(self, section: str) -> dict:
        (t,) = [t for t in self.tables if t["section"] == section]
        return t


def image_bytes(src: str, folder: Path) -> bytes:
    if src.startswith("data:"):
        head, _, data = src.partition(",")
        assert head in ("data:image/png;base64", "data:image/svg+xml;base64"), head
        return base64.b64decode(data, validate=True)
    f = (folder / src).resolve()
    assert f.is_file() and folder.resolve() in f.parents, f"{src}: not a file beside the report"
    return f.read_bytes()


def check_page(index: Path) -> Page:
    """Browser-free: every <img> resolves to a non-empty PNG (or SVG) that decodes to a drawn image; no markdown
    table is left in a <pre>; numbers are right-aligned."""
    text = index.read_text()
    page = Page(text)
    for src in page.imgs:
        raw = image_bytes(src, index.parent)
        assert raw, src[:60]
        if raw.lstrip().startswith((b"<svg", b"<?xml")):
            assert ET.fromstring(raw).tag.endswith("svg")
        else:
            img = Image.open(io.BytesIO(raw))
            assert img.format == "PNG"
            img.load()
            assert img.width > 0 and img.height > 0 and min(img.convert("L").getextrema()) < max(img.convert("L").getextrema())
    assert not re.search(r"<pre>\s*\|", text), "a markdown table inside <pre>"
    for t in page.tables:
        for row in t["rows"]:
            for c in row:
                if re.fullmatch(r"\s*-?\d[\d.]*(e[-+]?\d+)?( ± \d[\d.]*)?\s*", c["text"]):
                    assert "num" in c["class"], c
    return page


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "chromium-headless-shell"):
        for p in (Path("/usr/bin") / name, shutil.which(name)):
            if p and Path(p).is_file():
                return str(p)
    return None


PROBE = """<pre id="probe"></pre><script>
window.addEventListener("load", function () {
  var imgs = Array.prototype.slice.call(document.images);
  var rows = Array.prototype.map.call(document.querySelectorAll("table"), function (t) {
    return t.tBodies.length ? t.tBodies[0].rows.length : -1; });
  document.getElementById("probe").textContent = JSON.stringify({images: imgs.length,
    broken: imgs.filter(function (i) { return !(i.complete && i.naturalWidth > 0); }).length, rows: rows});
});
</script>"""


def in_chromium(index: Path, tmp: Path, page: Page) -> None:
    """The page loaded in headless Chromium (a copy with a probe script): no broken image, the tables' rows."""
    exe = chromium()
    if exe is None:
        pytest.skip("no Chromium (/usr/bin/chromium, or chromium / chromium-browser / chromium-headless-shell on "
                    "PATH): the in-browser check of the report is skipped; the parsed checks still ran")
    copy = tmp / f"probe-{index.parent.parent.name}" / "report"
    shutil.copytree(index.parent, copy, dirs_exist_ok=True)
    (copy / "index.html").write_text(index.read_text().replace("</body>", PROBE + "</body>"))
    p = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000",
                        "--dump-dom", (copy / "index.html").resolve().as_uri()], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    m = re.search(r'<pre id="probe">(.*?)</pre>', p.stdout, re.S)
    assert m and m.group(1), "the probe did not run"
    got = json.loads(m.group(1))
    assert got["images"] == len(page.imgs) > 0 and got["broken"] == 0, got
    assert got["rows"] == [len(t["rows"]) for t in page.tables], got


def report(d: Path, out: Path) -> tuple[Page, Path]:
    index = write_report(d, out=out)
    return check_page(index), index


def figs(index: Path) -> set[str]:
    return {f.stem.removeprefix("fig_") for f in index.parent.glob("fig_*.png")}


# ---- the three kinds of report ----------------------------------------------------------------------

def test_sweep_report(sweep_dir, tmp_path):
    info = json.loads((sweep_dir / "sweep.json").read_text())
    assert [r["drop_ratio"] for r in info["rows"]] == [0.2, 0.5]  # recorded by `ciders sweep`
    page, index = report(sweep_dir, tmp_path / "sw")
    assert figs(index) == {"tradeoff", "comm", "wall"}
    t = page.table("Sweep table")
    assert [c["text"] for c in t["head"]] == ["decomposition.drop_ratio", *METHODS] + [
        "AdapEmu response NLL (global eval) ↓", "stored FP32 LoRA MiB ↓"] * 2
    assert [r[0]["text"] for r in t["rows"]] == DROPS  # one row per grid point
    for row, r in zip(t["rows"], info["rows"]):
        a = r["aggregate"]["fedavg"]["nll"]
        assert row[3]["text"] == f"{a['mean']:.4f} ± {a['std']:.4f}" and "num" in row[3]["class"]
    stored = [r["aggregate"]["ciders-fo"]["stored_mib"]["mean"] for r in info["rows"]]
    assert stored == pytest.approx([0.8, 0.5])  # MiB of the saved adapters, shrinking with the drop ratio
    assert "<pre>" not in index.read_text()


def test_sweep_whose_axes_do_not_vary_leaves_the_table_v_figure_out(tmp_path):
    """A grid over the learning rate at one drop ratio: stored MiB and drop ratio are constant, so neither
    Table V panel carries information; one seed: no spread beside the means."""
    d = sweep(tmp_path / "lr", [("algorithm.lr", ["0.05", "0.1"])], seeds=[0])
    page, index = report(d, tmp_path / "lr-rep")
    assert "tradeoff" not in figs(index) and {"comm", "wall"} <= figs(index)
    assert "quality against stored size or drop ratio (needs points that differ in it): not available" in \
        index.read_text()
    rows = page.table("Sweep table")["rows"]
    assert len(rows) == 2 and all("±" not in c["text"] for r in rows for c in r)


def test_compare_report(sweep_dir, tmp_path):
    d = sweep_dir / "decomposition.drop_ratio=0.2"
    page, index = report(d, tmp_path / "cmp")
    # gamma is constant (0.3): the consensus figure keeps only its per-round panels; no FD run
    assert figs(index) == {"loss", "eval", "comm", "wall", "consensus", "pca"}
    assert [r[0]["text"] for r in page.table("Comparison table")["rows"]] == METHODS
    assert all("±" in c["text"] for r in page.table("Comparison table")["rows"] for c in r[1:])
    assert len(page.table("Per-seed metrics")["rows"]) == len(METHODS) * len(SEEDS)
    assert [r[0]["text"] for r in page.table("Communication")["rows"]] == METHODS


def test_run_report(sweep_dir, tmp_path):
    d = sweep_dir / "decomposition.drop_ratio=0.5" / "ciders-fo" / "seed1"
    page, index = report(d, tmp_path / "run")
    assert figs(index) == {"loss", "eval", "comm", "wall", "consensus", "pca"}
    rounds = load_config(d / "config.yaml").federation.rounds
    assert len(page.table("Diagnostics per round")["rows"]) == rounds
    assert [r[0]["text"] for r in page.table("Diagnostics per round")["rows"]] == [str(t + 1) for t in range(rounds)]
    assert {r[0]["text"] for r in page.table("Final metrics")["rows"]} >= {
        "AdapEmu PPL (global eval) ↓", "stored FP32 LoRA MiB ↓", "MiB up / client-round ↓"}
    assert len(page.table("Communication")["rows"]) == 1


def test_every_report_kind_loads_in_chromium(sweep_dir, tmp_path):
    """Sweep, comparison and run report in headless Chromium: every figure decodes (naturalWidth > 0) and each
    table has the rows the parsed page has (skipped, with the reason, where no Chromium is installed)."""
    for name, d in {"sweep": sweep_dir, "compare": sweep_dir / "decomposition.drop_ratio=0.2",
                    "run": sweep_dir / "decomposition.drop_ratio=0.2" / "fedavg" / "seed0"}.items():
        page, index = report(d, tmp_path / name)
        assert page.tables and page.imgs
        if name == "sweep":  # the rows expected, not only those the parsed page has
            assert len(page.table("Sweep table")["rows"]) == len(DROPS)
        in_chromium(index, tmp_path, page)


# ---- the numbers behind the new figures ---------------------------------------------------------------

def test_progress_is_the_records_cumulated(sweep_dir):
    """Communication: every round record's bytes down + up so far; wall clock: timing.jsonl's round seconds
    so far; both 0 at the evaluation before training; x of evaluation round t is t + 1."""
    d = sweep_dir / "decomposition.drop_ratio=0.2" / "ciders-fo" / "seed0"
    run = dg.load_run(d)
    prog = progress(run)
    assert [p["round"] for p in prog] == [ev["round"] + 1 for ev in run.events("eval")] == [0, 1, 2, 3]
    assert prog[0]["mib"] == 0 and prog[0]["seconds"] == 0
    rounds = run.events("round")
    for p in prog[1:]:
        done = [r for r in rounds if r["round"] < p["round"]]
        assert p["mib"] * 2**20 == sum(sum(r["bytes_down"].values()) + sum(r["bytes_up"].values()) for r in done)
    summ = json.loads((d / "summary.json").read_text())["mib"]
    assert prog[-1]["mib"] == pytest.approx(summ["down_total"] + summ["up_total"])
    secs = [r["seconds"] for r in read_jsonl(d / "timing.jsonl") if r["round"] >= 0]
    assert [p["seconds"] for p in prog[1:]] == pytest.approx(list(itertools_accumulate(secs)))
    assert prog[-1]["metrics"]["ppl"] == pytest.approx(json.loads((d / "summary.json").read_text())
                                                       ["eval_after"]["global"]["ppl"])


def itertools_accumulate(xs):
    total = 0.0
    for x in xs:
        total += x
        yield total


def test_bilevel_curves_use_the_same_round_convention(tmp_path):
    """The RABO-family curves draw record round t at t + 1 like every other figure: the evaluation before
    training (round -1) at 0, round 0's record at 1."""
    d = tmp_path / "rabo"
    d.mkdir()
    rows = [{"event": "eval", "round": -1, "accuracy": 0.1}, {"event": "round", "round": 0, "covering_x": 2},
            {"event": "eval", "round": 0, "accuracy": 0.3}, {"event": "round", "round": 1, "covering_x": 3},
            {"event": "eval", "round": 1, "accuracy": 0.4}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    panels = _bilevel_curves({"run": {"rabo": [d]}})
    assert panels["run: accuracy %"]["rabo"] == [{0: pytest.approx(10), 1: pytest.approx(30), 2: pytest.approx(40)}]
    assert panels["run: C_x*"]["rabo"] == [{1: 2, 2: 3}]


# ---- panels without information -------------------------------------------------------------------------

@pytest.fixture
def drawn(monkeypatch):
    """The titles of the visible panels of the figure a `figures` function saves."""
    got = []

    def save(fig, path):
        got.append([ax.get_title() for ax in fig.axes if ax.get_visible() and ax.get_title()])
        figures.plt.close(fig)
        return Path(path)

    monkeypatch.setattr(figures, "_save", save)
    return got


def test_informative():
    assert figures.informative([(0, 1.0), (1, 2.0)])
    assert not figures.informative([(0, 1.0)])  # one point
    assert not figures.informative([(0.3, 1.0), (0.3, 2.0)])  # constant x (a constant gamma)
    assert not figures.informative([(0, 1.0), (1, 1.0)])  # constant y
    assert not figures.informative([(0, 1.0), (1, float("nan"))])


def test_constant_gamma_and_single_point_panels_are_left_out(sweep_dir, drawn, tmp_path):
    run = dg.load_run(sweep_dir / "decomposition.drop_ratio=0.2" / "ciders-fo" / "seed0")
    means, ref = dg.round_means(run), dg.psi_reference(run)
    assert len({r["gamma"] for r in ref}) == 1  # constant gamma
    figures.consensus({"ciders-fo": (means, ref)}, tmp_path / "a.png")
    assert drawn[-1] == ["E-RAE per round", "S-DR per round", "S-PPR per round"]
    varying = [{**r, "gamma": 0.1 * (r["round"] + 1)} for r in ref]
    figures.consensus({"ciders-fo": (means, varying)}, tmp_path / "b.png")
    assert len(drawn[-1]) == 6 and "S-DR against gamma_t" in drawn[-1]
    assert figures.consensus({"ciders-fo": (means[:1], ref)}, tmp_path / "c.png") is None  # one round

    figures.seed_curves({"one point": {"m": [{1: 2.0}]}, "curve": {"m": [{1: 2.0, 2: 1.0}]},
                         "flat": {"m": [{1: 2.0, 2: 2.0}]}}, tmp_path / "d.png")
    assert drawn[-1] == ["curve"]
    assert figures.seed_curves({"one point": {"m": [{1: 2.0}]}}, tmp_path / "e.png") is None
    p = [figures.Panel("const x", "x", "y", {"m": [[(1.0, 2.0), (1.0, 3.0)]]}),
         figures.Panel("ok", "x", "y", {"m": [[(1.0, 2.0), (2.0, 3.0, 0.1)]]})]
    figures.xy_panels(p, tmp_path / "f.png")
    assert drawn[-1] == ["ok"]


def test_markdown_becomes_html_tables():
    html = md_html("Intro **bold**.\n\n| method | final |\n|---|---|\n| rabo | 1.00 ± 0.10 |\n| <u>x</u> | **2** |\n")
    page = Page(html)
    (t,) = page.tables
    assert [c["text"] for c in t["head"]] == ["method", "final"] and len(t["rows"]) == 2
    assert "num" in t["rows"][0][1]["class"] and "<u>x</u>" in html and "<b>2</b>" in html
    assert "<pre>" not in html and "|---" not in html


def test_drop_ratio_of_an_older_sweep_comes_from_its_grid():
    from ciders.report.html import _drop_ratio

    assert _drop_ratio({"drop_ratio": 0.3, "values": {"decomposition.drop_ratio": "0.5"}}) == 0.3  # recorded
    assert _drop_ratio({"values": {"decomposition.drop_ratio": "0.5"}}) == 0.5
    assert _drop_ratio({"values": {"decomposition.beta": "0.75"}}) == pytest.approx(0.25)
    assert _drop_ratio({"drop_ratio": None, "values": {"decomposition.student_layers": "4"}}) is None


# ---- privacy: epsilon per round, and quality against epsilon ------------------------------------------

PRIVATE = SETS + ["algorithm.weighting=uniform", "federation.secure_aggregation=true", "federation.dp.mode=central",
                  "federation.dp.clip=1.0"]


def test_a_sweep_over_epsilon_plots_quality_against_the_privacy_spent(tmp_path):
    """A sweep over federation.dp.target_epsilon under secure aggregation: the Table V figure gains the quality-
    against-epsilon panel (the spent epsilon of each point on a log axis), the run page lists the privacy
    settings and epsilon after every round, the communication table the secure-aggregation components; every
    page also loads in Chromium."""
    d = tmp_path / "eps"
    run_sweep(load_config(None, PRIVATE), [("federation.dp.target_epsilon", ["4", "16"])], ["ciders-fo"], [0], d,
              metrics=("nll", "dp_epsilon"), make_task=lambda c, o: PplTask(c), log=lambda s: None, progress=False,
              control=None)
    info = json.loads((d / "sweep.json").read_text())
    spent = [r["aggregate"]["ciders-fo"]["dp_epsilon"]["mean"] for r in info["rows"]]
    assert 0.99 * 4 <= spent[0] <= 4 and 0.99 * 16 <= spent[1] <= 16
    panels = {p.title: p for p in __import__("ciders.report.html", fromlist=["x"]).tradeoff_panels(info)}
    eps_panel = next(p for t, p in panels.items() if "against DP epsilon" in t)
    assert eps_panel.logx and sorted(x for x, *_ in eps_panel.points()) == pytest.approx(spent)
    assert list(eps_panel.series) == ["ciders-fo"]  # the budgets are one line, not one legend entry each
    page, index = report(d, tmp_path / "eps-rep")
    assert "tradeoff" in figs(index)
    run = d / "federation.dp.target_epsilon=4" / "ciders-fo" / "seed0"
    rpage, rindex = report(run, tmp_path / "eps-run")
    privacy = [t for t in rpage.tables if t["section"] == "Privacy"]
    assert [r[0]["text"] for r in privacy[0]["rows"]][:2] == ["secure aggregation", "differential privacy"]
    assert [r[0]["text"] for r in privacy[1]["rows"]] == ["1", "2", "3"]
    assert float(privacy[1]["rows"][-1][1]["text"]) == pytest.approx(spent[0], rel=1e-3)
    comm = rpage.table("Communication")
    assert any("masked" in c["text"] for c in comm["head"]) and not any(c["text"] == "up: dc" for c in comm["head"])
    for p, i in ((page, index), (rpage, rindex)):
        in_chromium(i, tmp_path, p)


def test_quality_that_spans_orders_of_magnitude_gets_a_log_axis():
    """A PPL that diverges at the smallest budget would flatten the other points on a linear axis; each
    budget is a point of its method's line, and another grid key still splits the lines."""
    from ciders.report.html import tradeoff_panels

    def row(eps, agg, ppl, std):
        return {"values": {"federation.dp.target_epsilon": eps, "algorithm.aggregator": agg},
                "aggregate": {"ciders-fo": {"ppl": {"mean": ppl, "std": std, "n": 3},
                                            "dp_epsilon": {"mean": float(eps), "std": 0.0, "n": 3}}}}

    grid = [("federation.dp.target_epsilon", ["4", "64"]), ("algorithm.aggregator", ["mean", "median"])]
    info = {"methods": ["ciders-fo"], "metrics": ["ppl", "dp_epsilon"], "grid": grid,
            "rows": [row(4, "mean", 2994.0, 2750.0), row(64, "mean", 71.0, 12.0),
                     row(4, "median", 3100.0, 10.0), row(64, "median", 75.0, 1.0)]}
    (eps,) = [p for p in tradeoff_panels(info) if "epsilon" in p.title]
    assert eps.logx and eps.logy and "log scale" in eps.ylabel
    assert sorted(eps.series) == ["ciders-fo, aggregator=mean", "ciders-fo, aggregator=median"]
    assert sorted(eps.series["ciders-fo, aggregator=mean"][0]) == [(4.0, 2994.0, 2750.0), (64.0, 71.0, 12.0)]
    info["rows"] = [row(4, "mean", 80.0, 1.0), row(64, "mean", 71.0, 1.0)]
    (eps,) = [p for p in tradeoff_panels(info) if "epsilon" in p.title]
    assert not eps.logy and "log" not in eps.ylabel
