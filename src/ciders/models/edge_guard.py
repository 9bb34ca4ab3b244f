"""What an edge client checks before it builds anything from what the server sent (docs/security.md#edge-first-contact).

The spec's `config.json` alone decides how much memory the client allocates (AdapEmu's placeholder weights are
built from it before the first broadcast), so a 2 KB config could claim a 64 GiB model. `check_config` builds the
model it describes on the meta device (shapes only, no storage), refuses it over MAX_EDGE_PARAMS parameters and,
when weights came with it, unless every parameter it implies is one of them with the same shape. The tokenizer's
chat template is code from the server too: `bound_chat_template` makes each render stop after MAX_TEMPLATE_STEPS
template lines or MAX_TEMPLATE_SECONDS, so a template with a 10^10-step loop is an error instead of a hang.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from pathlib import Path

from ciders.errors import PayloadError

# SmolLM2-135M's AdapEmu has ~0.1e9 parameters and Qwen2.5-3B's full model 3.1e9: 4e9 fits every edge model we run
# while refusing a config that claims tens of GiB. A node made for a larger model raises it with PARAMS_ENV.
MAX_EDGE_PARAMS = 4 * 10**9
PARAMS_ENV = "CIDERS_EDGE_MAX_PARAMS"
MAX_EDGE_LAYERS = 512  # building the meta model costs Python objects per layer; no edge model comes near
# a chat template renders one conversation in a few hundred lines per message; Python runs ~10^6 traced lines a second
MAX_TEMPLATE_STEPS = 2_000_000
MAX_TEMPLATE_SECONDS = 10.0
_TEMPLATE_FILE = "<template>"  # the file name jinja2 compiles a template from a string under


def max_edge_params() -> int:
    raw = os.environ.get(PARAMS_ENV)
    if raw is None:
        return MAX_EDGE_PARAMS
    try:
        return int(raw)
    except ValueError:
        raise PayloadError(f"{PARAMS_ENV}={raw[:32]!r} is not an integer (a number of parameters)") from None


def implied_params(config: dict) -> dict[str, tuple[int, ...]]:
    """name -> shape of every parameter `config` (a parsed config.json) implies, tied ones once, from the model
    built on the meta device: the same names `from_pretrained` loads and `save_edge_weights` writes."""
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    layers = config.get("num_hidden_layers")
    if not isinstance(layers, int) or not 0 < layers <= MAX_EDGE_LAYERS:
        raise PayloadError(f"edge spec: config.json's num_hidden_layers={str(layers)[:32]} is not in 1 .. "
                           f"{MAX_EDGE_LAYERS} (MAX_EDGE_LAYERS)")
    try:
        conf = CONFIG_MAPPING[config["model_type"]].from_dict(config)
        with torch.device("meta"):  # shapes without storage: nothing of the claimed size is allocated
            model = AutoModelForCausalLM.from_config(conf, trust_remote_code=False)
    except Exception as exc:  # an unknown model_type or values transformers refuses: one line naming it
        msg = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise PayloadError(f"edge spec: cannot build config.json's model: {type(exc).__name__}: {msg}") from exc
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def check_config(config: dict, received: dict[str, tuple[int, ...]] | None = None) -> dict[str, tuple[int, ...]]:
    """The parameters `config` implies (`implied_params`), refused over `max_edge_params()` or, with `received`
    (name -> shape of the weights that came with it), unless they are exactly those: a config cannot claim more
    than what was sent. Raises PayloadError naming the field, the claimed value and the limit."""
    shapes = implied_params(config)
    total, limit = sum(math.prod(s) for s in shapes.values()), max_edge_params()
    if total > limit:
        name, shape = max(shapes.items(), key=lambda kv: math.prod(kv[1]))
        raise PayloadError(f"edge spec: config.json implies {total:,} parameters, over the limit of {limit:,} "
                           f"(MAX_EDGE_PARAMS; a node raises it with {PARAMS_ENV}): the largest, {name} {list(shape)}, "
                           f"comes from {_fields(config, shape)}")
    if received is not None:
        _match(shapes, received)
    return shapes


def _fields(config: dict, shape: tuple[int, ...]) -> str:
    """The config fields a shape's dimensions equal ("vocab_size=268435456, hidden_size=64")."""
    named = [f"{k}={v}" for d in dict.fromkeys(shape) for k, v in config.items() if type(v) is int and v == d]
    return ", ".join(named[:6]) or f"dimensions {list(shape)}"


def _match(shapes: dict[str, tuple[int, ...]], received: dict[str, tuple[int, ...]]) -> None:
    missing, extra = sorted(shapes.keys() - received.keys()), sorted(received.keys() - shapes.keys())
    wrong = sorted(k for k in shapes.keys() & received.keys() if tuple(received[k]) != shapes[k])
    if missing or extra or wrong:
        first = (f"{wrong[0]} is {list(shapes[wrong[0]])} in config.json, {list(received[wrong[0]])} received"
                 if wrong else f"missing {missing[:3]}, unexpected {extra[:3]}")
        raise PayloadError(f"edge spec: config.json does not match the weights received ({len(missing)} missing, "
                           f"{len(extra)} unexpected, {len(wrong)} of another shape; {first})")


def stored_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of the tensors in a safetensors file, from its header only (no tensor is read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as exc:  # a torn or foreign file: say which
        raise PayloadError(f"cannot read the tensor shapes of {path}: {str(exc).splitlines()[0][:200]}") from exc


# ------------------------------------------------------------------------------------------- chat templates


def bound_chat_template(tok):
    """`tok` with every `apply_chat_template` render bounded (`template_budget`); returns it. transformers renders
    in jinja2's sandbox, which stops attribute access but not a long loop, so this wraps the one entry point."""
    render = tok.apply_chat_template

    @functools.wraps(render)
    def bounded(*args, **kwargs):
        with template_budget():
            return render(*args, **kwargs)

    tok.apply_chat_template = bounded
    return tok


class template_budget:
    """A context in which template code (frames compiled from `<template>`) may run MAX_TEMPLATE_STEPS lines
    for MAX_TEMPLATE_SECONDS; past either, and on the sandbox's own refusals, a one-line PayloadError."""

    def __init__(self, steps: int = MAX_TEMPLATE_STEPS, seconds: float = MAX_TEMPLATE_SECONDS):
        self.steps, self.left, self.seconds = steps, steps, seconds

    def __enter__(self):
        self.deadline, self.previous = time.monotonic() + self.seconds, sys.gettrace()
        sys.settrace(self._call)  # this thread only: a render runs in the caller's thread
        return self

    def __exit__(self, kind, exc, tb):
        sys.settrace(self.previous)
        import jinja2

        if kind is not None and issubclass(kind, (jinja2.TemplateError, OverflowError, RecursionError)):
            raise PayloadError(f"the edge spec's chat template failed: {kind.__name__}: "
                               f"{str(exc).splitlines()[0][:200] if str(exc) else ''}") from exc
        return False

    def _call(self, frame, event, arg):
        return self._line if frame.f_code.co_filename == _TEMPLATE_FILE else None  # other code runs untraced

    def _line(self, frame, event, arg):
        self.left -= 1  # every line event, so a loop's empty body counts too
        if self.left < 0 or (self.left % 4096 == 0 and time.monotonic() > self.deadline):
            raise PayloadError(f"the edge spec's chat template ran over its bound ({self.steps:,} steps "
                               f"or {self.seconds:g} s per render): refused")
        return self._line
