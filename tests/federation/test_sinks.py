"""What a person watching a run sees, checked against metrics.jsonl: the console's round lines, run.log, the
progress bars' switch, the TensorBoard mirror (read back from its event files) and the MLflow run (read
back through MLflow's client)."""

import io
import json
import logging
import math
import sys

import pytest
import torch

from ciders.errors import CidersError
from ciders.federation import console
from ciders.federation.inprocess import SimulatedCrash
from ciders.federation.loop import Faults
from ciders.federation.ciders_loop import run_federation
from ciders.federation.sinks import MIB, stream_scalars
from ciders.fileio import read_jsonl
from ciders.config import load_config
from helpers import event_scalars
from synthetic import VectorTask

VEC = ["federation.clients=5", "federation.rounds=4", "federation.per_round=3", "algorithm.local_steps=3",
       "algorithm.lr=0.05", "algorithm.schedule=warmup_cosine", "algorithm.warmup_steps=2"]


def vec_cfg(*extra):
    return load_config(None, VEC + list(extra))


def run_vec(out, faults=None, resume=False, cfg=None):
    return run_federation(cfg or vec_cfg(), VectorTask(5), out, resume=resume, faults=faults, progress=False,
                          log=lambda s: None)


def rows_of(out):
    return read_jsonl(out / "metrics.jsonl")


