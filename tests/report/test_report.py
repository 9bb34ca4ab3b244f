"""`ciders.report.html.write_report` on real tiny federations (a comparison, its runs, and a Protocol-B
shaped domains run with the NLL matrix), each page opened in headless Chromium: every embedded figure
must decode, the page must log nothing to the console, and every PNG must hold a drawn image."""

import re
import subprocess
from pathlib import Path

import pytest
from matplotlib.image import imread

from ciders.cli import main
from ciders.errors import CidersError
from ciders.report.html import write_report
from conftest import ROOT
from helpers import shared

CHROMIUM = Path("/usr/bin/chromium-headless-shell")
# what every page has; the figure sections say "not available" when their data is missing
COMMON = ["Communication", "Training loss and evaluation curves", "Quality against communication and wall-clock time",
          "Cross-domain NLL matrices",
          "Consensus dynamics (E-RAE, S-DR, S-PPR)", "PCA paths of the client statistics",
          "Finite-difference correction profile", "Configuration"]
RUN_SECTIONS = (["Final metrics", "Evaluation before / after training"] + COMMON[:-1]
                + ["Diagnostics per round", "Configuration"])


@pytest.fixture(scope="module")
def compare_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("report")
    cfg = tmp / "tiny.yaml"
    cfg.write_text((ROOT / "configs" / "tiny.yaml").read_text().replace("../data/", f"{ROOT}/data/"))
    out = tmp / "cmp"
    assert main(["compare", str(cfg), "--algorithms", "ciders-fo,ciders-fd,fedavg", "--seeds", "0,1",
                 "--out", str(out), "--set", "federation.rounds=3"]) == 0
    return out


def open_page(index: Path, figures: set[str]) -> str:
    """The DOM after load, checked: all `figures` embedded and decoded, no console output, no blank PNG."""
    if not CHROMIUM.is_file():
        pytest.skip(f"{CHROMIUM} not installed (needed to check that the report renders)")
    p = subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
                        "--enable-logging=stderr", "--v=0", "--dump-dom", index.resolve().as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    n = len(figures)
    assert n > 0 and f'data-images-ok="{n}/{n}"' in p.stdout
    # Chromium logs every console message (log, error, uncaught exception) as "...:INFO:CONSOLE:<line>] ..."
    # whatever its level; the page writes to the console only about a broken figure
    assert [ln for ln in p.stderr.splitlines() if ":CONSOLE" in ln or "Uncaught" in ln] == []
    pngs = sorted(index.parent.glob("fig_*.png"))
    assert {f.stem.removeprefix("fig_") for f in pngs} == figures
    for f in pngs:
        img = imread(f)
        assert f.stat().st_size > 0 and img.size > 0 and img[..., :3].std() > 0, f
    assert "http://" not in p.stdout and "https://" not in p.stdout  # self-contained
    return p.stdout


def headings(dom: str) -> list[str]:
    return [re.sub("<[^>]+>", "", h) for h in re.findall(r"<h2[^>]*>(.*?)</h2>", dom)]


def test_compare_report(compare_dir, tmp_path):
    index = write_report(compare_dir, out=tmp_path)
    assert index == tmp_path / "report" / "index.html"
    dom = open_page(index, {"loss", "eval", "comm", "wall", "consensus", "pca", "fd"})
    # the three asked for and the takd-only control `ciders compare` adds by default
    assert "<h1>Comparison report: tiny — 4 methods × 2 seeds</h1>" in dom
    assert headings(dom) == ["Comparison table", "Per-seed metrics"] + COMMON
    assert dom.count("<b>") >= 1 and dom.count("<u>") >= 1  # best / second of the comparison table
    for m in ("ciders-fo", "ciders-fd", "fedavg", "takd-only"):
        assert dom.count(f'<tr><td>{m}</td><td class="num">') >= 2  # two per-seed rows
    # the control's row is labelled in the comparison table and the dagger is explained beneath it
    assert "<td>takd-only (control)</td>" in dom and "does not beat the takd-only control" in dom
    assert "down: messenger" in dom and "up: dc" in dom and "<details>" in dom
    assert "NLL matrix (eval.tasks without nll_matrix): not available in these runs." in dom


def test_run_reports(compare_dir, tmp_path):
    fd_run = compare_dir / "ciders-fd" / "seed0"
    index = write_report(fd_run)  # default: inside the run directory
    assert index == fd_run / "report" / "index.html"
    dom = open_page(index, {"loss", "eval", "comm", "wall", "consensus", "pca", "fd"})
    assert "<h1>Run report: tiny-ciders-fd-seed0 (ciders-fd, seed 0)</h1>" in dom
    assert headings(dom) == RUN_SECTIONS
    assert "small % (≤ 0.1)" in dom and "DR_ref" in dom and "(before)" in dom

    dom = open_page(write_report(compare_dir / "fedavg" / "seed1", out=tmp_path), {"loss", "eval", "comm", "wall"})
    assert headings(dom) == RUN_SECTIONS
    assert "consensus statistics (no run with gamma &gt; 0): not available in this run." in dom
    assert "FD correction (no second-order / FD run): not available in this run." in dom


@pytest.mark.full_data
def test_domains_run_draws_the_nll_matrix(tmp_path):
    shared("personalization")
    sets = ["model.name=tiny-qwen2", "model.dtype=float32", "decomposition.messenger_layers=2",
            "decomposition.drop_ratio=0.5", "takd.bootstrap_steps=1", "takd.round_steps=1",
            "takd.hidden_loss=teacher_rms", "algorithm.local_steps=1", "algorithm.batch_size=2", "algorithm.lr=1e-3",
            "federation.rounds=1", "federation.holdout=0.25", "data.task=domains", "data.per_label=true",
            "data.public_size=2", "data.eval_size=2", "data.client_size=6", "data.max_length=512",
            "federation.clients=5", "federation.partition=natural", "eval.tasks=[nll_matrix]"]
    (tmp_path / "b.yaml").write_text("name: b\n")
    run = tmp_path / "b"
    assert main(["run", str(tmp_path / "b.yaml"), "--out", str(run), *[x for v in sets for x in ("--set", v)]]) == 0
    # one round: the loss and consensus panels would hold one point each, so they are left out
    dom = open_page(write_report(run), {"eval", "comm", "wall", "nll", "pca"})
    assert "NLL in-domain (mean L_ii)" in dom and "Delta_cross" in dom


def test_not_a_run_directory(tmp_path):
    with pytest.raises(CidersError, match="neither a run directory"):
        write_report(tmp_path)


@pytest.mark.full_data
def test_bilevel_table_and_run_reports(tmp_path):
    """`ciders report` on a `ciders compare` directory of a bilevel config, on one experiment point and on
    one method's run: the table and the learning curves (accuracy and C_x* per round) render."""
    shared("cifar10", "cifar10_test.zip")
    small = [x for kv in ["federation.clients=2", "federation.rounds=2", "task.n_max=20", "task.imbalance=10",
                          "task.val_per_class=5"] for x in ("--set", kv)]
    out = tmp_path / "bl"
    assert main(["compare", str(ROOT / "configs/cpu/rabo_losstune.yaml"), "--out", str(out), "--algorithms",
                 "rabo,fedmbo", "--seeds", "0,1", *small]) == 0
    for d in (out, out / "default" / "seed0", out / "default" / "seed0" / "rabo"):
        dom = open_page(write_report(d, tmp_path / "rep" / d.name), {"bilevel_curves"})
        assert headings(dom) == ["Table", "Learning curves"]
    assert "fedmbo" in open_page(write_report(out, tmp_path / "rep2"), {"bilevel_curves"})
