"""The ServerApp, and `run_simulation` behind `ciders run CONFIG --engine flower-sim`.

The ServerApp runs the experiment's own round loop (`federation.loop.run_rounds`, through `run_federation`
or `run_bilevel`) with a `FlowerExchange` as its transport: ciders owns the loop, Flower moves the
messages. The run directory is the same as the in-process engine's (metrics.jsonl, checkpoints, eval/,
adapters/), minus `clients/`: on Flower, client state lives on the clients.

Under `flwr run` the run config (`--run-config`) names the experiment:
  config = "/abs/path/experiment.yaml"   set = "federation.rounds=2;seed=1"   out = "/abs/run/dir"
  resume = false   (true: continue from the run directory's last committed checkpoint)
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp


def _spec_from_run_config(rc: dict) -> dict:
    from ciders.config import dump_yaml, load_experiment
    from ciders.errors import ConfigError

    if not rc.get("config") or not rc.get("out"):
        raise ConfigError("the ServerApp needs run config keys config=<experiment.yaml> and out=<run dir> "
                          "(flwr run ... --run-config 'config=\"...\" out=\"...\"')")
    overrides = [s for s in str(rc.get("set", "")).split(";") if s.strip()]
    cfg = load_experiment(Path(str(rc["config"])), overrides)
    if cfg.family == "bilevel":
        from ciders.algorithms.registry import bilevel_config

        cfg = bilevel_config(cfg, cfg.method)
    return {"config_text": dump_yaml(cfg), "out": str(rc["out"]), "resume": bool(rc.get("resume", False))}


def _teed(log, path: Path):
    """`log`, with each line also appended to `path` (the ServerApp's own output is otherwise only in the
    SuperLink's `flwr log`, which is gone with the SuperLink)."""
    import time

    def both(line: str) -> None:
        log(line)
        with open(path, "a") as fh:
            fh.write(f"{time.strftime('%H:%M:%S')} {line}\n")

    return both


def serve(grid: Grid, spec: dict, log=print) -> dict:
    """One whole run on `grid` (simulation or deployment): the run's own round loop with a FlowerExchange
    as its transport, its log also kept in RUN/server.log. Returns the run summary."""
    from ciders import algorithms
    from ciders.config import dump_yaml, loads_experiment
    from ciders.federation.exchange import client_id
    from ciders.transports.flower.exchange import FlowerExchange

    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    log = _teed(log, out / "server.log")
    resume = bool(spec.get("resume", False))
    cfg = loads_experiment(spec["config_text"], "the experiment")
    if cfg.family == "bilevel":
        from ciders.federation.bilevel_loop import run_bilevel
        from ciders.workloads.bilevel import build

        exp = cfg
        ids = [client_id(i) for i in range(exp.federation.clients)]
        ex = FlowerExchange(grid, spec["config_text"], ids, exp.flower, "bilevel", log)
        return run_bilevel(exp, build(exp), out, log=log, resume=resume, exchange=ex)
    from ciders.federation.ciders_loop import run_federation
    from ciders.runtime import DTYPES
    from ciders.workloads.llm import LLMTask

    ed = cfg.federation.emulator_dtype
    task = LLMTask(cfg, out, log=log, edge_dtype=None if ed == "model" else DTYPES[ed],
                   edge_quantize=cfg.federation.emulator_quantize)
    # the clients get the effective config (a baseline's knobs set)
    ex = FlowerExchange(grid, dump_yaml(algorithms.configure(cfg)), sorted(task.clients()), cfg.flower, "ciders", log,
                        edge_spec=task.edge_spec())
    return run_federation(cfg, task, out, resume=resume, log=log, progress=False, exchange=ex)


def _stoppable(grid: Grid, stop) -> Grid:
    """`grid`, whose every pull raises once `stop` (a threading.Event) is set. Flower's simulation runs the
    ServerApp in a thread that is not a daemon and that Ctrl-C does not reach: without this, an interrupted
    `--engine flower-sim` command would wait out flower.round_timeout_s for replies that never come."""
    from ciders.errors import CidersError

    for name in ("pull_messages", "get_node_ids"):
        def checked(*a, _call=getattr(grid, name), **kw):
            if stop.is_set():
                raise CidersError("interrupted: the simulation stops; --resume continues from the last committed "
                                  "round")
            return _call(*a, **kw)

        setattr(grid, name, checked)
    return grid


class _AfterStop(logging.Filter):
    """Drops Flower's log records once `stop` is set: a terminal's Ctrl-C reaches Ray's worker processes too (one
    process group), and Flower's simulation thread then logs each message in flight as an error with Ray's
    traceback ("Broken pipe"), which is the interruption itself, not a fault."""

    def __init__(self, stop):
        super().__init__()
        self.stop = stop

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.stop.is_set()


@contextlib.contextmanager
def _ctrl_c_stops(stop):
    """Within: Ctrl-C sets `stop` (the ServerApp thread ends at its next exchange; the interpreter waits for it on
    exit) and silences Flower's logger before KeyboardInterrupt unwinds the simulation. The handler runs in the main
    thread as soon as the signal arrives, ahead of the Ray workers' deaths that Flower would report."""
    flwr_log = logging.getLogger("flwr")
    quiet = _AfterStop(stop)
    flwr_log.addFilter(quiet)
    for h in flwr_log.handlers:
        h.addFilter(quiet)  # records of child loggers reach these handlers without the parent's filters

    def interrupted(signum, frame):
        stop.set()
        raise KeyboardInterrupt

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, interrupted) if main else None
    try:
        yield
    except KeyboardInterrupt:
        stop.set()
        raise
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)
        if not stop.is_set():  # after a stop, Flower's threads may go on logging while the interpreter exits
            flwr_log.removeFilter(quiet)
            for h in flwr_log.handlers:
                h.removeFilter(quiet)


