"""federation.adapter_dtype: the messenger and the student LoRA travel in bfloat16 (half of fp32, a quarter of the
synthetic task's fp64), c and the uploads do not, and Eq. 11 still rebuilds every client's Delta_i exactly."""

import pytest
import torch

from ciders.algorithms import ciders as alg
from ciders.config import load_config
from ciders.core import consensus as cs
from ciders.federation.ciders_loop import run_federation
from ciders.fileio import read_jsonl
from synthetic import VEC, VectorTask


class AdapterTask(VectorTask):
    """VectorTask with a per-round student LoRA in its downlink, whose values bfloat16 cannot hold exactly."""

    def __init__(self, n):
        super().__init__(n)
        self.got = []

    def downlink_extra(self, extra) -> dict:
        return {"student": {"s": torch.linspace(0.1, 1.7, 32, dtype=torch.float64)}}

    def begin_round(self, t, downlink_extra):
        self.got.append(downlink_extra["student"]["s"])


def run(tmp_path, name, dtype, monkeypatch=None):
    task = AdapterTask(3)
    cfg = load_config(None, VEC + [f"federation.adapter_dtype={dtype}", "federation.rounds=3"])
    run_federation(cfg, task, tmp_path / name, progress=False, log=lambda s: None)
    rounds = [r for r in read_jsonl(tmp_path / name / "metrics.jsonl") if r["event"] == "round"]
    return task, rounds


def test_adapters_travel_in_bfloat16_and_c_does_not(tmp_path):
    t64, r64 = run(tmp_path, "model", "model")
    t16, r16 = run(tmp_path, "bf16", "bfloat16")
    from safetensors.torch import save

    def blob(t):  # one client's component as it travels: a safetensors blob of the tensor
        return len(save({"x" if t.numel() == 8 else "s": t}))

    student = torch.linspace(0.1, 1.7, 32, dtype=torch.float64)
    for a, b in zip(r64, r16):  # 3 clients each round, each one blob per component
        assert a["bytes_down"]["student"] == 3 * blob(student)
        assert b["bytes_down"]["student"] == 3 * blob(student.to(torch.bfloat16))
        assert b["bytes_down"]["messenger"] == 3 * blob(torch.zeros(8, dtype=torch.bfloat16))
        assert a["bytes_down"]["messenger"] == 3 * blob(torch.zeros(8, dtype=torch.float64))
        assert b["bytes_down"]["c"] == a["bytes_down"]["c"] and b["bytes_up"] == a["bytes_up"]
    want = torch.linspace(0.1, 1.7, 32, dtype=torch.float64)
    assert all(torch.equal(s, want) for s in t64.got)
    assert all(s.dtype == torch.bfloat16 and torch.equal(s, want.to(torch.bfloat16)) for s in t16.got)


def test_eq11_rebuilds_delta_exactly_from_a_bfloat16_broadcast(tmp_path, monkeypatch):
    sent, rebuilt, starts = [], [], []
    real_update, real_reconstruct = alg.client_update, cs.reconstruct

    def client_update(acfg, b, *a, **kw):
        starts.append(b.messenger["x"].clone())
        up, state, m = real_update(acfg, b, *a, **kw)
        sent.append({k: v.clone() for k, v in up.delta.items()})
        return up, state, m

    def reconstruct(*a, **kw):
        rebuilt.append(real_reconstruct(*a, **kw))
        return rebuilt[-1]

    monkeypatch.setattr(alg, "client_update", client_update)
    monkeypatch.setattr(cs, "reconstruct", reconstruct)
    run(tmp_path, "bf16", "bfloat16")
    assert len(sent) == len(rebuilt) == 9
    # the server's Delta_i is the client's to float64 rounding (1-3 ulp, as with an fp64 broadcast: dc_i = c_i' - c_i
    # and c_i + dc_i round); a broadcast c in bfloat16 would put its rounding, ~1e-3 relative, into Eq. 11
    assert all(torch.allclose(d["x"], r["x"], rtol=1e-12, atol=1e-15) for d, r in zip(sent, rebuilt))
    # each client trained from the bfloat16-rounded messenger, back in the model's dtype
    assert all(x.dtype == torch.float64 and torch.equal(x, x.to(torch.bfloat16).double()) for x in starts)
    assert any(x.abs().sum() > 0 for x in starts)


def test_an_unknown_adapter_dtype_is_refused():
    from ciders.errors import ConfigError

    with pytest.raises(ConfigError, match="adapter_dtype"):
        load_config(None, VEC + ["federation.adapter_dtype=int8"])


def test_a_tiny_llm_federation_halves_its_adapters_on_the_wire(tmp_path):
    """The real path (LLMTask, tiny-qwen2 in float32): the messenger and the student LoRA cost half their float32
    bytes, plus each blob's header; c and the emulator's first download are unchanged."""
    from ciders.workloads.llm import LLMTask
    from conftest import ROOT

    s = ROOT / "data" / "gsm8k-slice"
    base = ["model.name=tiny-qwen2", "model.device=cpu", "model.dtype=float32", "decomposition.messenger_layers=2",
            "federation.clients=2", "federation.rounds=1", "data.public_limit=4", "data.eval_limit=2",
            "data.clients_limit=8", "data.max_length=48", f"data.public={s}/public.jsonl", f"data.eval={s}/eval.jsonl",
            f"data.clients={s}/clients.jsonl", "takd.teacher_cache=off", "takd.bootstrap_steps=1", "takd.round_steps=1",
            "algorithm.batch_size=2", "algorithm.local_steps=1"]
    got = {}
    for dt in ("model", "bfloat16"):
        cfg = load_config(None, base + [f"federation.adapter_dtype={dt}"])
        run_federation(cfg, LLMTask(cfg, tmp_path / dt, log=lambda s: None), tmp_path / dt, progress=False,
                       log=lambda s: None)
        got[dt] = next(r for r in read_jsonl(tmp_path / dt / "metrics.jsonl") if r["event"] == "round")["bytes_down"]
    for k in ("messenger", "student"):
        assert 0.5 < got["bfloat16"][k] / got["model"][k] < 0.55, (k, got)
    assert got["bfloat16"]["c"] == got["model"]["c"] and got["bfloat16"]["emulator"] == got["model"]["emulator"]
