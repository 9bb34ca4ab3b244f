"""Data a user brings: files of every supported kind and hub ids through `datasets.load_dataset`, the record formats
(prompt/completion, chat messages through the chat template, renamed fields), labels for the label-based
partitioners, and paths relative to the config file."""

import gzip
import json
from pathlib import Path

import datasets
import pytest

from ciders.config import load_config
from ciders.errors import CidersError, ConfigError
from ciders.models.load import byte_tokenizer
from ciders.tasks import federated, sources
from ciders.tasks.partition import partition
from ciders.tasks.text import IGNORE, tokenize

ROOT = Path(__file__).resolve().parents[2]
SLICE = ROOT / "data" / "gsm8k-slice"
# a minimal ChatML template, as instruct models ship (the byte tokenizer of the tiny models has none)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _rows(n=12, start=0):
    return [json.loads(x) for x in (SLICE / "public.jsonl").read_text().splitlines()[start:start + n]]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".json", ".csv", ".tsv", ".parquet"])
def test_every_file_kind_reads_the_same_records(tmp_path, suffix):
    rows = _rows()
    p = tmp_path / f"d{suffix}"
    ds = datasets.Dataset.from_list(rows)
    if suffix == ".jsonl":
        ds.to_json(str(p), lines=True)
    elif suffix == ".jsonl.gz":
        p.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    elif suffix == ".json":
        p.write_text(json.dumps(rows))
    elif suffix == ".csv":
        ds.to_csv(str(p), index=False)
    elif suffix == ".tsv":
        ds.to_csv(str(p), index=False, sep="\t")
    else:
        ds.to_parquet(str(p))
    got, rep = sources.read(str(p))
    assert got == rows and rep.records == len(rows)
    ex, _ = sources.load_examples(p)
    assert [e.prompt for e in ex] == [f"Question: {r['question'].strip()}\nAnswer:" for r in rows]


def test_a_parquet_file_is_not_read_as_json_lines(tmp_path):
    p = tmp_path / "d.parquet"
    datasets.Dataset.from_list(_rows(3)).to_parquet(str(p))
    assert sources.parse(str(p)).kind == "file"
    assert len(sources.read(str(p))[0]) == 3  # a jsonl reader would count 0 usable lines


def test_hub_ids_parse_and_fail_cleanly_offline(monkeypatch):
    s = sources.parse("openai/gsm8k:main@test")
    assert (s.kind, s.where, s.config, s.split) == ("hub", "openai/gsm8k", "main", "test")
    assert sources.parse("hub:org/name").split == "train"
    assert sources.parse("databricks/databricks-dolly-15k").kind == "hub"
    with pytest.raises(CidersError, match="neither an existing file nor a hub dataset id"):
        sources.parse("a/b/c")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(CidersError, match=r"cannot load hub:no-such-org/no-such-set@train from the Hugging Face hub: "
                                          r"offline"):
        sources.read("no-such-org/no-such-set")


def test_a_missing_file_says_what_is_there(tmp_path):
    (tmp_path / "clients.jsonl").write_text("{}\n")
    with pytest.raises(CidersError, match="did you mean .*clients.jsonl"):
        sources.check(str(tmp_path / "client.jsonl"))
    (tmp_path / "d.xlsx").write_text("x")
    with pytest.raises(CidersError, match="unknown suffix"):
        sources.check(str(tmp_path / "d.xlsx"))


