"""core.optim: AdamW by hand on a 2-parameter problem, and its typed state's checkpoint record."""

import math

import pytest
import torch

from ciders.core import optim
from ciders.core.optim import AdamWState


def test_adamw_two_steps_by_hand():
    lr, wd, eps = 0.1, 0.5, 1e-8
    params = {"w": torch.tensor(1.0, dtype=torch.float64), "b": torch.tensor(-3.0, dtype=torch.float64)}
    state = optim.adamw_init(params)
    assert state.step == 0 and all(float(t) == 0 for t in (*state.m.values(), *state.v.values()))

    # step 1: bias correction makes m_hat = g, v_hat = g^2, so the Adam part is lr * g / (|g| + eps)
    p1, s1 = optim.adamw_step(params, {"w": torch.tensor(2.0, dtype=torch.float64),
                                       "b": torch.tensor(0.5, dtype=torch.float64)}, state, lr, weight_decay=wd)
    assert s1.step == 1
    assert float(s1.m["w"]) == pytest.approx(0.1 * 2.0) and float(s1.v["w"]) == pytest.approx(0.001 * 4.0)
    # decoupled weight decay: p (1 - lr wd), not a gradient term
    assert float(p1["w"]) == pytest.approx(1.0 * (1 - lr * wd) - lr * 2.0 / (2.0 + eps), abs=1e-15)
    assert float(p1["w"]) == pytest.approx(0.85, abs=1e-9)
    assert float(p1["b"]) == pytest.approx(-3.0 * 0.95 - lr * 0.5 / (0.5 + eps), abs=1e-15)

    # step 2: g_w = -1, g_b = 0.5 again
    p2, s2 = optim.adamw_step(p1, {"w": torch.tensor(-1.0, dtype=torch.float64),
                                   "b": torch.tensor(0.5, dtype=torch.float64)}, s1, lr, weight_decay=wd)
    m_w, v_w = 0.9 * 0.2 + 0.1 * -1.0, 0.999 * 0.004 + 0.001 * 1.0  # 0.08, 0.004996
    bc1, bc2 = 1 - 0.9**2, 1 - 0.999**2  # 0.19, 0.001999
    assert float(s2.m["w"]) == pytest.approx(m_w) and float(s2.v["w"]) == pytest.approx(v_w)
    want_w = float(p1["w"]) * 0.95 - lr * (m_w / bc1) / (math.sqrt(v_w / bc2) + eps)
    assert float(p2["w"]) == pytest.approx(want_w, abs=1e-14)
    assert float(p2["w"]) == pytest.approx(0.7808662966774315, abs=1e-12)
    # a constant gradient: m_hat = g, v_hat = g^2 at every step, the Adam part is lr again
    assert float(p2["b"]) == pytest.approx(float(p1["b"]) * 0.95 - lr * 0.5 / (0.5 + eps), abs=1e-12)
    assert s2.step == 2 and state.step == 0 and float(state.m["w"]) == 0  # the old state is untouched


def test_adamw_matches_torch_on_two_parameters():
    g = torch.Generator().manual_seed(0)
    params = {"a": torch.randn(3, generator=g), "b": torch.randn(2, 2, generator=g)}
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = torch.optim.AdamW(list(ref.values()), lr=3e-2, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6)
    state = optim.adamw_init(params)
    for _ in range(4):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        for k, p in ref.items():
            p.grad = grads[k].clone()
        opt.step()
        params, state = optim.adamw_step(params, grads, state, 3e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    for k in params:
        torch.testing.assert_close(params[k], ref[k].detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(state.m[k], opt.state[ref[k]]["exp_avg"])
        torch.testing.assert_close(state.v[k], opt.state[ref[k]]["exp_avg_sq"])
    assert state.step == 4


def test_state_record_round_trip_and_equality():
    g = torch.Generator().manual_seed(1)
    st = AdamWState(7, {"l.a": torch.randn(2, 3, generator=g), "l.b": torch.randn(3, generator=g)},
                    {"l.a": torch.rand(2, 3, generator=g), "l.b": torch.rand(3, generator=g)})
    tensors, meta = st.to_record("takd")
    assert sorted(tensors) == ["takd_m/l.a", "takd_m/l.b", "takd_v/l.a", "takd_v/l.b"] and meta == {"takd_t": 7}
    back = AdamWState.from_record({**tensors, "student/x": torch.zeros(1)}, {**meta, "takd_step": 3}, "takd")
    assert back == st and back.equal(st) and back is not st
    t2, m2 = st.to_record()  # default prefix
    assert set(m2) == {"adamw_t"} and all(k.startswith(("adamw_m/", "adamw_v/")) for k in t2)
    assert AdamWState.from_record(t2, m2) == st
    assert AdamWState.from_record({}, {"takd_t": None}, "takd") is None
    assert AdamWState.from_record({}, {}, "takd") is None
    # equality is exact and a bool
    other = AdamWState(7, dict(st.m), {**st.v, "l.b": st.v["l.b"] + 1e-7})
    assert (other == st) is False and AdamWState(8, st.m, st.v) != st
    assert AdamWState(7, st.m, {k: v.double() for k, v in st.v.items()}) != st  # dtype counts
    with pytest.raises(ValueError, match="different parameters"):
        AdamWState(0, {"a": torch.zeros(1)}, {})
    with pytest.raises(ValueError, match="step"):
        AdamWState(-1, {}, {})


def test_takd_checkpoint_keeps_its_key_names():
    """The TAKD record's on-disk layout is unchanged: student/*, takd_m/*, takd_v/*, meta takd_step, takd_t."""
    from ciders.models.distill import TAKDState, takd_from_record, takd_record

    student = {"s.lora_A": torch.ones(2, 2), "s.lora_B": torch.zeros(2, 2)}
    fresh = TAKDState(student)
    t, meta = takd_record(fresh)
    assert sorted(t) == ["student/s.lora_A", "student/s.lora_B"] and meta == {"takd_step": 0, "takd_t": None}
    assert takd_from_record(t, meta).optimizer is None
    _, opt = optim.adamw_step(student, {k: torch.full_like(v, 0.5) for k, v in student.items()},
                              optim.adamw_init(student), 1e-2)
    t, meta = takd_record(TAKDState(student, opt, 1))
    assert sorted(t) == ["student/s.lora_A", "student/s.lora_B", "takd_m/s.lora_A", "takd_m/s.lora_B",
                         "takd_v/s.lora_A", "takd_v/s.lora_B"]
    assert meta == {"takd_step": 1, "takd_t": 1}
    # a record written by the previous (dict-state) code loads
    old = {**{f"student/{k}": v for k, v in student.items()}, **{f"takd_m/{k}": v for k, v in opt.m.items()},
           **{f"takd_v/{k}": v for k, v in opt.v.items()}}
    back = takd_from_record(old, {"takd_step": 1, "takd_t": 1})
    assert back.optimizer == opt and back.step == 1 and back.student.keys() == student.keys()
