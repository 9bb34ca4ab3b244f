"""Device, dtype and seeding helpers. Nothing in ciders hard-codes the CPU: every model path
resolves `device: auto` / `dtype: auto` here."""

from __future__ import annotations

import random

import torch

from ciders.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str = "auto", key: str = "model.device") -> torch.device:
    """`auto` picks CUDA, then Apple MPS, then the CPU (`key` names the config key in errors)."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"{key}: unknown device {name!r} (use auto, cpu, cuda, cuda:N or mps)") from exc
    if dev.type not in ("cpu", "cuda", "mps"):  # torch knows more types (meta, xla, ...); ciders runs on these
        raise ConfigError(f"{key}: unsupported device {name!r} (use auto, cpu, cuda, cuda:N or mps)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key}: {name!r} requested but CUDA is not available here; use device: auto")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"{key}: {name!r} requested but this machine has {torch.cuda.device_count()} CUDA "
                          f"device(s) (cuda:0 .. cuda:{torch.cuda.device_count() - 1})")
    mps = getattr(torch.backends, "mps", None)
    if dev.type == "mps" and not (mps is not None and mps.is_available()):
        raise ConfigError(f"{key}: {name!r} requested but Apple MPS is not available here; use device: auto")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on a CUDA device that supports it (paper scale), float32 elsewhere."""
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise ConfigError(f"model.dtype: unknown dtype {name!r} (use auto, {', '.join(DTYPES)})")
    return DTYPES[name]


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy (when present) and torch (all devices)."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:  # numpy is optional
        pass


# ------------------------------------------------------------------------------------------ seed streams
# Every random draw of the package that is derived from the run seed names its stream here. A stream is a
# purpose (which examples a client sees, which dropout mask, which initial LoRA A), never a magic number:
# derive_seed refuses a name that is not registered, so a typo cannot silently open a new stream.

SEED_STREAMS: frozenset[str] = frozenset({
    # tasks/
    "task-split",           # tasks.registry.split_indices: a named task's public / client / evaluation sets
    "omniglot-shards",      # tasks.omniglot.shard: the character permutation (no key) / client i's draw (key i)
    # models/
    "messenger-lora-init",  # models.decompose: LoRA A of the messenger
    "student-lora-init",    # models.decompose: LoRA A of the learnable backbone B_L
    "takd-order",           # models.distill.sample_indices: the public-data permutation of epoch e (key e)
    "takd-dropout",         # models.distill.distill: LoRA dropout of step s, micro-batch m (keys s, m)
    # federated rounds and workloads
    "client-sampling",      # federation.rundir.sample_clients: the clients of round t (key t)
    "client-batches",       # workloads.llm: a client's data order in round t, epoch e (keys t, ci, e)
    "client-dropout",       # workloads.llm: the dropout seed of client ci's micro-batch j in round t (keys t, ci, j)
    "dp-central-noise",     # core.privacy.noise_generator, dp.noise seeded: the server's noise in round t (key t)
    "dp-local-noise",       # core.privacy.noise_generator, dp.noise seeded: client ci's noise in round t (keys t, ci)
    "eval-split",           # workloads.evaluation: the seeded Dolly evaluation slice
    "synthetic-client",     # tests/synthetic.py: client ci's quadratic (key ci)
    "synthetic-batch",      # tests/synthetic.py: client ci's gradient noise in round t (keys t, ci)
    "bilevel-episodes",     # workloads.bilevel few-shot: client i's episode of round q (keys q, i)
    "bilevel-eval",         # workloads.bilevel few-shot: the held-out evaluation episodes
    "bilevel-init",         # workloads.bilevel: the initial model of a bilevel task
    "bilevel-tune",         # workloads.bilevel few-shot: the tuning split's episodes (task.tune_alphabets)
    "losstune-split",       # workloads.bilevel loss tuning: the permutations dealing train / val to clients
})

_FNV_OFFSET = 1469598103934665603  # FNV-1a's 64-bit basis less its last digit (kept: seeds stay stable)
_FNV_PRIME = 1099511628211
_M64 = (1 << 64) - 1
_M63 = (1 << 63) - 1


def _mix(h: int, part: int) -> int:
    """One FNV-1a step on a 64-bit word. For a fixed `part` it is a bijection of h modulo 2^63 too (xor,
    then multiplication by an odd number; the low 63 bits of the result only depend on the low 63 of h)."""
    return ((h ^ (int(part) & _M64)) * _FNV_PRIME) & _M64


def _stream_state(stream: str) -> int:
    """FNV-1a over the name's UTF-8 bytes, then its byte length (so no name is another's prefix state)."""
    raw = stream.encode("utf-8")
    h = _FNV_OFFSET
    for b in raw:
        h = _mix(h, b)
    return _mix(h, len(raw))


_STREAM_STATES = {s: _stream_state(s) for s in SEED_STREAMS}
if len({h & _M63 for h in _STREAM_STATES.values()}) != len(_STREAM_STATES):  # pragma: no cover - registry bug
    raise RuntimeError("two seed streams hash to the same state; rename one")


def derive_seed(seed: int, stream: str, *keys: int) -> int:
    """A deterministic 63-bit seed for the draws of `stream` (a name in SEED_STREAMS) at integer `keys`
    (round, client, epoch, ...), from the run seed; stable across processes and platforms.

    The hash input is (name bytes, name length, number of keys, seed, keys...), mixed by FNV-1a steps.
    For fixed (seed, keys) every step is a bijection of the state modulo 2^63, and the
    registered names have distinct states (checked at import), so two streams never give the same seed for
    the same (seed, keys); (seed, "a", 1) and (seed, "a", 1, 0) differ in the key count."""
    try:
        h = _STREAM_STATES[stream]
    except (KeyError, TypeError):
        raise ValueError(f"unknown seed stream {stream!r}; register it in ciders.runtime.SEED_STREAMS "
                         f"(known: {', '.join(sorted(SEED_STREAMS))})") from None
    h = _mix(h, len(keys))
    h = _mix(h, seed)
    for k in keys:
        h = _mix(h, k)
    return h & _M63
