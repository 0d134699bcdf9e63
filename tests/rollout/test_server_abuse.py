"""The server under abuse: every bad input is a 4xx with a reason, one bad request never harms another, control
endpoints answer while every slot streams, work does not outlive its client, and an engine fault is a 5xx."""

import concurrent.futures as cf
import json

import httpx
import pytest

from model import Transformer, save_checkpoint

LONG = {"max_new_tokens": 100, "temperature": 1.0, "ignore_eos": True}


@pytest.fixture
def server(micro_server):
    with micro_server(max_queue=32) as srv_eng:
        yield srv_eng


def _http(srv, timeout=60.0):
    return httpx.Client(base_url=srv.url, timeout=timeout)


def _until(cond, what: str, cap: float = 60.0) -> None:
    """Wait for `cond()`; the cap is a safety net that fails loudly, not a budget."""
    import time

    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > cap:
            raise AssertionError(f"gave up waiting for {what} after {cap} s")
        time.sleep(0.01)


def test_bad_inputs_are_4xx_with_a_reason_and_the_server_serves_on(server, tmp_path):
    srv, eng = server
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    save_checkpoint(Transformer(eng.cfg), corrupt)
    for f in corrupt.glob("*.safetensors"):
        f.write_bytes(b"\x00\x01garbage" * 10)
    js = {"content-type": "application/json"}
    cases = [
        ("/abort_request", {"content": b"{nope", "headers": js}, "malformed JSON"),
        ("/abort_request", {"json": [1, 2]}, "JSON object"),
        ("/update_weight_version", {"content": b"{nope", "headers": js}, "malformed JSON"),
        ("/update_weight_version", {"json": {"new_version": "x"}}, "integer"),
        ("/generate", {"json": {"input_ids": [1], "sampling_params": {"sampling_seed": 2**64}}}, "sampling_seed"),
        ("/generate", {"json": {"input_ids": [1], "sampling_params": {"sampling_seed": -1}}}, "sampling_seed"),
        ("/v1/completions", {"json": {"prompt": "hi", "seed": 2**64}}, "seed"),
        ("/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "hi"}], "seed": 2**70}}, "seed"),
        ("/generate", {"json": {"input_ids": [1], "sampling_params": {"stop_token_ids": [10**6], "min_new_tokens": 2}}},
         "stop_token_ids out of range"),
        ("/generate", {"json": {"input_ids": [1], "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 3}}},
         "exceeds max_new_tokens"),
        ("/update_weights_from_disk", {"json": {"model_path": str(corrupt)}}, ""),
        ("/update_weights_from_disk", {"json": {"model_path": str(tmp_path / "absent")}}, ""),
        ("/update_weights_from_disk", {"json": {"model_path": str(corrupt), "weight_version": "default"}}, ""),
    ]
    version = eng.version
    with _http(srv) as c:
        for path, kw, needle in cases:
            r = c.post(path, **kw)
            assert 400 <= r.status_code < 500, (path, kw, r.status_code, r.text)
            body = r.json()
            msg = body.get("error", {}).get("message") if "error" in body else body.get("message")
            assert msg and needle in msg, (path, body)
        assert eng.version == version  # the corrupt checkpoint changed nothing
        ok = c.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3


def test_a_bad_request_never_harms_its_neighbours(server):
    """Requests that once aborted every co-batched one (an out-of-range stop id with min_new_tokens) are refused
    at the door: the good ones beside them finish whole."""
    srv, eng = server
    good = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    bad = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 12, "min_new_tokens": 4,
                                                         "stop_token_ids": [-3, 10**6]}}
    with _http(srv) as c, cf.ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(c.post, "/generate", json=good if i % 2 == 0 else bad) for i in range(8)]
        res = [f.result() for f in futs]
    for i, r in enumerate(res):
        if i % 2 == 0:
            assert r.status_code == 200 and len(r.json()["output_ids"]) == 12
            assert r.json()["meta_info"]["finish_reason"]["type"] == "length"
        else:
            assert r.status_code == 400


def test_an_engine_fault_is_a_5xx_and_the_next_request_is_served(server):
    srv, eng = server
    real = eng.step
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        out = real()
        if calls["n"] == 1:  # after the step admitted the request: it is running when the fault hits
            raise RuntimeError("injected step failure")
        return out

    eng.step = flaky
    try:
        with _http(srv) as c:
            r = c.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}})
            assert r.status_code == 500 and "injected step failure" in r.json()["error"]["message"]
            ok = c.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}})
            assert ok.status_code == 200
    finally:
        eng.step = real


