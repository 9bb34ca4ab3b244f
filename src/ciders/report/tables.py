"""Final metrics of a run and the Table III-shaped comparison (per metric mean +- std over seeds,
best bold, second underlined), from the runs' metrics.jsonl and summary.json."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from ciders.fileio import read_jsonl

# key -> (label, +1 higher is better / -1 lower is better / 0 no ranking, scale for display, format)
METRICS: dict[str, tuple[str, int, float, str]] = {
    "ppl": ("AdapEmu PPL (global eval)", -1, 1.0, "{:.3f}"),
    "nll": ("AdapEmu response NLL (global eval)", -1, 1.0, "{:.4f}"),
    "personalized_ppl": ("personalized PPL (own held-out)", -1, 1.0, "{:.3f}"),
    "agreement": ("edge fidelity: AdapEmu = AdapFu top-1 %", +1, 100.0, "{:.2f}"),
    "gsm8k": ("GSM8K acc. %", +1, 100.0, "{:.2f}"),
    "gsm8k_strict_match": ("GSM8K acc. % (lm-eval strict-match)", +1, 100.0, "{:.2f}"),
    "gsm8k_flexible_extract": ("GSM8K acc. % (lm-eval flexible-extract)", +1, 100.0, "{:.2f}"),
    "dolly_ppl": ("Dolly PPL", -1, 1.0, "{:.3f}"),
    "rouge_l": ("Dolly ROUGE-L", +1, 1.0, "{:.4f}"),
    "humaneval_python": ("HumanEval-X Py %", +1, 100.0, "{:.1f}"),
    "humaneval_java": ("HumanEval-X Java %", +1, 100.0, "{:.1f}"),
    "humaneval_go": ("HumanEval-X Go %", +1, 100.0, "{:.1f}"),
    "nll_diag": ("NLL in-domain (mean L_ii)", -1, 1.0, "{:.4f}"),
    "nll_off": ("NLL cross-domain (mean L_ij)", -1, 1.0, "{:.4f}"),
    "delta_cross": ("Delta_cross", 0, 1.0, "{:.4f}"),
    "stored_mib": ("stored FP32 LoRA MiB", -1, 1.0, "{:.3f}"),
    "mib_down": ("MiB down / client-round", -1, 1.0, "{:.3f}"),
    "mib_up": ("MiB up / client-round", -1, 1.0, "{:.3f}"),
    "dp_epsilon": ("DP epsilon spent (at dp.delta)", -1, 1.0, "{:.3f}"),
}


def final_metrics(run: str | Path) -> dict[str, float]:
    """The scalar metrics of a finished run's last evaluation (keys of METRICS that it has)."""
    run = Path(run)
    evals = [r for r in read_jsonl(run / "metrics.jsonl") if r["event"] == "eval"]
    if len(evals) < 2:
        raise ValueError(f"{run}: no evaluation after training in metrics.jsonl (is the run finished?)")
    out = metrics_of(evals[-1])
    summ = run / "summary.json"
    if summ.is_file():
        mib = json.loads(summ.read_text())["mib"]
        out["mib_down"], out["mib_up"] = mib["down_per_client_round"], mib["up_per_client_round"]
    stored = stored_lora_mib(run)
    if stored:
        out["stored_mib"] = sum(stored.values())
    eps = privacy_spent(run)
    if eps:
        out["dp_epsilon"] = eps[-1][1]
    return out


def privacy_spent(run: str | Path) -> list[tuple[int, float]]:
    """(round, epsilon spent after it) of a run with federation.dp and noise (docs/privacy.md); [] otherwise
    (no DP, or DP without noise, whose epsilon is unbounded and recorded as null)."""
    rows = read_jsonl(Path(run) / "metrics.jsonl")
    return [(r["round"], float(r["dp_epsilon"])) for r in rows if r["event"] == "server" and r.get("dp_epsilon") is not None]


def metrics_of(ev: dict) -> dict[str, float]:
    """The METRICS-keyed scalars of one eval record (any round)."""
    out: dict[str, float] = {}
    if ev.get("global", {}).get("tokens"):
        out["ppl"], out["nll"] = ev["global"]["ppl"], ev["global"]["nll"]
    pers = [r["personalized"]["nll"] for r in ev.get("clients", {}).values() if "personalized" in r]
    if pers:
        out["personalized_ppl"] = math.exp(sum(pers) / len(pers))
    if ev.get("fidelity", {}).get("tokens"):
        out["agreement"] = ev["fidelity"]["agreement"]
    if "exact_match" in ev.get("gsm8k", {}):
        out["gsm8k"] = ev["gsm8k"]["exact_match"]
        out.update({f"gsm8k_{k}": ev["gsm8k"][k] for k in ("strict_match", "flexible_extract") if k in ev["gsm8k"]})
    if "rouge_l" in ev.get("rouge_l", {}):
        out["rouge_l"], out["dolly_ppl"] = ev["rouge_l"]["rouge_l"], ev["rouge_l"]["ppl"]
    for lang in ("python", "java", "go"):
        r = ev.get(f"humaneval:{lang}", {})
        if "pass@1" in r:
            out[f"humaneval_{lang}"] = r["pass@1"]
    m = ev.get("nll_matrix", {})
    if m.get("delta_cross") is not None:
        out.update(nll_diag=m["diag_mean"], nll_off=m["off_mean"], delta_cross=m["delta_cross"])
    return {k: v for k, v in out.items() if v is not None and math.isfinite(v)}


