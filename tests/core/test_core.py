
import pytest
import torch

from ciders.core import aggregate as agg
from ciders.core import consensus as cs
from ciders.core import optim
from ciders.core.metagrad import fd_class, metagrad
from ciders.core.schedules import gamma_at, warmup_cosine
from ciders.core.store import RoundStore
from ciders.core.tensors import add, dot, equal, lincomb, norm, sub, zeros_like
from ciders.core.wire import PayloadError, decode, encode


def st(seed, shapes=((3, 4), (5,)), dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(s, generator=g, dtype=dtype) for i, s in enumerate(shapes)}


def test_tensor_ops_and_key_checks():
    a, b = st(0), st(1)
    torch.testing.assert_close(sub(add(a, b), b)["p0"], a["p0"])
    assert dot(a, a) == pytest.approx(norm(a) ** 2)
    assert equal(lincomb([(2.0, a), (-1.0, a)]), a)
    with pytest.raises(KeyError, match="key sets differ"):
        add(a, {"p0": a["p0"]})


def test_eq9_eq11_roundtrip_is_exact_in_float64():
    c_i, c, delta = st(0), st(1), st(2)
    for alpha, gamma in [(0.002, 0.01), (0.5, 0.9), (1.0, 0.0), (0.1, 1.0)]:
        dc = cs.increment(cs.client_consensus(c_i, delta, c, alpha, gamma), c_i)
        rec = cs.reconstruct(dc, c_i, c, alpha, gamma)
        assert max(float((rec[k] - delta[k]).abs().max()) for k in delta) < 1e-9


def test_eq12_and_weights():
    w, d1, d2 = st(0), st(1), st(2)
    p = agg.client_weights([1, 3])
    assert p == [0.25, 0.75] and agg.client_weights([5, 5, 5], uniform=True) == [1 / 3] * 3
    bar = agg.weighted_sum([d1, d2], p)
    torch.testing.assert_close(bar["p1"], 0.25 * d1["p1"] + 0.75 * d2["p1"])
    w2 = cs.server_messenger(w, bar, tau=0.5, k=4, eta_bar=0.1)
    torch.testing.assert_close(w2["p0"], w["p0"] - 0.5 * 4 * 0.1 * bar["p0"])
    c2 = cs.server_consensus(zeros_like(w), bar, 0.2)
    torch.testing.assert_close(c2["p0"], 0.2 * bar["p0"])


def test_functional_adamw_matches_torch():
    params = st(0, dtype=torch.float32)
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = torch.optim.AdamW(list(ref.values()), lr=1e-2, weight_decay=0.01)
    state = optim.adamw_init(params)
    for i in range(5):
        grads = st(10 + i, dtype=torch.float32)
        for k, p in ref.items():
            p.grad = grads[k].clone()
        opt.step()
        params, state = optim.adamw_step(params, grads, state, 1e-2, weight_decay=0.01)
    for k in params:
        torch.testing.assert_close(params[k], ref[k].detach(), atol=1e-6, rtol=1e-5)


def test_clip_and_sgd():
    g = {"a": torch.tensor([3.0, 4.0])}
    clipped, n = optim.clip_by_global_norm(g, 1.0)
    assert n == 5.0 and norm(clipped) == pytest.approx(1.0, rel=1e-5)
    assert optim.clip_by_global_norm(g, 0.0)[0]["a"] is g["a"]
    out = optim.sgd_step({"a": torch.tensor([1.0])}, {"a": torch.tensor([2.0])}, 0.1, weight_decay=0.5)
    assert float(out["a"]) == pytest.approx(1.0 - 0.1 * (2.0 + 0.5))


def test_schedules():
    assert gamma_at(0, "protocol_c", 0) == gamma_at(1, "protocol_c", 0) == 0.9
    assert gamma_at(2, "protocol_c", 0) == pytest.approx(0.9 * 0.86)
    floor = [t for t in range(2, 200) if gamma_at(t, "protocol_c", 0) == 0.01]
    assert floor[0] == 31  # docs/method.md#schedules: reaches the floor at round 31
    assert len({gamma_at(t, "protocol_c", 0) for t in range(151)}) == 31
    assert warmup_cosine(0, 100, 1.0, warmup=10) == pytest.approx(0.1)
    assert warmup_cosine(10, 100, 1.0, warmup=10) == pytest.approx(1.0)
    assert warmup_cosine(100, 100, 1.0, warmup=10) == pytest.approx(0.0, abs=1e-12)
    assert warmup_cosine(55, 100, 2.0, warmup=10) == pytest.approx(1.0)


