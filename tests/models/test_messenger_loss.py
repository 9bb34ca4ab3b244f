"""The messenger loss in a compute dtype above the base's, and the FD Hessian-vector product it exists for:
on a tiny Qwen2 messenger with a bfloat16 base, a central difference of bfloat16 gradients is mostly
rounding noise, while fp32 evaluations with the relative probe agree with double backward."""

import pytest
import torch

from ciders.algorithms.ciders import grad_of
from ciders.core.metagrad import exact_hvp, fd_hvp
from ciders.core.tensors import lincomb, norm
from ciders.models.decompose import decompose
from ciders.models.load import load_model
from ciders.models.messenger_loss import MessengerLoss, step_compute_dtype
from ciders.tasks.text import collate
from helpers import random_features, randomize_lora


def setup(dtype, name="tiny-qwen2", attn=None):
    d = decompose(load_model(name, device="cpu", dtype=dtype, attn_implementation=attn), 2, drop_ratio=0.5)
    randomize_lora(d, std=0.05)  # B = 0 at init would hide every B-B curvature term
    d.messenger_top.train()  # LoRA dropout on: every evaluation of a step must reuse one mask
    b = collate(random_features(n=3, seed=1), 257)
    hidden = d.backbone_hidden(b["input_ids"], b["attention_mask"])
    batch = {"hidden": hidden, "attention_mask": b["attention_mask"], "labels": b["labels"], "seed": 5}
    return d, batch


def rel(a, ref):
    return norm(lincomb([(1.0, a), (-1.0, ref)])) / norm(ref)


def absolute_probe_hvp(loss, x, v, batch, eps=1e-4):
    """The rule before the relative probe: x +- eps v, in the base dtype."""
    _, gp = grad_of(loss, lincomb([(1.0, x), (eps, v)]), batch)
    _, gm = grad_of(loss, lincomb([(1.0, x), (-eps, v)]), batch)
    return lincomb([(0.5 / eps, gp), (-0.5 / eps, gm)])


def test_fd_hvp_on_a_bf16_base_is_accurate_only_with_fp32_evaluations_and_the_relative_probe():
    d, batch = setup(torch.bfloat16)  # attention: the model's default (SDPA)
    x = d.messenger_state()
    base, fp32, fp64 = MessengerLoss(d), MessengerLoss(d, torch.float32), MessengerLoss(d, torch.float64)
    _, v = grad_of(fp32, x, batch)
    ref = exact_hvp(fp64, {k: t.double() for k, t in x.items()}, {k: t.double() for k, t in v.items()}, batch)
    ref = {k: t.float() for k, t in ref.items()}
    new = fd_hvp(lambda p: grad_of(fp32, p, batch), x, v, 1e-4)
    assert rel(new, ref) < 0.05  # measured ~2e-4
    old = absolute_probe_hvp(base, x, v, batch)
    assert rel(old, ref) > 0.3  # measured ~0.9 here (benchmarks/fd_accuracy.py: several x on other batches)
    in_bf16 = fd_hvp(lambda p: grad_of(base, p, batch), x, v, 1e-4)
    assert rel(in_bf16, ref) > 0.3  # the relative probe alone does not help: bf16 gradients are the noise
    # double backward in the base dtype has no cancellation: it stays accurate without fp32
    assert rel(exact_hvp(base, x, v, batch), ref) < 0.05


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_double_backward_runs_through_the_messenger_with_the_repos_attention(attn):
    d, batch = setup(torch.float32, attn=attn)
    loss = MessengerLoss(d)
    x = d.messenger_state()
    _, v = grad_of(loss, x, batch)
    hv = exact_hvp(loss, x, v, batch)
    assert rel(fd_hvp(lambda p: grad_of(loss, p, batch), x, v, 1e-3), hv) < 1e-3


