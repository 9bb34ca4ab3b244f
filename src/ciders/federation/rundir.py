"""The run directory: the interface between `ciders run`, `eval`, `compare` and `report`, shared by the
in-process and the Flower engines (`federation.rounds`). Checkpoints commit a round by one atomic pointer
write (checkpoints/LATEST); metrics.jsonl holds the reproducible numbers, timing.jsonl the wall clock."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ciders.config import ExperimentConfig, dump_yaml, load_run_config, to_dict
from ciders.errors import CidersError
from ciders.federation import console
from ciders.fileio import acquire_lock, append_jsonl, atomic_dir, read_jsonl, remove_leftovers, write_json, write_text
from ciders.runtime import derive_seed
from ciders.phases import phase

MIB = 2**20
RUN_SUBDIRS = ("checkpoints", "clients", "clients-secagg", "server", "eval", "adapters", "teacher_cache")  # a run writes below root


def sample_clients(ids: list[str], m: int | None, seed: int, t: int) -> list[str]:
    if m is None or m >= len(ids):
        return list(ids)
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(derive_seed(seed, "client-sampling", t)))
    return [ids[i] for i in sorted(perm[:m].tolist())]


class RunDir:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.ckpt = self.root / "checkpoints"
        self.metrics = self.root / "metrics.jsonl"
        self.timing = self.root / "timing.jsonl"

    def committed(self) -> int | None:
        p = self.ckpt / "LATEST"
        if not p.is_file():
            return None
        try:
            return int(json.loads(p.read_text())["round"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CidersError(f"{p} is unreadable ({exc}); the run directory is damaged") from exc

    def refuse_unless(self, resume: bool) -> int | None:
        """The last committed round; an error if there is one and `resume` is not set."""
        committed = self.committed()
        if committed is not None and not resume:
            raise CidersError(f"{self.root} already holds a run (round {committed} committed); pass --resume to "
                              "continue it or choose another --out")
        return committed

    @phase("I/O")
    def save_checkpoint(self, t: int, tensors: dict, meta: dict, keep: int) -> None:
        from safetensors.torch import save_file

        with atomic_dir(self.ckpt / f"round_{t + 1:06d}") as tmp:  # round -1 (pre-alignment) -> round_000000
            save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp / "state.safetensors"))
            (tmp / "state.json").write_text(json.dumps(meta, indent=2))
        write_json(self.ckpt / "LATEST", {"round": t})  # the commit point
        for old in sorted(self.ckpt.glob("round_*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    def remove_leftovers(self, committed: int | None) -> int:
        """What a killed process left behind: atomic-write scratch (*.tmp, *.partial) in the run directory
        and the subdirectories a run writes, and checkpoint directories of rounds after `committed` (written,
        never committed; all of them when nothing is committed). Client state on Flower (flower-clients/)
        is its clients' own; other directories (an --out given with --force) are not searched. Returns how
        many entries were removed."""
        n = remove_leftovers(self.root, within=RUN_SUBDIRS)
        last = -1 if committed is None else committed + 1  # round t lives in round_{t+1}
        for d in self.ckpt.glob("round_*") if self.ckpt.is_dir() else ():
            idx = d.name[len("round_"):]
            if d.is_dir() and idx.isdigit() and int(idx) > last:
                shutil.rmtree(d, ignore_errors=True)
                n += 1
        return n

    def load_checkpoint(self, t: int) -> tuple[dict, dict]:
        from safetensors.torch import load_file

        d = self.ckpt / f"round_{t + 1:06d}"
        if not d.is_dir():
            raise CidersError(f"checkpoint for round {t} missing in {self.ckpt}; the run directory is damaged")
        tensors = {k: v.clone() for k, v in load_file(str(d / "state.safetensors")).items()}  # aligned (core.wire)
        return tensors, json.loads((d / "state.json").read_text())

    def truncate_metrics(self, committed: int) -> None:
        for path in (self.metrics, self.timing):
            if path.exists():
                keep = [r for r in read_jsonl(path) if r.get("round", -1) <= committed]
                write_text(path, "".join(json.dumps(r) + "\n" for r in keep))


EXTENDABLE = "federation.rounds"  # the one key a resume may change (upwards): continue a finished run for longer
SCHEDULES = ("lr schedules (algorithm.schedule) are redefined over the new total of client steps from the first "
             "round run after the extension; rounds already run keep the rates they had; gamma schedules depend on "
             "the round number only and continue unchanged")


def start_run(run: RunDir, cfg, resume: bool, log=console.info, extend_rounds: bool = False) -> int | None:
    """The one rule for run directories, for every method family: a directory that holds a committed run
    is continued only with `resume`, and only with the same config (else an error says what differs; with
    `extend_rounds`, federation.rounds may grow: see `check_same_config`); otherwise the run starts afresh
    (its config.yaml written, earlier metrics removed). Only one process at a time may hold a run directory
    (an advisory lock; a second one gets an error); what a killed process left (scratch files, uncommitted
    checkpoints) is removed. Returns the last committed round, or None for a fresh run."""
    acquire_lock(run.root)  # one process per run directory (held until the run ends: `fileio.locked`)
    committed = run.refuse_unless(resume)
    before = check_same_config(run, cfg, extend_rounds) if committed is not None else None
    n = run.remove_leftovers(committed)
    if n:
        log(f"{run.root}: removed {n} leftovers of an interrupted process (scratch files, uncommitted checkpoints)")
    if committed is not None:
        run.truncate_metrics(committed)  # records of the round the checkpoint does not hold
        if before is not None:
            _extend(run, cfg, committed, before, log)
        return committed
    for p in (run.metrics, run.timing):
        p.unlink(missing_ok=True)
    write_text(run.root / "config.yaml", dump_yaml(cfg))
    return None


def _extend(run: RunDir, cfg, committed: int, before: int, log) -> None:
    """The run continues for more rounds: config.yaml takes the new total and metrics.jsonl records the
    extension (event "extend", at the last committed round) with the rule its schedules follow."""
    rounds = cfg.federation.rounds
    write_text(run.root / "config.yaml", dump_yaml(cfg))
    append_jsonl(run.metrics, {"event": "extend", "round": committed, "rounds_before": before, "rounds": rounds,
                               "schedules": SCHEDULES})
    log(f"--resume: federation.rounds {before} -> {rounds}: rounds {committed + 1}..{rounds - 1} follow; {SCHEDULES}")


def config_differences(a: dict, b: dict, path: str = "") -> list[str]:
    """The dotted keys at which two config dicts differ (the keys of `a`)."""
    out: list[str] = []
    for k, x in a.items():
        key = f"{path}.{k}" if path else k
        y = b.get(k) if isinstance(b, dict) else None
        if isinstance(x, dict):
            out += config_differences(x, y if isinstance(y, dict) else {}, key)
        elif x != y:
            out.append(key)
    return out


def check_same_config(run: RunDir, cfg, extend_rounds: bool = False) -> int | None:
    """An error unless `cfg` is the run's config.yaml. With `extend_rounds`, federation.rounds may be
    larger than the stored one (and nothing else may differ): returns the stored rounds then, else None."""
    path = run.root / "config.yaml"
    if not path.is_file():
        raise CidersError(f"--resume: {path} is missing; the run directory is damaged")
    saved = load_run_config(path, cls=type(cfg))
    keys = config_differences(to_dict(saved), to_dict(cfg))
    others = [k for k in keys if not (extend_rounds and k == EXTENDABLE)]
    if others:
        more = f" (and {len(others) - 1} more: {', '.join(others[1:4])})" if len(others) > 1 else ""
        allowed = f"; only {EXTENDABLE} may change, and only upwards" if extend_rounds else ""
        raise CidersError(f"--resume: the config differs from the run's config.yaml at '{others[0]}'{more}; resume "
                          f"with the same config{allowed}")
    if not keys:
        return None
    old, new = saved.federation.rounds, cfg.federation.rounds
    if new < old:
        raise CidersError(f"--resume: {EXTENDABLE} can only grow (the run's config.yaml has {old}, got {new}); a run "
                          "is not shortened")
    return old


def summarize(run: RunDir, cfg: ExperimentConfig, once: set[str] | frozenset = frozenset()) -> dict:
    """Totals and per-client-round MiB by component. Components a client downloads only at first contact
    (`once`: e.g. the emulator's base weights) are reported per client, not averaged into the rounds."""
    rows = read_jsonl(run.metrics)
    rounds = [r for r in rows if r["event"] == "round"]
    evals = [r for r in rows if r["event"] == "eval"]
    down = sum(sum(r["bytes_down"].values()) for r in rounds)
    up = sum(sum(r["bytes_up"].values()) for r in rounds)
    n_cr = sum(len(r["clients"]) for r in rounds)
    by_comp: dict[str, dict[str, float]] = {"down": {}, "up": {}}
    first: dict[str, float] = {}
    for r in rounds:
        for d, key in (("down", "bytes_down"), ("up", "bytes_up")):
            for k, v in r[key].items():
                acc = first if d == "down" and k in once else by_comp[d]
                acc[k] = acc.get(k, 0) + v / MIB
    n_clients = max(len({c for r in rounds for c in r["clients"]}), 1)
    down -= sum(first.values()) * MIB  # per client-round: the recurring traffic only
    res: dict[str, dict] = {}  # what edge clients report about themselves (Flower); a claim, shown as such
    for r in rows:
        if r["event"] == "client" and "peak_rss_mib" in r:
            c = res.setdefault(r["client"], {"peak_rss_mib": 0.0, "disk_mib": 0.0})
            c["peak_rss_mib"] = max(c["peak_rss_mib"], float(r["peak_rss_mib"]))
            c["disk_mib"] = float(r.get("disk_mib", c["disk_mib"]))
    return {
        "rounds": len(rounds), "client_rounds": n_cr,
        "loss_first_round": rounds[0]["loss"] if rounds else None, "loss_last_round": rounds[-1]["loss"] if rounds else None,
        "eval_before": evals[0] if evals else None, "eval_after": evals[-1] if len(evals) > 1 else None,
        "mib": {"down_total": down / MIB + sum(first.values()), "up_total": up / MIB,
                "down_per_client_round": down / MIB / max(n_cr, 1), "up_per_client_round": up / MIB / max(n_cr, 1),
                "by_component": by_comp,
                "first_contact": {k: v / n_clients for k, v in first.items()},  # MiB per client, sent once
                "first_contact_total": first},
        **({"client_resources": res} if res else {}),
    }
