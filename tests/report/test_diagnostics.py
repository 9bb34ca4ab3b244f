"""The diagnostics readout of a run (docs/method.md#empirical-readouts-e-rae-s-dr-s-ppr): the per client-round
statistics are the recorded ones, psi_t / psi_inf follow Eqs. 27-29 for the run's hyperparameters, FD shares count the
recorded r_FD, and the PCA is a proper projection of the five statistics."""

import numpy as np
import pytest

from ciders.config import load_config
from ciders.core.diagnostics import psi, psi_inf
from ciders.core.metagrad import fd_class
from ciders.federation.ciders_loop import run_federation
from synthetic import VectorTask
from ciders.fileio import read_jsonl
from ciders.report import diagnostics as dg

SETS = ["federation.clients=4", "federation.rounds=6", "algorithm.local_steps=3", "algorithm.lr=0.05",
        "algorithm.gamma_schedule=protocol_c", "algorithm.alpha=0.2", "algorithm.eps_prox=0.1", "algorithm.tau=0.5",
        "algorithm.metagrad=fd", "algorithm.fd_eta=0.5"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("diag")
    run_federation(load_config(None, SETS), VectorTask(4), out, progress=False, log=lambda s: None)
    return dg.load_run(out)


def test_client_rounds_are_the_recorded_statistics(run):
    rows = dg.client_rounds(run)
    rec = [r for r in read_jsonl(run.root / "metrics.jsonl") if r["event"] == "client"]
    assert len(rows) == 24 == len(rec)
    for r, x in zip(rows, rec):
        assert all(r[k] == x[k] for k in dg.PCA_STATS + ("loss", "gamma", "round", "client"))
    means = dg.round_means(run)
    assert means[2]["e_rae"] == pytest.approx(np.mean([x["e_rae"] for x in rec if x["round"] == 2]))


def test_psi_reference_follows_the_theory_with_the_schedule(run):
    ref = dg.psi_reference(run)
    assert [r["gamma"] for r in ref[:3]] == [0.9, 0.9, pytest.approx(0.9 * 0.86)]
    for r in ref:
        assert r["psi"] == psi(r["round"], r["gamma"], 0.2, 3, 0.05, 0.1)
        assert r["psi_inf"] == psi_inf(r["gamma"], 3, 0.05, 0.1) and r["dr_ref"] == 1 - r["psi"]
    assert ref[0]["psi"] == 1.0 and ref[5]["psi"] < 1.0


def test_fd_shares_count_the_recorded_r_fd(run):
    fd = dg.fd_shares(run)
    steps = [s["r_fd"] for r in run.events("client") for s in r["steps"]]
    assert fd["steps"] == len(steps) == 72 and fd["rounds"] == 6
    for c in dg.FD_CLASSES:
        assert fd[c] == sum(fd_class(v) == c for v in steps) / len(steps)
    assert sum(fd[c] for c in dg.FD_CLASSES) == pytest.approx(1.0)
    flagged = {r["round"] for r in run.events("client") for s in r["steps"] if fd_class(s["r_fd"]) != "small"}
    assert fd["rounds_with_event"] == len(flagged)


def test_pca_of_the_five_statistics(run):
    p = dg.pca(run)
    comps = np.array(p["components"])
    assert comps.shape == (2, 5) and np.allclose(comps @ comps.T, np.eye(2), atol=1e-10)
    assert 0 < sum(p["explained"]) <= 1 + 1e-12 and p["explained"][0] >= p["explained"][1]
    assert len(p["points"]) == 24 and set(p["centroids"]) == {"c0000", "c0001", "c0002", "c0003"}
    assert all(set(v) == {"early", "middle", "late"} for v in p["centroids"].values())
    pts = [q for q in p["points"] if q["client"] == "c0001" and q["phase"] == "late"]
    assert p["centroids"]["c0001"]["late"][0] == pytest.approx(np.mean([q["pc1"] for q in pts]))
