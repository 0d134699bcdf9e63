"""SGLang deployments: the launch command, what the checkpoint's config.json must hold, and the rollout resource
starting and stopping a fleet — with a stand-in `sglang.launch_server` module (temper's server behind SGLang's
module name and flags), since SGLang itself needs a GPU."""

import asyncio
import json
import socket
import sys
from pathlib import Path

import httpx
import pytest
import torch

import configs
from assets import RolloutBackend
from model import ByteTokenizer, Transformer, save_checkpoint, weights_checksum
from rollout.backend import ServerBackend
from rollout.sglang import SGLangLaunch, check_checkpoint, router_command, server_command

ROOT = Path(__file__).resolve().parents[2]

# parses the flags temper generates with SGLang's names, refuses a launch without the deterministic top-k
# settings, then serves the checkpoint with temper's engine
STANDIN = '''
import argparse, os, sys
p = argparse.ArgumentParser()
for flag in ("--model-path", "--host", "--port", "--tp-size", "--dtype", "--mem-fraction-static", "--weight-version",
             "--dsa-topk-backend", "--speculative-algorithm", "--speculative-num-steps", "--speculative-eagle-topk",
             "--speculative-num-draft-tokens", "--context-length", "--max-running-requests"):
    p.add_argument(flag)
p.add_argument("--skip-tokenizer-init", action="store_true")
a = p.parse_args()
if a.dsa_topk_backend != "flashinfer" or os.environ.get("SGLANG_DSA_TOPK_FLASHINFER_TIE_BREAK") != "small":
    sys.exit("non-deterministic DSA top-k")
from rollout.server import serve
serve(a.model_path, host=a.host, port=int(a.port), n_slots=4, max_len=int(a.context_length or 512))
'''


@pytest.fixture()
def ckpt(tmp_path):
    torch.manual_seed(0)
    m = Transformer(configs.load("micro").model)
    save_checkpoint(m, tmp_path / "ckpt", policy_version=0)
    return m, tmp_path / "ckpt"


def test_server_command_carries_dsa_determinism_and_mtp(ckpt, tmp_path):
    _, path = ckpt
    argv, env = server_command(path, 30001, SGLangLaunch(tp_size=8, max_running_requests=64))
    flag = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
    assert argv[1:3] == ["-m", "sglang.launch_server"] and flag["--model-path"] == str(path)
    assert flag["--tp-size"] == "8" and flag["--port"] == "30001" and flag["--max-running-requests"] == "64"
    assert flag["--dsa-topk-backend"] == "flashinfer"
    assert env == {"SGLANG_DSA_TOPK_FLASHINFER_DETERMINISTIC": "1", "SGLANG_DSA_TOPK_FLASHINFER_TIE_BREAK": "small"}
    # micro has one MTP layer: served as EAGLE with one draft per step, steps + 1 tokens verified
    assert flag["--speculative-algorithm"] == "EAGLE" and flag["--speculative-eagle-topk"] == "1"
    assert int(flag["--speculative-num-draft-tokens"]) == int(flag["--speculative-num-steps"]) + 1
    # a checkpoint without an MTP layer gets no speculative flags; deterministic top-k can be turned off
    save_checkpoint(Transformer(configs.load("micro", ["model.num_nextn_predict_layers=0"]).model), tmp_path / "nomtp")
    argv2, env2 = server_command(tmp_path / "nomtp", 1, SGLangLaunch(deterministic_topk=False))
    assert "--speculative-algorithm" not in argv2 and "--dsa-topk-backend" not in argv2 and env2 == {}
    assert router_command(["http://a:1", "http://b:2"], 29000)[3:7] == ["--worker-urls", "http://a:1", "http://b:2",
                                                                       "--policy"]


def test_checkpoint_config_is_what_sglang_loads(ckpt):
    _, path = ckpt
    cfg = check_checkpoint(path)
    assert cfg["architectures"] == ["GlmMoeDsaForCausalLM"] and cfg["model_type"] == "glm_moe_dsa"
    raw = json.loads((path / "config.json").read_text())
    del raw["index_topk"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="needs index_topk"):
        check_checkpoint(path)
    raw["index_topk"], raw["architectures"] = 8, ["LlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="do not name GlmMoeDsaForCausalLM"):
        check_checkpoint(path)


def _free_pair() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def test_rollout_resource_launches_a_fleet_and_stops_it(ckpt, tmp_path, monkeypatch):
    model, path = ckpt
    shim = tmp_path / "shim" / "sglang"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("")
    (shim / "launch_server.py").write_text(STANDIN)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'shim'}:{ROOT}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    port = _free_pair()
    res = RolloutBackend(kind="sglang", launch=True, sglang_servers=2, sglang_python=sys.executable, base_port=port)
    cfg = configs.load("micro")
    assert res.for_stages()  # SGLang serves every generating stage
    with res.serving(cfg, str(path)) as (urls, router):
        assert urls == [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"] and router == ""
        b = ServerBackend(urls, tmp_path / "sync")
        rec = b.push(model, 5)
        assert rec["workers"] == 2 and all(httpx.get(u + "/get_model_info").json()["weights_checksum"]
                                           == weights_checksum(model) for u in urls)

        async def go():
            async with b.session() as policy:
                return await policy.generate(ByteTokenizer().encode("hi"), {"max_new_tokens": 3, "ignore_eos": True})

        out = asyncio.run(go())
        assert len(out["output_ids"]) == 3 and out["meta_info"]["output_token_versions"] == [5, 5, 5]
    for u in urls:  # stopped with the step
        with pytest.raises(httpx.TransportError):
            httpx.get(u + "/health", timeout=2)
