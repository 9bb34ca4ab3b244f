"""Bilevel tasks for `federation.bilevel_loop` (docs/rabo.md#tasks): few-shot hyper-representation on Omniglot and
loss tuning on long-tailed CIFAR-10; `build(cfg)` makes one from a BilevelExperiment config."""

from __future__ import annotations

import torch

from ciders.core.hypergrad import grads
from ciders.runtime import derive_seed


def resnet12_widths(w: int) -> tuple[int, int, int, int]:
    """ResNet12 block widths from task.width w: (w, round(2.5 w), 5 w, 10 w); 64 -> (64, 160, 320, 640)."""
    return (w, max(1, round(2.5 * w)), 5 * w, 10 * w)


def _to(st: dict, device: torch.device) -> dict:
    return {k: v.to(device) for k, v in st.items()}


def _episode_to(ep, device: torch.device):
    from dataclasses import fields, replace

    return replace(ep, **{f.name: getattr(ep, f.name).to(device) for f in fields(ep)}) if device.type != "cpu" else ep


class FewShotTask:
    """Few-shot hyper-representation (docs/rabo.md#task-1-few-shot-hyper-representation): x = the backbone's features
    (`backbone`: conv4 of `width` channels, or resnet12 of widths (w, round(2.5 w), 5 w, 10 w), the paper's (64, 160,
    320, 640) at width 64), y = a linear head; the inner loss is support cross-entropy + (reg / 2)|y|^2 (strongly convex
    in y), the outer one query cross-entropy. Clients hold shards of characters (disjoint, or
    `shard_size` drawn each, overlapping);
    evaluation fits a fresh head on each held-out episode's support (`eval_steps` gradient steps) and
    reports query accuracy with a 95% CI."""

    def __init__(self, pool: dict, capacities: list[float], n_way: int = 5, k_shot: int = 1, q_query: int = 5,
                 width: int = 32, reg: float = 0.05, seed: int = 0, eval_pool: dict | None = None,
                 eval_episodes: int = 20, eval_steps: int = 20, eval_lr: float = 0.5, backbone: str = "conv4",
                 shard_size: int = 0, device: torch.device | str = "cpu", official_runs: list | None = None,
                 tune_pool: dict | None = None, episodes: int = 1):
        from ciders.tasks import omniglot as om

        self.device = torch.device(device)
        self.official_runs = official_runs or []
        self.tune_pool = tune_pool or {}  # the tuning split: characters no client trains on, nor the test uses
        self.episodes = episodes  # per client per round

        self.om, self.pool, self.caps = om, pool, capacities
        self.shards = om.shard(sorted(pool), len(capacities), seed, shard_size)
        if min(len(sh) for sh in self.shards) < n_way:
            from ciders.errors import ConfigError

            raise ConfigError(f"a client's shard has {min(len(sh) for sh in self.shards)} characters, fewer than "
                              f"task.n_way = {n_way} ({len(pool)} characters over {len(capacities)} clients); set "
                              f"task.shard_size >= {n_way} (overlapping shards) or use fewer clients")
        self.n_way, self.k_shot, self.q_query, self.width, self.reg, self.seed = n_way, k_shot, q_query, width, reg, seed
        self.eval_pool = eval_pool or pool
        self.eval_episodes, self.eval_steps, self.eval_lr = eval_episodes, eval_steps, eval_lr
        self._episodes: dict = {}
        self._round = -1
        if backbone not in ("conv4", "resnet12"):
            raise ValueError(f"backbone must be conv4 or resnet12, got {backbone!r}")
        self.backbone = backbone
        self.widths = (width,) * 4 if backbone == "conv4" else resnet12_widths(width)

    def clients(self) -> list[float]:
        return list(self.caps)

    def initial(self):
        from ciders.models import vision as vz

        if self.backbone == "resnet12":
            x = vz.resnet12_init(widths=self.widths, seed=derive_seed(self.seed, "bilevel-init"))
        else:
            x = vz.conv4_init(width=self.width, seed=derive_seed(self.seed, "bilevel-init"))
        return _to(x, self.device), _to(vz.linear_init(self.n_way, self.widths[-1]), self.device)

    def units(self) -> dict:
        """The sub-model plan of x and y (`core.masks`): the backbone's channels, and the head's columns
        following its last layer (28x28 images: one feature per channel)."""
        from ciders.models import vision as vz

        if self.backbone == "resnet12":
            return {"x": vz.resnet12_units(), "y": vz.linear_units("block3.residual")}
        return {"x": vz.conv4_units(), "y": vz.linear_units("block3.conv")}

    def flops(self, x_shapes: dict, y_shapes: dict) -> int:
        """Forward FLOPs per example of the model with these parameter shapes (`models.vision`)."""
        from ciders.models import vision as vz

        return vz.backbone_flops(self.backbone, x_shapes, 28) + vz.linear_flops(y_shapes["head.weight"])

    def features(self, x, images):
        from ciders.models import vision as vz

        return (vz.resnet12_features if self.backbone == "resnet12" else vz.conv4_features)(x, images)

    def _episode(self, i: int, q: int, j: int = 0):
        """Client i's episode j of round q (its support is the inner data, its query the outer data). Episode 0
        is drawn from (q, i) alone, so task.episodes = 1 gives the same episodes as before the option existed."""
        if self._round != q:
            self._episodes, self._round = {}, q
        if (i, j) not in self._episodes:
            keys = (q, i) if j == 0 else (q, i, j)
            gen = torch.Generator().manual_seed(derive_seed(self.seed, "bilevel-episodes", *keys))
            ep = self.om.episode(self.pool, self.shards[i], self.n_way, self.k_shot, self.q_query, gen)
            self._episodes[(i, j)] = _episode_to(ep, self.device)
        return self._episodes[(i, j)]

    def round_episodes(self, i: int, q: int) -> list:
        """Client i's `episodes` episodes of round q (the paper's N_m tasks)."""
        return [self._episode(i, q, j) for j in range(self.episodes)]

    def batches(self, i: int, q: int, n: int) -> list:
        """n steps' batches, one episode each, cycling through the round's episodes."""
        eps = self.round_episodes(i, q)
        return [eps[s % len(eps)] for s in range(n)]

    def outer_batch(self, i: int, q: int):
        """The outer data: the round's episode, or all of them (f and g then average over the episodes)."""
        eps = self.round_episodes(i, q)
        return eps[0] if len(eps) == 1 else eps

    def g(self, x, y, ep):
        import torch.nn.functional as F

        from ciders.models import vision as vz

        if isinstance(ep, list):  # (1/N_m) sum_j L_{S_j}, the paper's inner objective over N_m tasks
            return sum(self.g(x, y, e) for e in ep) / len(ep)
        return F.cross_entropy(vz.linear(y, self.features(x, ep.support)), ep.support_labels) + \
            0.5 * self.reg * sum((v ** 2).sum() for v in y.values())

    def f(self, x, y, ep):
        import torch.nn.functional as F

        from ciders.models import vision as vz

        if isinstance(ep, list):
            return sum(self.f(x, y, e) for e in ep) / len(ep)
        return F.cross_entropy(vz.linear(y, self.features(x, ep.query)), ep.query_labels)

    def _score(self, x, ep, n_way: int) -> float:
        """Query accuracy of a fresh head fitted on the episode's support (`eval_steps` steps)."""
        from ciders.models import vision as vz

        ep = _episode_to(ep, self.device)
        with torch.no_grad():
            fs, fq = self.features(x, ep.support), self.features(x, ep.query)
        head = {k: torch.zeros_like(v, device=fs.device, dtype=fs.dtype)
                for k, v in vz.linear_init(n_way, fs.shape[1]).items()}
        for _ in range(self.eval_steps):
            _, gh = grads(lambda a, b: torch.nn.functional.cross_entropy(vz.linear(b, fs), ep.support_labels), {}, head)
            head = {k: head[k] - self.eval_lr * gh[k] for k in head}
        return float((vz.linear(head, fq).argmax(1) == ep.query_labels).float().mean())

    def evaluate(self, x, y) -> dict:
        """Accuracy with a 95% CI over `eval_episodes` held-out N-way K-shot episodes, and (when the task has
        them) over the 20 official 20-way one-shot runs of Lake et al."""
        gen = torch.Generator().manual_seed(derive_seed(self.seed, "bilevel-eval"))
        chars = sorted(self.eval_pool)
        accs = [self._score(x, self.om.episode(self.eval_pool, chars, self.n_way, self.k_shot, self.q_query, gen),
                            self.n_way) for _ in range(self.eval_episodes)]
        out = _mean_ci(accs)
        out["episodes"] = len(accs)
        if self.tune_pool:  # what `ciders bilevel --tune` selects step sizes on, never the test characters
            tg, tc = torch.Generator().manual_seed(derive_seed(self.seed, "bilevel-tune")), sorted(self.tune_pool)
            out["tune_accuracy"] = _mean_ci([self._score(x, self.om.episode(self.tune_pool, tc, self.n_way, self.k_shot,
                                                                            self.q_query, tg), self.n_way)
                                             for _ in range(self.eval_episodes)])["accuracy"]
        if self.official_runs:
            off = _mean_ci([self._score(x, ep, 20) for ep in self.official_runs])
            out.update({"official_runs_accuracy": off["accuracy"], "official_runs_ci95": off["ci95"]})
        return out


