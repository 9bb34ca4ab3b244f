"""What the benchmarks share: the model arguments and building a decomposition and real text from them."""

from __future__ import annotations

import argparse
from pathlib import Path

from ciders.models.decompose import decompose
from ciders.models.load import load_model, load_tokenizer
from ciders.tasks.text import load_examples, tokenize

ROOT = Path(__file__).resolve().parents[1]


def parser(doc: str, batch_size: int) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--messenger-layers", type=int, default=2)
    ap.add_argument("--drop-ratio", type=float, default=0.5)
    ap.add_argument("--batch-size", type=int, default=batch_size)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    return ap


def setup(a: argparse.Namespace, data_file: str, examples: int):
    """(decomposition, tokenizer, tokenized examples of the vendored GSM8K slice)."""
    d = decompose(load_model(a.model, device=a.device, dtype=a.dtype), a.messenger_layers, drop_ratio=a.drop_ratio,
                  model_name=a.model)
    tok = load_tokenizer(a.model)
    ex, _ = load_examples(ROOT / "data" / "gsm8k-slice" / data_file, limit=examples)
    return d, tok, tokenize(ex, tok, a.max_length)


def interleaved_medians(fns: dict, repeats: int, sync) -> dict[str, float]:
    """Median seconds of each callable over `repeats` rounds, run interleaved (the order reversed every other round,
    so drift on a noisy machine hits every candidate alike); `sync` waits for the device (a no-op on CPU)."""
    import statistics
    import time

    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(repeats):
        for k in (list(fns) if r % 2 == 0 else list(reversed(fns))):
            sync()
            t0 = time.perf_counter()
            fns[k]()
            sync()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(t) for k, t in times.items()}


def peak_memory_mib(fn, device) -> float:
    """Peak memory while fn() runs, in MiB: on CUDA the allocator's peak; elsewhere the process's peak resident set
    (Linux: /proc/self/clear_refs resets VmHWM to the current RSS first, so the figure is this call's own peak,
    counting whatever the process already held; nan where the kernel offers neither)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        fn()
        return float("nan")
    fn()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_tensor_mib(fn) -> float:
    """Peak bytes of tensor storage that fn() allocates and holds at once (autograd's saved tensors included), in
    MiB, counted op by op under a dispatch mode on any device: RSS cannot show this on CPU, where the allocator
    keeps freed pages resident. An op's output that shares an input's storage (a view, an in-place op) is not new."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    live: dict[int, list[int]] = {}
    cur, peak = [0], [0]

    def release(ptr: int) -> None:
        ent = live.get(ptr)
        if ent is not None:
            ent[1] -= 1
            if ent[1] == 0:
                cur[0] -= ent[0]
                del live[ptr]

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            for t in tree_flatten(out)[0]:
                if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                    continue
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if ptr == 0 or ptr in ins:
                    continue
                if ptr in live:
                    live[ptr][1] += 1
                else:
                    live[ptr] = [st.nbytes(), 1]
                    cur[0] += st.nbytes()
                    peak[0] = max(peak[0], cur[0])
                weakref.finalize(t, release, ptr)
            return out

    with Mode():
        fn()
    return peak[0] / 2**20
