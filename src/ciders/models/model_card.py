"""The model card (README.md) of an exported edge model: base model, decomposition, training data, method and
the quality the run measured. Only facts the run directory records; a missing figure is said to be missing."""

from __future__ import annotations


def _quality(summary: dict | None, client: str | None, on_node: bool) -> list[str]:
    if on_node:
        return ["Exported on the node from what it holds, with no access to the server. The evaluation the "
                "server ran is in the run directory's summary.json, on the server."]
    if not summary or "eval_after" not in summary:
        return ["No evaluation is recorded in the run's summary.json (the run did not evaluate, or did not finish)."]
    before, after = summary.get("eval_before") or {}, summary["eval_after"]
    rows = ["| model | evaluated on | perplexity | NLL/token | tokens |", "|---|---|---|---|---|"]

    def row(label: str, where: str, r: dict | None) -> None:
        if r and "ppl" in r:
            rows.append(f"| {label} | {where} | {r['ppl']:.3f} | {r['nll']:.4f} | {r.get('tokens', '?')} |")

    row("before training", "global eval set", before.get("global"))
    row("global messenger, final", "global eval set", after.get("global"))
    if client:
        mine = (after.get("clients") or {}).get(client) or {}
        row("global messenger, final", f"{client}'s held-out data", mine.get("global"))
        row(f"{client}'s personalized messenger (this export)", f"{client}'s held-out data", mine.get("personalized"))
        if "personalized" not in mine:
            rows.append(f"\nThe run recorded no personalized evaluation for {client}.")
    return [f"Measured at round {after.get('round')} (round -1 is before training):", "", *rows]


def _gguf_types(g: dict) -> str:
    """What the GGUF's tensors are stored as: a reader of a quantized file must know it is not full precision."""
    types = g.get("tensor_types") or {}
    text = "tensor types: " + ", ".join(f"{n} {t}" for t, n in sorted(types.items(), key=lambda kv: -kv[1]))
    text = f"--gguf-dtype {g.get('dtype', '?')}, {text}" if types else f"--gguf-dtype {g.get('dtype', '?')}"
    if g.get("f16_fallback"):
        text += (f"; {len(g['f16_fallback'])} matrices with rows not a multiple of the quantization block kept F16: "
                 + ", ".join(g["f16_fallback"]))
    return text


def model_card(info: dict, cfg, summary: dict | None, client: str | None) -> str:
    """Markdown for README.md. `info`: the export's ciders_export.json; `cfg`: the run's ExperimentConfig."""
    sp = info["split"]
    who = (f"client **{client}**'s personalized messenger" if client else
           "the **global** messenger (the federation's aggregate)")
    fmt = {"hf": "a Hugging Face model directory (config.json + model.safetensors + tokenizer)",
           "onnx": "ONNX (model.onnx + model.onnx.data, KV cache as inputs/outputs; tokenizer.json)",
           "gguf": f"GGUF (model.gguf, tokenizer included; {_gguf_types(info.get('gguf') or {})}), for llama.cpp",
           }[info["format"]]
    d, a, f = cfg.data, cfg.algorithm, cfg.federation
    data_lines = [f"- task: `{d.task}`"]
    if client:
        data_lines.append(f"- the messenger was trained on {client}'s own data, which never left the client")
    else:
        data_lines.append(f"- the messenger aggregates the updates of {f.clients} clients, each trained on its own data")
    if getattr(d, "public", None):
        data_lines.append(f"- B_L (the compressed backbone) was distilled on the server's public data: `{d.public}`")
    lines = [
        f"# Edge model: {info['source_model']}, compressed (CIDERS AdapEmu)", "",
        f"Exported by `ciders export` as {fmt}, with every LoRA merged. It is a plain "
        f"{info['architecture']} decoder of {sp['edge_layers']} layers, not the base model's {sp['n_layers']}.", "",
        "## Base model and decomposition", "",
        f"- base model: `{info['source_model']}` ({sp['n_layers']} layers)",
        f"- layers 0..{sp['student_layers'] - 1}: the compressed backbone B_L, the base model's layers "
        f"{sp['student_indices']} (a strided subsample), with the distilled student LoRA merged",
        f"- layers {sp['student_layers']}..{sp['edge_layers'] - 1}: the messenger, the base model's top "
        f"{sp['messenger_layers']} layers, with {who} merged",
        "- The run's adapters stay separate in its `adapters/` directory. The messenger adapter targets the base "
        "model's layer indices. The student adapter targets AdapEmu's layers 0..n'-1, i.e. B_L's indices, not the "
        "base model's.", "",
        "## Method", "",
        f"- algorithm: `{a.name}`" + (f", meta-gradient `{a.metagrad}`" if getattr(a, "metagrad", None) else ""),
        f"- {f.rounds} rounds, {f.clients} clients, {a.local_steps} local steps per round, lr {a.lr}",
        f"- seed {cfg.seed}; the run's full config is its `config.yaml`", "",
        "## Training data", "", *data_lines, "",
        "## Measured quality", "", *_quality(summary, client, "node_state_dir" in info), "",
        "## Run it", "",
        "See the ciders documentation, docs/edge.md, section \"Running the personalized model on a device\".", "",
    ]
    return "\n".join(lines)