def _mean_ci(accs: list[float]) -> dict:
    t = torch.tensor(accs)
    return {"accuracy": float(t.mean()), "ci95": float(1.96 * t.std() / len(accs) ** 0.5) if len(accs) > 1 else 0.0}


# x (the loss's per-class hyperparameters) is never pruned; y's hidden neurons are: fc1's rows and the head's
# matching columns (the classes are never pruned)
LOSSTUNE_UNITS = {"x": {k: (None, None) for k in ("w", "l", "delta")},
                  "y": {"fc1.weight": ("fc1", None), "fc1.bias": ("fc1", None), "head.weight": (None, "fc1"),
                        "head.bias": (None, None)}}


class LossTuneTask:
    """Loss tuning (docs/rabo.md#task-2-loss-tuning-with-the-vs-loss): x = VS-loss (w, l, Delta) per class, y = a
    one-hidden-layer classifier on 8x8-average-pooled pixels (48 features; CPU scale). Clients hold an IID split of the
    long-tailed training set; the outer loss is cross-entropy on a balanced validation set (each client its share);
    evaluation is balanced accuracy on the balanced test set (and, given `tune`, on a disjoint tuning split)."""

    def __init__(self, train, val, test, capacities: list[float], width: int = 32, reg: float = 1e-3, seed: int = 0,
                 device: torch.device | str = "cpu", tune=None):
        import torch.nn.functional as F

        self.device = dev = torch.device(device)

        self.F, self.caps, self.width, self.reg, self.seed = F, capacities, width, reg, seed
        pool = lambda x: F.avg_pool2d(x, 8).flatten(1)  # noqa: E731
        (xt, yt), (xv, yv), (xs, ys) = train, val, test
        n = len(capacities)
        gen = torch.Generator().manual_seed(derive_seed(seed, "losstune-split"))
        pt, pv = torch.randperm(len(yt), generator=gen), torch.randperm(len(yv), generator=gen)
        self.train = [(pool(xt[pt[i::n]]).to(dev), yt[pt[i::n]].to(dev)) for i in range(n)]
        self.val = [(pool(xv[pv[i::n]]).to(dev), yv[pv[i::n]].to(dev)) for i in range(n)]
        self.test = (pool(xs).to(dev), ys.to(dev))
        self.tune = None if tune is None else (pool(tune[0]).to(dev), tune[1].to(dev))

    def clients(self) -> list[float]:
        return list(self.caps)

    def initial(self):
        g = torch.Generator().manual_seed(derive_seed(self.seed, "bilevel-init"))
        y = {"fc1.weight": torch.randn(self.width, 48, generator=g) * (2 / 48) ** 0.5,
             "fc1.bias": torch.zeros(self.width), "head.weight": torch.randn(10, self.width, generator=g) * 0.1,
             "head.bias": torch.zeros(10)}
        x = {"w": torch.ones(10), "l": torch.zeros(10), "delta": torch.ones(10)}
        return _to(x, self.device), _to(y, self.device)

    def units(self) -> dict:
        return LOSSTUNE_UNITS

    def flops(self, x_shapes: dict, y_shapes: dict) -> int:
        """Forward FLOPs per example of the classifier with these shapes (the loss adds O(classes))."""
        from ciders.models import vision as vz

        return vz.linear_flops(y_shapes["fc1.weight"]) + vz.linear_flops(y_shapes["head.weight"])

    def batches(self, i: int, q: int, n: int) -> list:
        return [self.train[i]] * n

    def outer_batch(self, i: int, q: int):
        return self.val[i]

    def _net(self, y, a):
        F = self.F
        return F.linear(torch.relu(F.linear(a, y["fc1.weight"], y["fc1.bias"])), y["head.weight"], y["head.bias"])

    def g(self, x, y, batch):
        from ciders.tasks.longtail import vs_loss

        a, lab = batch
        return vs_loss(self._net(y, a), lab, x["w"], x["l"], x["delta"]) + \
            0.5 * self.reg * sum((v ** 2).sum() for v in y.values())

    def f(self, x, y, batch):
        a, lab = batch
        return self.F.cross_entropy(self._net(y, a), lab)

    def evaluate(self, x, y) -> dict:
        from ciders.tasks.longtail import balanced_accuracy

        with torch.no_grad():
            logits = self._net(y, self.test[0])
            out = {"balanced_accuracy": balanced_accuracy(logits, self.test[1], 10), "test_examples": len(self.test[1])}
            if self.tune is not None:  # the tuning split: what `ciders bilevel --tune` selects step sizes on
                out["tune_balanced_accuracy"] = balanced_accuracy(self._net(y, self.tune[0]), self.tune[1], 10)
        return out