def test_metagrad_on_a_quadratic_against_the_exact_maml_gradient():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(4, 4, generator=g, dtype=torch.float64)
    h = m @ m.T + torch.eye(4, dtype=torch.float64)
    b = torch.randn(4, generator=g, dtype=torch.float64)
    calls = []

    def grad_fn(p):
        calls.append(1)
        x = p["x"]
        return 0.5 * (x - b) @ h @ (x - b), {"x": h @ (x - b)}

    x = {"x": torch.randn(4, generator=g, dtype=torch.float64)}
    eta = 0.05
    look = x["x"] - eta * h @ (x["x"] - b)
    fo, info = metagrad(grad_fn, x, eta, "fo")
    torch.testing.assert_close(fo["x"], h @ (look - b))
    assert info["evals"] == 2 and len(calls) == 2
    exact = (torch.eye(4, dtype=torch.float64) - eta * h) @ h @ (look - b)  # MAML: (I - eta H) grad L(x~)
    fd, info = metagrad(grad_fn, x, eta, "fd", eps_fd=1e-4)
    torch.testing.assert_close(fd["x"], exact, atol=1e-8, rtol=1e-8)  # central FD is exact on a quadratic
    assert info["evals"] == 4 and info["r_fd"] > 0
    same, _ = metagrad(grad_fn, x, eta, "fd", eta_hvp=0.0)
    assert equal(same, fo)  # FD with eta_HVP = 0 is FO
    assert metagrad(grad_fn, x, 0.0, "fo")[1]["evals"] == 1  # no look-ahead: one gradient
    assert [fd_class(r) for r in (0.1, 0.15, 0.2, 0.21)] == ["small", "moderate", "moderate", "large"]


def test_wire_roundtrip_counts_and_rejects():
    a = st(0, dtype=torch.float32)
    msg, sizes = encode({"messenger": a, "c": a, "skip": None}, {"round": 3})
    assert sizes["messenger"] == sizes["c"] and sum(sizes.values()) == len(msg)
    assert sizes["messenger"] >= 4 * sum(v.numel() for v in a.values())
    got, meta = decode(msg, {"messenger": a, "c": a})
    assert meta == {"round": 3} and equal(got["c"], a)
    bad = dict(a, p0=torch.zeros(2, 2))
    with pytest.raises(PayloadError, match="'p0' is \\(2, 2\\)"):
        decode(encode({"c": bad}, {})[0], {"c": a})
    nan = dict(a, p1=torch.full((5,), float("nan")))
    with pytest.raises(PayloadError, match="NaN or Inf"):
        decode(encode({"c": nan}, {})[0], {"c": a})
    with pytest.raises(PayloadError, match="unexpected component"):
        decode(encode({"zzz": a}, {})[0], {"c": a})
    with pytest.raises(PayloadError, match="truncated"):
        decode(msg[:-10], {"messenger": a, "c": a})
    with pytest.raises(PayloadError, match="bad magic"):
        decode(b"PICKLE" + msg)


def test_round_store_commits_atomically_and_bounds_memory(tmp_path):
    s = RoundStore(tmp_path / "s", committed=-1, cache_size=2)
    s.put("a", 0, {"x": torch.ones(2)}, {"v": 1})
    s.commit(0)
    s.put("a", 1, {"x": torch.zeros(2)}, {"v": 2})  # round 1 in progress, then a crash
    assert s.get("a")[1] == {"v": 2}  # visible inside its own round
    s2 = RoundStore(tmp_path / "s", committed=0, cache_size=2)
    assert s2.recover(0) == 1
    t, meta = s2.get("a")
    assert meta == {"v": 1} and torch.equal(t["x"], torch.ones(2))
    for i in range(10):
        s2.put(f"k{i}", 1, {"x": torch.full((3,), float(i))}, {})
    assert s2.cached == 2 and s2.get("k3")[0]["x"][0] == 3.0  # bounded cache, disk keeps all
    s2.commit(1)
    s2.put("a", 2, {"x": torch.ones(1)}, {})
    s2.commit(2)
    assert [p.name for p in (tmp_path / "s" / "a").iterdir()] == ["r00000002.safetensors"]
    assert s2.get("never-seen") is None
    with pytest.raises(ValueError, match="already committed"):
        s2.put("a", 2, {"x": torch.ones(1)}, {})
