"""The edge model (models.edge, models.edge_spec): AdapEmu rebuilt from the spec and the emulator weights alone
is the server's AdapEmu (same keys, same outputs bit for bit), and a spec from the network is checked before
anything is written."""

import json
import math
import sys
import time

import pytest
import torch

from ciders.config import LoraConfig
from ciders.core.wire import PayloadError
from ciders.errors import CidersError
from ciders.models import edge, edge_guard as guard, edge_spec as es
from ciders.models.decompose import decompose
from ciders.models.load import byte_tokenizer, load_model
from helpers import ARCHS, randomize_lora


def server(name):
    d = decompose(load_model(name, device="cpu", dtype="float32"), 2, drop_ratio=0.5, seed=3, model_name=name)
    randomize_lora(d)
    return d


def edge_from(d, directory):
    files = edge.edge_spec(d, byte_tokenizer())
    es.write_spec(directory, files)
    model, loaded = edge.load_edge(directory, torch.device("cpu"), torch.float32)
    return edge.edge_decompose(model, es.split_of(es.check_spec(files)), LoraConfig(), LoraConfig(), seed=3), loaded


@pytest.mark.parametrize("name", ARCHS)
def test_the_edge_model_is_the_servers_adapemu(name, tmp_path):
    d = server(name)
    e, loaded = edge_from(d, tmp_path / "edge")
    assert not loaded  # no weights yet: placeholders until the first broadcast
    assert e.messenger_state().keys() == d.messenger_state().keys()  # the ORIGINAL model's layer indices
    assert e.student_state().keys() == d.student_state().keys()
    assert e.emulator_base_state().keys() == d.emulator_base_state().keys()
    e.load_emulator_base(d.emulator_base_state())
    edge.save_edge_weights(e, tmp_path / "edge")
    model, loaded = edge.load_edge(tmp_path / "edge", torch.device("cpu"), torch.float32)
    e = edge.edge_decompose(model, d.split, LoraConfig(), LoraConfig(), seed=3)
    assert loaded
    e.load_messenger(d.messenger_state())
    e.load_student(d.student_state())
    ids = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(ids)
    with torch.no_grad():
        assert torch.equal(e.adapemu(ids).logits, d.adapemu(ids).logits)
        h = d.backbone_hidden(ids, am)
        assert torch.equal(e.backbone_hidden(ids, am), h)
        assert torch.equal(e.messenger_top(inputs_embeds=h, attention_mask=am).logits,
                           d.messenger_top(inputs_embeds=h, attention_mask=am).logits)
    conf = json.loads((tmp_path / "edge" / "config.json").read_text())
    assert conf["num_hidden_layers"] == d.split.edge_layers < d.split.n_layers
    with pytest.raises(CidersError, match="no full model"):
        e.adapfu  # noqa: B018


def test_the_messenger_keys_follow_the_original_layers(tmp_path):
    d = server("tiny-qwen2")
    e, _ = edge_from(d, tmp_path / "edge")
    n_s, first = d.split.student_layers, d.split.teacher_layers
    for k, p in e.messenger_params().items():  # edge layer n'+j holds base layer n-a+j
        layer = int(k.split(".")[2])
        edge_layer = next(int(n.split(".")[2]) for n, q in e.adapemu.named_parameters() if q is p)
        assert layer - first == edge_layer - n_s and layer >= first


def _spec():
    return edge.edge_spec(server("tiny-qwen2"), byte_tokenizer())


@pytest.mark.parametrize("attack, match", [
    (lambda f: {**f, "modeling_evil.py": b"import os"}, "unexpected file"),
    (lambda f: {**f, "../../etc/passwd": b"x"}, "unexpected file"),
    (lambda f: {k: v for k, v in f.items() if k != "config.json"}, "config.json missing"),
    (lambda f: {**f, "tokenizer.json": b"x" * (es.MAX_SPEC_BYTES + 1)}, "at most"),
    (lambda f: {**f, "config.json": "{}"}, "must be bytes"),
    (lambda f: {**f, es.META: json.dumps({**json.loads(f[es.META]), "student_indices": [9, 1]}).encode()},
     "inconsistent split"),
    (lambda f: {**f, "config.json": json.dumps({**json.loads(f["config.json"]), "num_hidden_layers": 6}).encode()},
     "B_L \\+ messenger"),
    (lambda f: {**f, "config.json": b"[" * 100 + b"]" * 100}, "nested deeper"),
])
def test_a_hostile_spec_is_refused_and_nothing_is_written(attack, match, tmp_path):
    bad = attack(_spec())
    with pytest.raises(PayloadError, match=match):
        es.write_spec(tmp_path / "edge", bad)
    assert not (tmp_path / "edge").exists()


def test_the_setup_message_is_checked_before_it_is_stored(tmp_path):
    from ciders.transports.flower.edge_phase import setup as _setup

    files = _spec()
    names = sorted(files)
    msg = {"kind": "setup", "sha": es.spec_digest(files), "names": names,
           **{f"file{i}": files[n] for i, n in enumerate(names)}}
    with pytest.raises(PayloadError, match="digest"):
        _setup({**msg, "sha": "0" * 64}, "client0", tmp_path)
    assert es.held_digest(tmp_path / "edge") == ""
    with pytest.raises(PayloadError, match="file names"):
        _setup({**msg, "names": "config.json"}, "client0", tmp_path)
    assert _setup(msg, "client0", tmp_path) == {"client_id": "client0", "edge": es.spec_digest(files)}
    assert es.held_digest(tmp_path / "edge") == es.spec_digest(files)


