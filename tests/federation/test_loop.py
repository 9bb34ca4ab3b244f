import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ciders.algorithms import ciders as alg
from ciders.federation import codec
from ciders.config import load_config
from ciders.core.store import RoundStore
from ciders.core.tensors import equal, lincomb, max_abs_diff
from ciders.federation.loop import Faults, RunDir, SimulatedCrash
from ciders.federation.ciders_loop import run_federation
from synthetic import VectorTask
from ciders.errors import CidersError
from ciders.fileio import read_jsonl
from conftest import ROOT

VEC = ["federation.clients=5", "federation.rounds=4", "federation.per_round=3", "algorithm.local_steps=3",
       "algorithm.optimizer=adamw", "algorithm.lr=0.05", "algorithm.gamma=0.3", "algorithm.alpha=0.2",
       "algorithm.tau=0.5", "algorithm.metagrad=fd", "algorithm.schedule=warmup_cosine", "algorithm.warmup_steps=2"]


def vec_cfg(*extra):
    return load_config(None, VEC + list(extra))


def run_vec(out, faults=None, resume=False, n=5, cfg=None):
    return run_federation(cfg or vec_cfg(), VectorTask(n), out, resume=resume, faults=faults, progress=False,
                          log=lambda s: None)


def in_sync(cs: alg.ClientState, cp: alg.ServerCopy) -> bool:
    """Equal copies, or equal once the client commits its pending increment (next contact)."""
    if cs.version == cp.version:
        return equal(cs.c_i, cp.c_i)
    p = cs.pending
    return p is not None and cp.version == cs.version + 1 and equal({k: cs.c_i[k] + p.dc[k] for k in cs.c_i}, cp.c_i)


def stores(out):
    c = RunDir(out).committed()
    return RoundStore(out / "clients", c), RoundStore(out / "server", c)


def test_same_seed_identical_metrics(tmp_path):
    run_vec(tmp_path / "a")
    run_vec(tmp_path / "b")
    assert (tmp_path / "a" / "metrics.jsonl").read_bytes() == (tmp_path / "b" / "metrics.jsonl").read_bytes()
    rows = read_jsonl(tmp_path / "a" / "metrics.jsonl")
    assert {r["event"] for r in rows} == {"prealign", "eval", "client", "server", "takd", "round"}
    assert all("seconds" not in json.dumps(r) for r in rows)  # timings live in timing.jsonl
    assert len(read_jsonl(tmp_path / "a" / "timing.jsonl")) == 5


@pytest.mark.parametrize("phase", ["client:0", "client:2", "server", "takd", "checkpoint", "commit"])
@pytest.mark.parametrize("t", [0, 2])
def test_resume_after_a_crash_anywhere_gives_the_same_run(tmp_path, phase, t):
    run_vec(tmp_path / "ref")
    with pytest.raises(SimulatedCrash):
        run_vec(tmp_path / "x", Faults(crash=(t, phase)))
    run_vec(tmp_path / "x", resume=True)
    assert (tmp_path / "x" / "metrics.jsonl").read_bytes() == (tmp_path / "ref" / "metrics.jsonl").read_bytes()
    ca, sa = stores(tmp_path / "ref")
    cb, sb = stores(tmp_path / "x")
    for cid in VectorTask(5).ids:
        for a, b in ((ca, cb), (sa, sb)):
            ra, rb = a.get(cid), b.get(cid)
            assert (ra is None) == (rb is None)
            if ra:
                assert ra[1] == rb[1] and equal(ra[0], rb[0])


def test_fresh_run_refuses_an_existing_run_and_resume_checks_the_config(tmp_path):
    run_vec(tmp_path / "r")
    with pytest.raises(CidersError, match="already holds a run .*--resume"):
        run_vec(tmp_path / "r")
    with pytest.raises(CidersError, match="differs from the run's config.yaml at 'algorithm.gamma'"):
        run_vec(tmp_path / "r", resume=True, cfg=vec_cfg("algorithm.gamma=0.4"))


def test_channel_faults_keep_every_consensus_copy_in_sync(tmp_path):
    cfg = vec_cfg("federation.per_round=null", "federation.rounds=6")
    faults = Faults(drop={(0, "c0000"), (3, "c0002")}, duplicate={(1, "c0001"), (2, "c0003")},
                    delay={(2, "c0004"), (4, "c0000")}, corrupt={(1, "c0002")})
    run_vec(tmp_path / "r", faults, cfg=cfg)
    rows = read_jsonl(tmp_path / "r" / "metrics.jsonl")
    server = {r["round"]: r for r in rows if r["event"] == "server"}
    assert "c0000" not in server[0]["accepted"]
    assert "duplicate" in server[1]["rejected"]["c0001"] and "c0001" in server[1]["accepted"]
    assert "late" in server[3]["rejected"]["c0004"] and "c0004" not in server[2]["accepted"]
    assert any("NaN" in why for why in server[1]["rejected"].values()) and "c0002" not in server[1]["accepted"]
    cs, ss = stores(tmp_path / "r")
    for cid in VectorTask(5).ids:
        client, copy = codec.client_from_record(*cs.get(cid)), codec.copy_from_record(*ss.get(cid))
        assert in_sync(client, copy), cid
    versions = {cid: codec.copy_from_record(*ss.get(cid)).version for cid in VectorTask(5).ids}
    assert versions == {"c0000": 4, "c0001": 6, "c0002": 4, "c0003": 6, "c0004": 5}


