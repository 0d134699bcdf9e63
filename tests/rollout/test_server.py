"""Every endpoint's contract, including bad input, against a live server on 127.0.0.1."""

import base64
import json

import httpx
import pytest

from model import save_checkpoint


@pytest.fixture(scope="module")
def server(micro_server):
    with micro_server(max_queue=8) as srv_eng:
        yield srv_eng


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server[0].url, timeout=60) as c:
        yield c


def test_generate_native(http):
    r = http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5, "temperature": 0,
                                                                               "ignore_eos": True},
                                     "return_logprob": True})
    assert r.status_code == 200
    d = r.json()
    assert len(d["output_ids"]) == 5 and d["meta_info"]["completion_tokens"] == 5
    assert d["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    lps = d["meta_info"]["output_token_logprobs"]
    assert [x[1] for x in lps] == d["output_ids"] and all(x[0] <= 0 for x in lps)
    inp = d["meta_info"]["input_token_logprobs"]
    assert inp[0][0] is None and [x[1] for x in inp] == [1, 2, 3]
    batch = http.post("/generate", json={"input_ids": [[1, 2], [3, 4, 5]], "sampling_params": {"max_new_tokens": 2}})
    assert all(len(b["output_ids"]) <= 2 for b in batch.json())
    assert batch.status_code == 200 and len(batch.json()) == 2
    text = http.post("/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert text.json()["meta_info"]["prompt_tokens"] == 5
    score = http.post("/generate", json={"input_ids": [7, 8, 9, 10], "sampling_params": {"max_new_tokens": 0},
                                         "return_logprob": True, "logprob_start_len": 0}).json()
    assert score["output_ids"] == [] and len(score["meta_info"]["input_token_logprobs"]) == 4


def test_generate_stream(http):
    with http.stream("POST", "/generate", json={"input_ids": [1, 2], "stream": True, "sampling_params": {
            "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert len(last["output_ids"]) == 4 and last["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"input_ids": [1], "foo": 1}, "unknown field `foo`"),
        ({"input_ids": [1], "sampling_params": {"bogus": 1}}, "unknown field `sampling_params.bogus`"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "temperature"),
        ({"input_ids": "abc"}, "input_ids"),
        ({"input_ids": [1] * 120, "sampling_params": {"max_new_tokens": 20}}, "exceeds the context length"),
        ({"input_ids": [1], "text": "x"}, "exactly one of"),
        ({}, "exactly one of"),
        ({"input_ids": [99999]}, "out of range"),
        ({"input_ids": [], "sampling_params": {}}, "empty"),
        ({"input_ids": [1], "return_hidden_states": True}, "not supported"),
    ],
)
def test_bad_generate_requests_get_400_with_a_reason(http, body, needle):
    r = http.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_malformed_json_and_server_survives(http):
    r = http.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/health_generate").status_code == 200


def test_queue_full_answers_503(server):
    srv, eng = server
    eng.pause()
    try:
        with httpx.Client(base_url=srv.url, timeout=5) as c:
            import concurrent.futures as cf

            with cf.ThreadPoolExecutor(12) as pool:
                futs = [pool.submit(c.post, "/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})
                        for _ in range(12)]
                import time

                time.sleep(1.0)
                eng.resume()
                codes = sorted(f.result().status_code for f in futs)
        assert codes.count(503) >= 1 and codes.count(200) >= 8
    finally:
        eng.resume()


def test_weight_updates(http, server, micro_model, tmp_path):
    _, eng = server
    save_checkpoint(micro_model, tmp_path / "ck", policy_version=3)
    r = http.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "ck")})
    assert r.status_code == 200 and r.json()["success"]
    assert http.get("/get_model_info").json()["weight_version"] == "3"
    out = http.post("/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True},
                                       "return_logprob": True}).json()
    assert out["meta_info"]["weight_version"] == "3" and out["meta_info"]["output_token_versions"] == [3, 3]
    bad = http.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "missing")})
    assert bad.status_code == 400 and bad.json()["success"] is False
    from safetensors.torch import save as st_save

    blob = base64.b64encode(st_save({k: v.contiguous() for k, v in micro_model.state_dict().items()})).decode()
    r = http.post("/update_weights_from_tensor", json={"serialized_named_tensors": blob, "weight_version": 4})
    assert r.json()["success"] and eng.version == 4
    assert http.post("/update_weights_from_tensor", json={"serialized_named_tensors": "!!"}).status_code == 400
    assert http.post("/update_weight_version", json={"new_version": 11}).json()["success"] and eng.version == 11
    assert http.post("/update_weight_version", json={"new_version": "x"}).status_code == 400


