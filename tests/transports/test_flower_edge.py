"""A real edge deployment: SuperNodes that cannot see the full model's files (nor any model cache) and
read their own data files (federation.partition=nodes) complete a run whose adapters equal, bit for bit,
the in-process run on the same files (partition=files). The edge client builds AdapEmu from the edge spec
and the emulator weights it received, and reports its own footprint."""

import json
import subprocess

import pytest
from safetensors.torch import load_file

from ciders.fileio import read_jsonl
from flower_helpers import TINY, deployment, local_run

pytestmark = pytest.mark.flower


def _hide(path) -> list[str]:
    """A command prefix: run under a private mount namespace where `path` is an empty tmpfs."""
    return ["unshare", "-m", "sh", "-c", f'mount -t tmpfs none "{path}" && exec "$@"', "sh"]


def _model_dir(tmp_path):
    from ciders.models.load import build_tiny, byte_tokenizer

    d = tmp_path / "full-model"
    build_tiny("tiny-qwen2").save_pretrained(d)
    byte_tokenizer().save_pretrained(d)
    return d


def _client_files(tmp_path, n=3):
    from conftest import ROOT

    rows = (ROOT / "data" / "gsm8k-slice" / "clients.jsonl").read_text().splitlines()[:24]
    files = []
    for i in range(n):
        f = tmp_path / "node-data" / f"client{i}.jsonl"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("\n".join(rows[i::n]) + "\n")
        files.append(f)
    return files


def test_edge_nodes_without_the_full_model_and_with_their_own_data(tmp_path):
    model, files = _model_dir(tmp_path), _client_files(tmp_path)
    probe = subprocess.run([*_hide(model), "ls", "-A", str(model)], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"mount namespaces unavailable here ({probe.stderr.strip()[:120]})")
    assert probe.stdout.strip() == ""  # inside, the model directory is empty
    cfg = tmp_path / "edge.yaml"
    cfg.write_text(TINY.replace("name: tiny-qwen2", f"name: {model}").replace(
        "algorithm: {local_steps: 2,", "algorithm: {weighting: uniform, local_steps: 2,"))
    files_arg = "[" + ", ".join(str(f) for f in files) + "]"
    local_run(cfg, tmp_path / "local", ["federation.partition=files", f"data.client_files={files_arg}"])
    dep = deployment(tmp_path)
    out = tmp_path / "run"
    empty = tmp_path / "no-cache"
    env = {"HF_HOME": str(empty / "hf"), "HF_HUB_OFFLINE": "1", "CIDERS_CACHE": str(empty / "ciders")}
    try:
        dep.start_superlink()
        for i in range(3):
            dep.register(i)
            dep.start_supernode(i, 3, dep.work / "nodes" / f"client{i}", env=env, data_file=files[i], wrap=_hide(model))
        dep.wait_online(3)
        run_id = dep.launch(cfg, out, ["federation.partition=nodes", "data.clients=null"])
        assert dep.wait_run(run_id, timeout=600) == "finished:completed", dep.run_log(run_id)[-3000:]
    finally:
        dep.stop()
    rows = read_jsonl(out / "metrics.jsonl")
    server = [r for r in rows if r["event"] == "server"]
    assert len(server) == 2 and all(r["accepted"] == ["client0", "client1", "client2"] for r in server), server
    for part in ("messenger", "student"):  # the same training, bit for bit
        fa, fb = (next((d / "adapters" / part).glob("*.safetensors")) for d in (tmp_path / "local", out))
        ta, tb = load_file(fa), load_file(fb)
        assert ta.keys() == tb.keys() and all((ta[k] == tb[k]).all() for k in ta), part
    assert not any(r["event"] == "eval" and r.get("clients") for r in rows)  # the server has no client data
    assert "clients" not in json.loads((out / "data.json").read_text())["reports"]
    for i in range(3):
        edge = dep.work / "nodes" / f"client{i}" / "edge"
        conf = json.loads((edge / "config.json").read_text())
        assert conf["num_hidden_layers"] == 4 and (edge / "model.safetensors").is_file()  # AdapEmu: 2 B_L + 2 P_M
    summary = json.loads((out / "summary.json").read_text())
    res, sizes = summary["client_resources"], summary["model_mib"]
    assert sorted(res) == ["client0", "client1", "client2"] and all(r["peak_rss_mib"] > 50 for r in res.values())
    assert sizes["emulator"] < sizes["full_model"]
    assert all(r["disk_mib"] < 4 * sizes["full_model"] for r in res.values())
    # on the device, still without the full model: the node exports its personalized model by itself
    import sys

    exported = tmp_path / "client1-onnx"
    r = subprocess.run([*_hide(model), sys.executable, "-m", "ciders.cli", "export", str(dep.work / "nodes" / "client1"),
                        "--out", str(exported), "--format", "onnx"], capture_output=True, text=True, timeout=600,
                       env={**__import__("os").environ, **env})
    assert r.returncode == 0 and "client1's edge model (round 1 record" in r.stdout, r.stdout + r.stderr
    from ciders.models.onnx_run import EdgeSession

    assert len(EdgeSession(exported).generate([1, 2, 3], 4, stop_at_eos=False)) == 4
