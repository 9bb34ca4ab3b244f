"""The RABO family's per-reply step bound against references no client can inflate (issue 34;
docs/security.md#aggregation).

`federation.max_step_ratio` bounds each reply's server step (RABO / RAFBO / FedMBO: beta G_i on y, alpha h_i on x;
the baselines: the client's change of (x, y)) by ratio x max(r, 1), r the norm at the run's start of what the step
moves: ||y_0||, ||x_0||, ||(x_0, y_0)||, carried in the server state (`BilevelState.ref`) and its checkpoints. It
used to be ratio x max(||state||, 1) with the current state: one client pushing the largest accepted step in one
direction every round grew the state geometrically (each push raised the next round's bound)."""

import json
from dataclasses import replace

import pytest
import torch

from ciders.algorithms import rabo as rb
from ciders.algorithms.registry import bilevel_config
from ciders.config.bilevel import BilevelExperiment, BilevelFederationConfig
from ciders.core import aggregate as agg
from ciders.core import submodel as sm
from ciders.core.tensors import equal, norm
from ciders.core.wire import encode
from ciders.federation import bilevel_loop as bl
from ciders.federation.bilevel_client import client_phase
from ciders.federation.bilevel_rounds import BilevelServer
from ciders.federation.inprocess import Faults
from ciders.federation.loop import SimulatedCrash
from ciders.federation.rundir import RunDir
from helpers import QuadTask
from synthetic import largest_accepted
from ciders.workloads.bilevel import FewShotTask

RATIO = 10.0  # federation.max_step_ratio's default
EVIL = "client0"  # capacity 1: its masks keep everything, so it can push along one fixed direction every round
ROUNDS = 6


def _exp(method, rounds=ROUNDS, ratio=RATIO):
    base = BilevelExperiment(federation=BilevelFederationConfig(clients=3, rounds=rounds, max_step_ratio=ratio))
    base = replace(base, rabo=replace(base.rabo, inner_steps=2, beta=0.1, alpha=0.1, solver_iters=8),
                   fedmeta=replace(base.fedmeta, local_steps=2, lr=0.05, inner_lr=0.1))
    exp = bilevel_config(base, method)
    return replace(exp, task=replace(exp.task, kind="fewshot")) if method == "dist-maml" else exp


def _task(method):
    """The tiny tasks of the bilevel round tests: the two-layer quadratic, or (the ProtoNet sub-model baselines)
    few-shot episodes of random 28x28 images on a width-8 Conv4 (tests/algorithms/test_submodel_baselines.py)."""
    if method not in ("static", "fedrolex", "oap", "fiarse"):
        return QuadTask()
    g = torch.Generator().manual_seed(0)
    pool = {f"A/c{j:02d}": torch.rand(20, 1, 28, 28, generator=g) for j in range(20)}
    return FewShotTask(pool, [1.0, 0.5, 0.25], width=8, eval_episodes=2, eval_steps=2)


def _direction(st):
    """A fixed unit direction over the tensors of st (every entry equal)."""
    n = sum(v.numel() for v in st.values())
    return {k: torch.full_like(v, n ** -0.5) for k, v in st.items()}


def _evil_reply(server, phase, b, u):
    """The attacker's reply whose server step is b along u (u over y, x or both, as `phase` moves them)."""
    s, m = server.state, server.masks[EVIL]
    meta = {"round": s.round, "client": EVIL, "phase": phase}
    if phase == "inner":  # y_{q+1} = y_q - beta G: G = -b u / beta
        return encode({"G": sm.gather({k: -b * v / server.cfg.beta for k, v in u["y"].items()}, m.y)}, meta)[0]
    if phase == "outer":
        return encode({"h": sm.gather({k: -b * v / server.cfg.alpha for k, v in u["x"].items()}, m.x)}, meta)[0]
    if server.spec.submodel_local:  # the sub-model baselines: the change s - x_i, the server subtracts it
        return encode({"dx": sm.gather({k: -b * v for k, v in u["x"].items()}, m.x),
                       "dy": sm.gather({k: -b * v for k, v in u["y"].items()}, m.y)}, meta)[0]
    return encode({"x": {k: v + b * u["x"][k] for k, v in s.x.items()},  # the full-model baselines: the model
                   "y": {k: v + b * u["y"][k] for k, v in s.y.items()}}, meta)[0]


def _largest_accepted(server, phase, u):
    """The largest b for which the server accepts the attacker's step b u, found by asking the server itself
    (doubling, then bisection; the round in progress is restored after each question): the attacker needs no
    knowledge of the rule."""
    def ok(b):
        saved = server.round
        rejected = server.absorb(phase, {EVIL: _evil_reply(server, phase, b, u)})
        server.round = saved
        return EVIL not in rejected

    return largest_accepted(ok, 30)