def test_control_and_info_endpoints(http):
    assert http.post("/pause_generation").json()["success"]
    assert http.post("/continue_generation").json()["success"]
    assert http.post("/flush_cache").json()["success"] and http.get("/flush_cache").status_code == 200
    assert http.post("/abort_request", json={"rid": "nope"}).json() == {"success": True, "aborted": 0}
    assert http.post("/abort_request", json={"abort_all": True}).json()["success"]
    assert http.post("/abort_request", json={"rid": "x", "zap": 1}).status_code == 400
    for path in ("/model_info", "/get_model_info"):
        assert http.get(path).json()["is_generation"] is True
    for path in ("/server_info", "/get_server_info"):
        info = http.get(path).json()
        assert info["max_running_requests"] == 4 and info["context_length"] == 128
    assert http.get("/v1/models").json()["data"][0]["id"] == "temper"


def test_openai_completions_and_chat(http):
    r = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4, "temperature": 0, "logprobs": 1,
                                           "stop": ["<never>"]})
    d = r.json()
    assert r.status_code == 200 and d["object"] == "text_completion" and d["usage"]["completion_tokens"] == 4
    assert len(d["choices"][0]["logprobs"]["token_logprobs"]) == 4
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    d = r.json()
    assert r.status_code == 200 and d["choices"][0]["message"]["role"] == "assistant"
    assert d["choices"][0]["finish_reason"] in ("stop", "length")
    with http.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 3, "stream": True}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
    # greedy: a sampled token could be the end token (once in a suite run), and the finish would be "stop"
    with http.stream("POST", "/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "stream": True,
                                                      "temperature": 0}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert http.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}).status_code == 400
    assert http.post("/v1/chat/completions", json={"messages": []}).status_code == 400
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": -2}).status_code == 400
    assert http.post("/v1/completions", json={"prompt": "x", "best_of": 2}).status_code == 400


def test_settled_holds_back_what_can_still_change():
    from rollout.server import settled

    assert settled("ab\ufffd", []) == "ab"  # a multi-byte character still arriving
    assert settled("xyz ST", ["STOP"]) == "xyz "  # maybe the start of a stop string
    assert settled("xyz S", ["STOP", "Sx"]) == "xyz "
    assert settled("xyz", ["STOP"]) == "xyz"
    # the stopping token is in, the finish not yet marked: the view already ends where the finished text will
    assert settled("\ufffd2\ufffd1\\}", ["1\\}"]) == "\ufffd2"
    assert settled("ab STOP cd Sx", ["Sx", "STOP"]) == "ab "


def _streamed(http, path, body) -> tuple[str, str]:
    with http.stream("POST", path, json={**body, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    key = "delta" if path.endswith("chat/completions") else None
    text = "".join((e["choices"][0]["delta"].get("content", "") if key else e["choices"][0]["text"]) for e in events)
    return text, events[-1]["choices"][0]["finish_reason"]


def test_openai_stream_text_equals_the_non_stream_text(http):
    """Byte-level tokens split UTF-8 characters and stop strings arrive a token at a time: the concatenated stream
    deltas must still equal the non-streamed text, with the same finish reason, on both OpenAI endpoints."""
    checked_multibyte = 0
    for prompt in ["abc", "héllo wörld", "zz", "\u00e9\u00e8\u00ea", "q"]:
        base = {"prompt": prompt, "max_tokens": 40, "temperature": 0}
        full = http.post("/v1/completions", json=base).json()["choices"][0]
        checked_multibyte += any(ord(ch) > 127 for ch in full["text"])
        cases = [base]
        if len(full["text"]) > 6:  # a stop string the text contains: trimmed in both forms
            cases.append({**base, "stop": [full["text"][3:6]]})
        for body in cases:
            want = http.post("/v1/completions", json=body).json()["choices"][0]
            got, fin = _streamed(http, "/v1/completions", body)
            assert (got, fin) == (want["text"], want["finish_reason"]), (body, got, want)
        chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 40, "temperature": 0}
        want = http.post("/v1/chat/completions", json=chat).json()["choices"][0]
        got, fin = _streamed(http, "/v1/chat/completions", chat)
        assert (got, fin) == (want["message"]["content"], want["finish_reason"])
    assert checked_multibyte  # the random micro model emits non-ASCII bytes: the split-character case was hit
