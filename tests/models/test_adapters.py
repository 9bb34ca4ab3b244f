import json

import pytest
import torch

from ciders.errors import CidersError
from ciders.models.decompose import decompose
from ciders.models.load import build_tiny, load_model
from helpers import ARCHS, randomize_lora


def tiny(name, **kw):
    return decompose(load_model(name), 2, **{"drop_ratio": 0.5, **kw})


@pytest.mark.parametrize("name", ARCHS)
def test_state_get_set_roundtrip(name):
    d = tiny(name)
    randomize_lora(d)
    m, s = d.messenger_state(), d.student_state()
    assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in m)
    # messenger keys use ORIGINAL layer indices; student keys AdapEmu's 0..n'-1
    assert {int(k.split(".")[2]) for k in m} == set(d.split.messenger_indices)
    assert {int(k.split(".")[2]) for k in s} == set(range(d.split.student_layers))
    m0 = {k: v.clone() for k, v in m.items()}
    m[next(iter(m))].add_(1.0)  # the state is a copy, not a view
    assert torch.equal(d.messenger_state()[next(iter(m))], m0[next(iter(m))])
    d2 = tiny(name)
    d2.load_messenger(m0)
    d2.load_student(s)
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(d2.adapemu(ids).logits, d.adapemu(ids).logits)


def test_bad_state_is_rejected_and_changes_nothing():
    d = tiny("tiny-qwen2")
    randomize_lora(d)
    before = d.messenger_state()
    for mutate, match in [
        (lambda s: s.pop(next(iter(s))), "1 missing"),
        (lambda s: s.__setitem__("model.layers.9.x.lora_A.weight", torch.zeros(1)), "1 unexpected"),
        (lambda s: s.__setitem__(next(iter(s)), torch.zeros(3, 3)), "has shape"),
        (lambda s: s.__setitem__(list(s)[-1], torch.full_like(s[list(s)[-1]], float("nan"))), "NaN"),
        (lambda s: s.__setitem__(next(iter(s)), s[next(iter(s))].long()), "floating point"),
    ]:
        bad = {k: torch.randn_like(v) for k, v in before.items()}
        mutate(bad)
        with pytest.raises(CidersError, match=match):
            d.load_messenger(bad)
        after = d.messenger_state()
        assert all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("name", ARCHS)
def test_saved_messenger_loads_with_peft_onto_the_original_model(name, tmp_path):
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    d = tiny(name)
    randomize_lora(d)
    d.save_messenger(tmp_path / "messenger")
    cfg = json.loads((tmp_path / "messenger" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 16
    pm = PeftModel.from_pretrained(build_tiny(name, seed=0), str(tmp_path / "messenger")).eval()
    lora_layers = {int(n.split(".")[4]) for n, m in pm.named_modules() if isinstance(m, LoraLayer)}
    assert lora_layers == set(d.split.messenger_indices)
    ids = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(pm(ids).logits, d.adapfu(ids).logits, atol=1e-5, rtol=1e-5)


def test_student_peft_roundtrip_and_checks(tmp_path):
    d = tiny("tiny-llama")
    randomize_lora(d)
    d.save_student(tmp_path / "student")
    d.save_messenger(tmp_path / "messenger")
    d2 = tiny("tiny-llama")
    st = d2.read_adapter(tmp_path / "student", "student")
    assert all(torch.equal(st[k], v) for k, v in d.student_state().items())
    with pytest.raises(CidersError, match="this is a messenger adapter"):
        d2.read_adapter(tmp_path / "messenger", "student")
    other = decompose(load_model("tiny-llama"), 2, drop_ratio=0.25)  # 3 student layers, not 2
    with pytest.raises(CidersError, match="saved for split"):
        other.read_adapter(tmp_path / "student", "student")
    (tmp_path / "student" / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CidersError, match="unreadable adapter file"):
        d2.read_adapter(tmp_path / "student", "student")
    with pytest.raises(CidersError, match="no adapter_model.safetensors"):
        d2.read_adapter(tmp_path, "student")


def test_save_is_atomic_and_replaces(tmp_path):
    d = tiny("tiny-qwen2")
    p = tmp_path / "m"
    d.save_messenger(p)
    randomize_lora(d)
    d.save_messenger(p)
    d2 = tiny("tiny-qwen2")
    got = d2.read_adapter(p, "messenger")
    assert all(torch.equal(got[k], v) for k, v in d.messenger_state().items())
    assert [x.name for x in tmp_path.iterdir()] == ["m"]  # no temporary leftovers


def test_functional_call_names_drive_every_path():
    """`param_names` maps canonical keys to each model's parameter names, so algorithms can evaluate
    a messenger state functionally (torch.func.functional_call) without loading it."""
    from torch.func import functional_call

    d = tiny("tiny-llama")
    randomize_lora(d)
    other = {k: torch.randn_like(v) * 0.1 for k, v in d.messenger_state().items()}
    ids = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        got = {}
        for label, model in (("emu", d.adapemu), ("fu", d.adapfu)):
            names = d.param_names("messenger", model)
            assert set(names) == set(other)
            got[label] = functional_call(model, {names[k]: v for k, v in other.items()}, (ids,)).logits
        d.load_messenger(other)
        torch.testing.assert_close(got["emu"], d.adapemu(ids).logits)
        torch.testing.assert_close(got["fu"], d.adapfu(ids).logits)
    names = d.param_names("student", d.adapemu)
    assert set(names) == set(d.student_state()) and all(".student." in n for n in names.values())
