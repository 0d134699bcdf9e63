"""The LLM-backed environment generator, through the `openai` SDK.

Against a local OpenAI-compatible stand-in that answers with canned tasks (the success path, retries, schema
errors), and end to end against `temper serve`'s own `/v1/chat/completions`, whose randomly initialised model
cannot write a task: the SDK's request reaches temper's server, the structured-output request is refused with a
4xx that says why, and a reply that is not a task fails with a clear error.
"""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
import pytest

import configs
from envs.gate import validate
from envs.generator import LLMGenerator, LLMUnavailable
from rollout.backend import embedded_servers

TASK = {"domain": "math", "instruction": "What is 17 * 23? Use calc, then submit.", "files": {},
        "tools": ["calc"], "hidden": {"a": 17, "b": 23},
        "reference": ["<tool_call>calc 17*23</tool_call>", "<tool_call>submit 391</tool_call>"]}


class _FakeLLM(BaseHTTPRequestHandler):
    verifier: dict = {}
    task: dict = TASK
    bodies: list = []
    fail_first: int = 0  # answer this many requests with 503 first (the SDK retries them)

    def do_POST(self):  # noqa: N802 - http.server API
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        if _FakeLLM.fail_first > 0:
            _FakeLLM.fail_first -= 1
            self.send_response(503)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "overloaded"}}')
            return
        system = body["messages"][0]["content"]
        reply = self.task if system.startswith("You write executable") else self.verifier
        out = {"id": "chatcmpl-1", "object": "chat.completion", "created": int(time.time()), "model": body["model"],
               "choices": [{"index": 0, "finish_reason": "stop",
                            "message": {"role": "assistant", "content": "Here:\n" + json.dumps(reply)}}],
               "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps(out).encode())

    def log_message(self, *a):
        pass


@pytest.fixture
def fake_llm():
    srv = HTTPServer(("127.0.0.1", 0), _FakeLLM)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    _FakeLLM.bodies, _FakeLLM.fail_first, _FakeLLM.task = [], 0, TASK
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_llm_generator_goes_through_the_same_gate(fake_llm, sandbox):
    gen = LLMGenerator(fake_llm, model="stub")
    _FakeLLM.verifier = {"checks": [{"kind": "answer", "name": "product", "expected": "391", "normalize": "number"}]}
    spec = gen.generate("multiplication with a calculator", seed=3)
    assert spec.source == "llm" and spec.family.startswith("llm:")
    # two SDK calls: seeded, greedy, asking for JSON-schema structured output
    task_req, ver_req = _FakeLLM.bodies
    assert task_req["seed"] == 3 and task_req["temperature"] == 0 and task_req["model"] == "stub"
    assert task_req["response_format"]["type"] == "json_schema"
    assert "reference" in task_req["response_format"]["json_schema"]["schema"]["properties"]
    # the verifier writer got the public task and hidden state, never the reference
    user = ver_req["messages"][1]["content"]
    assert "submit 391" not in user and '"a": 17' in user
    assert validate(spec, sandbox).accepted
    _FakeLLM.verifier = {"checks": [{"kind": "python", "name": "lazy", "code": "emit({'pass': True})"}]}
    lazy = gen.generate("multiplication with a calculator", seed=4)
    rep = validate(lazy, sandbox)
    assert not rep.accepted and any(r.startswith("no-op") for r in rep.reasons)


def test_sdk_retries_an_overloaded_endpoint(fake_llm):
    _FakeLLM.verifier = {"checks": [{"kind": "answer", "name": "product", "expected": "391"}]}
    _FakeLLM.fail_first = 1
    spec = LLMGenerator(fake_llm, model="stub", max_retries=2).generate("multiplication", seed=1)
    assert spec.verifier.checks[0].expected == "391"
    assert len(_FakeLLM.bodies) == 3  # the 503, its retry, the verifier call
    _FakeLLM.bodies, _FakeLLM.fail_first = [], 5
    with pytest.raises(ValueError, match="HTTP 503"):
        LLMGenerator(fake_llm, model="stub", max_retries=1).generate("multiplication", seed=1)
    assert len(_FakeLLM.bodies) == 2  # the first try and one retry, then a clear error


def test_a_reply_that_is_not_a_task_names_the_field(fake_llm):
    _FakeLLM.task = {k: v for k, v in TASK.items() if k != "reference"} | {"domain": "chemistry"}
    with pytest.raises(ValueError, match=r"does not fit GeneratedTask: domain: .*; reference: Field required"):
        LLMGenerator(fake_llm, model="stub").generate("multiplication", seed=1)


def test_unreachable_endpoint_is_a_clear_error():
    s = socket.socket()  # a port nothing listens on: bind, read the number, close
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(LLMUnavailable, match="APIConnectionError"):
        LLMGenerator(f"http://127.0.0.1:{port}", model="stub", max_retries=0, timeout=5).generate("x", seed=0)


def test_generator_against_temper_serve_openai_endpoint():
    cfg = configs.load("micro", [])
    with embedded_servers(cfg.model, n=1, n_slots=2, max_len=2048, seed=3) as urls:
        served = httpx.get(urls[0] + "/v1/models").json()["data"][0]["id"]
        # structured output: refused with a reason (temper's engine has no constrained decoding)
        with pytest.raises(ValueError, match=r"HTTP 400.*response_format 'json_schema' is not supported"):
            LLMGenerator(urls[0], model=served, max_tokens=16).generate("multiplication", seed=1)
        # plain text: the SDK's request is served (greedy, seeded, max_tokens honoured); a random model's reply
        # is no task, and the generator says so instead of building a broken spec
        before = httpx.get(urls[0] + "/get_server_info").json()
        with pytest.raises(ValueError, match="holds no JSON object|does not fit GeneratedTask"):
            LLMGenerator(urls[0], model=served, structured=False, max_tokens=16).generate("multiplication", seed=1)
        after = httpx.get(urls[0] + "/get_server_info").json()
    grew = after["stats"]["generated_tokens"] - before["stats"]["generated_tokens"]
    assert 0 < grew <= 16  # one completion reached the engine, cut at the SDK's max_tokens


def test_cli_generates_specs_through_the_llm(fake_llm, tmp_path):
    from envs.dataset import read_dataset
    from pipelines.cli import main

    _FakeLLM.verifier = {"checks": [{"kind": "answer", "name": "product", "expected": "391", "normalize": "number"}]}
    out = tmp_path / "ds"
    assert main(["envs", "generate", "--llm-url", fake_llm, "--llm-model", "stub", "--pattern", "multiplication",
                 "--n", "2", "--out", str(out)]) == 0
    specs = read_dataset(out)
    assert [s.source for s in specs] == ["llm", "llm"] and len({s.id for s in specs}) == 2
    # an endpoint that is down: a clear error and status 1, nothing written
    assert main(["envs", "generate", "--llm-url", "http://127.0.0.1:9", "--pattern", "x", "--n", "1",
                 "--out", str(tmp_path / "none")]) == 1
    assert not (tmp_path / "none").exists()


def test_an_unsafe_generated_spec_is_rejected_with_the_reason(fake_llm, tmp_path):
    """A task whose files escape the workspace, or whose verifier runs workspace code in its own process, is a
    rejected spec (SpecRejected, a ValueError with the reason), never a crash and never written anywhere."""
    from envs.generator import SpecRejected

    gen = LLMGenerator(fake_llm, model="stub")
    _FakeLLM.verifier = {"checks": [{"kind": "answer", "name": "product", "expected": "391", "normalize": "number"}]}
    for path in ("../../etc/cron.d/x", "/root/.bashrc", "a/../../b"):
        _FakeLLM.task = {**TASK, "files": {"notes.txt": "hi", path: "pwned"}}
        with pytest.raises(SpecRejected, match=r"generated task rejected: files\..*task file '" + path.replace(".", r"\.")):
            gen.generate("multiplication", seed=1)
    _FakeLLM.task = {**TASK, "files": {"solution.py": "def mul(a, b):\n    return a + b\n"}}
    _FakeLLM.verifier = {"checks": [{"kind": "python", "name": "runs it", "code": "import sys\nsys.path.insert(0, '.')\n"
                                     "import solution\nemit({'pass': solution.mul(17, 23) == 391})"}]}
    with pytest.raises(SpecRejected, match=r"does not fit GeneratedVerifier: .*import sys.*'calls' check") as e:
        gen.generate("multiplication", seed=1)
    assert isinstance(e.value, ValueError) and e.value.reason == str(e.value)