@pytest.mark.parametrize("ratio", ["10.0", "null"])
def test_a_huge_upload_is_refused_by_the_engine_and_the_run_goes_on(tmp_path, monkeypatch, ratio):
    """c0002's round-1 upload is replaced by a finite but huge increment: with the default bound the server
    refuses it and every later round trains; with the bound off (null) it is accepted (the key is wired)."""
    import torch

    from ciders.federation import ciders_loop as loop

    def huge(upmsg, ref):
        up = codec.decode_upload(upmsg, ref)
        return codec.encode_upload(alg.Upload(up.client_id, up.round, up.base_version,
                                              {k: torch.full_like(v, 1e30) for k, v in up.dc.items()}))[0]

    monkeypatch.setattr(loop, "_nan_upload", huge)
    cfg = vec_cfg("federation.per_round=null", f"federation.max_step_ratio={ratio}")
    run_vec(tmp_path / "r", Faults(corrupt={(1, "c0002")}), cfg=cfg)
    server = {r["round"]: r for r in read_jsonl(tmp_path / "r" / "metrics.jsonl") if r["event"] == "server"}
    if ratio == "null":
        assert "c0002" in server[1]["accepted"]
        return
    assert "exceeds max_step_ratio" in server[1]["rejected"]["c0002"] and len(server[1]["accepted"]) == 4
    assert all(len(server[t]["accepted"]) == 5 for t in (2, 3)) and server[3]["c_norm"] < 1e3


def test_reconstruction_through_the_engine_equals_the_client_displacement(tmp_path):
    """Eq. 11 on the server side equals the client's true (w - x_K) / (K eta_bar), round after round."""
    cfg = vec_cfg("federation.per_round=null", "federation.rounds=5", "algorithm.tau=1.0", "algorithm.gamma=0.0",
                  "algorithm.eps_prox=0.0", "algorithm.eta_in=0.0", "algorithm.optimizer=sgd",
                  "algorithm.schedule=constant", "algorithm.metagrad=fo", "algorithm.max_grad_norm=0")
    out = tmp_path / "r"
    run_vec(out, cfg=cfg)
    # with tau = 1 and no correction the new global messenger is FedAvg of the personalized ones
    cs, _ = stores(out)
    tensors, meta = RunDir(out).load_checkpoint(4)
    w = codec.server_from_record({k: v for k, v in tensors.items() if not k.startswith("extra/")},
                                 meta["server"]).messenger
    sizes = VectorTask(5).clients()
    xs = [(sizes[c] / sum(sizes.values()), codec.client_from_record(*cs.get(c)).personalized) for c in sorted(sizes)]
    assert max_abs_diff(w, lincomb(xs)) < 1e-12


def test_a_median_run_completes_and_records_its_aggregator(tmp_path, monkeypatch):
    """algorithm.aggregator=median through the engine: 2 rounds commit, every server record names the aggregator
    (a mean run's records have no such field), and c0002's huge round-1 upload, accepted with the bound off, does
    not carry c or the messenger away."""
    import torch

    from ciders.federation import ciders_loop as loop

    def huge(upmsg, ref):
        up = codec.decode_upload(upmsg, ref)
        return codec.encode_upload(alg.Upload(up.client_id, up.round, up.base_version,
                                              {k: torch.full_like(v, 1e30) for k, v in up.dc.items()}))[0]

    monkeypatch.setattr(loop, "_nan_upload", huge)
    cfg = vec_cfg("federation.per_round=null", "federation.rounds=2", "federation.max_step_ratio=null",
                  "algorithm.aggregator=median")
    out = tmp_path / "r"
    s = run_vec(out, Faults(corrupt={(1, "c0002")}), cfg=cfg)
    assert RunDir(out).committed() == 1 and s["client_rounds"] == 10
    rows = read_jsonl(out / "metrics.jsonl")
    server = {r["round"]: r for r in rows if r["event"] == "server"}
    assert sorted(server) == [0, 1] and all(r["aggregator"] == "median" for r in server.values())
    assert "c0002" in server[1]["accepted"] and len(server[1]["accepted"]) == 5
    assert server[1]["delta_bar_norm"] < 1e3 and server[1]["c_norm"] < 1e3
    assert any(r["event"] == "eval" and r["round"] == 1 for r in rows)
    tensors, meta = RunDir(out).load_checkpoint(1)
    w = codec.server_from_record({k: v for k, v in tensors.items() if not k.startswith("extra/")}, meta["server"])
    assert float(w.messenger["x"].abs().max()) < 1e3
    plain = vec_cfg("federation.rounds=1")
    run_vec(tmp_path / "mean", cfg=plain)
    assert all("aggregator" not in r for r in read_jsonl(tmp_path / "mean" / "metrics.jsonl"))