# ------------------------------------------------------------------ first contact: sizes and templates (issue 34)


def _with_config(files, **changes):
    return {**files, "config.json": json.dumps({**json.loads(files["config.json"]), **changes}).encode()}


def _setup_msg(files):
    names = sorted(files)
    return {"kind": "setup", "sha": es.spec_digest(files), "names": names,
            **{f"file{i}": files[n] for i, n in enumerate(names)}}


def _peak_mib():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


HUGE_VOCAB = 2**28  # with hidden_size 64: 2**34 float32 parameters, 64 GiB, from a 2 KB config.json


def test_a_config_claiming_a_huge_vocabulary_is_refused_at_setup_without_allocating(tmp_path):
    from ciders.transports.flower.edge_phase import setup as _setup

    files = _with_config(_spec(), vocab_size=HUGE_VOCAB)
    assert len(files["config.json"]) < 4096
    peak, t0 = _peak_mib(), time.monotonic()
    with pytest.raises(PayloadError, match=f"over the limit of {guard.MAX_EDGE_PARAMS:,}.*vocab_size={HUGE_VOCAB}"):
        _setup(_setup_msg(files), "client0", tmp_path)
    assert time.monotonic() - t0 < 5 and _peak_mib() - peak < 512  # refused from shapes, nothing materialized
    assert es.held_digest(tmp_path / "edge") == ""  # and not stored


def test_a_stored_config_over_the_limit_is_refused_before_the_placeholder_model(tmp_path):
    es.write_spec(tmp_path / "edge", _with_config(_spec(), vocab_size=HUGE_VOCAB))  # e.g. stored by an older client
    peak, t0 = _peak_mib(), time.monotonic()
    with pytest.raises(PayloadError, match=f"vocab_size={HUGE_VOCAB}"):
        edge.load_edge(tmp_path / "edge", torch.device("cpu"), torch.float32)
    assert time.monotonic() - t0 < 5 and _peak_mib() - peak < 512


def test_the_limit_is_the_nodes_own(tmp_path, monkeypatch):
    files = _spec()
    shapes = guard.check_config(json.loads(files["config.json"]))
    monkeypatch.setenv(guard.PARAMS_ENV, str(sum(math.prod(s) for s in shapes.values()) - 1))
    with pytest.raises(PayloadError, match="over the limit"):
        guard.check_config(json.loads(files["config.json"]))


def _drop_last_layer(directory):
    from safetensors.torch import load_file, save_file

    state = load_file(str(directory / es.WEIGHTS))
    last = max(int(k.split(".")[2]) for k in state if k.startswith("model.layers."))
    kept = {k: v for k, v in state.items() if not k.startswith(f"model.layers.{last}.")}
    save_file(kept, str(directory / es.WEIGHTS))


def _grow_vocab(directory):
    conf = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**conf, "vocab_size": conf["vocab_size"] * 4}))


@pytest.mark.parametrize("tamper, match", [(_drop_last_layer, r"[1-9]\d* missing, 0 unexpected.*model\.layers\."),
                                           (_grow_vocab, r"embed_tokens.weight is \[1280, 64\] in config.json, "
                                                         r"\[320, 64\] received")])
def test_a_config_unlike_the_weights_it_came_with_is_refused(tamper, match, tmp_path):
    d = server("tiny-qwen2")
    e, _ = edge_from(d, tmp_path / "edge")
    edge.save_edge_weights(e, tmp_path / "edge")
    tamper(tmp_path / "edge")
    with pytest.raises(PayloadError, match=f"does not match the weights received.*({match})"):
        edge.load_edge(tmp_path / "edge", torch.device("cpu"), torch.float32)


def test_an_honest_config_implies_exactly_the_emulator_weights(tmp_path):
    d = server("tiny-qwen2")
    e, _ = edge_from(d, tmp_path / "edge")
    path = edge.save_edge_weights(e, tmp_path / "edge")
    conf = json.loads((tmp_path / "edge" / "config.json").read_text())
    assert guard.check_config(conf, guard.stored_shapes(path)) == {
        k.replace(".base_layer.", "."): tuple(v.shape) for k, v in d.emulator_base_state().items()}
    assert edge.load_edge(tmp_path / "edge", torch.device("cpu"), torch.float32)[1]


@pytest.mark.parametrize("template, match", [
    ("{% for i in range(10**10) %}x{% endfor %}", "Range too big"),  # jinja2's sandbox refuses it; one line now
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "ran over its bound"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
])
def test_a_hostile_chat_template_is_refused_within_seconds(template, match):
    tok = guard.bound_chat_template(byte_tokenizer())
    tok.chat_template = template
    before, t0 = sys.gettrace(), time.monotonic()
    with pytest.raises(PayloadError, match=f"chat template .*{match}") as info:
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert time.monotonic() - t0 < 5 and "\n" not in str(info.value)
    assert sys.gettrace() is before  # the tracer is gone: later code runs at full speed


def test_an_honest_chat_template_renders_as_before():
    template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|eos|>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    plain, bounded = byte_tokenizer(), guard.bound_chat_template(byte_tokenizer())
    plain.chat_template = bounded.chat_template = template
    conv = [{"role": r, "content": f"turn {i}"} for i in range(200) for r in ("user", "assistant")]
    for gen in (False, True):
        assert (bounded.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
                == plain.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen))
