"""core.privacy: clipping, Gaussian noise and the RDP accountant, checked against the maths (closed forms for the
Gaussian mechanism, a numerical integral for the subsampled one)."""

import math
import warnings

import numpy as np
import pytest
import torch

from ciders.core import privacy as P
from ciders.core.tensors import norm
from ciders.runtime import derive_seed

# ------------------------------------------------------------------------------------------------ clipping


def test_clipping_above_the_bound_scales_to_the_bound_in_the_same_direction():
    st = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([[0.0, 4.0]])}  # norm 5
    out, n = P.clip_to_norm(st, 2.0)
    assert n == 5.0
    assert norm(out) == pytest.approx(2.0, rel=1e-6)
    for k in st:  # same direction: exactly st * 2/5
        torch.testing.assert_close(out[k], st[k] * 0.4, rtol=1e-6, atol=0)
    assert st["a"].tolist() == [3.0, 0.0]  # the input is untouched


def test_clipping_below_the_bound_or_without_a_bound_returns_the_state_itself():
    st = {"w": torch.tensor([3.0, 4.0])}  # norm 5, exactly
    before = st["w"].clone()
    for bound in (7.5, 5.0, None):  # at the bound: no scaling either
        out, n = P.clip_to_norm(st, bound)
        assert out is st and n == 5.0
        assert torch.equal(st["w"], before)
    zero = {"w": torch.zeros(3)}
    out, n = P.clip_to_norm(zero, 0.5)
    assert out is zero and n == 0.0 and torch.equal(out["w"], torch.zeros(3))


def test_clipping_uses_the_global_norm_over_all_tensors():
    st = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([12.0]), "c": torch.zeros(2, 2)}  # 5, 12, 0 -> 13
    out, n = P.clip_to_norm(st, 1.3)
    assert n == pytest.approx(13.0, rel=1e-12)
    torch.testing.assert_close(out["a"], torch.tensor([0.3, 0.4]))  # one factor, 0.1, for every tensor
    torch.testing.assert_close(out["b"], torch.tensor([1.2]))
    assert torch.equal(out["c"], torch.zeros(2, 2))
    assert norm(out) == pytest.approx(1.3, rel=1e-6)


def test_clipping_keeps_dtypes_and_refuses_a_bad_bound():
    st = {"a": torch.full((4,), 10.0, dtype=torch.bfloat16)}  # norm 20
    out, n = P.clip_to_norm(st, 2.0)
    assert out["a"].dtype == torch.bfloat16 and n == 20.0
    assert norm(out) == pytest.approx(2.0, rel=1e-2)
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="max_norm"):
            P.clip_to_norm(st, bad)
    inf = {"a": torch.tensor([math.inf, 1.0])}
    assert P.clip_to_norm(inf, 1.0)[0] is inf  # left for the server's finite check


# --------------------------------------------------------------------------------------------------- noise


def _big_state():
    return {"b": torch.zeros(500, 1000), "a": torch.zeros(1000, 500)}  # 10^6 elements


def test_gaussian_like_has_the_requested_std():
    std = 0.37
    noise = P.gaussian_like(_big_state(), std, P.noise_generator(1))
    x = torch.cat([v.reshape(-1) for v in noise.values()]).double()
    assert x.numel() == 10**6
    assert abs(float(x.std()) / std - 1) < 0.01  # the sampling error is ~0.07%
    assert abs(float(x.mean())) < 5 * std / 1000  # 5 standard errors
    assert list(noise) == ["b", "a"] and all(v.dtype == torch.float32 for v in noise.values())


def test_the_same_seed_gives_the_same_noise_and_different_seeds_differ():
    like = {"x": torch.zeros(64), "y": torch.zeros(3, 5)}
    seed = derive_seed(7, "dp-local-noise", 2, 1)
    a = P.gaussian_like(like, 1.0, P.noise_generator(seed))
    b = P.gaussian_like(like, 1.0, P.noise_generator(seed))
    c = P.gaussian_like(like, 1.0, P.noise_generator(derive_seed(7, "dp-local-noise", 2, 0)))
    d = P.gaussian_like(like, 1.0, P.noise_generator(derive_seed(7, "dp-central-noise", 2)))
    assert all(torch.equal(a[k], b[k]) for k in like)
    assert not torch.equal(a["x"], c["x"]) and not torch.equal(a["x"], d["x"])
    # keys are drawn in sorted order: the dict's order does not change a key's noise
    rev = P.gaussian_like({"y": like["y"], "x": like["x"]}, 1.0, P.noise_generator(seed))
    assert list(rev) == ["y", "x"] and all(torch.equal(a[k], rev[k]) for k in like)
    # secret noise: seeded from the operating system, so two generators differ
    s1 = P.gaussian_like(like, 1.0, P.noise_generator(None))
    s2 = P.gaussian_like(like, 1.0, P.noise_generator(None))
    assert not torch.equal(s1["x"], s2["x"])


