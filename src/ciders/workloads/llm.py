"""The LLM task of CIDERS for the engines: decomposition, public data and TAKD on the server side,
client data and the messenger loss on the client side, and AdapEmu evaluation (docs/method.md#algorithm-2-one-round).
The data (disjoint public / client / evaluation parts and the partition) come from `ciders.tasks.federated`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ciders.config import ExperimentConfig
from ciders.errors import CidersError
from ciders.eval.metrics import perplexity, top1_agreement
from ciders.federation import console
from ciders.fileio import write_json
from ciders.models.distill import TAKDState, TeacherCache, distill, init_state, takd_from_record, takd_record
from ciders.models.messenger_loss import MessengerLoss, step_compute_dtype
from ciders.workloads import evaluation
from ciders.workloads.client_side import ClientSide
from ciders.workloads.prealign import build
from ciders.tasks import federated
from ciders.tasks.text import batches as iter_batches
from ciders.phases import phase


class LLMTask(ClientSide):
    """The server side (the full model, public data, TAKD, evaluation), which in-process is also every
    client's side (`ClientSide`): in-process clients share the server's model. A Flower client is an
    `EdgeTask` (`workloads.edge`), which holds AdapEmu only."""

    def __init__(self, cfg: ExperimentConfig, out: str | Path, log=console.info,
                 prealign_cache: str | Path | None = None, edge_dtype: torch.dtype | None = None,
                 edge_quantize: str = "none"):
        from ciders.algorithms import configure

        cfg = configure(cfg)  # a baseline's TAKD settings (FedBiOT, FedOT) live in its config
        self.cfg, self.log = cfg, log
        self.prealign_cache = None if prealign_cache is None else Path(prealign_cache)
        # Flower: the dtype of the emulator's first download (None: as held). In-process clients share the
        # server's model, so nothing is cast for them.
        self.edge_dtype = edge_dtype
        self.edge_quantize, self._quantized = edge_quantize, None  # Flower: int8 downloads, made once (frozen)
        with phase("model and data"):
            federated.check_sources(cfg)  # a mistyped data path fails before minutes of model loading
            self.d, self.tok = build(cfg)
            self.pad = self.tok.pad_token_id
            s = self.d.split
            log(f"model {cfg.model.name}: {s.n_layers} layers on {self.d.device} ({self.d.base.dtype}); messenger "
                f"{s.messenger_layers} layers, B_F {s.teacher_layers}, B_L {s.student_layers} at {list(s.student_indices)}")
            self._load_data(Path(out))
        log(f"data: {len(self.public)} public, {len(self.global_eval)} global eval, clients "
            + ", ".join(f"{c} {len(self.train[c])}+{len(self.heldout[c])}" for c in sorted(self.train)) + " (train+heldout)")
        tc = cfg.takd
        self.cache = None
        if tc.teacher_cache != "off":
            bar = console.bar(total=len(self.public), desc="teacher cache B_F(x)", unit="ex", leave=False)
            self.cache = TeacherCache.build(self.d, self.public, self.pad, batch_size=cfg.data.eval_batch_size,
                                            mode=tc.teacher_cache, directory=Path(out) / "teacher_cache",
                                            memory_limit_mib=tc.cache_memory_mib,
                                            progress=lambda i, n: bar.update(i - bar.n))
            bar.close()
        a = cfg.algorithm
        step_dtype = step_compute_dtype(a.metagrad, a.hvp, self.d.base.dtype)
        if step_dtype is not None:
            log(f"client steps: messenger evaluations in {step_dtype} (FD Hessian-vector product on a "
                f"{self.d.base.dtype} base; docs/method.md#eq-7-finite-difference-meta-gradient-fd)")
        self.loss = MessengerLoss(self.d, compute_dtype=step_dtype)
        self._hidden: dict[tuple[str, int], torch.Tensor] = {}
        self._eval_bar = None  # the running evaluation's progress bar (`evaluate`)

    def _load_data(self, out: Path) -> None:
        self.data = federated.build(self.cfg, self.tok)
        self.public, self.global_eval = self.data.public, self.data.global_eval
        n = self.cfg.takd.plateau_examples  # held out of TAKD: they decide when pre-alignment has plateaued
        if n and n >= len(self.public):
            raise CidersError(f"takd.plateau_examples={n} leaves no public data for TAKD ({len(self.public)} examples)")
        self.plateau_set, self.public = self.public[:n], self.public[n:]
        self.train, self.heldout = self.data.train, self.data.heldout
        if self.cfg.eval.split == "validation":  # tuning: every evaluation reads the validation parts instead
            self.heldout = self.data.validation
            self.global_eval = [f for cid in sorted(self.heldout) for f in self.heldout[cid]]
        write_json(out / "data.json", self.data.info)

    # ------------------------------------------------------------------ task protocol
    def initial_extra(self):
        """TAKD pre-alignment (Algorithm 1 step 8). With a `prealign_cache` directory, a result computed
        earlier for the same inputs (`prealign.key`: model, decomposition, LoRA, TAKD, data, seed) is
        reused bit for bit (loaded onto the model's device by `extra_from_record`): `ciders compare` shares one pre-alignment across the methods of a seed."""
        if self.prealign_cache is not None:
            from ciders.workloads import prealign as pa

            key = pa.key(self.cfg, self.public)
            hit = pa.load_cached(self.prealign_cache, key)
            if hit is not None:
                self.log(f"TAKD pre-alignment: reusing {self.prealign_cache / key}.safetensors")
                return hit
            res = self._prealign()
            pa.store_cached(self.prealign_cache, key, *res)
            return res
        return self._prealign()

    @phase("pre-alignment")
    def _prealign(self):
        tc = self.cfg.takd
        bar = console.bar(total=tc.bootstrap_steps, desc="round -1 TAKD pre-alignment", unit="step")

        def on_step(rec: dict) -> None:
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.3f}")

        msg = self.d.messenger_state()
        st, hist, curve = init_state(self.d), [], []
        # in chunks of plateau_every steps when a plateau set is held out (the same steps as one call: each step's
        # batch and dropout derive from (seed, step)); the bootstrap's own task weight (takd.lambda_task_bootstrap)
        chunk = tc.plateau_every if self.plateau_set else max(tc.bootstrap_steps, 1)
        while len(hist) < tc.bootstrap_steps and not _flat(curve, tc.plateau_tol, tc.plateau_patience):
            st, h = distill(self.d, st, msg, self.public, tc.bootstrap(), min(chunk, tc.bootstrap_steps - len(hist)),
                            pad_id=self.pad, seed=self.cfg.seed, cache=self.cache, on_step=on_step)
            hist += h
            if self.plateau_set:
                self.d.load_student(st.student)
                curve.append({"step": len(hist), "nll": self._ppl(msg, self.plateau_set)["nll"]})
        bar.close()
        t, m = takd_record(st)
        pre = {"steps": len(hist), **({"first_loss": hist[0]["loss"], "last_loss": hist[-1]["loss"]} if hist else {})}
        if curve:
            pre["plateau_curve"] = curve
            self.log(f"TAKD pre-alignment: {len(hist)} steps, held-out NLL " + " -> ".join(
                f"{c['nll']:.3f}" for c in curve) + (" (plateau)" if _flat(curve, tc.plateau_tol, tc.plateau_patience)
                                                     else " (cap: takd.bootstrap_steps)"))
        return t, m, pre

    def extra_from_record(self, tensors: dict, meta: dict) -> TAKDState:
        dev = self.d.device
        st = takd_from_record({k: v.to(dev) for k, v in tensors.items()}, meta)
        self.d.load_student(st.student)
        return st

    def extra_record(self, extra: TAKDState):
        return takd_record(extra)

    def downlink_extra(self, extra: TAKDState) -> dict:
        """The student LoRA (every round) and the emulator's frozen base weights (first contact only)."""
        emu = self.d.emulator_base_state()
        if self.edge_quantize != "none":
            if self._quantized is None:  # the base weights are frozen: quantized once per run
                from ciders.models import edge_quant
                from ciders.models.edge import plain_names

                self._quantized = edge_quant.quantize_state(self.d.adapemu.config.to_dict(), plain_names(emu),
                                                            self.edge_quantize)
            return {"student": extra.student, "emulator": self._quantized}
        if self.edge_dtype is not None:
            emu = {k: v.to(self.edge_dtype) for k, v in emu.items()}
        return {"student": extra.student, "emulator": emu}

    def edge_spec(self) -> dict[str, bytes]:
        """What a Flower client needs at first contact to build AdapEmu without the full model (`models.edge`)."""
        from ciders.models.edge import edge_spec

        return edge_spec(self.d, self.tok, self.edge_dtype, self.edge_quantize)

    def model_sizes(self) -> dict:
        """MiB of parameters: the full model the server holds and the emulator an edge client holds (base
        weights and both LoRA adapters), to set beside what edge clients report (`client_resources`)."""
        def mib(ts) -> float:
            return sum(t.numel() * t.element_size() for t in ts) / 2**20

        d = self.d
        adapters = list(d.messenger_params().values()) + list(d.student_params().values())
        return {"full_model": mib(d.base.parameters()), "emulator": mib(list(d.emulator_base_params().values()) + adapters)}

    def static_extra(self) -> set[str]:
        """Sent at a client's first contact only: the emulator's base weights (B_L, messenger layers,
        embeddings, head), and, without per-round TAKD (FedOT, LocalOT), the student LoRA too."""
        return {"emulator", "student"} if self.cfg.takd.round_steps == 0 else {"emulator"}

    def begin_round(self, t: int, downlink_extra: dict) -> None:
        if "emulator" in downlink_extra:  # absent in-process after first contact (shared model)
            self.d.load_emulator_base(downlink_extra["emulator"])
        if "student" in downlink_extra:  # absent when static and this client already holds it
            self.d.load_student(downlink_extra["student"])
        self._hidden.clear()  # B_L may have changed: cached backbone outputs are stale
        self.d.messenger_top.train()  # LoRA dropout during client steps

    def after_server(self, t: int, server, extra: TAKDState):
        self.d.messenger_top.eval()
        tc = self.cfg.takd
        if tc.round_steps == 0:
            return extra, {"steps": 0}
        with console.bar(total=tc.round_steps, desc=f"round {t} TAKD", unit="step", leave=False) as bar:
            st, hist = distill(self.d, extra, server.messenger, self.public, tc, tc.round_steps, pad_id=self.pad,
                               seed=self.cfg.seed, cache=self.cache, on_step=lambda rec: bar.update(1))
        return st, {"steps": tc.round_steps, "loss": sum(h["loss"] for h in hist) / len(hist),
                    "hidden": hist[-1]["hidden"], "kl": hist[-1]["kl"], "ce": hist[-1]["ce"]}

    def _batches(self, feats: list[dict]):
        """The evaluation batches of `feats`, counted on the running evaluation's bar."""
        for b in iter_batches(feats, self.cfg.data.eval_batch_size, self.pad, self.d.device):
            yield b
            if self._eval_bar is not None:
                self._eval_bar.update(b["input_ids"].shape[0])

    def _ppl(self, messenger: dict, feats: list[dict]) -> dict:
        self.d.load_messenger(messenger)
        return perplexity(self.d.adapemu, self._batches(feats))

    def _ppls(self, messengers: list[dict], feats: list[dict]) -> list[dict]:
        """`_ppl` of each messenger on the same examples, with B_L(x) computed once for all of them: AdapEmu =
        messenger o B_L, and only the messenger differs (the client loss relies on the same identity)."""
        if len(messengers) == 1:
            return [self._ppl(messengers[0], feats)]
        cached = []
        for b in self._batches(feats):
            with torch.inference_mode():
                h = self.d.backbone_hidden(b["input_ids"], b["attention_mask"])
            cached.append({"inputs_embeds": h, "attention_mask": b["attention_mask"], "labels": b["labels"]})
        out = []
        for m in messengers:
            self.d.load_messenger(m)
            out.append(perplexity(self.d.messenger_top, cached))
        return out

    def evaluate(self, t: int, server, personalized: dict) -> dict:
        """AdapEmu response NLL/PPL: global messenger on the global held-out set and on each client's
        held-out part; each client's personalized messenger on its own held-out part. Without
        communication (LocalOT) there is no global messenger: "global" figures and task metrics are the
        mean over the clients' own messengers (`local_models` says how many)."""
        pers = {cid: {k: v.to(self.d.device) for k, v in st.items()} for cid, st in personalized.items()}
        tasks = self.cfg.eval.tasks if t >= 0 or self.cfg.eval.tasks_before else ()
        local = not self.cfg.algorithm.communicate and pers
        held = sum(len(self.heldout[c]) for c in (pers if local else self.train) if self.heldout.get(c))
        # examples through the model: ppl of each messenger on the global set (and its fidelity), the held-out parts
        n = (len(pers) if local else 1) * len(self.global_eval) * (1 + self.cfg.eval.fidelity) + held
        with console.bar(total=n, desc=f"round {t} evaluation", unit="ex", leave=False) as self._eval_bar:
            try:
                return self._evaluate_local(server, pers, tasks) if local else self._evaluate(server, pers, tasks)
            finally:
                self._eval_bar = None

    def _fidelity(self, messenger: dict) -> dict:
        """Top-1 next-token agreement of AdapEmu with AdapFu, both with `messenger`, on the global held-out set."""
        self.d.load_messenger(messenger)
        return top1_agreement(self.d.adapemu, self.d.adapfu, self._batches(self.global_eval))

    def _evaluate(self, server, pers: dict, tasks) -> dict:
        out = {"global": self._ppl(server.messenger, self.global_eval), "clients": {}}
        if self.cfg.eval.fidelity:
            out["fidelity"] = self._fidelity(server.messenger)
        for cid in sorted(self.train):
            if not self.heldout[cid]:
                continue
            both = [server.messenger] + ([pers[cid]] if cid in pers else [])
            figures = self._ppls(both, self.heldout[cid])
            row = {"global": figures[0]}
            if cid in pers:
                row["personalized"] = figures[1]
            elif not self.cfg.algorithm.client_learning:  # takd-only: a client's model is the global one
                row["personalized"] = figures[0]
            out["clients"][cid] = row
        for name in tasks:  # scheduled task evaluations of the AdapEmu path
            out[name] = self._task(name, server.messenger, pers)
        self.d.load_messenger(server.messenger)
        return out

    def _evaluate_local(self, server, pers: dict, tasks) -> dict:
        runs = []
        for cid, m in sorted(pers.items()):
            r = {"global": self._ppl(m, self.global_eval)}
            if self.cfg.eval.fidelity:
                r["fidelity"] = self._fidelity(m)
            for name in tasks:
                if name != "nll_matrix":
                    r[name] = self._task(name, m, {})
            runs.append(r)
        out = _mean_tree(runs)
        out["clients"] = {cid: {"personalized": self._ppl(pers[cid], self.heldout[cid])}
                          for cid in sorted(pers) if self.heldout.get(cid)}
        if "nll_matrix" in tasks:
            out["nll_matrix"] = self._task("nll_matrix", server.messenger, pers)
        out["local_models"] = len(runs)
        self.d.load_messenger(server.messenger)
        return out

    def _task(self, name: str, messenger: dict, pers: dict) -> dict:
        self.d.load_messenger(messenger)
        msgs = {self.data.client_label[c]: m for c, m in pers.items() if c in self.data.client_label}
        if name == "nll_matrix" and len(msgs) < len(self.data.eval_by_label):
            return {"skipped": "not every domain's client has a personalized messenger yet"}
        return evaluation.evaluate(name, self.d.adapemu, self.tok, self.cfg.eval, data=self.data, seed=self.cfg.seed,
                                   messengers=msgs, load_messenger=self.d.load_messenger,
                                   max_length=self.cfg.data.max_length)

    def finalize(self, out: Path, server, extra: TAKDState) -> None:
        """The run's final global messenger and student LoRA as PEFT directories (for `ciders export`)."""
        self.d.save_messenger(Path(out) / "adapters" / "messenger", server.messenger)
        self.d.save_student(Path(out) / "adapters" / "student", extra.student)


