"""The round loop's own chores (`federation.loop.run_rounds`), the same for every method family: it admits the
replies (`exchange.admit`), counts the bytes (`ledger.Traffic`), writes the records through the sinks, keeps the
evaluation schedule, and checkpoints and commits each round. A toy strategy drives it here; the RABO family, which
once had none of this from the loop, gets the console line, TensorBoard and per-phase bytes from it."""

import json
from dataclasses import replace

import pytest
import torch

from ciders.config import BilevelExperiment, BilevelFederationConfig, FederationConfig
from ciders.config.federation import RunFederation
from ciders.errors import CidersError, ConfigError
from ciders.federation.bilevel_loop import run_bilevel
from ciders.federation.exchange import Reply, admit
from ciders.federation.inprocess import Faults, SimulatedCrash
from ciders.federation.ledger import Traffic
from ciders.federation.loop import run_rounds
from ciders.federation.rundir import RunDir
from ciders.fileio import read_jsonl
from helpers import QuadTask, bilevel_exp, event_scalars


# ---------------------------------------------------------------------------------------------- admission


def test_admission_refuses_errors_strangers_and_second_replies_with_why():
    replies = [Reply("a", b"1"), Reply("b", error="ValueError: boom"), Reply("c", rejected="unreadable"),
               Reply("z", b"2"), Reply("a", b"3"), Reply("a", b"4", kind="late"), Reply("b", b"5", kind="copy")]
    got = admit(replies, ["a", "b", "c"], "train", 4)
    assert [r.payload for r in got.replies] == [b"1"]  # the first reply of a client sent a message
    assert [r.kind for r in got.others] == ["late", "copy"]
    assert got.refused == {"b": "client error: ValueError: boom", "c": "unreadable",
                           "z": "a reply from a client sent no train message in round 4",
                           "a": "a second train reply in round 4"}
    assert got.failed == {"b"}


def test_admission_bounds_a_hostile_id_and_error_text():
    got = admit([Reply("x" * 10_000, b"1"), Reply("a", error="e" * 10_000)], ["a"], "inner", 0)
    assert max(len(k) for k in got.refused) <= 64 and len(got.refused["a"]) <= len("client error: ") + 200


# ---------------------------------------------------------------------------------------------- bytes


def test_traffic_counts_each_message_and_its_components_and_skips_the_uncounted():
    tr = Traffic()
    tr.add("down", "a", b"12345", {"messenger": 4, "header": 1})
    tr.add("down", "b", b"123", None)  # not sent in the method's own terms (e.g. no communication)
    tr.add("down", "a", b"12", {"secagg_keys": 2})  # a second phase adds to the client's and the component's count
    tr.add("up", "a", b"1", {"dc": 1})
    assert tr.down == {"messenger": 4, "header": 1, "secagg_keys": 2} and tr.down_by == {"a": 7}
    assert tr.up == {"dc": 1} and tr.up_by == {"a": 1}


# ---------------------------------------------------------------------------------------------- a toy strategy


class Toy:
    """Two clients, one phase; the state is a number that each reply adds to."""

    def __init__(self, root, eval_rounds=0):
        self.experiment = replace(BilevelExperiment(name="toy"),
                                  federation=BilevelFederationConfig(clients=2, rounds=3, eval_rounds=eval_rounds))
        self.run, self.ids, self.log, self.extends_rounds = RunDir(root), ["c0", "c1"], lambda s: None, False
        self.state, self.next, self.seen, self.first_round = 0, 0, [], 0

    def prepare(self):
        return [{"event": "prepared", "round": -1}]

    def from_record(self, t, tensors, meta):
        self.state, self.first_round = meta["state"], t + 1

    def begin(self, t):
        self.next = self.state

    def phases(self, t):
        return ("work",)

    def configure(self, phase, t):
        return {"c0": b"abc", "c1": b"de"}

    def count(self, direction, phase, cid, msg):
        return {f"{direction}-{phase}": len(msg)}

    def aggregate(self, phase, t, got, traffic, mark):
        self.seen.append((sorted(r.client_id for r in got.replies), dict(got.refused)))
        self.next += sum(int(r.payload) for r in got.replies)
        return [{"event": "client", "round": t, "client": r.client_id} for r in got.replies]

    def finish(self, t, traffic):
        return [{"event": "round", "round": t, "bytes_down": dict(traffic.down), "bytes_up": dict(traffic.up),
                 "by": dict(traffic.down_by)}]

    def evaluate(self, t):
        return {"value": self.next if t >= 0 else self.state}

    def to_record(self):
        return {"v": torch.tensor([float(self.next)])}, {"state": self.next}

    def commit(self, t):
        self.state = self.next

    def close(self):
        return {"state": self.state}