def test_noise_is_drawn_in_float32_then_cast_to_the_tensor_dtype():
    like = {"h": torch.zeros(100, dtype=torch.bfloat16)}
    n16 = P.gaussian_like(like, 0.5, P.noise_generator(3))
    n32 = P.gaussian_like({"h": torch.zeros(100)}, 0.5, P.noise_generator(3))
    assert n16["h"].dtype == torch.bfloat16
    assert torch.equal(n16["h"], n32["h"].to(torch.bfloat16))


def test_zero_std_gives_exact_zeros_without_consuming_randomness():
    like = {"x": torch.ones(10), "h": torch.ones(4, dtype=torch.bfloat16)}
    gen = P.noise_generator(5)
    state = gen.get_state().clone()
    z = P.gaussian_like(like, 0.0, gen)
    assert torch.equal(gen.get_state(), state)
    assert torch.equal(z["x"], torch.zeros(10)) and z["h"].dtype == torch.bfloat16 and not z["h"].any()
    assert P.add_noise(like, 0.0, gen) is like
    assert torch.equal(gen.get_state(), state)
    with pytest.raises(ValueError, match="std"):
        P.gaussian_like(like, -1.0, gen)


def test_add_noise_adds_the_drawn_noise():
    st = {"x": torch.arange(5.0)}
    out = P.add_noise(st, 2.0, P.noise_generator(11))
    noise = P.gaussian_like(st, 2.0, P.noise_generator(11))
    assert torch.equal(out["x"], st["x"] + noise["x"]) and torch.equal(st["x"], torch.arange(5.0))


def test_noise_std_formulas():
    C, z, m = 2.0, 3.0, 4
    assert P.noise_std("central", C, z, m) == pytest.approx(z * C / m)  # 1.5
    assert P.noise_std("local", C, z, m) == pytest.approx(z * C)  # 6.0
    assert P.noise_std("local", C, z) == pytest.approx(6.0)
    assert P.noise_std("none", C, z, m) == 0.0
    assert P.noise_std("central", None, 0.0, m) == 0.0  # no noise needs no clipping bound
    with pytest.raises(ValueError, match="clipping norm"):
        P.noise_std("central", None, 1.0, m)
    with pytest.raises(ValueError, match="m >= 1"):
        P.noise_std("central", C, z, 0)
    with pytest.raises(ValueError, match="mode"):
        P.noise_std("global", C, z, m)


# ---------------------------------------------------------------------------------------------- accountant


def _orders():
    from opacus.accountants import RDPAccountant

    return np.array(RDPAccountant.DEFAULT_ALPHAS, dtype=float)


def _eps_from_rdp(rdp, orders, delta):
    """Opacus's conversion (Balle et al. 2020, Thm. 21, as in opacus.accountants.analysis.rdp.get_privacy_spent):
    min_a rdp(a) + log((a-1)/a) - (log delta + log a) / (a-1)."""
    return float(np.min(rdp + np.log((orders - 1) / orders) - (math.log(delta) + np.log(orders)) / (orders - 1)))


def _gaussian_eps(z, rounds, delta):
    """The Gaussian mechanism without subsampling: RDP(a) = rounds * a / (2 z^2)."""
    a = _orders()
    return _eps_from_rdp(rounds * a / (2 * z**2), a, delta)


@pytest.mark.parametrize("z,rounds,delta", [(1.0, 1, 1e-5), (1.1, 100, 1e-5), (4.0, 50, 1e-6), (20.0, 300, 1e-3),
                                            (0.7, 10, 1e-5)])
def test_central_epsilon_without_sampling_is_the_gaussian_mechanism(z, rounds, delta):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eps = P.central_epsilon(z, 1.0, rounds, delta)
    assert eps == pytest.approx(_gaussian_eps(z, rounds, delta), rel=1e-9)
    a = _orders()  # the classical conversion rdp + log(1/delta)/(a-1) is never tighter
    assert eps <= _eps_from_rdp(rounds * a / (2 * z**2) - np.log((a - 1) / a) + np.log(a) / (a - 1), a, delta) + 1e-12


def test_local_epsilon_is_the_gaussian_mechanism_at_half_the_noise_multiplier():
    for z, rounds, delta in [(1.0, 5, 1e-5), (3.0, 40, 1e-5), (8.0, 200, 1e-6)]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            eps = P.local_epsilon(z, rounds, delta)
            assert eps == P.central_epsilon(z / 2, 1.0, rounds, delta)
        # sensitivity 2C, std z C: RDP(a) = rounds * a * (2C)^2 / (2 (z C)^2) = 2 rounds a / z^2
        a = _orders()
        assert eps == pytest.approx(_eps_from_rdp(2 * rounds * a / z**2, a, delta), rel=1e-9)