def _run(exp, task, attack):
    """exp's rounds, every client honest or (attack) client0 sending, in every phase, the largest step the server
    accepts along a fixed direction. Returns the server state after each round."""
    server = BilevelServer(exp, task, log=lambda s: None)
    u = {"x": _direction(server.state.x), "y": _direction(server.state.y)}
    scratch = {i: {} for i in server.ids}
    out = []
    for q in range(exp.federation.rounds):
        server.begin(q)
        for phase in server.phases(0):
            ids = [i for i in server.participants(phase) if not (attack and i == EVIL)]
            replies = {i: client_phase(exp, task, phase, i, server.down(phase, i), scratch[i])[0] for i in ids}
            if attack:
                b = _largest_accepted(server, phase, u)
                replies = {EVIL: _evil_reply(server, phase, b, u), **replies}
            rejected = server.absorb(phase, replies)
            assert EVIL not in rejected
        server.close_round()
        out.append(server.state)
    return out


def _per_round(state, phases):
    """The most one client's accepted steps can move (x, y) in a round (each coordinate moves by the mean over its
    holders, so by at most the client's own step): ratio x max(r, 1) on y (inner) and x (outer), or on (x, y)."""
    r = state.ref
    if phases == ("local",):
        return RATIO * max(r["xy"], 1.0)
    return (RATIO ** 2 * (max(r["x"], 1.0) ** 2 + max(r["y"], 1.0) ** 2)) ** 0.5


def _drifts(exp, task):
    """||(x, y)_attacked - (x, y)_honest|| after each round, that over ||(x, y)_honest||, and the per-round cap."""
    honest, attacked = _run(exp, task, False), _run(exp, task, True)
    both = [rb.joined(s.x, s.y) for s in honest]
    d = [norm({k: v - h[k] for k, v in rb.joined(a.x, a.y).items()}) for a, h in zip(attacked, both)]
    phases = BilevelServer(exp, task, log=lambda s: None).phases(0)
    return d, [x / norm(h) for x, h in zip(d, both)], _per_round(honest[0], phases)


METHODS = ["rabo", "rafbo", "fedmbo", "static", "dist-maml"]


@pytest.mark.parametrize("method", METHODS)
def test_one_client_moves_the_state_at_most_linearly_in_rounds(method):
    """Each round the attacker's accepted steps are at most RATIO x max(r, 1), r fixed at the start, so after t
    rounds the attacked run is at most t times the per-round cap from the honest one."""
    drift, rel, cap = _drifts(_exp(method), _task(method))
    print(f"{method} cap {cap:.4g} drift {[round(d, 3) for d in drift]}")
    print(f"{method} drift/||honest|| after each round: {[round(r, 3) for r in rel]}")
    assert drift[0] > 0.3 * cap  # the attack is at full strength
    assert all(d <= (t + 1) * cap * (1 + 1e-9) for t, d in enumerate(drift))


@pytest.mark.parametrize("method", ["rabo", "dist-maml"])
def test_the_old_bound_on_the_current_norm_compounds(monkeypatch, method):
    """What the fixed references fix: the same attack against the old rule (the references re-taken from the
    current state every round) grows the drift geometrically."""
    monkeypatch.setattr(rb, "with_ref", lambda s: replace(s, ref=rb.ref_norms(s.x, s.y)))
    drift, rel, cap = _drifts(_exp(method), _task(method))
    print(f"old rule, {method} cap {cap:.4g} drift {[round(d, 3) for d in drift]}")
    print(f"old rule, {method} drift/||honest|| after each round: {[round(r, 3) for r in rel]}")
    assert drift[5] > 6 * cap and drift[5] > 2 ** 5 * drift[0]


@pytest.mark.parametrize("method", METHODS)
def test_an_honest_run_is_unchanged(tmp_path, monkeypatch, method):
    """Bit for bit the run without any bound and the run under the old rule (the references re-taken from the
    current state every round): honest steps are well inside the bound, which therefore acts on no honest run."""
    steps = []
    check = agg.step_check

    def recorded(step, ref, ratio, name="||state||"):
        if ratio is not None:
            steps.append(norm(step) / (ratio * max(ref, 1.0)))  # the step over its bound
        return check(step, ref, ratio, name)

    monkeypatch.setattr(agg, "step_check", recorded)
    task = _task(method)
    bl.run_bilevel(_exp(method, rounds=3), task, tmp_path / "new", log=lambda s: None)
    bl.run_bilevel(_exp(method, rounds=3, ratio=None), task, tmp_path / "free", log=lambda s: None)
    print(f"{method}: the largest honest step is {max(steps):.3g} of its bound ({len(steps)} steps)")
    assert steps and max(steps) < 0.5
    monkeypatch.setattr(rb, "with_ref", lambda s: replace(s, ref=rb.ref_norms(s.x, s.y)))
    bl.run_bilevel(_exp(method, rounds=3), task, tmp_path / "old", log=lambda s: None)
    for name in ("final.safetensors", "metrics.jsonl"):
        assert (tmp_path / "new" / name).read_bytes() == (tmp_path / "free" / name).read_bytes()
        assert (tmp_path / "new" / name).read_bytes() == (tmp_path / "old" / name).read_bytes()


