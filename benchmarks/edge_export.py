"""The exported edge model on the device: file sizes, export time, and greedy decoding speed with a KV cache in
PyTorch (AdapEmu) against onnxruntime (the ONNX export), measured side by side in one run, with the agreement of
their tokens. The default model is SmolLM2-135M (2 messenger layers, drop ratio 0.5: 16 layers on the edge).
gguf_* is the f32 GGUF; gguf_f16_* and gguf_q8_0_* the other --gguf-dtype choices.

--json keys: hf_mib, onnx_mib, gguf_mib, gguf_f16_mib, gguf_q8_0_mib, hf_export_s, onnx_export_s, gguf_export_s,
gguf_f16_export_s, gguf_q8_0_export_s, onnx_tok_per_s, torch_tok_per_s, onnx_over_torch_speed, same_tokens

Where llama.cpp's bindings are installed (xllamacpp, as .ci/run installs them) and the tokenizer has BPE merges
(not the tiny --smoke model's), also llama_cpp.{f32,f16,q8_0}: tok_per_s, peak_rss_mib (of a process that loads
only llama.cpp and the GGUF) and same_tokens (against PyTorch).

    python benchmarks/edge_export.py [--model tiny-qwen2] [--new-tokens 64] [--json] [--smoke]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, also when imported from elsewhere
from common import SMOKE_MODEL, add_output_flags, emit, smoke  # noqa: E402


def _mib(paths) -> float:
    return sum(p.stat().st_size for p in paths if p.is_file()) / 2**20


GGUF_DTYPES = ("f32", "f16", "q8_0")
# llama.cpp in a process of its own, so that its peak RSS is llama.cpp's and not torch's: a warm-up, then n greedy
# tokens (EOS ignored, as PyTorch's min_new_tokens does) timed like the other backends, prefill included;
# llama.cpp's own defaults otherwise (F16 KV cache, flash attention on CPU), as a device would run it
LLAMA_CPP_RUN = r"""
import json, re, sys, time
import xllamacpp as xlc
path, ids, n, threads = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
p = xlc.CommonParams()
p.model.path, p.n_ctx, p.n_parallel, p.warmup = path, max(512, 2 * (len(ids) + n)), 1, False
p.cpuparams.n_threads = p.cpuparams_batch.n_threads = threads
s = xlc.Server(p)
req = {"prompt": ids, "temperature": 0.0, "top_k": 1, "logprobs": 1, "cache_prompt": False, "ignore_eos": True}
s.handle_completions({**req, "max_tokens": 4})
t0 = time.perf_counter()
r = s.handle_completions({**req, "max_tokens": n})
dt = time.perf_counter() - t0
got = [t["id"] for t in r["choices"][0]["logprobs"]["content"]]
# VmHWM, not getrusage's ru_maxrss: that one survives exec and so holds the parent's (torch's) peak
rss = int(re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) / 1024
print(json.dumps({"tokens": got, "s": dt, "peak_rss_mib": rss}))
"""


def llama_cpp(path: Path, ids: list[int], n: int, want: list[int]) -> dict:
    """llama.cpp's greedy decoding speed, peak RSS and token agreement with PyTorch on one GGUF."""
    r = subprocess.run([sys.executable, "-c", LLAMA_CPP_RUN, str(path), json.dumps(ids), str(n),
                        str(torch.get_num_threads())], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"llama.cpp on {path.name} failed: {r.stderr.strip().splitlines()[-1:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    return {"tok_per_s": n / res["s"], "peak_rss_mib": res["peak_rss_mib"],
            "same_tokens": sum(x == y for x, y in zip(res["tokens"], want))}


def _has_merges(tok) -> bool:
    """llama.cpp refuses a BPE vocabulary without merges; the tiny built-in models' byte-level tokenizers have none,
    so --smoke measures no llama.cpp."""
    return bool(json.loads(tok.backend_tokenizer.to_str())["model"].get("merges"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--messenger-layers", type=int, default=2)
    ap.add_argument("--drop-ratio", type=float, default=0.5)
    ap.add_argument("--new-tokens", type=int, default=64)
    a = smoke(add_output_flags(ap).parse_args(argv), model=SMOKE_MODEL, new_tokens=4)

    from ciders.models import load as L
    from ciders.models.decompose import decompose
    from ciders.models.export import export_edge_model
    from ciders.models.onnx_run import EdgeSession

    torch.set_num_threads(max(1, torch.get_num_threads()))
    d = decompose(L.load_model(a.model, dtype="float32"), a.messenger_layers, drop_ratio=a.drop_ratio)
    tok = L.load_tokenizer(a.model)
    root = Path(__file__).resolve().parents[1]
    q = json.loads((root / "data" / "gsm8k-slice" / "eval.jsonl").read_text().splitlines()[0])["question"]
    ids = tok(q, return_tensors="pt").input_ids
    out: dict = {"model": a.model, "edge_layers": d.split.edge_layers, "prompt_tokens": ids.shape[1],
                 "new_tokens": a.new_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        exports = [("hf", "hf", None), ("onnx", "onnx", None)]
        exports += [("gguf" if dt == "f32" else f"gguf_{dt}", "gguf", dt) for dt in GGUF_DTYPES]
        for key, fmt, dtype in exports:
            t0 = time.perf_counter()
            export_edge_model(d, Path(tmp) / key, fmt=fmt, tokenizer=tok, gguf_dtype=dtype or "f32")
            out[f"{key}_export_s"] = time.perf_counter() - t0
            weights = [p for p in (Path(tmp) / key).iterdir() if p.suffix in (".safetensors", ".gguf", ".data", ".onnx")]
            out[f"{key}_mib"] = _mib(weights)
        s = EdgeSession(Path(tmp) / "onnx")
        s.generate(ids[0].tolist(), 4, stop_at_eos=False)  # warm-up
        t0 = time.perf_counter()
        got = s.generate(ids[0].tolist(), a.new_tokens, stop_at_eos=False)
        out["onnx_s"] = time.perf_counter() - t0
        with torch.inference_mode():
            kw = dict(do_sample=False, pad_token_id=tok.pad_token_id)
            d.adapemu.generate(ids, max_new_tokens=4, **kw)
            t0 = time.perf_counter()
            want = d.adapemu.generate(ids, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, **kw)
            out["torch_s"] = time.perf_counter() - t0
        want = want[0, ids.shape[1]:].tolist()
        if importlib.util.find_spec("xllamacpp") is not None and _has_merges(tok):
            out["llama_cpp"] = {dt: llama_cpp(Path(tmp) / ("gguf" if dt == "f32" else f"gguf_{dt}") / "model.gguf",
                                              ids[0].tolist(), a.new_tokens, want) for dt in GGUF_DTYPES}
    out["same_tokens"] = sum(x == y for x, y in zip(got, want))
    out["onnx_tok_per_s"] = a.new_tokens / out["onnx_s"]
    out["torch_tok_per_s"] = a.new_tokens / out["torch_s"]
    out["onnx_over_torch_speed"] = out["onnx_tok_per_s"] / out["torch_tok_per_s"]
    emit(out, a.json, lambda: report(out))
    return 0


def report(out: dict) -> None:
    for k, v in out.items():
        if k == "llama_cpp":
            for dt, r in v.items():
                print(f"llama.cpp {dt:14s} {r['tok_per_s']:.1f} tok/s, peak RSS {r['peak_rss_mib']:.0f} MiB, "
                      f"{r['same_tokens']} tokens as PyTorch's")
        else:
            print(f"{k:24s} {v:.3f}" if isinstance(v, float) else f"{k:24s} {v}")


if __name__ == "__main__":
    raise SystemExit(main())