def _subsampled_gaussian_log_a(q, sigma, alpha):
    """log E_{x ~ N(0, sigma^2)} [(1 - q + q exp((2x - 1) / (2 sigma^2)))^alpha] (Mironov et al. 2019), by
    the trapezoidal rule on a fine grid in log space (the integrand is smooth and decays like a Gaussian)."""
    x = np.linspace(-40 * sigma, alpha + 40 * sigma, 400_001)
    f = alpha * np.log1p(q * np.expm1((2 * x - 1) / (2 * sigma**2))) - x**2 / (2 * sigma**2)
    top = f.max()
    return top + math.log(np.trapezoid(np.exp(f - top), x)) - 0.5 * math.log(2 * math.pi * sigma**2)


@pytest.mark.parametrize("z,q,rounds", [(1.0, 0.1, 100), (2.0, 0.02, 1000), (0.8, 0.3, 20)])
def test_central_epsilon_with_sampling_matches_a_numerical_integral(z, q, rounds):
    a = _orders()
    rdp = np.array([rounds * _subsampled_gaussian_log_a(q, z, al) / (al - 1) for al in a])
    delta = 1e-5
    assert P.central_epsilon(z, q, rounds, delta) == pytest.approx(_eps_from_rdp(rdp, a, delta), rel=1e-6)


def test_epsilon_decreases_with_noise_and_grows_with_rounds_and_sampling_rate():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        by_z = [P.central_epsilon(z, 0.1, 100, 1e-5) for z in (0.6, 0.8, 1.0, 2.0, 5.0)]
        by_t = [P.central_epsilon(1.0, 0.1, t, 1e-5) for t in (1, 10, 100, 1000)]
        by_q = [P.central_epsilon(1.0, q, 100, 1e-5) for q in (0.01, 0.05, 0.2, 1.0)]
        by_local = [P.local_epsilon(z, 50, 1e-5) for z in (1.0, 2.0, 10.0)]
    assert all(a > b for a, b in zip(by_z, by_z[1:])), by_z
    assert all(a < b for a, b in zip(by_t, by_t[1:])), by_t
    assert all(a < b for a, b in zip(by_q, by_q[1:])), by_q
    assert all(a > b for a, b in zip(by_local, by_local[1:])), by_local
    assert P.central_epsilon(0.0, 0.1, 10, 1e-5) == math.inf
    assert P.central_epsilon(0.0, 0.1, 0, 1e-5) == 0.0 and P.central_epsilon(1.0, 0.5, 0, 1e-5) == 0.0
    assert P.local_epsilon(0.0, 3, 1e-5) == math.inf


@pytest.mark.parametrize("mode,target,q,rounds", [("central", 3.0, 0.1, 100), ("central", 0.5, 0.05, 200),
                                                  ("central", 8.0, 1.0, 10), ("local", 10.0, 0.1, 20),
                                                  ("local", 100.0, 1.0, 5)])
def test_noise_for_epsilon_round_trips(mode, target, q, rounds):
    z = P.noise_for_epsilon(target, 1e-5, q, rounds, mode)

    def eps(zz):
        return P.central_epsilon(zz, q, rounds, 1e-5) if mode == "central" else P.local_epsilon(zz, rounds, 1e-5)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert 0.99 * target <= eps(z) <= target
        assert eps(z * (1 - 1e-3)) > target  # the smallest such z, to the bisection's tolerance
    if mode == "central":  # Opacus's own search (absolute tolerance 0.01 in epsilon) lands at or above ours
        from opacus.accountants.utils import get_noise_multiplier

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = get_noise_multiplier(target_epsilon=target, target_delta=1e-5, sample_rate=q, steps=rounds)
        assert z <= theirs * (1 + 1e-3)


def test_accountant_refuses_impossible_inputs():
    floor = P.epsilon_floor(1e-5)
    assert 0.1 < floor < 0.11  # min_a -(log delta + log a)/(a-1) + log((a-1)/a) over the default orders
    with pytest.raises(ValueError, match="least the RDP accountant can certify"):
        P.noise_for_epsilon(0.05, 1e-5, 0.1, 10, "central")
    with pytest.raises(ValueError, match="target_epsilon"):
        P.noise_for_epsilon(0.0, 1e-5, 0.1, 10, "local")
    with pytest.raises(ValueError, match="rounds"):
        P.noise_for_epsilon(1.0, 1e-5, 0.1, 0, "central")
    with pytest.raises(ValueError, match="mode"):
        P.noise_for_epsilon(1.0, 1e-5, 0.1, 10, "none")
    with pytest.raises(ValueError, match="sample_rate"):
        P.central_epsilon(1.0, 0.0, 10, 1e-5)
    with pytest.raises(ValueError, match="sample_rate"):
        P.noise_for_epsilon(1.0, 1e-5, 1.5, 10, "central")
    with pytest.raises(ValueError, match="delta"):
        P.central_epsilon(1.0, 0.1, 10, 1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        P.central_epsilon(-1.0, 0.1, 10, 1e-5)