def tuning_split(pool: dict, alphabets: tuple[str, ...], n_way: int) -> tuple[dict, dict]:
    """(training characters, tuning characters): the characters of `alphabets` leave the training pool whole (no
    client ever trains on them) and become the tuning split. Unknown names and a split too small for an n_way
    episode are errors naming the fix."""
    from ciders.errors import ConfigError

    known = sorted({c.split("/")[0] for c in pool})
    bad = [a for a in alphabets if a not in known]
    if bad:
        raise ConfigError(f"task.tune_alphabets: {', '.join(bad)} is not a training alphabet; choose from "
                          f"{', '.join(known)}")
    tune = {k: v for k, v in pool.items() if k.split("/")[0] in set(alphabets)}
    if alphabets and len(tune) < n_way:
        raise ConfigError(f"task.tune_alphabets: {len(tune)} characters, fewer than task.n_way = {n_way}; hold out "
                          "more alphabets")
    return {k: v for k, v in pool.items() if k not in tune}, tune


def head_reg(t) -> float:
    """The few-shot inner loss's L2 weight on y: task.reg, times reg_way / n_way when task.reg_way > 0. The support
    CE is a mean over N k examples, so its gradient on class c's row of y is O(1/N) while (reg/2)|y|^2's is reg y_c:
    with a fixed reg, the head is held N/5 times harder at N-way than at 5-way. Loss tuning does not call this."""
    return t.reg * t.reg_way / t.n_way if t.reg_way else t.reg