def test_thousand_registered_clients_cost_disk_not_ram(tmp_path):
    cfg = load_config(None, ["federation.clients=1000", "federation.rounds=3", "federation.per_round=3",
                             "federation.store_cache=4", "federation.eval_clients=participants",
                             "algorithm.local_steps=2", "algorithm.optimizer=sgd", "algorithm.lr=0.05"])
    task = VectorTask(1000)
    t0 = time.perf_counter()
    s = run_federation(cfg, task, tmp_path / "r", progress=False)
    assert time.perf_counter() - t0 < 60 and s["client_rounds"] == 9
    on_disk = sorted(p.name for p in (tmp_path / "r" / "clients").iterdir())
    assert len(on_disk) <= 9  # only clients that ever trained have a record
    assert len(task._params) <= 64


def test_bytes_are_measured_from_the_payloads(tmp_path):
    s = run_vec(tmp_path / "r")
    comp = s["mib"]["by_component"]
    n = s["client_rounds"]
    tensor_mib = 8 * 8 / 2**20  # one float64 vector of 8
    for d, k in (("down", "messenger"), ("down", "c"), ("up", "dc")):
        per = comp[d][k] / n
        assert tensor_mib < per < tensor_mib + 200 / 2**20  # tensor bytes + a safetensors header
    rows = [r for r in read_jsonl(tmp_path / "r" / "metrics.jsonl") if r["event"] == "client"]
    assert sum(r["bytes_up"] for r in rows) == pytest.approx(s["mib"]["up_total"] * 2**20)


def _tiny(tmp_path):
    cfg = (ROOT / "configs" / "tiny.yaml").read_text().replace("../data/", f"{ROOT}/data/")
    p = tmp_path / "tiny.yaml"
    p.write_text(cfg)
    return p


def test_tiny_llm_run_export_and_personalized_export(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from ciders.cli import main

    out = tmp_path / "run"
    assert main(["run", str(_tiny(tmp_path)), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "client0 personalized messenger" in text and "MiB per client per round" in text
    s = json.loads((out / "summary.json").read_text())
    assert s["rounds"] == 2 and s["client_rounds"] == 6
    after = s["eval_after"]
    assert set(after["clients"]) == {"client0", "client1", "client2"}
    assert all("personalized" in r for r in after["clients"].values())
    data = json.loads((out / "data.json").read_text())
    assert sum(v["train"] + v["heldout"] + sum(v["skipped"].values()) for v in data["partition"].values()) == 30
    for flag in ([], ["--client", "client1"]):
        assert main(["export", str(out), "--out", str(tmp_path / f"edge{len(flag)}"), *flag]) == 0
        AutoModelForCausalLM.from_pretrained(str(tmp_path / f"edge{len(flag)}"))
    assert main(["export", str(out), "--out", str(tmp_path / "e"), "--client", "nobody"]) == 2


def test_tiny_llm_run_killed_for_real_then_resumed(tmp_path):
    """SIGKILL in the middle of round 1, then --resume: the same metrics as an uninterrupted run."""
    cfg = _tiny(tmp_path)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "ciders.cli", "run", str(cfg)]
    subprocess.run(cmd + ["--out", str(tmp_path / "ref")], check=True, env=env, capture_output=True)
    out = tmp_path / "x"
    proc = subprocess.Popen(cmd + ["--out", str(out)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        rows = read_jsonl(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
        if any(r["event"] == "client" and r["round"] == 1 for r in rows):
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert RunDir(out).committed() == 0  # killed inside round 1
    subprocess.run(cmd + ["--out", str(out), "--resume"], check=True, env=env, capture_output=True)
    assert (out / "metrics.jsonl").read_bytes() == (tmp_path / "ref" / "metrics.jsonl").read_bytes()
    ref_ad = (tmp_path / "ref" / "adapters" / "messenger" / "adapter_model.safetensors").read_bytes()
    assert (out / "adapters" / "messenger" / "adapter_model.safetensors").read_bytes() == ref_ad