def _flat(curve: list[dict], tol: float, patience: int) -> bool:
    """The last `patience` checks each lowered the held-out NLL by less than `tol` (from the check before it)."""
    if len(curve) <= patience:
        return False
    nll = [c["nll"] for c in curve[-patience - 1:]]
    return all(a - b < tol for a, b in zip(nll, nll[1:]))


def _mean_tree(trees: list):
    """Elementwise mean of same-shaped metric trees (numbers averaged; perplexities recomputed as
    exp(mean NLL) where an 'nll' sits beside them; other leaves taken from the first tree)."""
    import math

    first = trees[0]
    if isinstance(first, dict):
        out = {k: _mean_tree([t[k] for t in trees if isinstance(t, dict) and k in t]) for k in first}
        if "nll" in out and "ppl" in out and isinstance(out["nll"], float):
            out["ppl"] = math.exp(out["nll"])
        return out
    if isinstance(first, (int, float)) and not isinstance(first, bool) and all(
            isinstance(t, (int, float)) for t in trees):
        return sum(trees) / len(trees) if isinstance(first, float) or len(set(trees)) > 1 else first
    return first


def render(summary: dict) -> str:
    """The demo table: AdapEmu held-out response NLL / PPL before and after, and MiB per direction."""
    before, after = summary["eval_before"], summary["eval_after"] or {}
    lines = ["AdapEmu held-out response perplexity (NLL)        before              after"]

    def cell(r):
        return f"{r['ppl']:9.3f} ({r['nll']:.3f})" if r else f"{'-':>17}"

    g0, g1 = before["global"], after.get("global")
    lines.append(f"  global messenger, global eval ({g0['tokens']} tok)".ljust(48) + f"{cell(g0)}   {cell(g1)}")
    for cid, row in sorted((after.get("clients") or before.get("clients") or {}).items()):
        b = before.get("clients", {}).get(cid, {})
        # a method without a global messenger after training (LocalOT) has only the personalized row after
        tok = (row.get("global") or b.get("global") or row.get("personalized") or {}).get("tokens", "?")
        lines.append(f"  {cid} global messenger ({tok} tok)".ljust(48)
                     + f"{cell(b.get('global'))}   {cell(row.get('global'))}")
        lines.append(f"  {cid} personalized messenger".ljust(48) + f"{cell(None)}   {cell(row.get('personalized'))}")
    mib = summary["mib"]
    comp = mib["by_component"]
    n = max(summary["client_rounds"], 1)

    def parts(d):
        return ", ".join(f"{k} {v / n:.3f}" for k, v in d.items())

    lines.append(f"MiB per client per round: downlink {mib['down_per_client_round']:.3f} ({parts(comp['down'])}); "
                 f"uplink {mib['up_per_client_round']:.3f} ({parts(comp['up'])})")
    once = mib.get("first_contact") or {}
    if once:
        lines.append("MiB per client, once at first contact: " + ", ".join(f"{k} {v:.3f}" for k, v in once.items()))
    lines.append(f"MiB in total over {summary['rounds']} rounds, {summary['client_rounds']} client-rounds: "
                 f"downlink {mib['down_total']:.2f}, uplink {mib['up_total']:.2f}")
    return "\n".join(lines)