def test_control_endpoints_answer_while_every_slot_streams(server):
    """Eight open streams (four running, four queued) once left /abort_request and /flush_cache waiting for a free
    worker thread. Here they answer, and the abort ends every stream with an `abort` finish on both APIs."""
    srv, eng = server
    finishes = []

    def native():
        with _http(srv) as c, c.stream("POST", "/generate", json={"input_ids": [1, 2], "stream": True,
                                                                    "sampling_params": LONG}) as s:
            ev = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
        return ev[-1]["meta_info"]["finish_reason"]["type"]

    def openai():
        with _http(srv) as c, c.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True,
                                                                          "max_tokens": 100}) as s:
            ev = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
        return ev[-1]["choices"][0]["finish_reason"]

    with cf.ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(native if i % 2 == 0 else openai) for i in range(8)]
        with _http(srv) as c:
            _until(lambda: eng.load()["running"] == 4, "every slot busy")
            assert c.post("/flush_cache").status_code == 200
            assert c.get("/get_server_info").status_code == 200
            r = c.post("/abort_request", json={"abort_all": True})
            assert r.status_code == 200 and r.json()["aborted"] >= 4
        finishes = [f.result() for f in futs]
    # every stream ended by the abort, unless it finished before it: by length, or (the OpenAI streams, which have no
    # `ignore_eos`) by the random model sampling its EOS token, which CI once saw
    assert all(f in ("abort", "length", "stop") for f in finishes) and finishes.count("abort") >= 4


def test_a_client_that_goes_away_takes_its_work_with_it(server):
    srv, eng = server
    before = eng.stats.aborted
    with _http(srv, timeout=0.5) as c:  # the client gives up while its request waits (the engine is paused)
        for i, (path, body) in enumerate([("/generate", {"input_ids": [1, 2], "sampling_params": LONG}),
                                          ("/v1/completions", {"prompt": "hi", "max_tokens": 100}),
                                          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                    "max_tokens": 100})]):
            eng.pause()
            try:
                with pytest.raises(httpx.ReadTimeout):
                    c.post(path, json=body)
                _until(lambda i=i: eng.stats.aborted - before == i + 1, f"the abort of the {path} request")
            finally:
                eng.resume()
    assert eng.load()["running"] == 0 and eng.load()["waiting"] == 0
    # a stream whose client leaves after the first event is aborted too (on both APIs)
    for i, (path, body) in enumerate([("/generate", {"input_ids": [1, 2], "stream": True, "sampling_params": LONG}),
                                      ("/v1/completions", {"prompt": "hi", "max_tokens": 100, "stream": True})]):
        try:
            with _http(srv) as c, c.stream("POST", path, json=body) as s:
                next(s.iter_lines())
                eng.pause()  # it cannot finish on its own before the server sees the client leave
            _until(lambda i=i: eng.stats.aborted - before == 4 + i, f"the abort of the left {path} stream")
        finally:
            eng.resume()
    with _http(srv) as c:  # and the server serves on
        assert c.post("/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 2}}).status_code == 200


def test_sglang_request_fields_as_slime_sends_them(server):
    """slime's default request: `no_stop_trim`, `spaces_between_special_tokens`, a null `stop` and null
    `stop_token_ids` are accepted and mean what they mean in SGLang; `/v1/loads` reports the engine's load."""
    srv, eng = server
    with _http(srv) as c:
        base = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}}
        free = c.post("/generate", json=base).json()["text"]
        assert len(free) >= 3
        stop = free[1:3]  # a stop string the greedy text is known to contain
        sp = {**base["sampling_params"], "stop": [stop]}
        trimmed = c.post("/generate", json={**base, "sampling_params": sp}).json()
        kept = c.post("/generate", json={**base, "sampling_params": {**sp, "no_stop_trim": True,
                                                                       "spaces_between_special_tokens": True}}).json()
        assert trimmed["text"] == free[:free.index(stop)]
        assert kept["text"] == free[:free.index(stop)] + stop
        nulls = {**base["sampling_params"], "stop": None, "stop_token_ids": None, "skip_special_tokens": True}
        r = c.post("/generate", json={**base, "sampling_params": nulls})
        assert r.status_code == 200 and r.json()["text"] == free
        ld = c.get("/v1/loads").json()["loads"]
        assert ld[0]["dp_rank"] == 0 and ld[0]["num_running_reqs"] == 0 and ld[0]["max_running_requests"] == 4
        assert c.get("/get_load").json() == ld
