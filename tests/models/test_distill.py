import math
from dataclasses import replace

import pytest
import torch

from ciders.config import TAKDConfig
from ciders.errors import CidersError
from ciders.models.decompose import decompose
from ciders.models.distill import TeacherCache, distill, init_state, sample_indices, takd_loss, takd_terms
from ciders.models.load import build_tiny, load_model
from ciders.tasks.text import collate
from helpers import ARCHS, random_features, randomize_lora, run_layers


def _softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


def _hand_terms(hs, ht, ls, lt, mask, labels, hidden_loss, kd_tokens):
    """Eq. 2 written out with Python floats (B = 1)."""
    T, H = len(hs), len(hs[0])
    m = [int(l != -100) for l in labels] if kd_tokens == "response" else mask
    sq = [sum((hs[t][j] - ht[t][j]) ** 2 for j in range(H)) for t in range(T)]
    num = sum(sq[t] for t in range(T) if m[t])
    cnt = sum(m)
    if hidden_loss == "sum":
        hidden = num / cnt
    elif hidden_loss == "mean":
        hidden = num / (cnt * H)
    else:
        hidden = num / sum(sum(v * v for v in ht[t]) for t in range(T) if m[t])
    kl = 0.0
    for t in range(T):
        if m[t]:
            p, q = _softmax(lt[t]), _softmax(ls[t])
            kl += sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    kl /= cnt
    ce = [-math.log(_softmax(ls[t])[labels[t + 1]]) for t in range(T - 1) if labels[t + 1] != -100]
    return hidden, kl, sum(ce) / len(ce)


@pytest.mark.parametrize("hidden_loss", ["mean", "sum", "teacher_rms"])
@pytest.mark.parametrize("kd_tokens", ["all", "response"])
def test_takd_terms_match_hand_computation(hidden_loss, kd_tokens):
    g = torch.Generator().manual_seed(0)
    hs, ht = torch.randn(1, 4, 2, generator=g), torch.randn(1, 4, 2, generator=g)
    ls, lt = torch.randn(1, 4, 3, generator=g), torch.randn(1, 4, 3, generator=g)
    mask = torch.tensor([[1, 1, 1, 0]])
    labels = torch.tensor([[-100, 2, 0, -100]])
    cfg = TAKDConfig(lambda_out=0.5, lambda_task=0.7, hidden_loss=hidden_loss, kd_tokens=kd_tokens)
    got = takd_terms(hs, ht, ls, lt, mask, labels, cfg)
    hid, kl, ce = _hand_terms(hs[0].tolist(), ht[0].tolist(), ls[0].tolist(), lt[0].tolist(),
                              mask[0].tolist(), labels[0].tolist(), hidden_loss, kd_tokens)
    assert float(got["hidden"]) == pytest.approx(hid, rel=1e-6)
    assert float(got["kl"]) == pytest.approx(kl, rel=1e-6)
    assert float(got["ce"]) == pytest.approx(ce, rel=1e-6)
    assert float(got["loss"]) == pytest.approx(hid + 0.5 * kl + 0.7 * ce, rel=1e-6)
    off = takd_terms(hs, ht, None, None, mask, labels, TAKDConfig(lambda_out=0, lambda_task=0))
    assert float(off["kl"]) == 0 and float(off["ce"]) == 0  # terms off need no logits at all


@pytest.mark.parametrize("name", ARCHS)
def test_takd_loss_wiring_against_hand_run_parts(name):
    """B_L(x), B_F(x), M(x), M*(x) recomputed by hand from the layers and a pristine model."""
    ref = build_tiny(name, seed=0).eval()
    ref.set_attn_implementation("eager")
    d = decompose(load_model(name, attn_implementation="eager"), 2, drop_ratio=0.5)
    randomize_lora(d)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :4] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    n, t = d.split, ids.size(1)
    with torch.no_grad():
        h_f = ref(ids, output_hidden_states=True).hidden_states[n.teacher_layers]
        lt = d.base.lm_head(d.base.model.norm(run_layers(d.base, d.messenger, h_f, t)))
        h_l = run_layers(d.base, d.student, d.base.model.embed_tokens(ids), t)
        ls = d.base.lm_head(d.base.model.norm(run_layers(d.base, d.messenger, h_l, t)))
        cfg = TAKDConfig()
        want = takd_terms(h_l, h_f, ls, lt, batch["attention_mask"], labels, cfg)
        for cached in (None, h_f):
            got = takd_loss(d, batch, cfg, cached)
            for k in want:
                assert float(got[k]) == pytest.approx(float(want[k]), rel=1e-5, abs=1e-6), k


def test_identity_student_has_zero_distillation_terms():
    d = decompose(load_model("tiny-qwen2"), 2, beta=1.0)  # B_L = every B_F layer, LoRA B = 0
    feats = random_features(4)
    batch = collate(feats, 0)
    with torch.no_grad():
        terms = takd_loss(d, batch, TAKDConfig())
    assert float(terms["hidden"]) < 1e-10 and abs(float(terms["kl"])) < 1e-6
    assert float(terms["ce"]) > 1.0


