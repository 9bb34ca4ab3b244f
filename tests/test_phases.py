"""ciders.phases: exclusive phase times under profiling(), nothing recorded outside it."""

import time

from ciders.phases import phase, profiling


def test_nested_phases_count_exclusively_and_the_rest_is_other():
    with phase("io"):  # no profile: nothing recorded, no error
        pass
    with profiling() as p:
        with phase("takd"):
            time.sleep(0.05)
            with phase("io"):
                time.sleep(0.03)
        with phase("io"):
            time.sleep(0.02)
        time.sleep(0.04)  # no phase
    assert p.calls == {"io": 2, "takd": 1}
    assert 0.045 <= p.seconds["takd"] < 0.075  # without the nested 0.03
    assert 0.049 <= p.seconds["io"] < 0.08
    assert sum(p.seconds.values()) <= p.wall
    s = p.shares()
    assert abs(sum(s.values()) - 1.0) < 1e-9 and s["other"] > 0.2


def test_an_exception_still_closes_the_phase():
    with profiling() as p:
        try:
            with phase("evaluation"):
                raise ValueError("x")
        except ValueError:
            pass
        with phase("TAKD"):
            pass
    assert p.calls == {"evaluation": 1, "TAKD": 1} and not p._stack
