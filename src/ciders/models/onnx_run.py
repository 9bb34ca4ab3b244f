"""Run an exported ONNX edge model on a device with numpy and onnxruntime only: no PyTorch, no transformers
(docs/edge.md, "ONNX: onnxruntime with a KV cache"). Its tokenizer is the export's tokenizer.json; read it with the `tokenizers`
package (a Rust wheel, no torch).

    from ciders.models.onnx_run import EdgeSession
    s = EdgeSession("edge-onnx/")
    ids = s.generate(prompt_ids, max_new_tokens=64)      # greedy, with the KV cache
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

META = "ciders_export.json"


class EdgeSession:
    def __init__(self, export_dir: str | Path, providers: list[str] | None = None):
        import onnxruntime as ort

        d = Path(export_dir)
        try:
            info = json.loads((d / META).read_text(encoding="utf-8"))["onnx"]
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"{d}: not an ONNX export of `ciders export --format onnx` ({exc})") from exc
        self.info = info
        self.eos = set(json.loads((d / META).read_text(encoding="utf-8")).get("eos_token_ids", []))
        self.session = ort.InferenceSession(str(d / info["graph"]), providers=providers or ["CPUExecutionProvider"])
        self.past_names = info["inputs"][3:]

    def empty_cache(self, batch: int = 1) -> list[np.ndarray]:
        shape = (batch, self.info["kv_heads"], 0, self.info["head_dim"])
        return [np.zeros(shape, np.float32) for _ in self.past_names]

    def step(self, ids: np.ndarray, cache: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        """Logits [batch, seq, vocab] of `ids` [batch, seq] after the cached positions, and the new cache."""
        ids = np.asarray(ids, dtype=np.int64)
        past = cache[0].shape[2]
        total = past + ids.shape[1]
        feeds = {"input_ids": ids, "attention_mask": np.ones((ids.shape[0], total), np.int64),
                 "position_ids": np.broadcast_to(np.arange(past, total, dtype=np.int64), ids.shape).copy()}
        feeds.update(zip(self.past_names, cache))
        out = self.session.run(None, feeds)
        return out[0], out[1:]

    def generate(self, prompt: list[int], max_new_tokens: int = 64, stop_at_eos: bool = True) -> list[int]:
        """Greedy continuation of one prompt (token ids); the new tokens only."""
        logits, cache = self.step(np.asarray([prompt]), self.empty_cache())
        new: list[int] = []
        for _ in range(max_new_tokens):
            tok = int(logits[0, -1].argmax())
            new.append(tok)
            if stop_at_eos and tok in self.eos:
                break
            logits, cache = self.step(np.asarray([[tok]]), cache)
        return new
