"""Nothing silently wrong at the server: a batch is all or nothing, the inputs that were 5xx are 4xx with a reason,
and `/health_generate` answers while paused; a corrupt checkpoint is refused naming its file, one without checksums
unless trusted, and an update from disk never falls back to version 0."""

import httpx
import pytest
import torch

from model import Transformer, save_checkpoint, weights_checksum

SP = {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture
def server(micro_server):
    with micro_server(max_queue=6) as srv_eng:
        yield srv_eng


def _http(srv):
    return httpx.Client(base_url=srv.url, timeout=60)


def test_a_batch_is_validated_whole_before_any_prompt_starts(server):
    """One bad prompt among good ones: 400 naming it, and nothing of the batch was queued (the engine is paused so a
    prompt that had been queued would still be there to see); a batch the queue has no room for: 503, none queued."""
    srv, eng = server
    with _http(srv) as c:
        eng.pause()
        try:
            r = c.post("/generate", json={"input_ids": [[1, 2, 3], [4, 5], [6, 10**6]], "sampling_params": SP})
            assert r.status_code == 400 and eng.load()["waiting"] == 0 and eng.load()["running"] == 0
            assert "batch[2]: token ids out of range" in r.json()["error"]["message"]
            r = c.post("/generate", json={"text": ["ab", "cd", ""], "sampling_params": SP})
            assert r.status_code == 400 and "batch[2]: input_ids is empty" in r.json()["error"]["message"]
            r = c.post("/generate", json={"input_ids": [[1, 2]] * 7, "sampling_params": SP})  # room for 6
            assert r.status_code == 503 and "7 requests do not fit" in r.json()["error"]["message"]
            assert eng.load()["waiting"] == 0
        finally:
            eng.resume()
        r = c.post("/generate", json={"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": SP})
        assert r.status_code == 200 and [len(x["output_ids"]) for x in r.json()] == [40, 40]


def test_the_former_5xx_are_4xx_with_a_reason(server):
    srv, eng = server
    v = eng.version
    with _http(srv) as c:
        r = c.post("/generate", json={"text": []})
        assert r.status_code == 400 and "empty list" in r.json()["error"]["message"]
        for raw in (b'{"new_version": 1e999}', b'{"new_version": 1.5}', b'{"new_version": true}',
                    b'{"new_version": -1}', b'{"new_version": 9223372036854775808}', b'{"new_version": "1e3"}'):
            r = c.post("/update_weight_version", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400 and "new_version must be an integer" in r.json()["error"]["message"], raw
        assert eng.version == v
        r = c.post("/update_weight_version", json={"new_version": "12"})
        assert r.status_code == 200 and eng.version == 12


def test_health_generate_answers_while_paused(server):
    srv, eng = server
    with _http(srv) as c:
        assert c.get("/health_generate").json()["status"] == "ok"
        eng.pause()
        try:
            r = c.get("/health_generate")  # (it once waited for /continue_generation: the client's timeout ended it)
            assert r.status_code == 200 and r.json()["status"] == "paused" and r.json()["paused"] is True
        finally:
            eng.resume()
        assert c.get("/health_generate").json() == {"status": "ok", "paused": False, "tokens": 1}
        assert eng.load()["waiting"] == eng.load()["running"] == 0  # the probe left nothing behind


def test_a_flipped_byte_is_refused_by_update_weights_from_disk_naming_the_file(server, tmp_path):
    srv, eng = server
    torch.manual_seed(3)
    new = Transformer(eng.cfg)
    save_checkpoint(new, tmp_path / "ck", policy_version=7)
    path = tmp_path / "ck" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x04
    path.write_bytes(bytes(data))
    before, version = weights_checksum(eng.model), eng.version
    with _http(srv) as c:
        r = c.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "ck"), "weight_version": 7})
        assert r.status_code == 400 and r.json()["success"] is False
        assert f"ChecksumError: {path}: its bytes do not match" in r.json()["message"]
        assert eng.version == version and weights_checksum(eng.model) == before  # the old weights serve on
        data[-1] ^= 0x04
        path.write_bytes(bytes(data))  # repaired: loads
        r = c.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "ck"), "weight_version": 7})
        assert r.status_code == 200 and eng.version == 7 and weights_checksum(eng.model) == weights_checksum(new)



