"""The exported edge model on the device: file sizes, export time, and greedy decoding speed with a KV cache in
PyTorch (AdapEmu) against onnxruntime (the ONNX export), measured side by side in one run, with the agreement of
their tokens. The default model is SmolLM2-135M (2 messenger layers, drop ratio 0.5: 16 layers on the edge).

--json keys: hf_mib, onnx_mib, gguf_mib, hf_export_s, onnx_export_s, gguf_export_s, onnx_tok_per_s, torch_tok_per_s,
onnx_over_torch_speed, same_tokens

    python benchmarks/edge_export.py [--model tiny-qwen2] [--new-tokens 64] [--json] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, also when imported from elsewhere
from common import SMOKE_MODEL, add_output_flags, emit, smoke  # noqa: E402


def _mib(paths) -> float:
    return sum(p.stat().st_size for p in paths if p.is_file()) / 2**20


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
        for fmt in ("hf", "onnx", "gguf"):
            t0 = time.perf_counter()
            export_edge_model(d, Path(tmp) / fmt, fmt=fmt, tokenizer=tok)
            out[f"{fmt}_export_s"] = time.perf_counter() - t0
            weights = [p for p in (Path(tmp) / fmt).iterdir() if p.suffix in (".safetensors", ".gguf", ".data", ".onnx")]
            out[f"{fmt}_mib"] = _mib(weights)
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
    out["same_tokens"] = sum(x == y for x, y in zip(got, want))
    out["onnx_tok_per_s"] = a.new_tokens / out["onnx_s"]
    out["torch_tok_per_s"] = a.new_tokens / out["torch_s"]
    out["onnx_over_torch_speed"] = out["onnx_tok_per_s"] / out["torch_tok_per_s"]
    emit(out, a.json, lambda: report(out))
    return 0


def report(out: dict) -> None:
    for k, v in out.items():
        print(f"{k:24s} {v:.3f}" if isinstance(v, float) else f"{k:24s} {v}")


if __name__ == "__main__":
    raise SystemExit(main())
