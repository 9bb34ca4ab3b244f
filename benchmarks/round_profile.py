"""Where a demo round's time goes: `configs/demo.yaml` (or --config) run in-process for --rounds rounds (default 1),
under `ciders.phases.profiling`, split into the phases the federation marks: model and data loading, the teacher
cache B_F(x), TAKD pre-alignment, client steps (B_L(x) and the K meta-gradient steps), aggregation (upload checks
and Eqs. 11-12), TAKD (Eq. 13), evaluation, serialization (wire encode/decode) and I/O (checkpoints, client records,
logs). Time is exclusive (a checkpoint inside TAKD is I/O), so the phases plus "other" add up to the wall time.

--smoke runs the same config on the tiny model with the smallest data and step counts (SMOKE).

--json keys: wall_s, seconds.*, shares.*

    python benchmarks/round_profile.py [--config configs/demo.yaml] [--rounds 1] [--json] [--smoke] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import ROOT, SMOKE_MODEL, add_output_flags, emit

from ciders.config import load_experiment
from ciders.federation.ciders_loop import run_federation
from ciders.phases import PHASES, profiling
from ciders.workloads.llm import LLMTask

# the demo's phases at their smallest: every phase still runs once
SMOKE = [f"model.name={SMOKE_MODEL}", "takd.bootstrap_steps=1", "takd.round_steps=1", "data.public_limit=8",
         "data.eval_limit=4", "data.clients_limit=12", "data.max_length=64", "algorithm.local_steps=1",
         "federation.clients=2"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides")
    a = add_output_flags(ap).parse_args()
    cfg = load_experiment(a.config, [f"federation.rounds={a.rounds}", *(SMOKE if a.smoke else []), *a.set])
    with tempfile.TemporaryDirectory() as tmp, profiling() as prof:
        out = Path(tmp) / "run"
        run_federation(cfg, LLMTask(cfg, out), out, log=lambda m: None, progress=False)
    shares = prof.shares()
    names = [p for p in PHASES if p in prof.seconds] + sorted(set(prof.seconds) - set(PHASES))
    res = {"config": a.config, "rounds": a.rounds, "wall_s": prof.wall,
           "seconds": {n: prof.seconds[n] for n in names}, "calls": {n: prof.calls[n] for n in names},
           "shares": {n: shares[n] for n in names + ["other"]}}
    res["seconds"]["other"] = shares["other"] * prof.wall
    emit(res, a.json, lambda: report(res, names, prof))


def report(res: dict, names: list[str], prof) -> None:
    shares = res["shares"]
    print(f"{Path(res['config']).name}, {res['rounds']} round(s) in-process: {prof.wall:.1f} s wall")
    print(f"  {'phase':<16}{'seconds':>9}{'share':>8}{'calls':>7}")
    for n in names + ["other"]:
        calls = f"{prof.calls[n]:>7}" if n in prof.calls else ""
        print(f"  {n:<16}{res['seconds'][n]:>9.2f}{100 * shares[n]:>7.1f}%{calls}")


if __name__ == "__main__":
    main()