def test_openai_replies_carry_their_weight_version(server):
    srv, eng = server
    eng.update_weights(state_dict=eng.model.state_dict(), version=31)
    with _http(srv) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["weight_version"] == "31"
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["weight_version"] == "31"


def test_a_fresh_fault_round_s_inputs_are_4xx_and_versions_stay_in_the_store_s_range(server):
    """What a later fault round sent: text with a lone surrogate (a 500 from the tokenizer, and the next request on the
    connection reset), JSON nested past the parser's recursion limit, weight versions the store cannot hold (negative:
    -1 means "no version"; 2**31 and above: the columns are int32) on the weight endpoints, which once took any int."""
    srv, eng = server
    v = eng.version
    with _http(srv) as c:
        for path, body in (("/generate", b'{"text": "a\\ud800b", "sampling_params": {"max_new_tokens": 2}}'),
                           ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}')):
            r = c.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400 and "cannot be encoded" in r.text, (path, r.text)
        deep = b'{"new_version": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        r = c.post("/update_weight_version", content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
        sd = {k: t.detach().clone() for k, t in eng.model.state_dict().items()}
        import base64

        from safetensors.torch import save as st_save

        blob = base64.b64encode(st_save(sd)).decode()
        for bad in (-5, -1, 2**31, 2**70, True, "1" * 30):
            r = c.post("/update_weights_from_tensor", json={"serialized_named_tensors": blob, "weight_version": bad})
            assert r.status_code == 400 and "weight_version" in r.json()["message"], (bad, r.text)
        assert eng.version == v
        r = c.post("/update_weights_from_tensor", json={"serialized_named_tensors": blob, "weight_version": 2**31 - 1})
        assert r.status_code == 200 and eng.version == 2**31 - 1
        assert c.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_a_worker_replying_with_something_other_than_json_is_unavailable_not_a_crash():
    import asyncio

    from rollout.client import EngineClient, EngineUnavailable

    def handler(request):
        return httpx.Response(200, content=b"<html>gateway</html>" if request.url.path == "/generate" else b"[1, 2]")

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            c = EngineClient("http://w", client=http)
            with pytest.raises(EngineUnavailable, match="not JSON"):
                await c._post("/generate", {"input_ids": [1]})
            assert await c._post("/other", {}) == [1, 2]  # a list is a batch reply
    asyncio.run(main())


def test_weights_of_another_model_are_refused_not_half_loaded(server, tmp_path):
    """A checkpoint of another config (a third layer, another rope theta) was loaded with 200: the engine kept its own
    config and dropped the extra layer. And a tensor payload with a weight the model lacks was accepted."""
    import base64

    from safetensors.torch import save as st_save

    srv, eng = server
    v = eng.version
    cfg = eng.model.config.model_copy(update={"rope_theta": eng.model.config.rope_theta * 7})
    save_checkpoint(Transformer(cfg), tmp_path / "other", policy_version=9)
    with _http(srv) as c:
        r = c.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "other")})
        assert r.status_code == 400 and "has another config" in r.json()["message"] and "rope_theta" in r.json()["message"]
        sd = {k: t.detach().clone() for k, t in eng.model.state_dict().items()}
        sd["model.layers.99.extra.weight"] = torch.zeros(2)
        r = c.post("/update_weights_from_tensor", json={"serialized_named_tensors": base64.b64encode(st_save(sd)).decode()})
        assert r.status_code == 400 and "unexpected ['model.layers.99.extra.weight']" in r.json()["message"]
    assert eng.version == v


def _hub_copy(model, path, version=7):
    """`model` saved as a checkpoint from the hub is: HF layout, no temper.json (no recorded version or checksums)."""
    save_checkpoint(model, path, policy_version=version)
    (path / "temper.json").unlink()
    return path


