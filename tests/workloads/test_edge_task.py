"""The edge client's task: from the spec and the first broadcast's emulator weights it gives the in-process
client's batches and losses exactly; it refuses to train on placeholder weights, and a node's own data file
is used exactly when the experiment says federation.partition=nodes."""

from types import SimpleNamespace

import pytest
import torch

from ciders.config import load_config
from ciders.core.wire import PayloadError
from ciders.errors import CidersError, ConfigError
from ciders.models.edge_spec import write_spec
from ciders.workloads.edge import EdgeTask
from ciders.workloads.llm import LLMTask
from helpers import edge_task_args

SLICE, BASE = edge_task_args()


@pytest.fixture
def setup(tmp_path):
    cfg = load_config(None, BASE)
    server = LLMTask(cfg, tmp_path / "server", log=lambda s: None)
    write_spec(tmp_path / "node" / "edge", server.edge_spec())
    return cfg, server, tmp_path / "node"


def test_the_edge_task_gives_the_in_process_clients_batches_and_loss(setup):
    cfg, server, state = setup
    task = EdgeTask(cfg, state, "client1")
    torch.manual_seed(0)
    student = {k: torch.randn_like(v) * 0.1 for k, v in server.d.student_state().items()}
    extra = {"student": student, "emulator": server.d.emulator_base_state()}
    server.begin_round(0, {"student": student})
    task.begin_round(0, extra)
    assert (state / "edge" / "model.safetensors").is_file() and task.loaded
    msg = {k: torch.randn_like(v) * 0.1 for k, v in server.initial_messenger().items()}
    a, b = server.batches("client1", 0, 3, cfg.seed), task.batches("client1", 0, 3, cfg.seed)
    for x, y in zip(a, b):
        assert torch.equal(x["hidden"], y["hidden"]) and torch.equal(x["labels"], y["labels"])
        assert torch.equal(server.loss(msg, x), task.loss(msg, y))
    again = EdgeTask(cfg, state, "client1")  # a new process: the stored weights, memory-mapped
    again.begin_round(1, {"student": student})
    assert torch.equal(again.batches("client1", 0, 1, cfg.seed)[0]["hidden"], a[0]["hidden"])


def test_no_training_on_placeholder_weights(setup):
    cfg, _, state = setup
    task = EdgeTask(cfg, state, "client0")
    with pytest.raises(PayloadError, match="does not hold the emulator weights"):
        task.begin_round(0, {})


def test_a_node_data_file_exactly_when_the_partition_is_nodes(setup, tmp_path):
    cfg, _, state = setup
    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join((SLICE / "clients.jsonl").read_text().splitlines(keepends=True)[:5]))
    with pytest.raises(CidersError, match="exactly when federation.partition=nodes"):
        EdgeTask(cfg, state, "client0", data_file=mine)
    nodes = load_config(None, BASE + ["federation.partition=nodes", "algorithm.weighting=uniform", "data.clients=null"])
    with pytest.raises(CidersError, match="exactly when"):
        EdgeTask(nodes, state, "client0")
    task = EdgeTask(nodes, state, "client0", data_file=mine)
    assert len(task.train["client0"]) == 4  # 5 records, the held-out fifth (federation.holdout 0.2) left out


def test_the_nodes_partition_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="weighting=uniform"):
        load_config(None, BASE + ["federation.partition=nodes"])
    cfg = load_config(None, BASE + ["federation.partition=nodes", "algorithm.weighting=uniform", "data.clients=null"])
    from ciders.federation.ciders_loop import run_federation

    task = LLMTask(cfg, tmp_path / "run", log=lambda s: None)
    assert task.clients() == {"client0": 0, "client1": 0}  # the server holds no client data
    with pytest.raises(ConfigError, match="Flower deployment"):
        run_federation(cfg, task, tmp_path / "run", log=lambda s: None, progress=False)