def test_malformed_json_lines_are_still_counted_not_fatal(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n{broken\n" + json.dumps([1]) + "\n")
    rows, rep = sources.read(str(p))
    assert len(rows) == 1 and rep.records == 3
    assert dict(rep.skipped) == {"invalid JSON": 1, "not a JSON object": 1}


def test_prompt_completion_renamed_fields_and_chat_messages(tmp_path):
    p = tmp_path / "pc.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in [{"prompt": "2+2=", "completion": " 4"},
                                                         {"prompt": "3+3=", "completion": "  "}]))
    recs = sources.load_records(str(p))
    assert [(e.prompt, e.response) for e in recs.examples] == [("2+2=", " 4")]  # verbatim
    assert dict(recs.report.skipped) == {"empty response": 1}
    q = tmp_path / "own.csv"
    datasets.Dataset.from_list([{"q": "Capital of France?", "a": "Paris", "topic": "geo"}]).to_csv(str(q), index=False)
    r = sources.load_records(str(q), keys=("q", "a"), label="topic")
    assert (r.examples[0].prompt, r.examples[0].response, r.labels) == ("Capital of France?", "Paris", ["geo"])
    r = sources.load_records(str(q), fmt="gsm8k", keys=("q", "a"))  # renamed onto a known format's fields
    assert r.examples[0].prompt == "Question: Capital of France?\nAnswer:"
    c = tmp_path / "chat.jsonl"
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
            {"role": "assistant", "content": "Hello."}]
    c.write_text(json.dumps({"messages": conv}) + "\n" + json.dumps({"messages": conv[:2]}) + "\n")
    r = sources.load_records(str(c))
    assert len(r.examples) == 1 and r.report.skipped == {"messages: the last turn is not the assistant's": 1}
    tok = byte_tokenizer()
    with pytest.raises(CidersError, match="need a tokenizer with a chat template"):
        tokenize(r.examples, tok, 256)
    tok.chat_template = CHATML
    (f,) = tokenize(r.examples, tok, 256)
    text = tok.decode(f["input_ids"])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"
                    "<|im_start|>assistant\nHello.<|im_end|>\n")
    learned = tok.decode([t for t in f["labels"] if t != IGNORE])
    assert learned == "Hello.<|im_end|>\n"  # the response and the template's end of turn, nothing of the prompt


