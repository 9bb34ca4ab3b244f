"""An edge client's first download (docs/edge.md#the-first-download-in-bfloat16): the emulator's base weights
in the model's dtype, in bfloat16 and in float16 (`federation.emulator_dtype`), with the size of each and the
perplexity of the AdapEmu an edge client builds from it (`models.edge`: spec, stored weights, memory-mapped
load), on real held-out text (the vendored GSM8K slice), beside the full model's size; and, since AdapEmu
before distillation is a poor model, the same rounding applied to a working model, the full model itself.

--json keys: full_model_mib, server_adapemu_ppl, downloads.*.mib, downloads.*.edge_disk_mib, downloads.*.ppl,
downloads.*.ppl_change, full_model_ppl.*

    python benchmarks/edge_download.py [--model smollm2-135m] [--examples 64] [--json] [--smoke]
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch

from ciders.eval.metrics import perplexity
from ciders.models import edge
from ciders.models.edge_spec import write_spec, split_of, check_spec
from ciders.tasks.text import batches
from common import SMOKE_MODEL, emit, parser, setup, smoke


def mib(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def edge_ppl(d, tok, feats, dtype, work: Path, batch_size: int) -> tuple[dict, float]:
    """AdapEmu as an edge client builds it from a download in `dtype`: (perplexity record, MiB on its disk)."""
    files = edge.edge_spec(d, tok, dtype)
    directory = work / str(dtype)
    write_spec(directory, files)
    model, _ = edge.load_edge(directory, d.device, d.base.dtype)
    e = edge.edge_decompose(model, split_of(check_spec(files)), d.messenger_lora, d.student_lora)
    e.load_emulator_base({k: v.to(dtype) for k, v in d.emulator_base_state().items()})
    edge.save_edge_weights(e, directory, dtype)
    model, loaded = edge.load_edge(directory, d.device, d.base.dtype)  # what every later process runs
    assert loaded
    e = edge.edge_decompose(model, e.split, d.messenger_lora, d.student_lora)
    e.load_messenger(d.messenger_state())
    e.load_student(d.student_state())
    rec = perplexity(e.adapemu, batches(feats, batch_size, tok.pad_token_id, d.device))
    return rec, sum(p.stat().st_size for p in directory.iterdir()) / 2**20


def main() -> None:
    ap = parser(__doc__, batch_size=8)
    ap.add_argument("--examples", type=int, default=64)
    a = smoke(ap.parse_args(), model=SMOKE_MODEL, examples=4)
    d, tok, feats = setup(a, "eval.jsonl", a.examples)
    emu = d.emulator_base_state()
    out = {"model": a.model, "examples": len(feats), "model_dtype": str(d.base.dtype).removeprefix("torch."),
           "full_model_mib": mib(d.base.parameters()), "layers": {"full": d.split.n_layers, "edge": d.split.edge_layers},
           "downloads": {}}
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        ref = perplexity(d.adapemu, batches(feats, a.batch_size, tok.pad_token_id, d.device))
        out["server_adapemu_ppl"] = ref["ppl"]
        for dt in dict.fromkeys([d.base.dtype, torch.bfloat16, torch.float16]):
            rec, disk = edge_ppl(d, tok, feats, dt, Path(tmp), a.batch_size)
            out["downloads"][str(dt).removeprefix("torch.")] = {
                "mib": mib(v.to(dt) for v in emu.values()), "edge_disk_mib": disk, "ppl": rec["ppl"], "nll": rec["nll"],
                "tokens": rec["tokens"], "ppl_change": rec["ppl"] / ref["ppl"] - 1}
        # AdapEmu before TAKD is a poor model (the strided B_L), so also round the weights of a working model
        # of the same family, the full model M* itself: the sensitivity that matters once AdapEmu is distilled
        full = perplexity(d.adapfu, batches(feats, a.batch_size, tok.pad_token_id, d.device))
        out["full_model_ppl"] = {"as_held": full["ppl"]}
        kept = {n: p.detach().clone() for n, p in d.adapfu.named_parameters()}
        for dt in (torch.bfloat16, torch.float16):
            for n, p in d.adapfu.named_parameters():
                p.copy_(kept[n].to(dt))
            r = perplexity(d.adapfu, batches(feats, a.batch_size, tok.pad_token_id, d.device))
            out["full_model_ppl"][str(dt).removeprefix("torch.")] = r["ppl"]
            for n, p in d.adapfu.named_parameters():
                p.copy_(kept[n])
    assert all(math.isfinite(r["ppl"]) for r in out["downloads"].values())
    emit(out, a.json, lambda: report(out))


def report(out: dict) -> None:
    print(f"{out['model']}: full model {out['full_model_mib']:.1f} MiB ({out['layers']['full']} layers, "
          f"{out['model_dtype']}); AdapEmu {out['layers']['edge']} layers; {out['examples']} held-out examples, "
          f"server-side AdapEmu PPL {out['server_adapemu_ppl']:.4f}")
    print(f"{'download':>10} {'MiB':>9} {'/ full':>7} {'edge disk MiB':>14} {'edge PPL':>10} {'change':>9}")
    for k, r in out["downloads"].items():
        print(f"{k:>10} {r['mib']:9.1f} {r['mib'] / out['full_model_mib']:7.3f} {r['edge_disk_mib']:14.1f} "
              f"{r['ppl']:10.4f} {100 * r['ppl_change']:+8.3f}%")
    f = out["full_model_ppl"]
    print(f"the full model's PPL with its weights as held {f['as_held']:.4f}, rounded to bfloat16 {f['bfloat16']:.4f} "
          f"({100 * (f['bfloat16'] / f['as_held'] - 1):+.3f}%), to float16 {f['float16']:.4f} "
          f"({100 * (f['float16'] / f['as_held'] - 1):+.3f}%)")


if __name__ == "__main__":
    main()
