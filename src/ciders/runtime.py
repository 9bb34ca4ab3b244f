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
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key}: {name!r} requested but CUDA is not available here; use device: auto")
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


def derived_seed(*parts: int) -> int:
    """A deterministic 63-bit seed from integers (e.g. run seed, step), stable across processes."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) % (1 << 64)
    return h & ((1 << 63) - 1)