def toy_exchange(phase, t, msgs):
    return [Reply("c0", b"1"), Reply("c1", error="lost"), Reply("c9", b"100")]


def test_the_loop_admits_counts_records_evaluates_on_schedule_and_commits(tmp_path):
    toy = Toy(tmp_path, eval_rounds=1)  # the model before round 0, then the last round only
    assert run_rounds(toy, toy_exchange, 3) == {"state": 3}
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["event"], r["round"]) for r in rows] == [
        ("prepared", -1), ("eval", -1), ("client", 0), ("round", 0), ("client", 1), ("round", 1),
        ("client", 2), ("round", 2), ("eval", 2)]
    assert rows[3]["bytes_down"] == {"down-work": 5} and rows[3]["bytes_up"] == {"up-work": 1}
    assert rows[3]["by"] == {"c0": 3, "c1": 2} and rows[-1]["value"] == 3
    assert toy.seen[0] == (["c0"], {"c1": "client error: lost", "c9": "a reply from a client sent no work message "
                                                                       "in round 0"})
    assert RunDir(tmp_path).committed() == 2 and RunDir(tmp_path).load_checkpoint(2)[1] == {"state": 3}
    assert json.loads((tmp_path / "eval" / "round_0002.json").read_text())["value"] == 3
    assert (tmp_path / "eval" / "before.json").is_file() and not (tmp_path / "eval" / "round_0001.json").exists()


def test_a_crash_before_the_checkpoint_leaves_the_last_commit_and_resume_continues_from_it(tmp_path):
    toy = Toy(tmp_path)
    with pytest.raises(SimulatedCrash):
        run_rounds(toy, toy_exchange, 3, Faults(crash=(1, "checkpoint")))
    assert RunDir(tmp_path).committed() == 0 and toy.state == 1  # round 1 never committed
    with pytest.raises(CidersError, match="already holds a run"):
        run_rounds(Toy(tmp_path), toy_exchange, 3)
    again = Toy(tmp_path)
    assert run_rounds(again, toy_exchange, 3, resume=True) == {"state": 3} and again.seen[0][0] == ["c0"]
    assert [(r["event"], r["round"]) for r in read_jsonl(tmp_path / "metrics.jsonl")][-2:] == [("round", 2),
                                                                                               ("eval", 2)]


# ---------------------------------------------------------------------------------------------- both families


def test_both_families_share_one_federation_section():
    for cls in (FederationConfig, BilevelFederationConfig):
        assert issubclass(cls, RunFederation)
        for key, bad in (("checkpoint_keep", 0), ("rounds", 0), ("max_step_ratio", 0.0)):
            with pytest.raises(ConfigError, match=f"federation.{key}"):
                replace(cls(), **{key: bad}).validate()
    with pytest.raises(ConfigError, match="federation.tracking"):
        replace(BilevelFederationConfig(), tracking="wandb").validate()
    every2 = FederationConfig(rounds=5, eval_every=2)
    assert [t for t in range(-1, 5) if every2.evaluates(t)] == [-1, 1, 3, 4]
    for cls in (FederationConfig, BilevelFederationConfig):  # one schedule: both keys in both families
        assert [t for t in range(-1, 6) if cls(rounds=6, eval_rounds=2).evaluates(t)] == [-1, 4, 5]
        assert [t for t in range(-1, 6) if cls(rounds=6, eval_every=2, eval_rounds=3).evaluates(t)] == [-1, 3, 5]
        with pytest.raises(ConfigError, match="federation.eval_rounds"):
            cls(rounds=2, eval_rounds=3).validate()