def build(cfg):
    """The task of a BilevelExperiment config, from the real data files."""
    from pathlib import Path

    from ciders.tasks.paths import resolve

    from ciders.runtime import resolve_device

    t, caps = cfg.task, cfg.federation.client_capacities()
    root = Path(resolve(t.data))
    dev = resolve_device(cfg.device, "device")
    if t.kind == "fewshot":
        from ciders.tasks import omniglot as om

        pool = om.load_characters(root / "images_background_small1.zip")
        seen = {c.split("/")[0] for c in pool}  # the test excludes every training alphabet, tuning ones included
        pool, tune = tuning_split(pool, t.tune_alphabets, t.n_way)
        held = om.load_characters(root / "images_background_small2.zip")
        held = {k: v for k, v in held.items() if k.split("/")[0] not in seen}
        pool = om.rotations(pool, t.rotations)  # training classes only: evaluation stays on unrotated characters
        return FewShotTask(pool, caps, t.n_way, t.k_shot, t.q_query, t.width, head_reg(t), cfg.seed, eval_pool=held,
                           eval_episodes=t.eval_episodes, eval_steps=t.eval_steps, backbone=t.backbone,
                           shard_size=t.shard_size, device=dev,
                           official_runs=om.one_shot_runs(root / "all_runs.zip") if (root / "all_runs.zip").is_file() else None,
                           tune_pool=tune, episodes=t.episodes)
    from ciders.tasks import longtail as lt

    xs, ys = lt.load_cifar10(root / "cifar10_train_500per_class.zip")
    xt, yt = lt.load_cifar10(root / "cifar10_test.zip")
    tr = lt.per_class_subset(ys, lt.long_tail_counts(t.n_max, 10, t.imbalance))
    va = lt.per_class_subset(yt, [t.val_per_class] * 10)
    held = t.val_per_class + t.tune_per_class  # validation, then the tuning split, then test
    te = lt.per_class_subset(yt, [1000 - held] * 10, offset=held)
    tu = lt.per_class_subset(yt, [t.tune_per_class] * 10, offset=t.val_per_class) if t.tune_per_class else None
    return LossTuneTask((xs[tr], ys[tr]), (xt[va], yt[va]), (xt[te], yt[te]), caps, t.width, t.reg, cfg.seed, device=dev,
                        tune=None if tu is None else (xt[tu], yt[tu]))