def _setup(name="tiny-qwen2"):
    d = decompose(load_model(name), 2, drop_ratio=0.5)
    randomize_lora(d, std=0.05)
    return d, d.messenger_state(), random_features(12, seed=2)


def test_teacher_cache_is_equivalent_to_recomputing(tmp_path):
    d, msg, feats = _setup()
    mem = TeacherCache.build(d, feats, pad_id=0, batch_size=5, mode="memory")
    disk = TeacherCache.build(d, feats, pad_id=0, batch_size=5, mode="disk", directory=tmp_path / "tc")
    assert mem.storage == "memory" and disk.storage == "disk" and len(mem) == len(feats)
    idx = [3, 0, 7]
    assert torch.equal(mem.gather(idx, d.device), disk.gather(idx, d.device))  # storage round-trips bit for bit
    other = TeacherCache.build(d, feats, pad_id=0, batch_size=3, mode="memory")  # other batch-mates: rounding only
    torch.testing.assert_close(mem.gather(idx, d.device), other.gather(idx, d.device), atol=1e-6, rtol=1e-6)
    cfg = TAKDConfig(lr=1e-2, batch_size=3)
    s0 = init_state(d)
    runs = {}
    for label, cache in (("memory", mem), ("disk", disk), ("off", None)):
        runs[label] = distill(d, s0, msg, feats, cfg, 5, pad_id=0, seed=1, cache=cache)
    for label in ("disk", "off"):
        st, hist = runs[label]
        for a, b in zip(hist, runs["memory"][1]):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        for k, v in st.student.items():
            # batch composition changes float rounding of the no-cache teacher pass only slightly
            torch.testing.assert_close(v, runs["memory"][0].student[k], atol=1e-4, rtol=1e-4)


def test_distill_is_pure_reproducible_and_resumable():
    d, msg, feats = _setup("tiny-llama")
    cfg = TAKDConfig(lr=1e-2, batch_size=2, grad_accum=2)
    s0 = init_state(d)
    a, ha = distill(d, s0, msg, feats, cfg, 6, pad_id=0, seed=3)
    b, hb = distill(d, s0, msg, feats, cfg, 6, pad_id=0, seed=3)
    assert [h["loss"] for h in ha] == [h["loss"] for h in hb]
    assert all(torch.equal(a.student[k], b.student[k]) for k in a.student)
    half, _ = distill(d, s0, msg, feats, cfg, 3, pad_id=0, seed=3)
    full, _ = distill(d, half, msg, feats, cfg, 3, pad_id=0, seed=3)
    assert full.step == 6 and all(torch.equal(full.student[k], a.student[k]) for k in a.student)
    assert not all(torch.equal(a.student[k], s0.student[k]) for k in a.student)
    # the messenger is fixed, and trainable flags are restored
    assert all(torch.equal(d.messenger_state()[k], v) for k, v in msg.items())
    assert all(p.requires_grad for p in d.student_params().values())
    assert all(p.requires_grad for p in d.messenger_params().values())
    c, _ = distill(d, s0, msg, feats, cfg, 6, pad_id=0, seed=4)
    assert not all(torch.equal(a.student[k], c.student[k]) for k in a.student)


def test_distill_lowers_the_takd_loss():
    d, msg, feats = _setup()
    # CE on random tokens is irreducible; the distillation terms are what the student can learn
    cfg = TAKDConfig(lr=2e-2, batch_size=4, lambda_task=0.0)
    s0 = init_state(d)
    batch = collate(feats, 0)

    def full_loss(state):
        d.load_student(state.student)
        with torch.no_grad():
            return float(takd_loss(d, batch, cfg)["loss"])

    before = full_loss(s0)
    s1, _ = distill(d, s0, msg, feats, cfg, 40, pad_id=0, seed=0)
    assert full_loss(s1) < 0.8 * before


def test_sampler_covers_each_epoch():
    seen = [i for pos in range(5) for i in sample_indices(10, 2, seed=1, position=pos)]
    assert sorted(seen) == list(range(10))
    assert sample_indices(10, 2, 1, 7) == sample_indices(10, 2, 1, 7)


def test_distill_errors():
    d, msg, feats = _setup()
    with pytest.raises(CidersError, match="needs public data"):
        distill(d, init_state(d), msg, [], TAKDConfig(), 1, pad_id=0)
    cache = TeacherCache.build(d, feats[:4], pad_id=0)
    with pytest.raises(CidersError, match="teacher cache holds 4"):
        distill(d, init_state(d), msg, feats, TAKDConfig(), 1, pad_id=0, cache=cache)
    with pytest.raises(CidersError, match="loss is"):
        distill(d, init_state(d), msg, feats, TAKDConfig(lr=1e6, batch_size=4, max_grad_norm=0), 30, pad_id=0)
    with pytest.raises(CidersError, match="needs a directory"):
        TeacherCache.build(d, feats, pad_id=0, mode="disk")


