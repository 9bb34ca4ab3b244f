"""The takd-only control and the TAKD task weights on a tiny model: the control is the run's own TAKD schedule with
no client learning (its student equals the schedule run by hand, its messenger never moves, nothing crosses the
wire), and pre-alignment uses takd.lambda_task_bootstrap while the per-round steps use takd.lambda_task."""

from dataclasses import replace

import torch

from ciders.algorithms import configure
from ciders.config import load_config
from ciders.fileio import read_jsonl
from ciders.workloads import prealign
from conftest import ROOT
from workloads.test_baselines_llm import ckpt, run


def _schedule_by_hand(cfg, scratch, rounds):
    """Pre-alignment, then takd.round_steps steps per round against the initial messenger, outside the loop."""
    from ciders.algorithms import ciders as alg
    from ciders.workloads.llm import LLMTask

    task = LLMTask(cfg, scratch, log=lambda s: None)
    extra = task.extra_from_record(*task._prealign()[:2])
    server = alg.init_server(task.initial_messenger(), rounds)
    for t in range(rounds):
        extra, _ = task.after_server(t, server, extra)
    return extra.student, server.messenger


def test_takd_only_runs_the_takd_schedule_alone(tmp_path):
    out = run(tmp_path, "takd-only", "federation.rounds=2", "takd.round_steps=2", "federation.checkpoint_keep=3")
    cfg = load_config(out / "config.yaml")
    assert cfg.algorithm.client_learning is False
    rows = read_jsonl(out / "metrics.jsonl")
    assert not [r for r in rows if r["event"] == "client"]  # nobody trained
    assert all(not r["bytes_down"] and not r["bytes_up"] for r in rows if r["event"] == "round")
    msg, student = ckpt(out, 1)
    student_hand, msg0 = _schedule_by_hand(cfg, tmp_path / "hand", 2)
    assert all(torch.equal(msg[k], msg0[k].to(msg[k].device)) for k in msg0)  # the messenger never moved
    assert max((student[k] - student_hand[k].to(student[k].device)).abs().max().item() for k in student) < 1e-6
    _, student_pre = ckpt(out, -1)
    assert any(not torch.equal(student[k], student_pre[k]) for k in student)  # B_L moved every round
    # each client's "personalized" figure is the global messenger on its own held-out part
    ev = [r for r in rows if r["event"] == "eval"][-1]
    assert ev["clients"] and all(c["personalized"] == c["global"] for c in ev["clients"].values())
    assert 0 <= ev["fidelity"]["agreement"] <= 1 and ev["fidelity"]["tokens"] == ev["global"]["tokens"]


def test_bootstrap_and_round_task_weights_are_separate(tmp_path):
    out = run(tmp_path, "fedavg", "takd.lambda_task=1", "takd.lambda_task_bootstrap=0")
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "takd"]
    assert rows[-1]["ce"] > 0  # the per-round steps use lambda_task
    cfg = load_config(out / "config.yaml")
    _, pre = ckpt(out, -1)
    # the pre-alignment equals one run with lambda_task = 0 throughout, and differs from lambda_task = 1
    from ciders.workloads.llm import LLMTask

    for lam, same in ((0.0, True), (1.0, False)):
        c = replace(cfg, takd=replace(cfg.takd, lambda_task=lam, lambda_task_bootstrap=None))
        t, _, _ = LLMTask(c, tmp_path / f"pre{lam}", log=lambda s: None)._prealign()
        got = {k[len("student/"):]: v for k, v in t.items() if k.startswith("student/")}
        assert (max((got[k] - pre[k]).abs().max().item() for k in pre) < 1e-7) is same


def test_prealignment_key_follows_the_bootstrap_weight_only():
    cfg = configure(load_config(ROOT / "configs" / "tiny.yaml"))
    feats = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}]

    def key(**kw):
        return prealign.key(replace(cfg, takd=replace(cfg.takd, **kw)), feats)

    assert key(lambda_task=1.0, lambda_task_bootstrap=0.0) == key(lambda_task=0.0, lambda_task_bootstrap=None)
    assert key(lambda_task=0.0, lambda_task_bootstrap=1.0) == key(lambda_task=1.0, lambda_task_bootstrap=None)
    assert key(lambda_task=1.0, lambda_task_bootstrap=0.0) != key(lambda_task=1.0, lambda_task_bootstrap=None)
    assert key(round_steps=7) == key(round_steps=1)
