"""Where a run's records go besides metrics.jsonl (the source of truth): the console's round lines, an
optional TensorBoard mirror (federation.tensorboard: true) and an optional MLflow run (federation.tracking:
mlflow), for both method families. The round loop's ledger (`federation.ledger`) calls every sink once per record it
writes to metrics.jsonl (`write`) and once at the end of each round (`end_round`, before the round's checkpoint), so
every sink sees the same stream in the same order.

Scalars (TensorBoard and MLflow): every numeric leaf of a record is `<event>/<path>` at step = round (-1:
pre-alignment and the evaluation before the first round). Per-client figures are summarized, never one tag
per client: the client records of a round become `client/<key>/{mean,p10,p90}` (and `client/n`, the
replies), and any dict keyed by client ids inside a record (an evaluation's `clients`, the server's
aggregation weights `p`) `<event>/<path>/<inner path>/{mean,p10,p90}`; a `<...>/nonfinite` count appears
when some clients' values are NaN or infinite (the statistics are over the finite ones). Per-step lists are left out. The whole config goes along once per
start: TensorBoard as hparams and as the YAML text (`config`), MLflow as params and the `config.yaml`
artifact.

Resume: TensorBoard purges what a crashed round had written (SummaryWriter's purge_step), so its curves
match metrics.jsonl; MLflow continues the same MLflow run (its id kept in OUT/mlflow.json) and cannot take
points back: a redone round's scalars appear there twice at the same step.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Callable, Iterable

from ciders.errors import CidersError
from ciders.federation.console import round_label

MIB = 2**20
NOT_SCALARS = ("extend",)  # events that are no time series (a resume extending the run: rundir.start_run)
STATS = {"mean": None, "p10": 0.1, "p90": 0.9}


class Sink:
    """What the ledger calls: `write` once per record, `end_round` once per round, `close` at the end."""

    def write(self, rec: dict) -> None:
        pass

    def end_round(self, t: int, seconds: float) -> None:
        pass

    def close(self) -> None:
        pass


class Sinks(Sink):
    """Several sinks fed the same stream, in order."""

    def __init__(self, sinks: Iterable[Sink]):
        self.sinks = list(sinks)

    def write(self, rec: dict) -> None:
        for s in self.sinks:
            s.write(rec)

    def end_round(self, t: int, seconds: float) -> None:
        for s in self.sinks:
            s.end_round(t, seconds)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


# ---------------------------------------------------------------------------------------------- scalars


def quantile(values: list[float], q: float) -> float:
    """The q-quantile of `values` by linear interpolation between order statistics (NumPy's default)."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary_stats(values: list[float], prefix: str) -> dict[str, float]:
    finite = [v for v in values if math.isfinite(v)]
    out = {f"{prefix}/{k}": (sum(finite) / len(finite) if q is None else quantile(finite, q)) if finite else math.nan
           for k, q in STATS.items()}
    if len(finite) < len(values):
        out[f"{prefix}/nonfinite"] = float(len(values) - len(finite))
    return out


def leaves(x, path: str = "", ids: frozenset = frozenset()) -> dict[str, float]:
    """The numeric leaves of a nested dict (bools and lists left out) as {path: value}; a dict keyed by
    client ids (`ids`) is summarized over its clients (`across`)."""
    out: dict[str, float] = {}
    if isinstance(x, bool):
        return out
    if isinstance(x, (int, float)):
        out[path] = float(x)
    elif isinstance(x, dict) and x and path and set(x) <= ids:
        out.update(across(x.values(), path, ids))
    elif isinstance(x, dict):
        for k, v in x.items():
            out.update(leaves(v, f"{path}/{k}" if path else str(k), ids))
    return out


def across(subtrees: Iterable, prefix: str, ids: frozenset = frozenset()) -> dict[str, float]:
    """Mean, p10 and p90 of each leaf over same-shaped subtrees or numbers (one per client):
    `<prefix>/<path>/<stat>`."""
    by_path: dict[str, list[float]] = {}
    for tree in subtrees:
        for p, v in leaves(tree, "", ids).items():
            by_path.setdefault(p, []).append(v)
    out: dict[str, float] = {}
    for p, vals in by_path.items():
        out.update(summary_stats(vals, f"{prefix}/{p}" if p else prefix))
    return out


def scalars(rec: dict, ids: frozenset = frozenset()) -> dict[str, float]:
    """The scalars of one record that is not a client record (`ids`: the run's client ids)."""
    ev = rec.get("event", "record")
    return {f"{ev}/{p}": x for k, v in rec.items() if k not in ("event", "round", "steps")
            for p, x in leaves(v, str(k), ids).items()}


def client_scalars(recs: list[dict], ids: frozenset = frozenset()) -> dict[str, float]:
    """The summary of one round's client records."""
    body = [{k: v for k, v in r.items() if k not in ("event", "round", "client", "steps")} for r in recs]
    return {"client/n": float(len(recs)), **across(body, "client", ids)}


def stream_scalars(rows: Iterable[dict], ids: Iterable[str] = ()) -> dict[int, dict[str, float]]:
    """step -> scalars, as the scalar sinks write them for this stream of records (e.g. metrics.jsonl) of a
    run whose clients are `ids`."""
    ids = frozenset(ids)
    out: dict[int, dict[str, float]] = {}
    clients: dict[int, list[dict]] = {}
    for r in rows:
        step = int(r.get("round", -1))
        if r.get("event") == "client":
            clients.setdefault(step, []).append(r)
        elif r.get("event") not in NOT_SCALARS:
            out.setdefault(step, {}).update(scalars(r, ids))
    for step, recs in clients.items():
        out.setdefault(step, {}).update(client_scalars(recs, ids))
    return out


class ScalarSink(Sink):
    """The record stream as scalars (`scalars`, `client_scalars`): a round's client records are held until
    its end and summarized there. Subclasses write (`put`) and make it durable (`flush`)."""

    def __init__(self, ids: Iterable[str]):
        self.ids = frozenset(ids)
        self._clients: dict[int, list[dict]] = {}

    def write(self, rec: dict) -> None:
        step = int(rec.get("round", -1))
        if rec.get("event") == "client":
            self._clients.setdefault(step, []).append(rec)
        elif rec.get("event") not in NOT_SCALARS:
            self.put(step, scalars(rec, self.ids))

    def end_round(self, t: int, seconds: float) -> None:
        for step in sorted(self._clients):
            self.put(step, client_scalars(self._clients[step], self.ids))
        self._clients.clear()
        self.flush()

    def put(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        pass


def flat_config(cfg) -> dict[str, object]:
    """The config as dotted keys; values bool / int / float / str (None and sequences as JSON text)."""
    from ciders.config import to_dict

    def walk(x, path):
        if isinstance(x, dict):
            for k, v in x.items():
                yield from walk(v, f"{path}.{k}" if path else k)
        else:
            yield path, x if isinstance(x, (bool, int, float, str)) else json.dumps(x)

    return dict(walk(to_dict(cfg), ""))


# ---------------------------------------------------------------------------------------------- the sinks


class TensorBoard(ScalarSink):
    """OUT/tensorboard: the scalars, the config as hparams and as YAML text; flushed every round."""

    METRICS = ("round/loss", "eval/global/ppl")  # what the hparams table shows beside the config

    def __init__(self, directory: str | Path, cfg, purge_from: int, ids: Iterable[str]):
        super().__init__(ids)
        try:
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams
        except ImportError as exc:
            raise CidersError("federation.tensorboard needs the tensorboard package: pip install tensorboard") from exc
        from ciders.config import dump_yaml

        # a reader drops what earlier processes wrote at steps >= purge_from: a resumed run's interrupted round,
        # everything for a fresh run (-1)
        self.writer = SummaryWriter(log_dir=str(directory), purge_step=purge_from)
        for s in hparams(flat_config(cfg), {m: math.nan for m in self.METRICS}):
            self.writer.file_writer.add_summary(s)
        text = "\n".join("    " + line for line in dump_yaml(cfg).splitlines())  # markdown code block
        self.writer.add_text("config", text, purge_from)

    def put(self, step: int, values: dict[str, float]) -> None:
        for tag, v in values.items():
            self.writer.add_scalar(tag, v, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class MLflow(ScalarSink):
    """An MLflow run (experiment = the config's name): the scalars as metrics, the config as params and
    the config.yaml artifact. federation.tracking_uri: any MLflow tracking URI; null = a SQLite file in the
    run directory (OUT/mlflow.db, artifacts in OUT/mlflow-artifacts), nothing leaves the machine."""

    BAD = re.compile(r"[^\w\-. :/]")  # characters MLflow refuses in a metric name

    def __init__(self, root: Path, cfg, resumed: bool, ids: Iterable[str]):
        super().__init__(ids)
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise CidersError("federation.tracking: mlflow needs the mlflow package: pip install 'ciders[mlflow]' "
                              "(or mlflow-skinny)") from exc
        from ciders.config import dump_yaml
        from ciders.fileio import write_json

        fed = cfg.federation
        uri = fed.tracking_uri or f"sqlite:///{(root / 'mlflow.db').resolve()}"
        # the default store keeps its artifacts in the run directory too (MLflow's own default: ./mlruns)
        where = None if fed.tracking_uri else (root / "mlflow-artifacts").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        state = root / "mlflow.json"
        rid = json.loads(state.read_text())["run_id"] if resumed and state.is_file() else None
        if rid is None:
            exp = self.client.get_experiment_by_name(cfg.name)
            eid = exp.experiment_id if exp is not None else self.client.create_experiment(cfg.name, where)
            rid = self.client.create_run(eid, run_name=root.name, tags={"ciders.run_dir": str(root.resolve())}).info.run_id
            write_json(state, {"tracking_uri": uri, "run_id": rid})
            self._params(rid, flat_config(cfg))
        else:
            self.client.update_run(rid, status="RUNNING")
            self.client.set_tag(rid, "federation.rounds", str(fed.rounds))  # params cannot change: a resume may extend
        self.client.log_text(rid, dump_yaml(cfg), "config.yaml")
        self.run_id = rid

    def _params(self, rid: str, params: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow's limit per batch
            self.client.log_batch(rid, params=items[i:i + 100])

    def put(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        ms = [Metric(self.BAD.sub("_", k), v, now, step) for k, v in values.items()]
        for i in range(0, len(ms), 1000):
            self.client.log_batch(self.run_id, metrics=ms[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")


class Console(Sink):
    """One line per round for a person watching: the round (numbered as in metrics.jsonl), the
    evaluation's headline figure when the round evaluates, the mean client loss (CIDERS) or the covering numbers
    (RABO family), the round's seconds and the MiB moved so far (both directions, every client)."""

    def __init__(self, rounds: int, log: Callable[[str], None], mib_before: float = 0.0):
        self.rounds, self.log, self.mib = rounds, log, mib_before
        self._round: dict | None = None
        self._eval: dict | None = None

    def write(self, rec: dict) -> None:
        if rec.get("event") == "round":
            self._round = rec
            self.mib += (sum(rec.get("bytes_down", {}).values()) + sum(rec.get("bytes_up", {}).values())) / MIB
        elif rec.get("event") == "eval":
            self._eval = rec

    def end_round(self, t: int, seconds: float) -> None:
        parts = [round_label(t, self.rounds) + (" (before the first round)" if t < 0 else "")]
        if self._eval is not None:
            parts.append(headline(self._eval))
        elif t >= 0:
            parts.append("not evaluated (federation's schedule)")
        r = self._round or {}
        if "clients" in r and not r["clients"]:  # the takd-only control samples nobody: no client loss
            parts.append("no client learning")
        elif "loss" in r:
            parts.append(f"client loss {r['loss']:.4f}")
        if "covering_x" in r:  # the RABO family's covering numbers (docs/rabo.md)
            parts.append(f"C_x* {r['covering_x']} C_y* {r['covering_y']}")
        parts.append(f"{seconds:.1f} s")
        if t >= 0:
            parts.append(f"{self.mib:.2f} MiB so far")
        self.log(" | ".join(parts))
        self._round = self._eval = None


def headline(ev: dict) -> str:
    """An evaluation's main figure: the global messenger's perplexity, else its first top-level number."""
    g = ev.get("global")
    if isinstance(g, dict) and isinstance(g.get("ppl"), (int, float)):
        return f"global ppl {g['ppl']:.3f}"
    for k, v in ev.items():
        if k not in ("event", "round") and isinstance(v, (int, float)) and not isinstance(v, bool):
            return f"{k} {v:.4g}"
    return "evaluated"


def open_sinks(cfg, root: Path, first_round: int, resumed: bool, ids: Iterable[str], log: Callable[[str], None],
               mib_before: float = 0.0) -> Sinks:
    """The sinks `cfg` asks for, for a run in `root` with clients `ids`, starting (`resumed` false) or
    resuming at round `first_round`; `mib_before`: what the committed rounds moved."""
    fed = cfg.federation
    out: list[Sink] = [Console(fed.rounds, log, mib_before)]
    if fed.tensorboard:
        out.append(TensorBoard(root / "tensorboard", cfg, first_round if resumed else -1, ids))
    if fed.tracking == "mlflow":
        out.append(MLflow(root, cfg, resumed, ids))
    return Sinks(out)
