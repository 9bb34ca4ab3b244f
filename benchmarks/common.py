"""What the benchmarks share: the model arguments, building a decomposition and real text from them, and the
`--smoke` / `--json` conventions every benchmark follows:

  --smoke  the built-in tiny model (random weights, offline), one repeat, the smallest sizes: a few seconds, so
           tests/benchmarks/test_benchmark_smoke.py can run every benchmark in the default test suite; its figures
           mean nothing beyond "the benchmark still runs end to end".
  --json   one JSON object on one line, the last line of stdout; the human report then goes to stderr, so stdout
           carries nothing else. The keys a machine may rely on are listed in each module docstring on a line
           `--json keys: a, b.c, rows.*.d` (dotted paths, `*` = every entry of a list or dict), each a finite number
           or a container of finite numbers; the smoke test holds every benchmark to its list.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from ciders.models.decompose import decompose
from ciders.models.load import load_model, load_tokenizer
from ciders.tasks.sources import load_examples
from ciders.tasks.text import tokenize

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
    return add_output_flags(ap)


SMOKE_MODEL = "tiny-qwen2"


def smoke(a: argparse.Namespace, **values) -> argparse.Namespace:
    """Under --smoke, `values` (the tiny model, one repeat, the smallest sizes) replace the arguments."""
    if a.smoke:
        for k, v in values.items():
            setattr(a, k, v)
    return a


def add_output_flags(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.add_argument("--json", action="store_true", help="one JSON object, the last line of stdout (report on stderr)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, one repeat: checks that it runs, in seconds")
    return ap


def emit(res: dict, as_json: bool, report=None) -> None:
    """The human report, then under --json the result as one line. The report goes to stderr under --json so that
    `> file` or a pipe gets exactly one JSON line, while a terminal still shows the table."""
    if report is not None:
        with contextlib.redirect_stdout(sys.stderr if as_json else sys.stdout):
            report()
    if as_json:
        sys.stdout.flush()
        print(json.dumps(res), flush=True)


@contextlib.contextmanager
def smoke_fewshot(smoke_run: bool):
    """Config overrides that run the few-shot task (configs/cpu/rabo_fewshot.yaml) at its smallest on a generated
    stand-in for Omniglot (random binary images in the upstream zips' layout), so its smoke needs no dataset;
    none without --smoke."""
    import tempfile

    if not smoke_run:
        yield []
        return
    with tempfile.TemporaryDirectory() as tmp:
        write_fake_omniglot(Path(tmp))
        yield [f"task.data={tmp}", "task.n_way=2", "task.k_shot=1", "task.q_query=1", "task.width=4",
               "task.shard_size=2", "task.eval_episodes=1", "task.eval_steps=1", "rabo.inner_steps=1",
               "rabo.solver_iters=1"]


def write_fake_omniglot(root: Path, alphabets: int = 2, characters: int = 3, drawings: int = 3) -> None:
    """images_background_small1/2.zip as the loader reads them (<root>/<alphabet>/<character>/<n>.png); the held-out
    zip's alphabets differ from the training one's, as upstream."""
    import io
    import zipfile

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for zname, prefix in (("images_background_small1", "a"), ("images_background_small2", "b")):
        with zipfile.ZipFile(root / f"{zname}.zip", "w") as z:
            for a in range(alphabets):
                for c in range(characters):
                    for n in range(drawings):
                        buf = io.BytesIO()
                        Image.fromarray((rng.random((28, 28)) > 0.2).astype(np.uint8) * 255).save(buf, "PNG")
                        z.writestr(f"{zname}/{prefix}{a}/character{c:02d}/{n}.png", buf.getvalue())


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