def test_compute_dtype_equals_the_upcast_model_and_follows_emulator_loads():
    d16, batch = setup(torch.bfloat16)
    d32, _ = setup(torch.bfloat16)
    d32.messenger_top.to(torch.float32)  # the same bf16 values, held in fp32
    x = d16.messenger_state()
    loss = MessengerLoss(d16, torch.float32)
    want = MessengerLoss(d32)(x, dict(batch, hidden=batch["hidden"].float()))
    got = loss(x, batch)
    assert got.dtype == torch.float32 and abs(float(got - want)) < 1e-5
    assert loss.base_weights() is loss.base_weights()  # built once, not per evaluation
    new = {k: (t * 1.5 if ".layers." in k else t) for k, t in d16.emulator_base_state().items()}
    d16.load_emulator_base({k: t.clone() for k, t in new.items()})  # in place, as a client's first contact does
    assert abs(float(loss(x, batch) - MessengerLoss(d16, torch.float32)(x, batch))) < 1e-6
    assert abs(float(loss(x, batch) - got)) > 1e-3


@pytest.mark.parametrize("name, copied, not_copied", [("tiny-qwen2", "model.embed_tokens.weight", "lm_head.weight"),
                                                      ("tiny-llama", "lm_head.weight", "model.embed_tokens.weight")])
def test_the_copy_holds_messenger_norm_and_head_only(name, copied, not_copied):
    d, _ = setup(torch.bfloat16, name=name)
    w = MessengerLoss(d, torch.float32).base_weights()
    assert copied in w and not_copied not in w  # a tied head is the embedding; an untied embedding is unused
    assert "model.norm.weight" in w and all(t.dtype == torch.float32 for t in w.values())
    assert not any("lora_" in k for k in w)
    assert MessengerLoss(d).base_weights() == {}


def test_the_step_dtype_rule():
    bf, fp, f32 = torch.bfloat16, torch.float16, torch.float32
    assert step_compute_dtype("fd", "fd", bf) == f32 and step_compute_dtype("fd", "fd", fp) == f32
    assert step_compute_dtype("fd", "fd", f32) is None  # already fp32
    assert step_compute_dtype("fd", "exact", bf) is None  # double backward has no cancellation
    assert step_compute_dtype("fo", "fd", bf) is None  # no Hessian-vector product at all


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama"])
@pytest.mark.parametrize("path", ["chunked", "logits"])
def test_the_head_runs_only_where_the_loss_reads_and_the_loss_is_unchanged(name, path, monkeypatch):
    """The LM head sees only the positions some row's next token is a response token at; loss and gradient
    equal the full-logits CE (eval.metrics.token_nll over every position) to float tolerance. The chunked path
    never forms more than a chunk of logits; the logits path (taken inside a double backward) runs the head
    module on the kept positions."""
    from ciders.core import metagrad
    from ciders.eval import chunked
    from ciders.eval.metrics import token_nll
    from ciders.models.messenger_loss import loss_positions

    d, batch = setup(torch.float32, name)
    loss = MessengerLoss(d)
    x = d.messenger_state()
    keep = loss_positions(batch["labels"])
    T = batch["labels"].shape[1]
    assert 0 < len(keep) < T - 1  # the prompts are left out
    vocab = d.messenger_top.lm_head.out_features
    monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", 4 * vocab)  # 4 rows of logits at a time
    rows, chunks = [], []
    hook = d.messenger_top.lm_head.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[1]))
    real = chunked.chunk_logits
    monkeypatch.setattr(chunked, "chunk_logits", lambda h, w: chunks.append(h.shape[0]) or real(h, w))
    token = metagrad._SECOND_ORDER.set(path == "logits")
    try:
        assert loss.fused() == (path == "chunked")
        got, g_got = grad_of(loss, x, batch)
    finally:
        metagrad._SECOND_ORDER.reset(token)
        hook.remove()
    if path == "chunked":
        n_rows = batch["labels"].shape[0] * len(keep)
        assert rows == [] and sum(chunks) == n_rows and max(chunks) == 4 and len(chunks) == -(-n_rows // 4)
    else:
        assert rows == [len(keep)] and chunks == []

    def full(p, b):
        nll, n = token_nll(loss.logits(p, b), b["labels"])
        return nll / n

    want, g_want = grad_of(full, x, batch)
    assert abs(float(got) - float(want)) < 1e-5 * abs(float(want))
    assert rel(g_got, g_want) < 1e-5
    none = dict(batch, labels=torch.full_like(batch["labels"], -100))
    assert float(loss(x, none)) == 0.0  # no target token: no loss, no error