def test_a_hub_checkpoint_is_refused_unless_trusted_and_the_old_weights_serve_on(server, micro_model, tmp_path, caplog):
    """A checkpoint without recorded checksums was loaded unverified and put the version back to 0. Now: without a
    version 400 naming the missing version; with one but unverifiable 400 naming the missing checksums (a `verify`
    that is not a JSON boolean too); the old weights keep serving, stamped with their version. Only `"verify": false`
    loads it: warned in the log, `verified: false` and the version it made live in the reply."""
    from engine_helpers import full_forward_greedy

    srv, eng = server
    torch.manual_seed(5)
    new = Transformer(eng.cfg).eval()
    hub = _hub_copy(new, tmp_path / "hub")
    eng.update_weights(state_dict=micro_model.state_dict(), version=4)
    sp = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    with _http(srv) as c:
        def served():
            out = c.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": sp, "return_logprob": True}).json()
            return out["output_ids"], out["meta_info"]["weight_version"], out["meta_info"]["output_token_versions"]

        r = c.post("/update_weights_from_disk", json={"model_path": str(hub)})
        assert r.status_code == 400 and "records no policy version" in r.json()["message"], r.text
        for bad in ({"weight_version": 8}, {"weight_version": 8, "verify": True}, {"weight_version": 8, "verify": "false"},
                    {"weight_version": 8, "verify": 0}):
            r = c.post("/update_weights_from_disk", json={"model_path": str(hub), **bad})
            assert 400 <= r.status_code < 500 and r.json().get("success") is not True, (bad, r.text)
            assert eng.version == 4 and served() == (full_forward_greedy(micro_model, [1, 2, 3], 4), "4", [4] * 4), bad
        assert "records no checksums" in c.post("/update_weights_from_disk",
                                                json={"model_path": str(hub), "weight_version": 8}).json()["message"]
        with caplog.at_level("WARNING", logger="rollout.engine"):
            r = c.post("/update_weights_from_disk", json={"model_path": str(hub), "weight_version": 8, "verify": False})
        assert r.status_code == 200 and r.json()["verified"] is False and r.json()["weight_version"] == "8"
        assert "UNVERIFIED" in r.json()["message"] and f"loading {hub} without verifying it" in caplog.text
        assert served() == (full_forward_greedy(new, [1, 2, 3], 4), "8", [8] * 4)
        ck = tmp_path / "ck"
        save_checkpoint(micro_model, ck, policy_version=9)  # a temper checkpoint: verified, its recorded version
        r = c.post("/update_weights_from_disk", json={"model_path": str(ck)})
        assert r.status_code == 200 and r.json()["verified"] is True and r.json()["weight_version"] == "9"


def test_an_update_from_disk_never_falls_back_to_version_0(server, micro_model, tmp_path):
    """No version in the request and none recorded (a hub checkpoint, trusted or not; a temper.json that lost its
    `policy_version`): refused, and the engine keeps its version — it never drops to 0 by default. The client sends
    `verify: false` only when asked (SGLang's servers do not know the field)."""
    import asyncio
    import json

    from rollout.client import EngineClient

    srv, eng = server
    hub = _hub_copy(micro_model, tmp_path / "hub")
    ck = tmp_path / "ck"
    save_checkpoint(micro_model, ck, policy_version=3)
    meta = json.loads((ck / "temper.json").read_text())
    (ck / "temper.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "policy_version"}))
    eng.update_weights(state_dict=micro_model.state_dict(), version=6)
    with _http(srv) as c:
        for body in ({"model_path": str(hub), "verify": False}, {"model_path": str(ck)}):
            r = c.post("/update_weights_from_disk", json=body)
            assert r.status_code == 400 and "records no policy version" in r.json()["message"], body
            assert eng.version == 6 and c.get("/get_model_info").json()["weight_version"] == "6"
        r = c.post("/update_weights_from_disk", json={"model_path": str(ck), "weight_version": 0})  # said: taken
        assert r.status_code == 200 and eng.version == 0 and r.json()["verified"] is True
    sent = []

    def handler(request):
        sent.append(json.loads(request.content))
        return httpx.Response(200, json={"success": True})

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            c = EngineClient("http://w", client=http)
            await c.update_weights_from_disk("/ck", weight_version=2)
            await c.update_weights_from_disk("/ck", weight_version=2, verify=False)
    asyncio.run(main())
    assert "verify" not in sent[0] and sent[1]["verify"] is False
