"""Per client-round diagnostics of a run (paper Sec. VI-D / Protocol C;
docs/method.md#empirical-readouts-e-rae-s-dr-s-ppr), read back from metrics.jsonl: the five scalar statistics, the
theoretical psi_t / psi_inf for the run's hyperparameters beside the measured S-DR / S-PPR, FD correction shares, and
the PCA of the five statistics."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ciders.config import ExperimentConfig, load_run_config
from ciders.core.diagnostics import psi, psi_inf
from ciders.core.metagrad import fd_class
from ciders.core.schedules import gamma_at
from ciders.fileio import read_jsonl

# the five scalar statistics of the paper's PCA (Fig. 6): local-consensus norm ||c_i||, consensus-
# increment norm ||dc_i||, E-RAE, S-DR, S-PPR
PCA_STATS = ("c_i_norm", "dc_norm", "e_rae", "s_dr", "s_ppr")
FD_CLASSES = ("small", "moderate", "large")


@dataclass
class Run:
    root: Path
    cfg: ExperimentConfig
    rows: list[dict]

    @property
    def method(self) -> str:
        return self.cfg.algorithm.method

    def events(self, kind: str) -> list[dict]:
        return [r for r in self.rows if r["event"] == kind]


def load_run(root: str | Path) -> Run:
    root = Path(root)
    if not (root / "metrics.jsonl").is_file() or not (root / "config.yaml").is_file():
        raise FileNotFoundError(f"{root} is not a run directory (no metrics.jsonl / config.yaml)")
    return Run(root, load_run_config(root / "config.yaml"), read_jsonl(root / "metrics.jsonl"))


def client_rounds(run: Run) -> list[dict]:
    """One row per client-round: round, client, loss, gamma and the five statistics (+ r_FD counts)."""
    keep = ("round", "client", "loss", "gamma") + PCA_STATS + tuple(f"r_fd_{c}" for c in FD_CLASSES)
    return [{k: r[k] for k in keep if k in r} for r in run.events("client") if "loss" in r]


def psi_reference(run: Run) -> list[dict]:
    """Per round: gamma_t and the idealised psi_t (Eqs. 27-29, docs/method.md#eqs-27-29-proximal-damping; with the
    run's alpha, K, eta, eps_prox; a gamma schedule is evaluated at each round's gamma_t) with DR_ref = 1 - psi_t,
    PPR_ref = psi_t."""
    a = run.cfg.algorithm
    out = []
    for t in range(run.cfg.federation.rounds):
        g = gamma_at(t, a.gamma_schedule, a.gamma)
        p = psi(t, g, a.alpha, a.local_steps, a.lr, a.eps_prox)
        out.append({"round": t, "gamma": g, "psi": p, "psi_inf": psi_inf(g, a.local_steps, a.lr, a.eps_prox),
                    "dr_ref": 1 - p, "ppr_ref": p})
    return out


def round_means(run: Run, keys=("loss",) + PCA_STATS) -> list[dict]:
    """Mean (and 10th / 90th percentile) over clients of each statistic, per round."""
    rows = client_rounds(run)
    out = []
    for t in sorted({r["round"] for r in rows}):
        rs = [r for r in rows if r["round"] == t]
        rec = {"round": t}
        for k in keys:
            v = np.array([r[k] for r in rs if k in r and r[k] is not None], dtype=float)
            v = v[np.isfinite(v)]
            if v.size:
                rec[k], rec[f"{k}_p10"], rec[f"{k}_p90"] = float(v.mean()), float(np.quantile(v, 0.1)), float(np.quantile(v, 0.9))
        out.append(rec)
    return out


def fd_shares(run: Run) -> dict | None:
    """Share of steps with small / moderate / large r_FD, and rounds with >= 1 moderate-or-large
    event (thresholds 0.1 / 0.2: docs/method.md#eq-7-finite-difference-meta-gradient-fd). None for first-order runs."""
    steps = [(r["round"], s["r_fd"]) for r in run.events("client") for s in r.get("steps", []) if "r_fd" in s]
    if not steps:
        return None
    cls = [(t, fd_class(v)) for t, v in steps]
    n = len(cls)
    flagged = {t for t, c in cls if c != "small"}
    return {**{c: sum(1 for _, k in cls if k == c) / n for c in FD_CLASSES}, "steps": n,
            "rounds_with_event": len(flagged), "rounds": len({t for t, _ in cls}),
            "per_step": [{"round": t, "r_fd": v} for t, v in steps]}


def pca(run: Run) -> dict | None:
    """PCA (standardised) of the five statistics over all client-rounds, with per-client centroids of
    the early / middle / late thirds of the rounds (the paper's Fig. 6)."""
    rows = [r for r in client_rounds(run) if all(np.isfinite(r.get(k, np.nan)) for k in PCA_STATS)]
    if len(rows) < 3:
        return None
    x = np.array([[r[k] for k in PCA_STATS] for r in rows], dtype=float)
    mu, sd = x.mean(0), x.std(0)
    sd[sd == 0] = 1.0
    z = (x - mu) / sd
    _, s, vt = np.linalg.svd(z, full_matrices=False)
    var = s**2 / max((s**2).sum(), 1e-300)
    proj = z @ vt[:2].T
    t_max = max(r["round"] for r in rows) + 1
    phase = lambda t: ("early", "middle", "late")[min(3 * t // t_max, 2)]  # noqa: E731
    points = [{"client": r["client"], "round": r["round"], "phase": phase(r["round"]),
               "pc1": float(p[0]), "pc2": float(p[1] if p.size > 1 else 0.0)} for r, p in zip(rows, proj)]
    cents: dict = {}
    for c in sorted({p["client"] for p in points}):
        cents[c] = {}
        for ph in ("early", "middle", "late"):
            ps = [p for p in points if p["client"] == c and p["phase"] == ph]
            if ps:
                cents[c][ph] = [float(np.mean([p["pc1"] for p in ps])), float(np.mean([p["pc2"] for p in ps]))]
    return {"stats": list(PCA_STATS), "components": vt[:2].tolist(), "explained": var[:2].tolist(),
            "points": points, "centroids": cents}


def summary(run: Run) -> dict:
    """Everything above in one JSON-able dict (for the report and `diagnostics.json`)."""
    return {"method": run.method, "client_rounds": client_rounds(run), "round_means": round_means(run),
            "psi_reference": psi_reference(run), "fd": fd_shares(run), "pca": pca(run)}