def test_a_bfloat16_first_download_halves_the_bytes_and_rounds_the_weights(tmp_path):
    from ciders.core import wire
    from ciders.models.edge_spec import WEIGHTS

    cfg = load_config(None, BASE)
    server = LLMTask(cfg, tmp_path / "server", log=lambda s: None, edge_dtype=torch.bfloat16)
    write_spec(tmp_path / "node" / "edge", server.edge_spec())
    task = EdgeTask(cfg, tmp_path / "node", "client0")
    extra = server.downlink_extra(SimpleNamespace(student=server.d.student_state()))
    emu = extra["emulator"]
    full = server.d.emulator_base_state()
    assert all(v.dtype == torch.bfloat16 for v in emu.values())
    wire.check(emu, task.downlink_reference()["emulator"], "emulator")  # what the client decodes against
    with pytest.raises(PayloadError):
        wire.check(emu, full, "emulator")  # a float32 reference would refuse it
    task.begin_round(0, {"emulator": emu, "student": extra["student"]})
    mine = task.d.emulator_base_state()
    assert all(mine[k].dtype == torch.float32 and torch.equal(mine[k], full[k].bfloat16().float()) for k in full)
    assert any(not torch.equal(mine[k], full[k]) for k in full)  # rounded: a lossy download
    stored = (tmp_path / "node" / "edge" / WEIGHTS).stat().st_size
    assert stored < 0.6 * sum(v.numel() * 4 for v in full.values())  # kept in bfloat16 on disk


def test_a_node_exports_its_personalized_model_by_itself(setup, tmp_path, capsys):
    """`ciders export NODE_STATE_DIR`: from the node's edge model, the last student LoRA it received and its
    personalized messenger, nothing else. The model equals the server-side export of the same adapters."""
    from safetensors.torch import load_file

    from ciders.algorithms import ciders as alg
    from ciders.federation import codec
    from ciders.cli import main
    from ciders.core.store import RoundStore
    from ciders.models.export import export_edge_model

    cfg, server, state = setup
    task = EdgeTask(cfg, state, "client1")
    torch.manual_seed(1)
    student = {k: torch.randn_like(v) * 0.1 for k, v in server.d.student_state().items()}
    mine = {k: torch.randn_like(v) * 0.1 for k, v in server.initial_messenger().items()}
    assert main(["export", str(state), "--out", str(tmp_path / "early")]) == 2  # before its first round
    assert "holds no emulator weights yet" in capsys.readouterr().err
    task.begin_round(0, {"student": student, "emulator": server.d.emulator_base_state()})
    c0 = {k: torch.zeros_like(v) for k, v in mine.items()}
    RoundStore(state / "store").put("client1", 0, *codec.client_record(alg.ClientState("client1", c0, 0, None, mine)))
    assert main(["export", str(state), "--out", str(tmp_path / "out-node"), "--client", "client0"]) == 2
    assert "client1's node, not client0's" in capsys.readouterr().err
    assert main(["export", str(state), "--out", str(tmp_path / "out-node")]) == 0
    assert "client1's edge model (round 0 record" in capsys.readouterr().out
    export_edge_model(server.d, tmp_path / "server", messenger=mine, student=student)
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("out-node", "server"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    card = (tmp_path / "out-node" / "README.md").read_text()
    assert "client **client1**'s personalized messenger" in card and "Exported on the node" in card
    info = __import__("json").loads((tmp_path / "out-node" / "ciders_export.json").read_text())
    assert info["client"] == "client1" and info["record_round"] == 0


def test_the_servers_chat_template_is_rendered_bounded_on_the_client(setup):
    import time

    from ciders.tasks.text import Example, render_chat

    cfg, server, state = setup
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"  # 10^10 steps
    write_spec(state / "edge", {**server.edge_spec(), "chat_template.jinja": loop.encode()})
    task = EdgeTask(cfg, state, "client0")
    t0 = time.monotonic()
    with pytest.raises(PayloadError, match="chat template ran over its bound"):
        render_chat(Example("hi", "ho", (("user", "hi"),)), task.tok)
    assert time.monotonic() - t0 < 5
