"""Evaluations of a model path (docs/method.md#experiments-and-metrics), shared by `ciders eval` and the evaluations
scheduled in `ciders run`: response perplexity, GSM8K exact match, Dolly ROUGE-L (+ PPL), HumanEval-X pass@1 per
language, and the Protocol B response-NLL matrix. Every result carries its example / token counts."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ciders.config import EvalConfig
from ciders.core.tensors import State
from ciders.errors import CidersError
from ciders.federation import console
from ciders.eval import gsm8k, humaneval, rouge
from ciders.eval.generate import generate
from ciders.eval.metrics import perplexity
from ciders.eval.nll_matrix import nll_matrix
from ciders.runtime import derive_seed
from ciders.tasks.text import batches, to_example, tokenize

EVAL_TASKS = ("ppl", "gsm8k", "rouge_l", "humaneval:python", "humaneval:java", "humaneval:go", "nll_matrix")
DOLLY_STOPS = ("\n### ", "\n\n\n")


def _bar(total: int, desc: str):
    bar = console.bar(total=total, desc=desc, leave=False)  # on a terminal only; off with --quiet
    return bar, (lambda n: bar.update(n))


def evaluate(name: str, model: Any, tok: Any, cfg: EvalConfig, *, data=None, seed: int = 0,
             messengers: dict[str, State] | None = None, load_messenger: Callable[[State], None] | None = None,
             max_length: int = 256) -> dict:
    """One evaluation of `model` (an AdapEmu / AdapFu HF model with its messenger loaded)."""
    lim = cfg.limit
    device = next(model.parameters()).device
    if name == "ppl":
        if data is None:
            raise CidersError("ppl needs the run's evaluation data")
        feats = data.global_eval[:lim] if lim else data.global_eval
        return perplexity(model, batches(feats, cfg.batch_size, tok.pad_token_id, device))
    if name == "gsm8k":
        from ciders.tasks.registry import load_task

        recs = load_task("gsm8k", eval_split=True, limit=lim).raw
        bar, prog = _bar(len(recs), "GSM8K generation")
        out = gsm8k.exact_match(model, tok, recs, cfg.max_new_tokens, cfg.batch_size, prog)
        bar.close()
        return out
    if name == "rouge_l":
        raw = _dolly_heldout(data, seed, lim or 200)
        exs = [to_example(r, "instruction") for r in raw]
        exs = [e for e in exs if not isinstance(e, str)]
        bar, prog = _bar(len(exs), "Dolly generation")
        preds = generate(model, tok, [e.prompt for e in exs], cfg.max_new_tokens, cfg.batch_size, DOLLY_STOPS, prog)
        bar.close()
        out = rouge.rouge_l(preds, [e.response for e in exs])
        ppl = perplexity(model, batches(tokenize(exs, tok, max_length), cfg.batch_size, tok.pad_token_id, device))
        return {**out, "ppl": ppl["ppl"], "nll": ppl["nll"], "tokens": ppl["tokens"], "examples": len(exs)}
    if name.startswith("humaneval:"):
        lang = name.split(":", 1)[1]
        humaneval.check_toolchain(lang)
        probs = humaneval.load_problems(lang)[:lim] if lim else humaneval.load_problems(lang)
        bar, prog = _bar(len(probs), f"HumanEval-X {lang} generation")
        gens = generate(model, tok, [p["prompt"] for p in probs], cfg.max_new_tokens, cfg.batch_size,
                        humaneval.STOPS[lang], prog)
        bar.close()
        comps = [{"task_id": p["task_id"], "completion": humaneval.truncate(lang, g)} for p, g in zip(probs, gens)]
        bar, prog = _bar(len(comps), f"HumanEval-X {lang} sandbox")
        res = humaneval.score(lang, comps, probs, ks=(1,), workers=cfg.code_workers, progress=prog)
        bar.close()
        return res
    if name == "nll_matrix":
        if data is None or not data.eval_by_label or not messengers or load_messenger is None:
            raise CidersError("nll_matrix needs a run with one domain per client (data.task: domains, "
                              "federation.partition: natural) and the clients' personalized messengers")
        targets = {k: (v[:lim] if lim else v) for k, v in data.eval_by_label.items()}
        return nll_matrix(model, load_messenger, messengers, targets, tok.pad_token_id, cfg.batch_size, device)
    raise CidersError(f"unknown evaluation {name!r} (use {', '.join(EVAL_TASKS)})")


def _dolly_heldout(data, seed: int, n: int) -> list[dict]:
    """The run's own Dolly evaluation split when it trains on Dolly; otherwise a seeded Dolly slice."""
    if data is not None and data.info.get("split", {}).get("kind") == "dolly":
        return data.global_eval_raw[:n]
    import torch

    from ciders.tasks.registry import load_task

    recs = load_task("dolly")
    perm = torch.randperm(len(recs.raw), generator=torch.Generator().manual_seed(derive_seed(seed, "eval-split"))).tolist()
    return [recs.raw[i] for i in perm[:n]]


