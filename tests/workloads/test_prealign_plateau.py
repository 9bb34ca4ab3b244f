"""Pre-alignment to a plateau (takd.plateau_*): held-out public examples leave TAKD, pre-alignment stops after
`plateau_patience` flat checks (or at takd.bootstrap_steps), and the steps it ran are the steps one uninterrupted
distillation would have run."""

from dataclasses import replace

import torch

from ciders.config import load_config
from ciders.models.distill import distill, init_state
from ciders.workloads.llm import LLMTask, _flat
from conftest import ROOT


def test_flat_needs_patience_flat_checks_in_a_row():
    c = [{"nll": x} for x in (5.0, 4.0, 3.995, 3.99)]
    assert _flat(c, 0.01, 2) and not _flat(c, 0.001, 2) and not _flat(c[:3], 0.01, 2)
    assert not _flat([{"nll": x} for x in (5.0, 4.995, 4.0, 3.995)], 0.01, 2)  # a drop in between resets it
    assert _flat([{"nll": 4.0}, {"nll": 4.2}], 0.01, 1)  # a rise is flat too
    assert not _flat([{"nll": 4.0}, {"nll": 4.0}], 0.01, 2)  # two checks make one comparison, not two


def _task(tmp_path, **takd):
    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    cfg = replace(cfg, takd=replace(cfg.takd, **takd)).validate()
    return LLMTask(cfg, tmp_path, log=lambda s: None)


def test_prealignment_stops_at_the_plateau_with_the_steps_of_one_run(tmp_path):
    task = _task(tmp_path / "a", bootstrap_steps=40, plateau_examples=4, plateau_every=1, plateau_tol=100.0,
                 plateau_patience=2)
    assert len(task.plateau_set) == 4 and len(task.public) == 12  # 16 public examples in the tiny config
    assert not {tuple(f["input_ids"]) for f in task.plateau_set} & {tuple(f["input_ids"]) for f in task.public}
    t, _, pre = task._prealign()
    assert pre["steps"] == 3 and [c["step"] for c in pre["plateau_curve"]] == [1, 2, 3]  # every drop < 100 nats
    ref = _task(tmp_path / "ref", bootstrap_steps=40, plateau_examples=4)  # a fresh student, the same public part
    st, _ = distill(ref.d, init_state(ref.d), ref.d.messenger_state(), ref.public, ref.cfg.takd.bootstrap(), 3, pad_id=ref.pad,
                    seed=ref.cfg.seed, cache=ref.cache)
    assert all(torch.equal(t[f"student/{k}"], v) for k, v in st.student.items())


def test_prealignment_without_a_plateau_set_runs_bootstrap_steps(tmp_path):
    task = _task(tmp_path / "b", bootstrap_steps=2)
    assert task.plateau_set == [] and len(task.public) == 16
    _, _, pre = task._prealign()
    assert pre["steps"] == 2 and "plateau_curve" not in pre
    capped = _task(tmp_path / "c", bootstrap_steps=2, plateau_examples=4, plateau_every=1, plateau_tol=0.0)
    _, _, pre = capped._prealign()
    assert pre["steps"] == 2 and len(pre["plateau_curve"]) == 2  # the cap ends it before 3 checks exist