def assert_same(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for step, tags in expected.items():
        assert set(got[step]) == set(tags), step
        for tag, v in tags.items():
            assert got[step][tag] == pytest.approx(v, rel=1e-6, abs=1e-30, nan_ok=True), (step, tag)


# ---------------------------------------------------------------------------------------------- console, run.log


def test_one_console_line_per_round_numbered_as_metrics_jsonl(tmp_path):
    lines = []
    run_federation(vec_cfg(), VectorTask(5), tmp_path, progress=False, log=lines.append)
    rows = rows_of(tmp_path)
    rounds = [r for r in rows if r["event"] == "round"]
    round_lines = [x for x in lines if x.startswith("round ") and " s" in x and "|" in x]
    assert [int(x.split()[1].split("/")[0]) for x in round_lines] == [-1] + [r["round"] for r in rounds]
    assert all(x.split()[1].endswith("/3") for x in round_lines)  # the last round's number: 4 rounds, 0..3
    evals = {r["round"]: r for r in rows if r["event"] == "eval"}
    mib = 0.0
    for r, line in zip(rounds, round_lines[1:]):
        mib += (sum(r["bytes_down"].values()) + sum(r["bytes_up"].values())) / MIB
        assert f"client loss {r['loss']:.4f}" in line and f"{mib:.2f} MiB so far" in line
        assert f"global_loss {evals[r['round']]['global_loss']:.4g}" in line
    assert f"global_loss {evals[-1]['global_loss']:.4g}" in round_lines[0] and "MiB" not in round_lines[0]


def test_run_log_gets_the_lines_and_no_progress_bars(tmp_path):
    run_federation(vec_cfg(), VectorTask(5), tmp_path, progress=True)  # the default log: the `ciders` logger
    text = (tmp_path / "run.log").read_text()
    for t in range(-1, 4):
        assert f"round {t}/3" in text
    assert "\r" not in text and "client steps" not in text  # bars never reach the log
    assert not console.LOGGER.handlers  # the run's file handler is gone with the run
    run_federation(vec_cfg("federation.rounds=5"), VectorTask(5), tmp_path, resume=True, progress=False)
    text = (tmp_path / "run.log").read_text()
    assert text.count("round 0/3") == 1 and "round 4/4" in text  # a resume appends


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_bars_only_on_a_terminal_and_never_when_quiet(monkeypatch):
    assert console.bar(total=3).disable  # pytest's captured stderr is no terminal
    monkeypatch.setattr(sys, "stderr", FakeTTY())
    assert not console.bar(total=3).disable
    assert console.bar(False, total=3).disable
    console.quiet()
    try:
        assert console.bar(total=3).disable
    finally:
        console.quiet(False)


def test_console_handler_writes_lines_at_its_level():
    stream = io.StringIO()
    h = console.to_console(logging.WARNING, stream)
    try:
        console.info("an info line")
        console.LOGGER.warning("a warning line")
    finally:
        console.LOGGER.removeHandler(h)
    assert stream.getvalue() == "a warning line\n"


# ---------------------------------------------------------------------------------------------- TensorBoard


def test_tensorboard_holds_client_summaries_hparams_and_config(tmp_path):
    pytest.importorskip("tensorboard", reason="federation.tensorboard needs the tensorboard package")
    from tensorboard.plugins.hparams import plugin_data_pb2

    run_vec(tmp_path, cfg=vec_cfg("federation.tensorboard=true"))
    acc, got = event_scalars(tmp_path / "tensorboard")
    rows = rows_of(tmp_path)
    assert_same(got, stream_scalars(rows, VectorTask(5).ids))
    assert not [t for t in acc.Tags()["scalars"] if "c000" in t]  # no tag per client
    # the summaries, from metrics.jsonl's client records directly
    for t in range(4):
        loss = torch.tensor([r["loss"] for r in rows if r["event"] == "client" and r["round"] == t], dtype=torch.float64)
        assert len(loss) == 3 and got[t]["client/n"] == 3
        assert got[t]["client/loss/mean"] == pytest.approx(float(loss.mean()), rel=1e-6)
        assert got[t]["client/loss/p10"] == pytest.approx(float(torch.quantile(loss, 0.1)), rel=1e-6)
        assert got[t]["client/loss/p90"] == pytest.approx(float(torch.quantile(loss, 0.9)), rel=1e-6)
        assert got[t]["round/loss"] == pytest.approx(next(r["loss"] for r in rows if r["event"] == "round" and r["round"] == t))
    assert "eval/global_loss" in got[-1] and "prealign/" not in " ".join(got[-1])  # VectorTask: no prealign figures
    hp = acc.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(hp["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["federation.rounds"].number_value == 4
    assert start.hparams["algorithm.schedule"].string_value == "warmup_cosine"
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "rounds: 4" in text and "schedule: warmup_cosine" in text


class Watching(Faults):
    """At each round's checkpoint (just after the sinks' end of round): what a person running `tensorboard`
    sees on disk, and how often the writer was flushed so far."""

    def __init__(self, directory, flushes):
        super().__init__()
        self.directory, self.flushes, self.seen = directory, flushes, {}

    def maybe_crash(self, t, point):
        if point == "checkpoint":
            _, got = event_scalars(self.directory)
            self.seen[t] = (max(s for s, tags in got.items() if "round/loss" in tags and "client/loss/mean" in tags),
                            len(self.flushes))


def test_tensorboard_is_flushed_every_round(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard", reason="federation.tensorboard needs the tensorboard package")
    from torch.utils.tensorboard import SummaryWriter

    flushes, real = [], SummaryWriter.flush
    monkeypatch.setattr(SummaryWriter, "flush", lambda self: (flushes.append(1), real(self))[1])
    faults = Watching(tmp_path / "tensorboard", flushes)
    run_vec(tmp_path, cfg=vec_cfg("federation.tensorboard=true"), faults=faults)
    assert faults.seen == {t: (t, t + 2) for t in range(4)}  # round t on disk; flushed at rounds -1 .. t


@pytest.mark.parametrize("point", ["takd", "checkpoint"])
def test_tensorboard_after_a_crash_and_resume_still_matches_metrics_jsonl(tmp_path, point):
    pytest.importorskip("tensorboard", reason="federation.tensorboard needs the tensorboard package")
    cfg = vec_cfg("federation.tensorboard=true")
    with pytest.raises(SimulatedCrash):
        run_vec(tmp_path, cfg=cfg, faults=Faults(crash=(2, point)))
    run_vec(tmp_path, cfg=cfg, resume=True)
    _, got = event_scalars(tmp_path / "tensorboard")  # round 2 was written (checkpoint) or held (takd) before
    assert_same(got, stream_scalars(rows_of(tmp_path), VectorTask(5).ids))


def test_tensorboard_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(CidersError, match="needs the tensorboard package"):
        run_vec(tmp_path, cfg=vec_cfg("federation.tensorboard=true"))


# ---------------------------------------------------------------------------------------------- MLflow


def test_mlflow_run_holds_the_same_scalars_params_and_config(tmp_path):
    pytest.importorskip("mlflow", reason="federation.tracking: mlflow needs mlflow or mlflow-skinny (pip install "
                                         "'ciders[mlflow]')")
    from mlflow.tracking import MlflowClient

    from ciders.federation.sinks import MLflow

    cfg = vec_cfg("federation.tracking=mlflow", "federation.rounds=2")
    run_vec(tmp_path, cfg=cfg)
    state = json.loads((tmp_path / "mlflow.json").read_text())
    assert state["tracking_uri"].startswith("sqlite:///") and (tmp_path / "mlflow.db").is_file()  # nothing left the machine
    client = MlflowClient(tracking_uri=state["tracking_uri"])
    run = client.get_run(state["run_id"])
    assert run.info.status == "FINISHED" and run.data.params["federation.rounds"] == "2"
    assert run.data.params["algorithm.schedule"] == "warmup_cosine"

    def history():
        out: dict[int, dict[str, float]] = {}
        for key in client.get_run(state["run_id"]).data.metrics:
            for m in client.get_metric_history(state["run_id"], key):
                assert key not in out.get(m.step, {}), f"{key} twice at step {m.step}"
                out.setdefault(m.step, {})[key] = m.value
        return out

    def expected():
        return {s: {MLflow.BAD.sub("_", k): v for k, v in tags.items()} for s, tags in stream_scalars(rows_of(tmp_path), VectorTask(5).ids).items()}

    assert_same(history(), expected())
    assert not [k for k in run.data.metrics if "c000" in k]
    assert run.info.artifact_uri.startswith((tmp_path / "mlflow-artifacts").resolve().as_uri())  # not ./mlruns
    art = client.download_artifacts(state["run_id"], "config.yaml", str(tmp_path / "art"))
    assert "rounds: 2" in open(art).read()
    run_vec(tmp_path, cfg=vec_cfg("federation.tracking=mlflow", "federation.rounds=3"), resume=True)  # extended
    assert json.loads((tmp_path / "mlflow.json").read_text())["run_id"] == state["run_id"]  # the same MLflow run
    assert_same(history(), expected())
    run = client.get_run(state["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["federation.rounds"] == "3"


def test_mlflow_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    with pytest.raises(CidersError, match=r"needs the mlflow package: pip install 'ciders\[mlflow\]'"):
        run_vec(tmp_path, cfg=vec_cfg("federation.tracking=mlflow"))


def test_summary_statistics_skip_non_finite_values_and_count_them():
    from ciders.federation.sinks import client_scalars

    recs = [{"event": "client", "round": 0, "client": f"c{i}", "loss": v, "steps": [{"loss": 1.0}]}
            for i, v in enumerate([1.0, 2.0, 3.0, float("nan")])]
    got = client_scalars(recs)
    assert got["client/n"] == 4 and got["client/loss/mean"] == 2.0 and got["client/loss/nonfinite"] == 1
    assert got["client/loss/p10"] == pytest.approx(1.2) and got["client/loss/p90"] == pytest.approx(2.8)
    assert math.isnan(client_scalars([{"loss": float("inf")}])["client/loss/mean"])