def test_template_chat_wraps_any_format_as_one_user_turn():
    tok = byte_tokenizer()
    tok.chat_template = CHATML
    r = sources.load_records(str(SLICE / "public.jsonl"), limit=1, template="chat")
    (f,) = tokenize(r.examples, tok, 2048)
    q = _rows(1)[0]["question"].strip()
    assert tok.decode(f["input_ids"]).startswith(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")


def _custom(tmp_path, *overrides, clients_rows=None):
    d = tmp_path / "d"
    d.mkdir(exist_ok=True)
    if clients_rows is not None:
        (d / "clients.jsonl").write_text("".join(json.dumps(r) + "\n" for r in clients_rows))
    cfg_path = tmp_path / "cfg" / "exp.yaml"
    cfg_path.parent.mkdir(exist_ok=True)
    cfg_path.write_text(f"model: {{name: tiny-qwen2}}\ndata:\n  public: {SLICE}/public.jsonl\n  eval: {SLICE}/eval.jsonl\n"
                        f"  clients: ../d/clients.jsonl\n  public_limit: 8\n  eval_limit: 4\n")
    return load_config(cfg_path, list(overrides))


def _labelled_rows():
    """The first 10 rows of three personalization domains: the vendored slice (data/personalization-slice)."""
    rows = []
    for dom in ("finance", "medical", "general"):
        lines = ROOT / "data" / "personalization-slice" / f"{dom}.jsonl"
        rows += [{**json.loads(x), "domain": dom} for x in lines.read_text().splitlines()[:10]]
    return rows


@pytest.mark.full_data
def test_vendored_personalization_slice_is_a_verbatim_prefix_of_the_shared_files():
    from helpers import shared

    for dom in ("finance", "medical", "general"):
        with open(shared("personalization", f"{dom}.jsonl"), "rb") as f:
            head = [f.readline() for _ in range(10)]
        assert (ROOT / "data" / "personalization-slice" / f"{dom}.jsonl").read_bytes() == b"".join(head), dom


def test_custom_data_uses_the_label_based_partitioners(tmp_path):
    rows = _labelled_rows()
    with pytest.raises(ConfigError, match="needs data.label_key"):
        _custom(tmp_path, "federation.partition=natural", clients_rows=rows)
    cfg = _custom(tmp_path, "federation.partition=natural", "data.label_key=domain", clients_rows=rows)
    data = federated.build(cfg, byte_tokenizer())
    assert data.client_label == {"client0": "finance", "client1": "general", "client2": "medical"}
    assert [h["labels"] for h in data.info["split"]["histograms"]] == [{"finance": 10}, {"general": 10}, {"medical": 10}]
    cfg = _custom(tmp_path, "federation.partition=dirichlet", "data.label_key=domain", "federation.dirichlet_alpha=0.1",
                  clients_rows=rows)
    info = federated.build(cfg, byte_tokenizer()).info["split"]
    assert info["partition"] == "dirichlet" and info["label_skew"] > 0.2
    assert sum(h["size"] for h in info["histograms"]) == 30


def test_custom_iid_split_is_flwr_datasets_iid_partitioner(tmp_path):
    rows = _rows(30, start=100)
    cfg = _custom(tmp_path, "federation.holdout=0", "data.max_length=4096", clients_rows=rows)  # bytes: no truncation
    data = federated.build(cfg, byte_tokenizer())
    want = partition([None] * 30, 3, "iid", seed=cfg.seed)
    tok = byte_tokenizer()
    for i, idx in enumerate(want):
        expect = [f"Question: {rows[j]['question'].strip()}\nAnswer:" for j in idx]
        got = [tok.decode([t for t, lab in zip(f["input_ids"], f["labels"]) if lab == IGNORE]) for f in
               data.train[f"client{i}"]]
        assert sorted(got) == sorted(expect)


def test_paths_in_a_config_are_relative_to_the_file(tmp_path, monkeypatch):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.jsonl").write_text("{}\n")
    cfg_path = tmp_path / "cfg" / "exp.yaml"
    cfg_path.parent.mkdir()
    cfg_path.write_text("model: {name: ../models/mine}\ndata:\n  public: ../d/x.jsonl\n  eval: ${CIDERS_DATA}/e.jsonl\n"
                        "  clients: openai/gsm8k:main@train\n")
    (tmp_path / "models" / "mine").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(cfg_path, ["data.client_files=[mine.jsonl]"])
    assert cfg.data.public == str(tmp_path / "d" / "x.jsonl")
    assert cfg.model.name == str(tmp_path / "models" / "mine")
    assert cfg.data.eval == "${CIDERS_DATA}/e.jsonl"  # expanded when read, from the environment
    assert cfg.data.clients == "openai/gsm8k:main@train"  # a hub id, not a path
    assert cfg.data.client_files == (str(elsewhere / "mine.jsonl"),)  # --set: relative to where it was typed
    assert load_config(cfg_path).model.name == str(tmp_path / "models" / "mine")


def test_a_mistyped_data_path_fails_before_the_model_loads(tmp_path, monkeypatch):
    from ciders.cli import main
    from ciders.models import load

    def boom(*a, **k):
        raise AssertionError("the model was loaded before the data paths were checked")

    monkeypatch.setattr(load, "load_model", boom)
    cfg = tmp_path / "exp.yaml"
    cfg.write_text(f"model: {{name: tiny-qwen2}}\ndata:\n  public: {SLICE}/public.jsonl\n  eval: {SLICE}/evl.jsonl\n"
                   f"  clients: {SLICE}/clients.jsonl\n")
    assert main(["run", str(cfg), "--out", str(tmp_path / "r")]) == 2
    assert main(["distill", str(cfg), "--out", str(tmp_path / "r2")]) == 2


def test_a_mistyped_model_name_fails_at_once_offline(monkeypatch):
    from ciders.models import load

    monkeypatch.setattr(load, "hub_reachable", lambda timeout=2.0: False)
    with pytest.raises(ConfigError, match=r"model.name 'smolm2-135m': .*offline.*did you mean 'smollm2-135m'"):
        load.load_model("smolm2-135m")
    with pytest.raises(ConfigError, match="no such local path"):
        load.load_config("./nowhere/model")
    load.check_model_name("tiny-llama")  # built-in names pass without the hub
