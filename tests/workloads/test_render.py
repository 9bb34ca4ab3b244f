"""The table `ciders run` prints at the end (`workloads.llm.render`)."""

from ciders.workloads.llm import render


def _ppl(nll, tokens=64):
    return {"ppl": 2.718281828 ** nll, "nll": nll, "tokens": tokens}


def test_a_run_without_a_global_messenger_after_training_renders():
    """LocalOT's evaluation after training has only personalized messengers per client: the table shows them
    (and '-' where the global messenger was not evaluated) instead of failing on the missing row."""
    summary = {"eval_before": {"global": _ppl(5.7, 128), "clients": {"client0": {"global": _ppl(5.8)}}},
               "eval_after": {"global": _ppl(5.4, 128), "clients": {"client0": {"personalized": _ppl(5.3)}}},
               "mib": {"by_component": {"down": {"messenger": 1.0}, "up": {}}, "down_per_client_round": 0.5,
                       "up_per_client_round": 0.0, "down_total": 1.0, "up_total": 0.0},
               "client_rounds": 2, "rounds": 2}
    lines = render(summary).splitlines()
    row = next(line for line in lines if line.startswith("  client0 global"))
    assert "(64 tok)" in row and row.rstrip().endswith("-")
    assert f"{2.718281828 ** 5.3:9.3f}" in next(line for line in lines if "client0 personalized" in line)
