"""LLMTask's evaluation: the global and the personalized messenger on a client's held-out part share B_L(x), and
give the perplexities AdapEmu gives with each messenger loaded in turn."""

import torch

from ciders.algorithms import ciders as alg
from ciders.config import load_config
from ciders.workloads.llm import LLMTask
from conftest import ROOT
from helpers import randomize_lora

BASE = ["model.name=tiny-qwen2", "model.device=cpu", "decomposition.messenger_layers=2",
        "decomposition.drop_ratio=0.5", "federation.clients=2", "data.public_limit=4", "data.eval_limit=2",
        "data.max_length=64", f"data.public={ROOT}/data/gsm8k-slice/public.jsonl",
        f"data.eval={ROOT}/data/gsm8k-slice/eval.jsonl", f"data.clients={ROOT}/data/gsm8k-slice/clients.jsonl"]


def test_evaluation_shares_b_l_between_the_messengers_and_gives_adapemus_figures(tmp_path):
    # edge fidelity off: it runs the global set through AdapEmu (and AdapFu) once more (tests/eval/test_agreement.py)
    cfg = load_config(None, BASE + ["model.dtype=float32", "data.clients_limit=8", "federation.holdout=0.5",
                                    "eval.fidelity=false"])
    task = LLMTask(cfg, tmp_path, log=lambda m: None)
    randomize_lora(task.d, std=0.05)
    server = alg.init_server(task.d.messenger_state(), 1)
    pers = {cid: {k: v + 0.05 * torch.randn_like(v) for k, v in server.messenger.items()} for cid in sorted(task.train)}
    calls = []
    # B_L's first layer, as AdapEmu runs it and as backbone_hidden runs it
    hooks = [m.register_forward_hook(lambda m, i, o: calls.append(1))
             for m in {id(x): x for x in (task.d.student[0], task.d.student_stack.model.layers[0])}.values()]
    try:
        got = task.evaluate(0, server, pers)
    finally:
        for h in hooks:
            h.remove()
    n_batches = sum(-(-len(task.heldout[c]) // cfg.data.eval_batch_size) for c in task.heldout if task.heldout[c])
    n_global = -(-len(task.global_eval) // cfg.data.eval_batch_size)
    assert len(calls) == n_global + n_batches  # B_L once per batch, not once per messenger
    for cid in sorted(task.train):
        if not task.heldout[cid]:
            continue
        for which, m in (("global", server.messenger), ("personalized", pers[cid])):
            want = task._ppl(m, task.heldout[cid])
            assert got["clients"][cid][which]["tokens"] == want["tokens"]
            assert abs(got["clients"][cid][which]["nll"] - want["nll"]) <= 1e-5 * abs(want["nll"])
    assert got["clients"][cid]["global"]["nll"] != got["clients"][cid]["personalized"]["nll"]