def stored_lora_mib(run: str | Path) -> dict[str, float]:
    """MiB of the LoRA tensors the run saved (adapters/messenger, adapters/student), measured from the
    safetensors files: the deployment payload of Table V (FP32 LoRA, not the frozen base)."""
    from safetensors import safe_open

    out = {}
    for part in ("messenger", "student"):
        f = Path(run) / "adapters" / part / "adapter_model.safetensors"
        if f.is_file():
            with safe_open(str(f), "pt") as st:
                out[part] = sum(math.prod(st.get_slice(k).get_shape()) * _itemsize(st.get_slice(k).get_dtype())
                                for k in st.keys()) / 2**20
    return out


def _itemsize(dtype: str) -> int:
    return {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4}.get(dtype, 4)


def communication(run: str | Path) -> dict:
    """Per-direction MiB per client per round by component, measured from the serialized payloads
    (summary.json), and the run's totals (Table VI shape)."""
    s = json.loads((Path(run) / "summary.json").read_text())
    n = max(s["client_rounds"], 1)
    mib = s["mib"]
    return {"per_client_round": {d: {k: v / n for k, v in mib["by_component"][d].items()} for d in ("down", "up")},
            "first_contact": mib.get("first_contact", {}),
            "down": mib["down_per_client_round"], "up": mib["up_per_client_round"],
            "total_gib": (mib["down_total"] + mib["up_total"]) / 1024, "rounds": s["rounds"], "client_rounds": n}


def communication_markdown(runs: dict[str, str | Path]) -> str:
    """{method: run dir} -> a Table VI-shaped markdown table."""
    lines = ["| method | downlink MiB / client-round (by component) | uplink MiB / client-round (by component) "
             "| MiB / client once, at first contact | total GiB (both directions) |", "|---|---|---|---|---|"]
    for m, rd in runs.items():
        c = communication(rd)
        parts = {d: ", ".join(f"{k} {v:.3f}" for k, v in c["per_client_round"][d].items()) or "none" for d in ("down", "up")}
        once = ", ".join(f"{k} {v:.3f}" for k, v in c["first_contact"].items()) or "none"
        lines.append(f"| {m} | {c['down']:.3f} ({parts['down']}) | {c['up']:.3f} ({parts['up']}) | {once} "
                     f"| {c['total_gib']:.4f} |")
    return "\n".join(lines) + "\n"


def aggregate(per_seed: dict[str, dict[int, dict[str, float]]]) -> dict:
    """{method: {seed: metrics}} -> {method: {metric: {mean, std, n, values}}}; std is the sample std."""
    out: dict = {}
    for method, seeds in per_seed.items():
        keys = sorted({k for m in seeds.values() for k in m}, key=list(METRICS).index)
        out[method] = {}
        for k in keys:
            vals = [seeds[s][k] for s in sorted(seeds) if k in seeds[s] and seeds[s][k] is not None
                    and not math.isnan(seeds[s][k])]
            if vals:
                out[method][k] = {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                                  "n": len(vals), "values": vals}
    return out


def ranks(agg: dict, metric: str) -> dict[str, int]:
    """1 for the best mean, 2 for the second (ties at display precision share a rank)."""
    label, sign, scale, fmt = METRICS[metric]
    if sign == 0:
        return {}
    shown = {m: float(fmt.format(v[metric]["mean"] * scale)) for m, v in agg.items() if metric in v}
    order = sorted(set(shown.values()), reverse=sign > 0)
    return {m: order.index(x) + 1 for m, x in shown.items() if order.index(x) < 2}


CONTROL_METRICS = ("nll", "personalized_ppl", "agreement")  # the figures every method is held against the control on


def against_control(per_seed: dict[str, dict[int, dict[str, float]]], control: str) -> dict[str, list[dict]]:
    """{metric: pairwise rows (a = each other method, b = `control`)} over CONTROL_METRICS, each row with `beats`:
    the method is better than the control beyond the seed spread (`pairwise`'s `exceeds`, in its favour)."""
    out = {}
    for k in CONTROL_METRICS:
        rows = []
        for m in per_seed:
            if m == control:
                continue
            for r in pairwise({m: per_seed[m], control: per_seed.get(control, {})}, k):
                if r["a"] != m:  # pairwise orders the pair as given; keep a = the method
                    continue
                rows.append({**r, "beats": r["exceeds"] and r["better"] == m})
        if rows:
            out[k] = rows
    return out


