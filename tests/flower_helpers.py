"""Shared by the Flower test modules: the tiny experiment, the in-process reference run, the bit-for-bit
comparison of two runs, free ports and a fresh loopback deployment with credentials."""

import socket
from pathlib import Path

import torch
from safetensors.torch import load_file

from ciders.config import load_config
from ciders.federation.ciders_loop import run_federation
from ciders.workloads.llm import LLMTask
from ciders.fileio import read_jsonl
from conftest import ROOT

TINY = f"""name: flower-tiny
model: {{name: tiny-qwen2, dtype: float32}}
decomposition: {{messenger_layers: 2, drop_ratio: 0.5}}
takd: {{bootstrap_steps: 2, round_steps: 1, batch_size: 2}}
algorithm: {{local_steps: 2, batch_size: 2, lr: 0.01}}
federation: {{clients: 3, rounds: 2}}
data:
  public_limit: 12
  eval_limit: 4
  clients_limit: 24
  max_length: 128
  public: {ROOT}/data/gsm8k-slice/public.jsonl
  eval: {ROOT}/data/gsm8k-slice/eval.jsonl
  clients: {ROOT}/data/gsm8k-slice/clients.jsonl
flower: {{round_timeout_s: 120, node_wait_s: 90}}
"""



def local_run(cfg_path, out, overrides=(), faults=None):
    cfg = load_config(cfg_path, list(overrides))
    return run_federation(cfg, LLMTask(cfg, out, log=lambda s: None), out, faults=faults, log=lambda s: None,
                          progress=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def deployment(tmp_path, n=3):
    from ciders.transports.flower.deploy import Deployment, make_credentials

    work = tmp_path / "dep"
    make_credentials(work, n)
    return Deployment(work, port=free_port(), node_port=free_port(), control_port=free_port())


def _diagnosis(run: Path, work: Path | None) -> str:
    """What to read when a deployed run differs: the ServerApp's log and the nodes' worker logs (tails)."""
    logs = [run / "server.log"] + (sorted(work.glob("nodes/*/worker.log")) if work else [])
    return "\n".join(f"--- {p}\n" + p.read_text()[-3000:] for p in logs if p.exists())


def assert_same_run(a: Path, b: Path, work: Path | None = None):
    ra, rb = read_jsonl(a / "metrics.jsonl"), read_jsonl(b / "metrics.jsonl")
    assert [r["event"] for r in ra] == [r["event"] for r in rb]
    for x, y in zip(ra, rb):
        if y["event"] == "client" and "peak_rss_mib" in y:  # an edge client's own footprint and timings: Flower only
            for k in ("peak_rss_mib", "disk_mib", "compute_s", "handle_s", "startup_s"):
                assert y.pop(k) > 0, k
            assert isinstance(y.pop("warm"), bool)
        assert x == y, (x["event"], x.get("round"), _diagnosis(b, work))
    for part in ("messenger", "student"):
        fa, fb = (next((d / "adapters" / part).glob("*.safetensors")) for d in (a, b))
        ta, tb = load_file(fa), load_file(fb)
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), part