def test_the_teacher_cache_batches_by_length_and_keeps_the_given_order():
    """Each example's B_F(x) equals its own unpadded forward, whatever batch it was computed in; the build's
    batches are cut longest first, so they pad less than consecutive ones."""
    from ciders.models import distill as dist
    from ciders.tasks import text

    d, _, feats = _setup()
    lens = [len(f["input_ids"]) for f in feats]
    assert len(set(lens)) > 3  # the features differ in length
    seen = []
    real = dist.collate
    try:
        dist.collate = lambda fs, pad, dev: seen.append([len(f["input_ids"]) for f in fs]) or real(fs, pad, dev)
        cache = TeacherCache.build(d, feats, pad_id=0, batch_size=4, mode="memory")
    finally:
        dist.collate = real
    assert [n for b in seen for n in b] == sorted(lens, reverse=True)
    padded = sum(max(b) * len(b) for b in seen)
    consecutive = sum(max(lens[i : i + 4]) * len(lens[i : i + 4]) for i in range(0, len(lens), 4))
    assert padded < consecutive
    for k in (0, 5, 11):
        b = text.collate([feats[k]], 0, d.device)
        h, _ = dist.teacher_forward(d, b, need_logits=False)
        torch.testing.assert_close(cache.gather([k], d.device)[0], h[0], atol=1e-5, rtol=1e-5)


def test_activation_checkpointing_recomputes_b_l_and_changes_nothing_else():
    """takd.activation_checkpointing: each B_L layer runs its forward twice per step (once more in the backward
    pass), the steps' losses and the student equal the plain run's (same dropout masks: the recompute replays the
    RNG state), and the model is left without checkpointing."""
    d, msg, feats = _setup()
    cfg = TAKDConfig(lr=1e-2, batch_size=3)
    s0 = init_state(d)
    calls = []
    hook = d.student[1].mlp.register_forward_pre_hook(lambda m, i: calls.append(1))  # the layer's own hooks skip the replay
    try:
        plain = distill(d, s0, msg, feats, cfg, 3, pad_id=0, seed=1)
        n_plain = len(calls)
        ck = distill(d, s0, msg, feats, replace(cfg, activation_checkpointing=True), 3, pad_id=0, seed=1)
        n_ck = len(calls) - n_plain
    finally:
        hook.remove()
    assert n_plain == 3 and n_ck == 6
    for a, b in zip(plain[1], ck[1]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    for k, v in plain[0].student.items():
        torch.testing.assert_close(ck[0].student[k], v, atol=1e-6, rtol=1e-5)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in d.adapemu.modules())


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama"])
@pytest.mark.parametrize("cached", [True, False])
@pytest.mark.parametrize("kw", [{}, {"kd_tokens": "response", "hidden_loss": "teacher_rms"},
                                {"lambda_out": 0.0}, {"lambda_task": 0.0, "hidden_loss": "sum"}])
def test_the_fused_takd_loss_equals_the_logits_one(name, cached, kw, monkeypatch):
    """takd_loss from the final hidden states in chunks (eval.chunked.linear_kl_ce) against takd_terms on the full
    logits: every term and the student's gradient, with and without the teacher cache; no chunk holds more
    than 5 rows of logits."""
    from ciders.eval import chunked
    from ciders.models.distill import takd_loss, teacher_forward
    from ciders.tasks.text import collate

    d, msg, feats = _setup(name)
    d.load_messenger(msg)
    params = d.student_params()
    d.set_trainable(messenger=False, student=True)
    cfg = TAKDConfig(**kw)
    batch = collate(feats[:4], 0, d.device)
    h_t = teacher_forward(d, batch, need_logits=False)[0] if cached else None
    rows = []
    real = chunked.chunk_logits
    monkeypatch.setattr(chunked, "chunk_logits", lambda h, w: rows.append(h.shape[0]) or real(h, w))
    monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", 5 * d.adapemu.lm_head.out_features)
    got = takd_loss(d, batch, cfg, h_t)
    g_got = torch.autograd.grad(got["loss"], list(params.values()))
    assert rows and max(rows) <= 5
    m = batch["attention_mask"].bool() if cfg.lambda_out > 0 and cfg.kd_tokens == "all" else torch.zeros_like(
        batch["attention_mask"], dtype=torch.bool)
    if cfg.lambda_out > 0 and cfg.kd_tokens == "response":
        m |= batch["labels"] != -100
    if cfg.lambda_task > 0:
        m[:, :-1] |= batch["labels"][:, 1:] != -100
    per = 2 if cfg.lambda_out > 0 else 1  # the teacher's logits are chunked too when the KL term is on
    assert sum(rows) == per * int(m.sum()) and int(m.sum()) < batch["labels"].numel()  # only rows a term reads
    rows.clear()
    want = takd_loss(d, batch, cfg, h_t, fused=False)
    g_want = torch.autograd.grad(want["loss"], list(params.values()))
    assert rows == []  # the logits path does not chunk
    for k in ("loss", "hidden", "kl", "ce"):
        assert float(got[k].detach()) == pytest.approx(float(want[k].detach()), rel=1e-5, abs=1e-7), k
    num = sum(float((a - b).norm() ** 2) for a, b in zip(g_got, g_want)) ** 0.5
    den = sum(float(b.norm() ** 2) for b in g_want) ** 0.5
    assert num <= 1e-5 * den
