"""The pre-alignment job (Algorithm 1 with step 8): load M*, decompose, run TAKD bootstrap on the
public data, and measure perplexity of the teacher (AdapFu) and of the student path (AdapEmu)
before and after. This is `ciders distill CONFIG` and, until the federated engine lands, `make demo`.

Run directory:
  config.yaml      resolved configuration
  data.json        data sources, counts, truncations and skipped records
  metrics.jsonl    one record per TAKD step, then one per evaluation
  summary.json     perplexities before/after, token counts, timings
  adapters/messenger, adapters/student   standard PEFT adapter directories
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from tqdm.auto import tqdm

from ciders.config import ExperimentConfig, dump_yaml
from ciders.errors import CidersError
from ciders.eval.metrics import perplexity
from ciders.fileio import append_jsonl, write_json, write_text
from ciders.models.decompose import Decomposition, decompose
from ciders.models.distill import TAKDState, TeacherCache, distill, init_state
from ciders.models.load import load_model, load_tokenizer
from ciders.runtime import seed_everything
from ciders.tasks.sources import check, data_kw, load_examples
from ciders.tasks.text import batches, tokenize


def build(cfg: ExperimentConfig) -> tuple[Decomposition, object]:
    """Load M* and its tokenizer and decompose it as the config says."""
    m = cfg.model
    model = load_model(m.name, device=m.device, dtype=m.dtype, attn_implementation=m.attn_implementation, seed=cfg.seed)
    tok = load_tokenizer(m.name)
    d = decompose(model, cfg.decomposition.messenger_layers, **cfg.decomposition.split_kwargs(),
                  messenger_lora=cfg.lora.messenger, student_lora=cfg.lora.student, seed=cfg.seed,
                  model_name=m.name)
    return d, tok


def load_text(cfg: ExperimentConfig, tok) -> tuple[list[dict], list[dict], dict]:
    dc = cfg.data
    pub_ex, pub_rep = load_examples(dc.public, dc.format, dc.public_limit, **data_kw(dc))
    ev_ex, ev_rep = load_examples(dc.eval, dc.format, dc.eval_limit, **data_kw(dc))
    public = tokenize(pub_ex, tok, dc.max_length, pub_rep)
    evald = tokenize(ev_ex, tok, dc.max_length, ev_rep)
    overlap = len({e.prompt for e in pub_ex} & {e.prompt for e in ev_ex})
    if overlap:
        raise CidersError(f"{overlap} evaluation prompts also occur in the public data; they must be disjoint")
    if not public or not evald:
        raise CidersError(f"no usable examples after tokenization ({pub_rep.summary()}; {ev_rep.summary()})")
    info = {"public": pub_rep.to_dict(), "eval": ev_rep.to_dict(), "max_length": dc.max_length, "overlap": overlap}
    return public, evald, info


def _teacher_cache(cfg: ExperimentConfig, d: Decomposition, public: list[dict], pad: int,
                   out: Path) -> TeacherCache | None:
    """B_F(x) for every public example once, before TAKD (None with takd.teacher_cache = off)."""
    tc = cfg.takd
    if tc.teacher_cache == "off":
        return None
    bar = tqdm(total=len(public), desc="teacher cache B_F(x)", unit="ex", leave=False, disable=None)
    cache = TeacherCache.build(d, public, pad, batch_size=cfg.data.eval_batch_size, mode=tc.teacher_cache,
                               directory=out / "teacher_cache", memory_limit_mib=tc.cache_memory_mib,
                               progress=lambda i, n: bar.update(i - bar.n))
    bar.close()
    return cache


def _bootstrap(cfg: ExperimentConfig, d: Decomposition, public: list[dict], pad: int, cache: TeacherCache | None,
               metrics: Path) -> tuple[dict, TAKDState, list[dict], float]:
    """The TAKD bootstrap from a fresh student state: the messenger used, the new state, the per-step
    history and the seconds it took; each step is appended to metrics.jsonl as it finishes."""
    tc = cfg.takd
    state = init_state(d)
    messenger = d.messenger_state()
    bar = tqdm(total=tc.bootstrap_steps, desc="TAKD pre-alignment", unit="step", disable=None)

    def on_step(rec: dict) -> None:
        append_jsonl(metrics, {"event": "takd", **rec})
        bar.update(1)
        bar.set_postfix(loss=f"{rec['loss']:.3f}", hid=f"{rec['hidden']:.3f}", kl=f"{rec['kl']:.3f}", ce=f"{rec['ce']:.3f}")

    t0 = time.perf_counter()
    state, hist = distill(d, state, messenger, public, tc.bootstrap(), tc.bootstrap_steps, pad_id=pad, seed=cfg.seed,
                          cache=cache, on_step=on_step)
    bar.close()
    return messenger, state, hist, time.perf_counter() - t0


def _summary(cfg: ExperimentConfig, d: Decomposition, teacher: dict, before: dict, after: dict, hist: list[dict],
             takd_s: float, cache: TeacherCache | None, t_start: float) -> dict:
    """summary.json: the three perplexities, the TAKD run and the total seconds since `t_start`."""
    s, tc = d.split, cfg.takd
    return {
        "model": cfg.model.name, "device": str(d.device), "dtype": str(d.base.dtype).replace("torch.", ""),
        "split": {"n_layers": s.n_layers, "messenger_layers": s.messenger_layers,
                  "student_indices": list(s.student_indices)},
        "eval_tokens": teacher["tokens"],
        "ppl": {"teacher_adapfu": teacher["ppl"], "student_before": before["ppl"], "student_after": after["ppl"]},
        "nll": {"teacher_adapfu": teacher["nll"], "student_before": before["nll"], "student_after": after["nll"]},
        "takd": {"steps": tc.bootstrap_steps, "seconds": takd_s,
                 "first_loss": hist[0]["loss"] if hist else None, "last_loss": hist[-1]["loss"] if hist else None,
                 "teacher_cache": cache.storage if cache else "off"},
        "seconds": time.perf_counter() - t_start,
    }


def run_prealign(cfg: ExperimentConfig, out: str | Path, log: Callable[[str], None] = print) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    if metrics.exists():
        metrics.unlink()  # this job is short and restarts from scratch
    write_text(out / "config.yaml", dump_yaml(cfg))
    seed_everything(cfg.seed)
    t_start = time.perf_counter()

    for src in (cfg.data.public, cfg.data.eval):  # before the model: a mistyped path fails at once
        check(src)
    d, tok = build(cfg)
    s = d.split
    log(f"model {cfg.model.name}: {s.n_layers} layers on {d.device} ({d.base.dtype}); messenger {s.messenger_layers} "
        f"layers, B_F {s.teacher_layers}, B_L {s.student_layers} at {list(s.student_indices)}")
    public, evald, info = load_text(cfg, tok)
    write_json(out / "data.json", info)
    log(f"data: {len(public)} public examples, {len(evald)} evaluation examples "
        f"({info['public']['truncated'] + info['eval']['truncated']} truncated to {cfg.data.max_length} tokens)")
    pad = tok.pad_token_id
    cache = _teacher_cache(cfg, d, public, pad, out)

    def ppl(model, desc):
        r = perplexity(model, tqdm(list(batches(evald, cfg.data.eval_batch_size, pad, d.device)), desc=desc, leave=False, disable=None))
        append_jsonl(metrics, {"event": "eval", "path": desc, **r})
        return r

    teacher = ppl(d.adapfu, "teacher (AdapFu)")
    before = ppl(d.adapemu, "student before (AdapEmu)")
    messenger, state, hist, takd_s = _bootstrap(cfg, d, public, pad, cache, metrics)
    d.load_student(state.student)
    after = ppl(d.adapemu, "student after (AdapEmu)")

    d.save_messenger(out / "adapters" / "messenger", messenger)
    d.save_student(out / "adapters" / "student", state.student)
    summary = _summary(cfg, d, teacher, before, after, hist, takd_s, cache, t_start)
    write_json(out / "summary.json", summary)
    log(render_summary(summary))
    return summary


def render_summary(s: dict) -> str:
    p = s["ppl"]
    rows = [("teacher M* (AdapFu, full backbone)", p["teacher_adapfu"]),
            ("student before TAKD (AdapEmu)", p["student_before"]),
            ("student after TAKD (AdapEmu)", p["student_after"])]
    lines = [f"perplexity on {s['eval_tokens']} held-out target tokens:"]
    lines += [f"  {name:<36}{v:10.3f}" for name, v in rows]
    t = s["takd"]
    lines.append(f"TAKD: {t['steps']} steps in {t['seconds']:.1f} s (loss {t['first_loss']:.3f} -> {t['last_loss']:.3f}, "
                 f"teacher cache: {t['teacher_cache']})" if t["steps"] else "TAKD: 0 steps")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ shared cache
# `ciders compare` runs several methods per seed; those whose pre-alignment inputs are identical (CIDERS,
# FedOT, FedAvg, SCAFFOLD: not FedBiOT, whose TAKD has no task CE) share one result instead of recomputing it.


def key(cfg: ExperimentConfig, public: list[dict]) -> str:
    """What the pre-alignment depends on, hashed: the model, decomposition, LoRA and TAKD settings as the
    bootstrap steps use them (all but the per-round and storage ones; the task weight is the bootstrap's), the
    seed, the code version and the public examples' tokens."""
    import hashlib
    import json

    import ciders
    from ciders.config import to_dict

    takd = {k: v for k, v in to_dict(cfg.takd.bootstrap()).items()
            if k not in ("round_steps", "teacher_cache", "cache_memory_mib", "lambda_task_bootstrap")}
    h = hashlib.sha256(json.dumps({"model": to_dict(cfg.model), "decomposition": to_dict(cfg.decomposition),
                                   "lora": to_dict(cfg.lora), "takd": takd, "seed": cfg.seed,
                                   "version": ciders.__version__}, sort_keys=True).encode())
    for f in public:
        h.update(json.dumps([list(map(int, f["input_ids"])), list(map(int, f["labels"]))]).encode())
    return h.hexdigest()[:32]


def load_cached(directory: Path, k: str) -> tuple[dict, dict, dict] | None:
    """(tensors, meta, metrics) stored under key `k`, or None (absent, or unreadable: then recomputed)."""
    import json

    from safetensors import safe_open

    path = Path(directory) / f"{k}.safetensors"
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            md = f.metadata() or {}
            if md.get("key") != k:
                return None
            tensors = {n: f.get_tensor(n) for n in f.keys()}
        return tensors, json.loads(md["meta"]), json.loads(md["pre"])
    except Exception:  # noqa: BLE001 - safetensors raises its own error type; any damage means "recompute"
        return None


def store_cached(directory: Path, k: str, tensors: dict, meta: dict, pre: dict) -> None:
    import json

    from safetensors.torch import save_file

    from ciders.fileio import atomic_path

    with atomic_path(Path(directory) / f"{k}.safetensors") as tmp:
        save_file({n: t.detach().cpu().contiguous() for n, t in tensors.items()}, str(tmp),
                  metadata={"key": k, "meta": json.dumps(meta), "pre": json.dumps(pre)})