def test_the_reference_is_fixed_saved_and_loaded(tmp_path):
    """init_state fixes the references; rounds carry them however x and y move; every checkpoint keeps them exactly
    through JSON; a run stopped after round 2 and resumed takes them from the checkpoint (not from the state it
    holds) and equals the uninterrupted one; a checkpoint written before they existed loads with its own state's
    norms."""
    task, x0y0 = QuadTask(), rb.ref_norms(*QuadTask().initial())
    assert rb.init_state(*task.initial()).ref == x0y0
    assert x0y0["xy"] ** 2 == pytest.approx(x0y0["x"] ** 2 + x0y0["y"] ** 2)
    exp = _exp("rabo", rounds=5)
    bl.run_bilevel(exp, task, tmp_path / "whole", log=lambda s: None)
    with pytest.raises(SimulatedCrash):
        bl.run_bilevel(exp, task, tmp_path / "cut", log=lambda s: None, faults=Faults(crash=(2, "commit")))
    rd = RunDir(tmp_path / "cut")
    tensors, meta = rd.load_checkpoint(2)
    assert meta["ref_norm"] == x0y0  # exact: a float survives JSON
    resumed = BilevelServer(exp, task, log=lambda s: None)
    resumed.from_record(2, tensors, meta)
    s = resumed.state
    assert s.round == 3 and s.ref == x0y0 and rb.ref_norms(s.x, s.y) != x0y0  # the state moved, the reference did not
    bl.run_bilevel(exp, task, tmp_path / "cut", resume=True, log=lambda s: None)
    final = "final.safetensors"
    assert (tmp_path / "cut" / final).read_bytes() == (tmp_path / "whole" / final).read_bytes()
    assert RunDir(tmp_path / "cut").load_checkpoint(4)[1]["ref_norm"] == x0y0
    # a checkpoint from before the references: the norms of the state it holds, kept from then on
    with pytest.raises(SimulatedCrash):
        bl.run_bilevel(exp, task, tmp_path / "old", log=lambda s: None, faults=Faults(crash=(2, "commit")))
    d = RunDir(tmp_path / "old").ckpt / "round_000003" / "state.json"
    d.write_text(json.dumps({k: v for k, v in meta.items() if k != "ref_norm"}))
    old = BilevelServer(exp, task, log=lambda s: None)
    old.from_record(2, *RunDir(tmp_path / "old").load_checkpoint(2))
    old = old.state
    assert old.ref == rb.ref_norms(old.x, old.y) and equal(old.x, {k: tensors[f"x/{k}"] for k in old.x})
    bl.run_bilevel(exp, task, tmp_path / "old", resume=True, log=lambda s: None)
    assert RunDir(tmp_path / "old").load_checkpoint(4)[1]["ref_norm"] == old.ref
    server = BilevelServer(_exp("rabo"), task, log=lambda s: None)
    server.state = rb.BilevelState(0, *task.initial())  # a state set without references: its own norms, kept
    server.begin(0)
    assert server.state.ref == x0y0


def test_a_reply_inside_the_old_bound_but_outside_the_new_one_is_refused():
    """y pushed to norm 100 (references still those of x_0, y_0, ||y_0|| about 5.2): an inner step of norm 80
    passed the old bound (10 x 100) and is now refused, naming its reference; with the reference at 100 it
    passes."""
    exp, task = _exp("rabo"), QuadTask()
    server = BilevelServer(exp, task, log=lambda s: None)
    u = {"x": _direction(server.state.x), "y": _direction(server.state.y)}
    server.state = replace(server.state, y={k: 100 * v for k, v in u["y"].items()})
    server.begin(0)
    rejected = server.absorb("inner", {EVIL: _evil_reply(server, "inner", 80.0, u)})
    assert f"exceeds max_step_ratio 10 x max(||y_0||, 1) = {RATIO * server.state.ref['y']:.4g}" in rejected[EVIL]
    server.state = replace(server.state, ref={**server.state.ref, "y": 100.0})
    server.begin(0)
    assert server.absorb("inner", {EVIL: _evil_reply(server, "inner", 80.0, u)}) == {}
