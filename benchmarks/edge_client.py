"""An edge client on a loopback Flower deployment (docs/flower.md#warm-clients), with the tiny test model and with
SmolLM2-135M, each run cold (every Flower message a fresh ClientApp process that imports torch and loads the edge
model) and warm (the node's worker keeps them), side by side:

  per_message_overhead_s  a train message's handling in the ClientApp minus the client round's own compute
                          (median over the rounds after the first: the first builds the edge model)
  compute_s               the client round (client_update and its batches), median
  startup_s               from the ClientApp process's start to its handler (Flower's process and imports), median
  client_peak_rss_mib     the largest peak resident memory a client process reported
  full_model_files_opened files under the full model's directory opened by any SuperNode-side process
                          (ClientApps and workers), counted with strace -f in a separate warm run (strace slows
                          every system call, so its timings are not used)

--smoke: the tiny model alone, 2 rounds of 1 local step (a Flower deployment: the smoke test is marked `flower`).

--json keys: *.cold, *.warm, *.overhead_over_compute_warm, *.full_model_files_opened, *.open_calls_traced
(one entry per model of --models; cold and warm each hold the figures above)

    python benchmarks/edge_client.py [--models tiny,smollm2-135m] [--rounds 3] [--json] [--smoke]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

from common import ROOT, add_output_flags, emit, smoke

CONFIG = """name: edge-client-bench
model: {{name: {model}, dtype: float32, device: cpu}}
decomposition: {{messenger_layers: 2, drop_ratio: 0.5}}
takd: {{bootstrap_steps: 1, round_steps: 1, batch_size: 2}}
algorithm: {{local_steps: {steps}, batch_size: 2, lr: 0.0001}}
federation: {{clients: 2, rounds: {rounds}, eval_every: 0}}
data:
  public_limit: 8
  eval_limit: 4
  clients_limit: 16
  max_length: 128
  public: {root}/data/gsm8k-slice/public.jsonl
  eval: {root}/data/gsm8k-slice/eval.jsonl
  clients: {root}/data/gsm8k-slice/clients.jsonl
flower: {{round_timeout_s: 900, node_wait_s: 120}}
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_dir(name: str, tmp: Path) -> Path:
    if name == "tiny":
        from ciders.models.load import build_tiny, byte_tokenizer

        d = tmp / "tiny-model"
        build_tiny("tiny-qwen2").save_pretrained(d)
        byte_tokenizer().save_pretrained(d)
        return d
    from ciders.models.load import SMOLLM2, ensure_smollm2

    if name != SMOLLM2:
        raise SystemExit(f"--models: tiny or {SMOLLM2}, got {name!r}")
    return ensure_smollm2()


def deploy(cfg: Path, out: Path, work: Path, warm: bool, trace: Path | None) -> list[dict]:
    """One loopback run with 2 SuperNodes; the client records of metrics.jsonl."""
    from ciders.fileio import read_jsonl
    from ciders.transports.flower.deploy import Deployment, make_credentials

    make_credentials(work, 2)
    dep = Deployment(work, port=free_port(), node_port=free_port(), control_port=free_port())
    try:
        dep.start_superlink()
        for i in range(2):
            dep.register(i)
            wrap = ["strace", "-f", "-qq", "-e", "trace=open,openat,openat2", "-o", f"{trace}.{i}"] if trace else None
            dep.start_supernode(i, 2, work / "nodes" / f"client{i}", warm=warm, wrap=wrap,
                                port=free_port(), env={"OMP_NUM_THREADS": "1"})
        dep.wait_online(2)
        status = dep.wait_run(dep.launch(cfg, out, []), timeout=3600)
        if status != "finished:completed":
            raise SystemExit(f"the run did not finish ({status}); see {work / 'logs'}")
    finally:
        dep.stop()
    return [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "client"]


def opened_under(trace: Path, root: Path) -> tuple[list[str], int]:
    """Files under `root` that the traced processes opened (successfully or not), and all open calls traced."""
    hits, total = set(), 0
    for f in trace.parent.glob(trace.name + ".*"):
        for line in f.read_text(errors="replace").splitlines():
            total += "open" in line
            if str(root) in line and "open" in line:
                hits.add(line.split('"')[1] if '"' in line else line)
    return sorted(hits), total


def figures(recs: list[dict]) -> dict:
    later = [r for r in recs if r["round"] >= 1] or recs
    over = [r["handle_s"] - r["compute_s"] for r in later]
    return {"per_message_overhead_s": statistics.median(over), "compute_s": statistics.median(r["compute_s"] for r in later),
            "startup_s": statistics.median(r["startup_s"] for r in later),
            "first_message_s": statistics.median(r["handle_s"] for r in recs if r["round"] == 0),
            "client_peak_rss_mib": max(r["peak_rss_mib"] for r in recs),
            "client_disk_mib": max(r["disk_mib"] for r in recs), "messages": len(later)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,smollm2-135m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="local steps per round")
    a = smoke(add_output_flags(ap).parse_args(), models="tiny", rounds=2, steps=1)
    with tempfile.TemporaryDirectory() as t:
        out = {name: measure(name, Path(t), a) for name in a.models.split(",")}
    emit(out, a.json, lambda: report(out))


def measure(name: str, tmp: Path, a: argparse.Namespace) -> dict:
    """Cold and warm runs of one model, then a warm run under strace for the files opened."""
    mdir = model_dir(name, tmp)
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(CONFIG.format(model=mdir, rounds=a.rounds, steps=a.steps, root=ROOT))
    row = {}
    for mode in ("cold", "warm"):
        row[mode] = figures(deploy(cfg, tmp / f"{name}-{mode}", tmp / f"{name}-{mode}-work", mode == "warm", None))
    trace = tmp / f"{name}-trace" / "strace"
    trace.parent.mkdir()
    deploy(cfg, tmp / f"{name}-traced", tmp / f"{name}-traced-work", True, trace)
    files, total = opened_under(trace, mdir)
    if total == 0:
        raise SystemExit("strace recorded no open call: the count would mean nothing")
    row["full_model_files_opened"], row["open_calls_traced"] = len(files), total
    row["full_model_files"] = files[:10]
    w = row["warm"]
    row["overhead_over_compute_warm"] = w["per_message_overhead_s"] / w["compute_s"]
    for d in (f"{name}-cold", f"{name}-warm", f"{name}-traced"):
        shutil.rmtree(tmp / d, ignore_errors=True)
    return row


def report(out: dict) -> None:
    for name, row in out.items():
        print(f"{name}: full-model files opened on the client side: {row['full_model_files_opened']}")
        for mode in ("cold", "warm"):
            r = row[mode]
            print(f"  {mode:>4}: overhead {r['per_message_overhead_s']:7.3f} s per message, compute {r['compute_s']:7.3f} s "
                  f"(overhead / compute {r['per_message_overhead_s'] / r['compute_s']:6.3f}), Flower start "
                  f"{r['startup_s']:6.2f} s, first message {r['first_message_s']:6.2f} s, peak RSS "
                  f"{r['client_peak_rss_mib']:7.1f} MiB, disk {r['client_disk_mib']:7.1f} MiB")


if __name__ == "__main__":
    main()
