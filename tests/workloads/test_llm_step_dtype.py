"""The LLM workload runs its client loss in fp32 exactly when an FD Hessian-vector product would
difference bfloat16 gradients (docs/method.md#eq-7-finite-difference-meta-gradient-fd)."""

import pytest
import torch

from ciders.config import load_config
from ciders.workloads.llm import LLMTask
from conftest import ROOT

BASE = ["model.name=tiny-qwen2", "model.device=cpu", "decomposition.messenger_layers=2",
        "decomposition.drop_ratio=0.5", "federation.clients=2", "data.public_limit=4", "data.eval_limit=2",
        "data.clients_limit=4", "data.max_length=64", f"data.public={ROOT}/data/gsm8k-slice/public.jsonl",
        f"data.eval={ROOT}/data/gsm8k-slice/eval.jsonl", f"data.clients={ROOT}/data/gsm8k-slice/clients.jsonl"]


@pytest.mark.parametrize("dtype, metagrad, hvp, want", [("bfloat16", "fd", "fd", torch.float32),
                                                         ("bfloat16", "fd", "exact", None),
                                                         ("float32", "fd", "fd", None)])
def test_the_client_loss_dtype_follows_the_config(tmp_path, dtype, metagrad, hvp, want):
    cfg = load_config(None, BASE + [f"model.dtype={dtype}", f"algorithm.metagrad={metagrad}", f"algorithm.hvp={hvp}"])
    logs = []
    task = LLMTask(cfg, tmp_path, log=logs.append)
    assert task.loss.compute_dtype == want
    assert any("messenger evaluations in torch.float32" in s for s in logs) == (want is not None)