def make_server_app(spec: dict | None = None, stop=None) -> ServerApp:
    """`stop`: a threading.Event that ends the run at its next message exchange (simulation, Ctrl-C)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        serve(grid if stop is None else _stoppable(grid, stop),
              spec if spec is not None else _spec_from_run_config(dict(context.run_config)))

    return app


app = make_server_app()  # for `flwr run` (pyproject: ciders.transports.flower.server_app:app)


def run_simulation(cfg, out: str | Path, resume: bool = False, log=print) -> dict:
    """The run on Flower's simulation runtime (Ray), one virtual SuperNode per client; `cfg` is a CIDERS
    experiment or a bilevel one (`serve` tells them apart)."""
    import json

    from flwr.simulation import run_simulation as flwr_run_simulation

    from ciders.config import dump_yaml
    from ciders.transports.flower.client_app import make_client_app
    from ciders.errors import CidersError

    if getattr(cfg.federation, "partition", None) == "nodes":
        from ciders.errors import ConfigError

        raise ConfigError("federation.partition=nodes: simulated SuperNodes hold no data files; run it on a "
                          "deployment (`ciders flower loopback` / `launch`, SuperNodes with --data-file)")
    out = Path(out)
    summary_path = out / "summary.json"
    summary_path.unlink(missing_ok=True)
    spec = {"config_text": dump_yaml(cfg), "out": str(out.resolve()), "resume": resume,
            "clients_root": str((out / "flower-clients").resolve())}
    fc = cfg.flower
    backend = {"client_resources": {"num_cpus": fc.client_cpus, "num_gpus": fc.client_gpus}}
    stop = threading.Event()
    with _ctrl_c_stops(stop):
        flwr_run_simulation(make_server_app(spec, stop), make_client_app(spec), num_supernodes=cfg.federation.clients,
                            backend_config=backend)
    if not summary_path.is_file():
        raise CidersError(f"the Flower simulation ended without finishing the run (no {summary_path}); "
                          "see the log above; the same command with --resume continues it")
    return json.loads(summary_path.read_text())