def control_marks(vs: dict[str, list[dict]]) -> set[tuple[str, str]]:
    """(method, metric) pairs on which the method does not beat the control beyond the seed spread."""
    return {(r["a"], k) for k, rows in vs.items() for r in rows if not r["beats"]}


def markdown(agg: dict, title: str = "", seeds: list[int] | None = None, control: str | None = None,
             marks: set[tuple[str, str]] = frozenset()) -> str:
    """The comparison table; with a `control`, its row is labelled and each (method, metric) cell in `marks` gets
    a dagger: that method does not beat the control there beyond the seed spread (`against_control`)."""
    metrics = [k for k in METRICS if any(k in v for v in agg.values())]
    rk = {k: ranks(agg, k) for k in metrics}
    head = ["method"] + [METRICS[k][0] + {1: " ↑", -1: " ↓", 0: ""}[METRICS[k][1]] for k in metrics]
    lines = [f"### {title}", ""] if title else []
    if seeds is not None:
        lines += [f"mean ± std over seeds {', '.join(map(str, seeds))}; **best**, <u>second</u> at the shown precision.", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, v in agg.items():
        cells = [f"{method} (control)" if method == control else method]
        for k in metrics:
            if k not in v:
                cells.append("–")
                continue
            _, _, scale, fmt = METRICS[k]
            s = f"{fmt.format(v[k]['mean'] * scale)} ± {fmt.format(v[k]['std'] * scale)}"
            r = rk[k].get(method)
            dagger = " †" if (method, k) in marks else ""
            cells.append((f"**{s}**" if r == 1 else f"<u>{s}</u>" if r == 2 else s) + dagger)
        lines.append("| " + " | ".join(cells) + " |")
    if control is not None and control in agg:
        lines += ["", f"† does not beat the {control} control (the same TAKD schedule with no client learning) beyond "
                  "the seed spread on that metric: the difference of means is not larger than both seed stds with the "
                  "same sign in every seed" + (" (one seed: nothing can beat it)" if seeds and len(seeds) < 2 else "")
                  + "."]
    return "\n".join(lines) + "\n"


def pairwise(per_seed: dict[str, dict[int, dict[str, float]]], metric: str) -> list[dict]:
    """Every pair of methods on `metric`, over the seeds both have: the mean and sample std of the paired
    differences a - b (the seeds share split and pre-alignment, so pairing removes their common part), each
    method's own seed std, which one is better, and `exceeds`: whether the difference is larger than the seed
    spread, i.e. |mean(a) - mean(b)| > max(std(a), std(b)) and every seed's difference has the same sign."""
    sign = METRICS[metric][1] if metric in METRICS else -1
    rows = []
    methods = [m for m in per_seed if any(metric in v for v in per_seed[m].values())]
    for i, a in enumerate(methods):
        for b in methods[i + 1:]:
            seeds = sorted(s for s in per_seed[a] if s in per_seed[b] and _num(per_seed[a][s].get(metric))
                           and _num(per_seed[b][s].get(metric)))
            if not seeds:
                continue
            va, vb = ([per_seed[m][s][metric] for s in seeds] for m in (a, b))
            d = [x - y for x, y in zip(va, vb)]
            sa, sb = (statistics.stdev(v) if len(v) > 1 else 0.0 for v in (va, vb))
            mean_d = statistics.fmean(d)
            better = a if (mean_d * (sign or -1)) > 0 else b
            rows.append({"a": a, "b": b, "n": len(seeds), "diff_mean": mean_d,
                         "diff_std": statistics.stdev(d) if len(d) > 1 else 0.0, "std_a": sa, "std_b": sb,
                         "better": better, "exceeds": len(d) > 1 and abs(mean_d) > max(sa, sb)
                         and (all(x > 0 for x in d) or all(x < 0 for x in d))})
    return rows


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def pairwise_markdown(rows: list[dict], metric: str) -> str:
    label, _, scale, fmt = METRICS.get(metric, (metric, -1, 1.0, "{:.4f}"))
    out = [f"Pairwise on {label} (a - b over paired seeds; 'exceeds' = |difference of means| > both seed stds and "
           "the same sign in every seed):", "", "| a | b | a - b (mean ± std) | std a | std b | better | exceeds seed spread |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        f = fmt.format
        out.append(f"| {r['a']} | {r['b']} | {f(r['diff_mean'] * scale)} ± {f(r['diff_std'] * scale)} | "
                   f"{f(r['std_a'] * scale)} | {f(r['std_b'] * scale)} | {r['better']} | {'yes' if r['exceeds'] else 'no'} |")
    return "\n".join(out) + "\n"
