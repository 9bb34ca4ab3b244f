import pytest

from ciders.errors import CidersError
from ciders.tasks.partition import histograms, partition, skew
from ciders.tasks.registry import DOMAINS, TASKS, gsm8k_steps_category, load_task, split_indices
from ciders.tasks.text import to_example
from helpers import shared


@pytest.mark.full_data
@pytest.mark.parametrize("name, n", [("gsm8k", 7473), ("dolly", 15011), ("code", 974), ("domains", 13803), ("math", 7473)])
def test_named_tasks_load_from_the_shared_data(name, n):
    shared({"dolly": "dolly", "code": "mbpp", "domains": "personalization"}.get(name, "gsm8k"))
    r = load_task(name)
    assert len(r.examples) == n and r.report.kept == n and not r.report.skipped
    assert all(e.response.strip() for e in r.examples[:50])
    if TASKS[name].label:
        assert all(lab is not None for lab in r.labels)
    if name == "domains":
        assert set(r.labels) == set(DOMAINS)
    if name == "gsm8k":
        assert len(load_task("gsm8k", eval_split=True).examples) == 1319


def test_formats_and_category():
    assert to_example({"text": "Add.", "code": "def f(): pass", "test_list": ["assert f() is None"]}, "mbpp").prompt.endswith(
        "### Python solution:\n")
    assert to_example({"query": "1+1?", "response": "2"}, "metamath").response == " 2"
    assert gsm8k_steps_category("a\nb\n#### 1") == "steps_1-2"
    assert gsm8k_steps_category("a\nb\nc\nd\n#### 1") == "steps_4"
    assert gsm8k_steps_category("\n".join("x" * 9) + "\n#### 1") == "steps_6+"
    with pytest.raises(CidersError, match="unknown task"):
        load_task("imagenet")


def test_local_override_and_missing_files(tmp_path):
    p = tmp_path / "mine.jsonl"
    p.write_text('{"instruction": "Hi", "response": "Hello", "category": "x"}\n{"bad json\n'
                 '{"instruction": "Q", "response": "", "category": "y"}\n')
    r = load_task("dolly", str(p))
    assert len(r.examples) == 1 and dict(r.report.skipped) == {"invalid JSON": 1, "empty response": 1}
    with pytest.raises(CidersError, match="not found"):
        load_task("dolly", str(tmp_path / "none.jsonl"))


def test_splits_are_disjoint_deterministic_and_cover():
    s = split_indices(100, 10, 20, seed=3)
    assert len(s.public) == 10 and len(s.eval) == 20 and len(s.clients) == 70
    assert sorted(s.public + s.eval + s.clients) == list(range(100))
    assert s == split_indices(100, 10, 20, seed=3) and s != split_indices(100, 10, 20, seed=4)
    labels = ["a"] * 50 + ["b"] * 50
    st = split_indices(100, 10, 20, seed=3, stratify=labels)
    assert sum(labels[i] == "a" for i in st.public) == 5 and sum(labels[i] == "a" for i in st.eval) == 10
    with pytest.raises(CidersError, match="cannot take"):
        split_indices(10, 5, 5, seed=0)


def test_partitions_deterministic_disjoint_covering_and_skewed():
    labels = [f"c{i % 5}" for i in range(1000)]
    for kind in ("iid", "dirichlet"):
        a = partition(labels, 8, kind, seed=1, alpha=0.5)
        assert a == partition(labels, 8, kind, seed=1, alpha=0.5)
        flat = [i for p in a for i in p]
        assert len(flat) == len(set(flat)) == 1000
    skews = [skew(partition(labels, 8, "dirichlet", seed=0, alpha=a), labels) for a in (100.0, 1.0, 0.1)]
    assert skews[0] < skews[1] < skews[2]
    assert skew(partition(labels, 8, "iid", seed=0), labels) < 0.1
    nat = partition(labels, 5, "natural")
    assert [set(labels[i] for i in p) for p in nat] == [{f"c{k}"} for k in range(5)]
    assert histograms(nat, labels)[0] == {"size": 200, "labels": {"c0": 200}}
    with pytest.raises(CidersError, match="5 distinct labels"):
        partition(labels, 3, "natural")


@pytest.mark.full_data
def test_eval_limit_with_per_label_keeps_every_domain():
    """A plain prefix of the label-grouped evaluation split would drop whole domains (and with them
    NLL-matrix columns); with per_label the limit applies per label."""
    shared("personalization")
    from ciders.config import load_config
    from ciders.models.load import load_tokenizer
    from ciders.tasks import federated

    cfg = load_config(None, ["data.task=domains", "data.per_label=true", "data.public_size=2", "data.eval_size=4",
                             "data.eval_limit=3", "data.client_size=4", "federation.clients=5",
                             "federation.partition=natural", "data.max_length=512"])
    data = federated.build(cfg, load_tokenizer("tiny-qwen2"))
    assert sorted(data.eval_by_label) == sorted(DOMAINS)
    assert all(len(v) == 3 for v in data.eval_by_label.values()) and len(data.global_eval) == 15
