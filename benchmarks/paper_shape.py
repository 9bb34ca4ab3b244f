"""One step of each kind at the paper's shapes, with random weights (no download): does it run, how long, how much
memory, and is `ciders plan`'s memory prediction right (issue 32; README "Sizing machines").

The paper's architectures come from their shipped config.json files (tests/fixtures/configs: Qwen2-1.5B and
Qwen2.5-3B) and are decomposed as configs/paper/* decompose them (6-layer messenger, drop ratio 0.2: Table II). Each
step runs in its own process, so each peak is that step's alone:

  client_fo   an edge client (AdapEmu only: B_L + messenger + embeddings / norm / head, as on Flower) takes one
              CIDERS-FO step (client_update, K = 1): B_L(x) once, look-ahead and meta-gradient, AdamW
  client_fd   the same with the FD meta-gradient and the exact HVP (algorithm.hvp: exact, the default)
  takd        the server (M* with B_F, and B_L over B_F's own Parameters) builds the teacher cache over
              --public-examples examples and takes one TAKD step (Eq. 2, the config's lambdas and hidden loss)

at batch --batch-size x --seq-len (default 1 x 128; the response is the second half). Qwen2-1.5B runs in float32,
Qwen2.5-3B in bfloat16 (the paper's dtype). A step that cannot run stops the script with a message naming the model
and the step. `peak_mib` is the step's peak (CPU: peak resident set, /proc VmHWM, above what the process held after
its imports; CUDA: the allocator's peak) and `predicted_mib` the plan's total for it (`ciders.models.plan.memory_plan`,
at the same workload); `ratio` = peak / predicted. The takd step also checks that B_L holds no copy of B_F's weights
(every B_L base tensor has the data pointer of its B_F layer's) and measures what a copy would cost by making one.

    python benchmarks/paper_shape.py [--models qwen2-1.5b,qwen2.5-3b] [--device cpu|cuda] [--json] [--smoke]

--json keys: models.*.steps.*.seconds, models.*.steps.*.peak_mib, models.*.steps.*.predicted_mib, models.*.steps.*.ratio, models.*.shared_mib, models.*.copy_mib
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
MODELS = {  # name: (architecture, dtype, the paper config that decomposes it)
    "qwen2-1.5b": (str(CONFIGS / "qwen2-1.5b" / "config.json"), "float32", "configs/paper/protocol_b.yaml"),
    "qwen2.5-3b": (str(CONFIGS / "qwen2.5-3b" / "config.json"), "bfloat16", "configs/paper/protocol_a_gsm8k.yaml"),
    "tiny-qwen2": ("tiny-qwen2", "float32", "configs/tiny.yaml"),  # --smoke
}
STEPS = ("client_fo", "client_fd", "takd")
PAD = 0


# ------------------------------------------------------------------------------------------ memory figures


def rss_mib(field: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak(device: torch.device) -> None:
    """Start a new peak: the allocator's on CUDA; on CPU /proc/self/clear_refs sets VmHWM back to the current RSS."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")


def peak_mib(device: torch.device, base: float) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(device) / 2**20
    return rss_mib("VmHWM") - base


# ------------------------------------------------------------------------------------------ models and data