def eval_run(run_dir, tasks: tuple[str, ...] | None = None, path: str = "adapemu", messenger: str = "global",
             limit: int | None = None, log=print) -> dict:
    """`ciders eval`: rebuild the run's model and data from its directory, load its final adapters (or a
    client's personalized messenger) and evaluate one model path; results go to RUN_DIR/eval/."""
    from dataclasses import replace
    from pathlib import Path

    from ciders.config import load_run_config
    from ciders.federation.rundir import RunDir
    from ciders.workloads.prealign import build
    from ciders.fileio import write_json
    from ciders.tasks import federated

    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        raise CidersError(f"{run}: not a run directory (no config.yaml)")
    cfg = load_run_config(run / "config.yaml")
    ecfg = replace(cfg.eval, limit=limit if limit is not None else cfg.eval.limit)
    tasks = tasks or ("ppl", *cfg.eval.tasks)
    for t in tasks:
        if t not in EVAL_TASKS:
            raise CidersError(f"--tasks: unknown evaluation {t!r} (use {', '.join(EVAL_TASKS)})")
    if path not in ("adapemu", "adapfu", "teacher"):
        raise CidersError(f"--path must be adapemu, adapfu or teacher, got {path!r}")
    d, tok = build(cfg)
    data = federated.build(cfg, tok)
    ad = run / "adapters"
    if (ad / "student").is_dir():
        d.load_student(d.read_adapter(ad / "student", "student"))
    if messenger == "global":
        msg = d.read_adapter(ad / "messenger", "messenger") if (ad / "messenger").is_dir() else d.messenger_state()
    elif messenger.startswith("client:"):
        msg = load_personalized(run, messenger.split(":", 1)[1], d)
    else:
        raise CidersError(f"--messenger must be global or client:ID, got {messenger!r}")
    if path == "teacher":  # M* itself: the pretrained model, LoRA B = 0 (the adapters are the identity)
        msg = {k: (v * 0 if ".lora_B." in k else v) for k, v in msg.items()}
    d.load_messenger(msg)
    model = d.adapemu if path == "adapemu" else d.adapfu
    committed = RunDir(run).committed()
    personalized = {}
    if "nll_matrix" in tasks:
        for cid in data.client_label:
            try:
                personalized[data.client_label[cid]] = load_personalized(run, cid, d)
            except CidersError:
                pass
    results = {}
    for t in tasks:
        log(f"evaluating {t} on {path} with the {messenger} messenger")
        d.load_messenger(msg)
        results[t] = evaluate(t, model, tok, ecfg, data=data, seed=cfg.seed, messengers=personalized,
                              load_messenger=d.load_messenger, max_length=cfg.data.max_length)
    out = {"run": str(run), "round": committed, "path": path, "messenger": messenger, "limit": ecfg.limit,
           "tasks": results}
    write_json(run / "eval" / f"{path}-{messenger.replace(':', '_')}.json", out)
    return out


def load_personalized(run: str | Path, client: str, d) -> dict:
    """A client's personalized messenger (x_K of its last participation) from a run's client store."""
    from ciders.federation import codec
    from ciders.core.store import RoundStore
    from ciders.federation.rundir import RunDir
    from ciders.models.adapters import check_state

    run = Path(run)
    committed = RunDir(run).committed()
    store = run / "clients"
    rec = RoundStore(store, committed if committed is not None else -1).get(client) if store.is_dir() else None
    st = codec.client_from_record(*rec) if rec else None
    if st is None or st.personalized is None:
        where = " (a Flower run keeps client state on the nodes: evaluate there, or export it from the node's state-dir)" \
            if not store.is_dir() else " (never trained in this run)"
        raise CidersError(f"{run}: client {client!r} has no personalized messenger{where}")
    check_state(d.messenger_params(), st.personalized, f"client {client}")
    return {k: v.to(d.device) for k, v in st.personalized.items()}
