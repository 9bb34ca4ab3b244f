"""The edge model (models.edge, models.edge_spec): AdapEmu rebuilt from the spec and the emulator weights alone
is the server's AdapEmu (same keys, same outputs bit for bit), and a spec from the network is checked before
anything is written."""

import json

import pytest
import torch

from ciders.config import LoraConfig
from ciders.core.wire import PayloadError
from ciders.errors import CidersError
from ciders.models import edge, edge_spec as es
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
