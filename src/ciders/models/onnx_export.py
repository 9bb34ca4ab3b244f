"""ONNX export of a merged edge model, with its KV cache as explicit inputs and outputs (docs/edge.md, "ONNX: onnxruntime with a KV cache").

One graph serves both prefill and decoding. It is traced with the TorchScript exporter in float32 with eager
attention: plain MatMul and Softmax (a traced sdpa gives the same ops plus an IsNaN guard).

  inputs   input_ids       [batch, seq]                         int64
           attention_mask  [batch, past + seq]                  int64 (1 = attend)
           position_ids    [batch, seq]                         int64
           past.{i}.key    [batch, kv_heads, past, head_dim]    float32, i = 0..L-1 (past = 0 at prefill)
           past.{i}.value  the same
  outputs  logits          [batch, seq, vocab]                  float32
           present.{i}.key / present.{i}.value   [batch, kv_heads, past + seq, head_dim]

The weights go to `model.onnx.data` beside the graph (ONNX's external-data format). That is how graphs over
protobuf's 2 GiB limit are stored, and it is the one layout at every size. `ciders.models.onnx_run` runs the export
with numpy and onnxruntime only.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import nn

GRAPH, DATA = "model.onnx", "model.onnx.data"


def io_names(n_layers: int) -> tuple[list[str], list[str]]:
    past = [f"past.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


class _Step(nn.Module):
    """forward(input_ids, attention_mask, position_ids, *past) -> (logits, *present), the cache flattened."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model, self.n_layers = model, model.config.num_hidden_layers

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache

        cache = DynamicCache()
        for i in range(self.n_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
        flat = []
        for layer in out.past_key_values.layers:
            flat += [layer.keys, layer.values]
        return (out.logits, *flat)


def write_onnx(model: nn.Module, out_dir: Path, opset: int = 17) -> dict:
    """Write `model` (a merged HF causal LM, e.g. from `export.merged_copy`) as out_dir/model.onnx plus
    model.onnx.data. Returns the graph's I/O description (recorded in ciders_export.json). The model is
    converted in place (CPU, float32, eager attention): pass a copy you own."""
    import warnings

    import onnx

    from ciders.models.load import attention_shape

    m = model.to(device="cpu", dtype=torch.float32).eval()
    m.config._attn_implementation = "eager"  # MatMul + Softmax; traced sdpa is the same ops plus an IsNaN guard
    n, (_, kv, hd) = m.config.num_hidden_layers, attention_shape(m.config)
    ins, outs = io_names(n)
    # trace shapes: 3 cached positions, 4 new ones (all axes below are dynamic)
    past = [torch.zeros(1, kv, 3, hd) for _ in range(2 * n)]
    ids = torch.zeros(1, 4, dtype=torch.long)
    mask = torch.ones(1, 7, dtype=torch.long)
    pos = torch.arange(3, 7).unsqueeze(0)
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total"},
            "position_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
    axes.update({k: {0: "batch", 2: "past"} for k in ins[3:]})
    axes.update({k: {0: "batch", 2: "total"} for k in outs[1:]})
    with tempfile.TemporaryDirectory() as scratch, warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # TracerWarnings on cache branches that are fixed for this graph
        traced = Path(scratch) / "traced.onnx"
        torch.onnx.export(_Step(m), (ids, mask, pos, *past), str(traced), dynamo=False, input_names=ins,
                          output_names=outs, dynamic_axes=axes, opset_version=opset)
        proto = onnx.load(str(traced))  # with any external data the exporter wrote
        onnx.save_model(proto, str(Path(out_dir) / GRAPH), save_as_external_data=True,
                        all_tensors_to_one_file=True, location=DATA, size_threshold=0)
    return {"graph": GRAPH, "data": DATA, "opset": opset, "dtype": "float32", "inputs": ins, "outputs": outs,
            "layers": n, "kv_heads": kv, "head_dim": hd, "vocab": int(m.config.vocab_size)}