def random_model(cfg, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """The architecture with random weights, built without transformers' per-module init (minutes at 3B on two cores):
    matrices N(0, initializer_range^2), norm weights 1, biases 0. Every weight is written, so all of it is resident."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights(), torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.tie_weights()  # no_init_weights also skips the tying: an untied head would be a second vocab x hidden matrix
    if getattr(cfg, "tie_word_embeddings", False) and model.lm_head.weight is not model.model.embed_tokens.weight:
        raise SystemExit("paper_shape: the LM head is not tied to the embeddings as the config says")
    gen = torch.Generator(device=device).manual_seed(seed)
    std = getattr(cfg, "initializer_range", 0.02)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, std, generator=gen)
            else:
                p.fill_(0.0 if name.endswith("bias") else 1.0)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def edge_config(cfg, split):
    """AdapEmu's config, as the server's edge spec writes it: n' + a layers (and their layer_types)."""
    c = copy.deepcopy(cfg)
    idx = list(split.student_indices) + list(split.messenger_indices)
    c.num_hidden_layers = len(idx)
    if getattr(c, "layer_types", None) is not None:
        c.layer_types = [cfg.layer_types[i] for i in idx]
    return c


def features(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    """Random token examples whose second half is the response (the loss's positions)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, vocab, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100] * (length // 2) + ids[length // 2:]})
    return out


# ------------------------------------------------------------------------------------------ one step per process


def setting(a: argparse.Namespace):
    from ciders.config import load_experiment
    from ciders.models.load import load_config
    from ciders.models.split import split_layers

    arch, dtype, protocol = MODELS[a.model]
    exp = load_experiment(ROOT / protocol)
    cfg = load_config(arch)
    dc = exp.decomposition
    split = split_layers(cfg.num_hidden_layers, dc.messenger_layers, beta=dc.beta, drop_ratio=dc.drop_ratio,
                         student_layers=dc.student_layers, rounding=dc.rounding)
    return exp, cfg, getattr(torch, dtype), split


def client_step(a: argparse.Namespace, kind: str, device: torch.device, base: float) -> dict:
    from ciders.algorithms import ciders as alg
    from ciders.models.edge import edge_decompose
    from ciders.models.messenger_loss import MessengerLoss, step_compute_dtype
    from ciders.tasks.text import collate

    exp, cfg, dtype, split = setting(a)
    d = edge_decompose(random_model(edge_config(cfg, split), dtype, device), split, exp.lora.messenger,
                       exp.lora.student, model_name=a.model)
    ccfg = replace(exp.algorithm, local_steps=1, grad_accum=1, metagrad=kind, hvp="exact")
    loss = MessengerLoss(d, compute_dtype=step_compute_dtype(kind, ccfg.hvp, dtype))
    msg = d.messenger_state()
    bc = alg.make_broadcast(ccfg, alg.init_server(msg, exp.federation.rounds), alg.init_copy(msg))
    client = alg.init_client("client0", msg)
    b = collate(features(a.batch_size, a.seq_len, cfg.vocab_size, 1), PAD, device)
    d.messenger_top.train()  # LoRA dropout during client steps, as workloads.llm does

    def step():
        h = d.backbone_hidden(b["input_ids"], b["attention_mask"])
        _, _, info = alg.client_update(ccfg, bc, client, loss, [dict(b, hidden=h, seed=0)])
        return info["loss"]

    return measure(step, device, base)


def takd_step(a: argparse.Namespace, device: torch.device, base: float) -> dict:
    from ciders.models.decompose import decompose
    from ciders.models.distill import TeacherCache, distill, init_state

    exp, cfg, dtype, split = setting(a)
    model = random_model(cfg, dtype, device)
    before = rss_mib()
    dc = exp.decomposition
    d = decompose(model, dc.messenger_layers, student_layers=split.student_layers, messenger_lora=exp.lora.messenger,
                  student_lora=exp.lora.student, model_name=a.model)
    sharing = shared_weights(d)
    sharing["decompose_rss_mib"] = rss_mib() - before
    feats = features(a.public_examples, a.seq_len, cfg.vocab_size, 2)
    cache = TeacherCache.build(d, feats, PAD, batch_size=a.batch_size, mode="memory")
    tcfg = replace(exp.takd, batch_size=a.batch_size, grad_accum=1)
    state, msg = init_state(d), d.messenger_state()

    def step():
        _, hist = distill(d, state, msg, feats, tcfg, 1, pad_id=PAD, seed=0, cache=cache)
        return hist[0]["loss"]

    res = measure(step, device, base)
    res.update(sharing, copy_mib=copy_cost(d, device))
    return res


def measure(step, device: torch.device, base: float) -> dict:
    reset_peak(device)
    t0 = time.perf_counter()
    loss = step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"seconds": time.perf_counter() - t0, "peak_mib": peak_mib(device, base), "loss": float(loss)}


def shared_weights(d) -> dict:
    """Check that every B_L layer's base tensors ARE those of the B_F layer it was sampled from (same storage), and
    return their size: what decompose did not copy."""
    lora = {id(p) for p in list(d.student_params().values()) + list(d.messenger_params().values())}
    shared = 0
    for j, src in enumerate(d.split.student_indices):
        mine = [p for p in d.student[j].parameters() if id(p) not in lora]
        theirs = [p for p in d.backbone_full[src].parameters() if id(p) not in lora]
        if [p.data_ptr() for p in mine] != [p.data_ptr() for p in theirs]:
            raise SystemExit(f"paper_shape: B_L layer {j} does not share the weights of B_F layer {src}")
        shared += sum(p.numel() * p.element_size() for p in mine)
    return {"shared_mib": shared / 2**20}


def copy_cost(d, device: torch.device) -> float:
    """What a copy of B_L's base weights would cost, measured: the memory that cloning them takes."""
    lora = {id(p) for p in d.student_params().values()}
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else rss_mib() * 2**20
    clones = [p.detach().clone() for layer in d.student for p in layer.parameters() if id(p) not in lora]
    after = torch.cuda.memory_allocated(device) if device.type == "cuda" else rss_mib() * 2**20
    del clones
    return (after - before) / 2**20


def preload(model: str) -> None:
    """Import what a step uses (transformers' model classes, PEFT, ciders) before the baseline is taken."""
    import importlib

    from ciders.models.load import load_config

    for mod in ("peft", "ciders.algorithms.ciders", "ciders.models.edge", "ciders.models.distill",
                "ciders.models.messenger_loss", f"transformers.models.{load_config(MODELS[model][0]).model_type}"):
        importlib.import_module(mod)
    from transformers import AutoModelForCausalLM  # noqa: F401


def worker(a: argparse.Namespace) -> None:
    """Run one step in this process and print its figures as one JSON line."""
    device = torch.device(a.device)
    preload(a.model)
    base = rss_mib()  # after the imports: the peak counts what the step's machine needs for the model and step
    torch.manual_seed(0)
    res = takd_step(a, device, base) if a.step == "takd" else client_step(a, a.step.removeprefix("client_"), device,
                                                                          base)
    print(json.dumps(res), flush=True)


# ------------------------------------------------------------------------------------------ the driver


def predicted(a: argparse.Namespace, name: str) -> dict:
    """The plan's totals, in MiB, at this script's workload."""
    from ciders.config import load_experiment
    from ciders.models.plan import Workload, make_plan

    arch, dtype, protocol = MODELS[name]
    exp = load_experiment(ROOT / protocol)
    dc = exp.decomposition
    w = Workload(dtype=dtype, batch_size=a.batch_size, seq_len=a.seq_len, takd_batch_size=a.batch_size,
                 public_examples=a.public_examples, cache_memory_mib=float("inf"))
    p = make_plan(arch, dc.messenger_layers, beta=dc.beta, drop_ratio=dc.drop_ratio, student_layers=dc.student_layers,
                  rounding=dc.rounding, messenger_lora=exp.lora.messenger, student_lora=exp.lora.student, workload=w)
    mem = p.memory
    return {"client_fo": mem["client"]["fo"]["total"], "client_fd": mem["client"]["fd"]["total"],
            "takd": mem["server"]["total"]}


def run_step(a: argparse.Namespace, name: str, step: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", step, "--model", name, "--device", a.device,
           "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--public-examples", str(a.public_examples)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.step_timeout)
    if r.returncode != 0 or not r.stdout.strip():
        lines = [x for x in r.stderr.strip().splitlines() if "warn" not in x.lower()] or ["(no output)"]
        tail = lines[-1] if r.returncode >= 0 else f"killed by signal {-r.returncode} (9: out of memory?)"
        raise SystemExit(f"paper_shape: the {step} step of {name} failed (exit {r.returncode}): {tail}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def arguments() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen2-1.5b,qwen2.5-3b")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--public-examples", type=int, default=2, help="examples in the teacher cache")
    ap.add_argument("--step-timeout", type=int, default=1200, help="seconds a step may take")
    ap.add_argument("--worker", choices=STEPS, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    return ap


def main() -> None:
    if "--worker" in sys.argv:  # a step's own process needs none of the driver's helpers (benchmarks/common.py)
        a = arguments().parse_args()
        a.step = a.worker
        return worker(a)
    from common import add_output_flags, emit

    a = add_output_flags(arguments()).parse_args()
    names = ["tiny-qwen2"] if a.smoke else [n.strip() for n in a.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise SystemExit(f"paper_shape: unknown model {unknown[0]!r} (known: {', '.join(MODELS)})")
    res = {"device": a.device, "batch": [a.batch_size, a.seq_len], "models": {}}
    for name in names:
        pred = predicted(a, name)
        steps = {}
        for step in STEPS:
            r = run_step(a, name, step)
            steps[step] = {**r, "predicted_mib": pred[step], "ratio": r["peak_mib"] / pred[step]}
            print(f"{name} {step}: {r['seconds']:.1f} s, peak {r['peak_mib']:.0f} MiB, predicted {pred[step]:.0f} MiB",
                  file=sys.stderr, flush=True)
        takd = steps["takd"]
        res["models"][name] = {"dtype": MODELS[name][1], "steps": steps, "shared_mib": takd.pop("shared_mib"),
                               "copy_mib": takd.pop("copy_mib"), "decompose_rss_mib": takd.pop("decompose_rss_mib")}
    emit(res, a.json, lambda: report(res))
    bad = [(n, s) for n, m in res["models"].items() for s, v in m["steps"].items() if not 0.75 <= v["ratio"] <= 1.25]
    if bad and not a.smoke:
        raise SystemExit(f"paper_shape: the plan's prediction is off by more than 25% for {bad}")


def report(res: dict) -> None:
    print(f"paper shape on {res['device']}, batch {res['batch'][0]} x {res['batch'][1]} tokens, one step each")
    print(f"  {'model':<12}{'dtype':<10}{'step':<11}{'seconds':>9}{'peak MiB':>10}{'predicted':>11}{'ratio':>7}")
    for name, m in res["models"].items():
        for step, v in m["steps"].items():
            print(f"  {name:<12}{m['dtype']:<10}{step:<11}{v['seconds']:>9.1f}{v['peak_mib']:>10.0f}"
                  f"{v['predicted_mib']:>11.0f}{v['ratio']:>7.2f}")
        print(f"  {name}: B_L shares {m['shared_mib']:.0f} MiB of B_F's weights (same storage); decompose added "
              f"{m['decompose_rss_mib']:.0f} MiB of RSS; a copy would add {m['copy_mib']:.0f} MiB (measured)")


if __name__ == "__main__":
    main()