def test_the_rabo_family_gets_the_console_line_tensorboard_and_bytes_per_phase(tmp_path):
    pytest.importorskip("tensorboard", reason="federation.tensorboard needs the tensorboard package")
    exp = bilevel_exp("rabo", rounds=2)
    exp = replace(exp, federation=replace(exp.federation, tensorboard=True))
    lines = []
    summary = run_bilevel(exp, QuadTask(), tmp_path, log=lines.append)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    rounds = [r for r in rows if r["event"] == "round"]
    for r in rounds:  # per phase, equal to the lengths the client records carry
        clients = [c for c in rows if c["event"] == "client" and c["round"] == r["round"]]
        for phase in ("inner", "outer"):
            assert r["bytes_down"][phase] == sum(c["bytes_down"] for c in clients if c["phase"] == phase) > 0
            assert r["bytes_up"][phase] == sum(c["bytes_up"] for c in clients if c["phase"] == phase) > 0
    assert summary["bytes_down"] == sum(sum(r["bytes_down"].values()) for r in rounds)
    console = [s for s in lines if s.startswith("round ")]
    assert len(console) == 3 and "C_x*" in console[-1] and "MiB so far" in console[-1], console
    _, got = event_scalars(tmp_path / "tensorboard")
    assert got[1]["round/bytes_down/outer"] == rounds[1]["bytes_down"]["outer"] and "client/calls/mean" in got[1]
    assert "eval/" + next(k for k, v in rows[0].items() if isinstance(v, float)) in got[-1]


def test_the_generic_loop_knows_no_method_family():
    """federation.loop (the loop, the strategy protocol) and the modules it uses import no family's code: no update
    rule, codec, task protocol or round of either family."""
    import ast
    from pathlib import Path

    import ciders.federation as fed

    family = ("ciders.algorithms", "ciders.federation.rounds", "ciders.federation.codec", "ciders.federation.secure",
              "ciders.federation.bilevel", "ciders.federation.ciders_loop", "ciders.workloads", "ciders.models")
    for name in ("loop", "ledger", "exchange", "sinks", "inprocess", "rundir"):
        tree = ast.parse((Path(fed.__file__).parent / f"{name}.py").read_text())
        mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not [m for m in mods if m and m.startswith(family)], (name, sorted(mods))


def test_a_ciders_round_counts_its_broadcasts_and_uploads_but_not_the_evaluation_s_report(tmp_path):
    """Every round evaluates here, so each has a report phase (the personalized messengers the evaluation reads):
    the round's bytes are the train phase's alone, equal to what its client records carry."""
    from ciders.config import load_config
    from ciders.federation.ciders_loop import run_federation
    from synthetic import VEC, VectorTask

    run_federation(load_config(None, VEC + ["federation.eval_every=1"]), VectorTask(3), tmp_path, progress=False,
                   log=lambda s: None)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    for r in (r for r in rows if r["event"] == "round"):
        clients = [c for c in rows if c["event"] == "client" and c["round"] == r["round"]]
        assert "personalized" not in r["bytes_up"] and set(r["bytes_up"]) >= {"dc"}
        assert sum(r["bytes_down"].values()) == sum(c["bytes_down"] for c in clients) > 0
        assert sum(r["bytes_up"].values()) == sum(c["bytes_up"] for c in clients) > 0


def test_a_resumed_rabo_run_reports_what_an_uninterrupted_one_does(tmp_path):
    """The totals summary.json reports (calls, op_estimate, bytes) come back from the checkpoint on resume."""
    exp = bilevel_exp("rabo", rounds=3)
    whole = run_bilevel(exp, QuadTask(), tmp_path / "whole", log=lambda s: None)
    with pytest.raises(SimulatedCrash):
        run_bilevel(exp, QuadTask(), tmp_path / "cut", log=lambda s: None, faults=Faults(crash=(1, "commit")))
    resumed = run_bilevel(exp, QuadTask(), tmp_path / "cut", log=lambda s: None, resume=True)
    assert {k: v for k, v in whole.items() if k != "seconds"} == {k: v for k, v in resumed.items() if k != "seconds"}
    assert read_jsonl(tmp_path / "whole" / "metrics.jsonl") == read_jsonl(tmp_path / "cut" / "metrics.jsonl")


def test_both_families_log_a_rejected_reply_in_one_form():
    from ciders.federation.console import rejected

    assert rejected(3, "train", "client1", "NaN in dc") == "round 3 train: rejected client1: NaN in dc"
    assert len(rejected(0, "inner", "x" * 10_000, "why")) < 100  # a hostile id is cut
