"""Every shipped experiment config loads and validates, each method resolves from it, and the paper-
scale ones decompose their models as Table II says (from the public config.json, no weights)."""


import pytest

from ciders import algorithms
from ciders.config import load_config
from ciders.errors import ConfigError
from ciders.models.plan import make_plan
from conftest import ROOT

CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))
FIX = ROOT / "tests" / "fixtures" / "configs"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_config_loads_and_every_method_resolves(path):
    if path.name.startswith("rabo_"):  # a bilevel experiment (`ciders bilevel`)
        from ciders.config.bilevel import BilevelExperiment

        cfg = load_config(path, cls=BilevelExperiment)
    else:
        cfg = load_config(path)
        private = cfg.federation.secure_aggregation or cfg.federation.dp.enabled
        for m in algorithms.METHODS:
            if private and not algorithms.configure(cfg.__class__(), m).algorithm.communicate:
                with pytest.raises(ConfigError, match="uploads nothing"):  # LocalOT has nothing to protect
                    algorithms.configure(cfg, m)
                continue
            algorithms.configure(cfg, m).validate()
    assert cfg.name and path.read_text().startswith("#")  # a header says what it is and how to run it


@pytest.mark.parametrize("name,fixture,student,mib", [
    ("protocol_a_gsm8k", "qwen2.5-3b", 24, 4.76), ("protocol_a_dolly", "qwen2.5-3b", 24, 4.76),
    ("protocol_a_code", "qwen2.5-3b", 24, 4.76), ("ablation_output_kl", "qwen2.5-3b", 24, 4.76),
    ("protocol_b", "qwen2-1.5b", 18, 3.77), ("compression_sweep", "qwen2-1.5b", 18, 3.77),
])
def test_paper_configs_match_table_ii(name, fixture, student, mib):
    cfg = load_config(ROOT / "configs" / "paper" / f"{name}.yaml")
    d = cfg.decomposition
    p = make_plan(str(FIX / fixture / "config.json"), d.messenger_layers, drop_ratio=d.drop_ratio,
                  messenger_lora=cfg.lora.messenger, student_lora=cfg.lora.student)
    assert p.student_layers == student and round(p.consensus_mib, 2) == mib
    a = cfg.algorithm
    assert (a.lr, a.tau, a.alpha, a.eps_prox, a.optimizer, cfg.federation.rounds, cfg.takd.round_steps,
            cfg.takd.lambda_out) == (1e-4, 0.02, 0.002, 0.01, "adamw", 150, 5, 0.5)


@pytest.mark.parametrize("name,fd_eta", [("protocol_a_gsm8k", 1e-3), ("protocol_a_dolly", 1e-3),
                                         ("protocol_a_code", 1e-3), ("ablation_output_kl", 1e-3),
                                         ("protocol_b", 5e-4)])
def test_paper_configs_set_the_papers_hvp_weight_and_eq4(name, fd_eta):
    a = load_config(ROOT / "configs" / "paper" / f"{name}.yaml").algorithm
    assert (a.fd_eta, a.eps_fd, a.consensus_space) == (fd_eta, 1e-4, "paper")
