"""HTTP server for the embedded engine: SGLang's native API subset plus OpenAI completions.

Native: POST /generate, /update_weights_from_disk, /update_weights_from_tensor, /update_weight_version,
/pause_generation, /continue_generation, /flush_cache, /abort_request; GET /health, /health_generate,
/model_info, /get_model_info, /server_info, /get_server_info, /v1/models.
OpenAI: POST /v1/completions, /v1/chat/completions (plain and `stream: true` server-sent events).

Requests are validated strictly: unknown fields, wrong types, negative limits and over-long prompts get
400 with the reason; a full queue gets 503; anything else that goes wrong inside a request gets 500 and
the server goes on. A batch is all or nothing: every prompt is checked, and the queue's room for all of them,
before any starts. A checkpoint whose files do not match their recorded checksums is refused (400, naming the
file); one that records no checksums (from the hub) is refused (400) unless the request says `"verify": false`
(loaded with a warning; the reply says `"verified": false`). An update from disk serves the request's
`weight_version`, else the version the checkpoint records, else it is refused (400): never a default. Every reply's
`weight_version` is the version that computed it (a weight update's reply: the version it made live);
`/health_generate` says when generation is paused instead of waiting for it to resume.

    temper serve --checkpoint DIR --port 30000 [--device cuda --dtype bfloat16 --cuda-graphs]
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import queue
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from model.tokenizer import ChatTemplate

from .engine import Engine, EngineError, GenRequest, QueueFull
from .sampling import SamplingParams
from .schemas import (
    UNSUPPORTED_FLAGS,
    ChatBody,
    CompletionBody,
    GenerateBody,
    UpdateFromDisk,
    UpdateFromTensor,
    parse_version,
)


def _reason(err: ValidationError | RequestValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"] if x != "body")
        if e["type"] == "extra_forbidden":
            parts.append(f"unknown field `{loc}`")
        else:
            parts.append(f"{loc}: {e['msg']}" if loc else e["msg"])
    return "; ".join(parts)


def _version_or_raise(v) -> int | None:
    """A weight update's `weight_version`: None (keep counting), else what `parse_version` accepts ([0, 2**31)),
    else a ValueError (the update's 400)."""
    if v is None:
        return None
    got = parse_version(v)
    if got is None:
        raise ValueError(f"weight_version {str(v)[:40]!r}: expected an integer in [0, 2**31)")
    return got


def bad(msg: str, code: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": msg, "code": code}}, status_code=code)


async def _json_object(request: Request) -> dict | JSONResponse:
    """The request's JSON object, or a 400 saying why not (malformed JSON was once a 500)."""
    try:
        body = await request.json()
    except (ValueError, RecursionError) as e:  # (nested past the parser's recursion limit: once a 500)
        return bad(f"malformed JSON: {type(e).__name__}: {str(e)[:200]}")
    if not isinstance(body, dict):
        return bad("expected a JSON object")
    return body


async def _next_chunk(q: queue.Queue):
    """The next streamed chunk, without holding a worker thread while waiting: a stream parked in
    `asyncio.to_thread` once used up the default executor, and control endpoints waited behind it."""
    while True:
        try:
            return q.get_nowait()
        except queue.Empty:
            await asyncio.sleep(0.005)


def create_app(engine: Engine, model_path: str = "", served_name: str = "temper") -> FastAPI:
    app = FastAPI(title="temper engine", docs_url=None, redoc_url=None)
    tpl = ChatTemplate(engine.tok)
    control = ThreadPoolExecutor(max_workers=4, thread_name_prefix="control")  # never shared with generation

    async def in_control(fn, *a, **kw):
        return await asyncio.get_running_loop().run_in_executor(control, functools.partial(fn, *a, **kw))

    async def chunks(r: GenRequest):
        """The kinds of `r`'s streamed chunks, up to and including "finish". A stream that ends early (its client
        went away, which cancels the task) aborts `r`; the abort is handed off, not awaited, as this task is
        being cancelled."""
        try:
            while True:
                kind, *_ = await _next_chunk(r.chunks)
                yield kind
                if kind == "finish":
                    return
        finally:
            if not r.future.done():
                control.submit(engine.abort, r.rid)

    async def until_done(request: Request | None, reqs: list[GenRequest]) -> None:
        """Wait for `reqs`; a client that goes away aborts them (its work does not outlive it)."""
        futs = [asyncio.wrap_future(r.future) for r in reqs]
        while True:
            done, _ = await asyncio.wait(futs, timeout=0.1)
            if len(done) == len(futs):
                return
            if request is not None and await request.is_disconnected():
                for r in reqs:
                    if not r.future.done():
                        await in_control(engine.abort, r.rid)
                await asyncio.gather(*futs, return_exceptions=True)
                return

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        return bad(_reason(exc))

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception):
        return bad(f"internal error: {type(exc).__name__}: {exc}", 500)

    def params(d: dict[str, Any]) -> SamplingParams:
        try:
            return SamplingParams(**d)
        except ValidationError as e:
            raise EngineError(
                _reason(e).replace("unknown field `", "unknown field `sampling_params.")
                + f" (expected one of {', '.join(SamplingParams.model_fields)})"
            ) from None

    def reply_version(r: GenRequest) -> int:
        """The weight version that computed `r`'s reply: the scoring one, else the one it finished under (a weight
        update re-prefills running requests, so that version computed its last rows), else (unfinished) now's."""
        for v in (r.scored_version, r.finish_version):
            if v is not None:
                return v
        return engine.version

    def meta(r: GenRequest) -> dict:
        m = {"id": r.rid, "prompt_tokens": len(r.input_ids), "completion_tokens": len(r.output_ids),
             "cached_tokens": r.reused, "finish_reason": r.finish,
             "weight_version": str(reply_version(r)),
             "e2e_latency": time.perf_counter() - r.t_arrival}
        if r.spec_verify:
            m["spec_verify_ct"] = r.spec_verify
            m["spec_accept_length"] = len(r.output_ids) / r.spec_verify
        if r.return_logprob:
            dec = engine.tok.decode
            m["output_token_logprobs"] = [[lp, t, dec([t])] for lp, t in zip(r.output_logprobs, r.output_ids)]
            m["output_token_versions"] = r.output_versions
            start = max(r.logprob_start_len, 0)
            m["input_token_logprobs"] = [[lp, t, None] for lp, t in
                                         zip(r.input_logprobs[start:], r.input_ids[start:])]
            if r.scored_version is not None:  # scored whole by the trainers' own function (Engine._score)
                m["exact_scoring"] = True
        return m

    def text_of(r: GenRequest) -> str:
        text = engine.tok.decode(r.output_ids, skip_special=r.params.skip_special_tokens)
        m = (r.finish or {}).get("matched")
        if isinstance(m, str) and m in text:  # SGLang trims the matched stop string unless `no_stop_trim`
            text = text[: text.index(m) + (len(m) if r.params.no_stop_trim else 0)]
        return text

    # ---- native ----------------------------------------------------------------------------------
    @app.post("/generate")
    async def generate(body: GenerateBody, request: Request):
        try:
            on = [f for f in UNSUPPORTED_FLAGS if getattr(body, f)]
            if on:
                return bad(f"not supported by the embedded engine: {', '.join(on)}")
            if (body.text is None) == (body.input_ids is None):
                return bad("give exactly one of `text` or `input_ids`")
            batch = isinstance(body.text, list) or (bool(body.input_ids) and isinstance(body.input_ids[0], list))
            if isinstance(body.text, list) and not body.text:  # (`input_ids: []` is an empty prompt: refused below)
                return bad("`text` is an empty list: a batch needs at least one prompt")
            prompts = ([engine.tok.encode(t) for t in body.text] if isinstance(body.text, list) else
                       [engine.tok.encode(body.text)] if body.text is not None else
                       body.input_ids if batch else [body.input_ids])
            if batch and body.stream:
                return bad("stream is not supported for batch requests")
            rids = body.rid if isinstance(body.rid, list) else [body.rid] * len(prompts)
            if len(rids) != len(prompts):
                return bad("rid list and prompt list differ in length")
            sp = params(body.sampling_params)
            reqs = [GenRequest(list(p), sp.model_copy(), rid=rid or uuid.uuid4().hex, session_id=body.session_id,
                               return_logprob=body.return_logprob, logprob_start_len=body.logprob_start_len,
                               stream=body.stream) for p, rid in zip(prompts, rids)]
            if body.stream:
                return StreamingResponse(stream_native(reqs[0]), media_type="text/event-stream")
            engine.submit_batch(reqs)  # all or nothing: every prompt checked, and room for all, before any starts
        except QueueFull as e:
            return bad(str(e), 503)
        except EngineError as e:
            return bad(str(e))
        except UnicodeError as e:  # text the tokenizer cannot encode (a lone surrogate): the caller's
            return bad(f"text cannot be encoded: {e}")
        await until_done(request, reqs)
        failed = [r for r in reqs if (r.finish or {}).get("error")]
        if failed:  # the engine failed (not the request): say so, never a 200 with a silent abort
            return bad(f"engine error: {failed[0].finish['error']}", 500)
        out = [{"text": text_of(r), "output_ids": r.output_ids, "meta_info": meta(r)} for r in reqs]
        return out if batch else out[0]

    async def stream_native(r: GenRequest):
        try:
            engine.submit(r)
        except (QueueFull, EngineError) as e:
            yield f"data: {json.dumps({'error': {'message': str(e)}})}\n\n"
            return
        async for _kind in chunks(r):
            payload = {"text": text_of(r), "output_ids": r.output_ids, "meta_info": meta(r)}
            yield f"data: {json.dumps(payload)}\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/update_weights_from_disk")
    async def update_from_disk(body: UpdateFromDisk):
        try:
            v = _version_or_raise(body.weight_version)
            res = await in_control(engine.update_weights, path=body.model_path, version=v, verify=body.verify,
                                   flush_cache=body.flush_cache, abort_all=body.abort_all_requests)
        except Exception as e:  # noqa: BLE001 - a missing, corrupt, unverifiable or mismatched checkpoint: old weights stay
            return JSONResponse({"success": False, "message": f"{type(e).__name__}: {e}", "num_paused_requests": 0,
                                 "weight_version": str(engine.version)}, status_code=400)
        return {"success": True, "message": res["message"], "num_paused_requests": res["num_paused_requests"],
                "weight_version": str(res["version"]), "verified": res["verified"]}

    @app.post("/update_weights_from_tensor")
    async def update_from_tensor(body: UpdateFromTensor):
        from safetensors.torch import load as st_load

        try:
            sd = st_load(base64.b64decode(body.serialized_named_tensors))
            v = _version_or_raise(body.weight_version)
            res = await in_control(engine.update_weights, state_dict=sd, version=v,
                                   flush_cache=body.flush_cache, abort_all=body.abort_all_requests)
        except Exception as e:  # noqa: BLE001 - bad payloads are the caller's error
            return JSONResponse({"success": False, "message": f"{type(e).__name__}: {e}"}, status_code=400)
        return {"success": True, "message": res["message"], "num_paused_requests": res["num_paused_requests"]}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body = await _json_object(request)
        if isinstance(body, JSONResponse):
            return body
        if "new_version" not in body:
            return bad("expected {\"new_version\": ...}")
        v = parse_version(body["new_version"])
        if v is None:
            return bad(f"new_version must be an integer from 0 to 2**31 - 1 (or its decimal string), got "
                       f"{str(body['new_version'])[:40]!r}")
        engine.version = v
        return {"success": True, "message": f"weight version {engine.version}"}

    @app.post("/pause_generation")
    async def pause():
        engine.pause()
        return {"success": True}

    @app.post("/continue_generation")
    async def resume():
        engine.resume()
        return {"success": True}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush():
        await in_control(engine.flush_cache)
        return {"success": True, "message": "cache flushed"}

    @app.post("/abort_request")
    async def abort(request: Request):
        body = await _json_object(request)
        if isinstance(body, JSONResponse):
            return body
        unknown = set(body) - {"rid", "abort_all"}
        if unknown:
            return bad(f"unknown field `{sorted(unknown)[0]}`, expected one of rid, abort_all")
        n = await in_control(engine.abort, None if body.get("abort_all") else body.get("rid"))
        return {"success": True, "aborted": n}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/health_generate")
    async def health_generate():
        """One token generated end to end; while generation is paused it answers at once that it is paused (the
        probe is not left waiting for /continue_generation)."""
        paused = {"status": "paused", "paused": True, "message": "generation is paused (POST /continue_generation)"}
        if engine.paused:
            return paused
        r = GenRequest([engine.tok.eos_id], SamplingParams(max_new_tokens=1))
        try:
            engine.submit(r)
        except QueueFull as e:  # busy, not broken: 503, as the other endpoints say it
            return bad(str(e), 503)
        fut = asyncio.wrap_future(r.future)
        while not fut.done():
            await asyncio.wait([fut], timeout=0.05)
            if engine.paused and not fut.done():  # paused while it waited: it would wait as long as the pause
                await in_control(engine.abort, r.rid)
                return paused
        if (r.finish or {}).get("error"):
            return bad(f"engine error: {r.finish['error']}", 500)
        return {"status": "ok", "paused": False, "tokens": len(r.output_ids)}

    sums: dict[tuple, str] = {}  # weights checksum per loaded weights, computed once (what a weight push verifies)

    def checksum() -> str:
        v = (engine.version, engine.stats.weight_updates)
        if v not in sums:
            from model import weights_checksum

            sums.clear()
            sums[v] = weights_checksum(engine.model)
        return sums[v]

    def model_info():
        return {"model_path": model_path, "tokenizer_path": model_path, "is_generation": True,
                "served_model_name": served_name, "weight_version": str(engine.version),
                "weights_checksum": checksum(), "model_type": engine.cfg.model_type}

    def server_info():
        return {"engine": "temper-embedded", "max_total_num_tokens": engine.n_slots * engine.max_len,
                "context_length": engine.max_len, "max_running_requests": engine.n_slots,
                "chunked_prefill_size": engine.chunk_size, "speculative_num_draft_tokens": engine.spec_drafts,
                "weight_version": str(engine.version), "load": engine.load(),
                "device": str(engine.device),
                "stats": {**engine.stats.__dict__, "accept_length": engine.stats.accept_length,
                          "prefix_reuse": engine.stats.prefix_reuse}}

    for path in ("/model_info", "/get_model_info"):
        app.get(path)(model_info)
    for path in ("/server_info", "/get_server_info"):
        app.get(path)(server_info)

    def loads():
        """SGLang's load report: one entry per data-parallel rank (one here)."""
        ld = engine.load()
        return {"loads": [{"dp_rank": 0, "num_running_reqs": ld["running"], "num_waiting_reqs": ld["waiting"],
                           "num_reqs": ld["running"] + ld["waiting"], "num_free_slots": ld["free_slots"],
                           "max_running_requests": engine.n_slots, "weight_version": str(ld["version"]),
                           "paused": ld["paused"]}]}

    app.get("/v1/loads")(loads)
    app.get("/get_load")(lambda: loads()["loads"])

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_name, "object": "model", "owned_by": "temper"}]}

    # ---- OpenAI ------------------------------------------------------------------------------------
    def finish_reason(r: GenRequest) -> str:
        kind = (r.finish or {}).get("type")
        return kind if kind in ("length", "abort") else "stop"

    def submit_openai(req: GenRequest, cid: str, obj: str, chat: bool):
        """Submit; returns the response to send now (an error, or the event stream) or None to wait."""
        try:
            engine.submit(req)
        except QueueFull as e:
            return bad(str(e), 503)
        except EngineError as e:
            return bad(str(e))
        if req.stream:
            return StreamingResponse(stream_openai(req, cid, obj, chat=chat), media_type="text/event-stream")
        return None

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        try:
            ids = engine.tok.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        except UnicodeError as e:  # a lone surrogate: the caller's, once a 500
            return bad(f"prompt cannot be encoded: {e}")
        stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        sp = SamplingParams(max_new_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                            top_k=body.top_k, stop=stop, sampling_seed=body.seed)
        req = GenRequest(ids, sp, session_id=body.session_id, return_logprob=bool(body.logprobs), stream=body.stream)
        cid = f"cmpl-{req.rid}"
        early = submit_openai(req, cid, "text_completion", chat=False)
        if early is not None:
            return early
        await until_done(request, [req])
        if (req.finish or {}).get("error"):
            return bad(f"engine error: {req.finish['error']}", 500)
        r = req
        choice = {"index": 0, "text": text_of(r), "finish_reason": finish_reason(r), "logprobs": None}
        if body.logprobs:
            choice["logprobs"] = {"tokens": [engine.tok.decode([t]) for t in r.output_ids],
                                  "token_logprobs": r.output_logprobs}
        return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": served_name,
                "choices": [choice], "usage": usage(r), "weight_version": str(reply_version(r))}

    def usage(r: GenRequest) -> dict:
        return {"prompt_tokens": len(r.input_ids), "completion_tokens": len(r.output_ids),
                "total_tokens": len(r.input_ids) + len(r.output_ids)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        kind = (body.response_format or {}).get("type", "text")
        if kind != "text":
            return bad(f"response_format {kind!r} is not supported: temper's engine has no constrained decoding "
                       "(send type 'text' and validate the reply yourself)")
        try:
            ids = tpl.render([m.model_dump() for m in body.messages], add_generation_prompt=True).ids
        except ValueError as e:
            return bad(str(e))
        stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        mx = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        sp = SamplingParams(max_new_tokens=128 if mx is None else mx, temperature=body.temperature, top_p=body.top_p,
                            top_k=body.top_k, stop=stop, stop_token_ids=tpl.stop_ids, sampling_seed=body.seed)
        req = GenRequest(ids, sp, session_id=body.session_id, return_logprob=body.logprobs, stream=body.stream)
        cid = f"chatcmpl-{req.rid}"
        early = submit_openai(req, cid, "chat.completion.chunk", chat=True)
        if early is not None:
            return early
        await until_done(request, [req])
        if (req.finish or {}).get("error"):
            return bad(f"engine error: {req.finish['error']}", 500)
        r = req
        msg = {"role": "assistant", "content": text_of(r)}
        choice = {"index": 0, "message": msg, "finish_reason": finish_reason(r)}
        if body.logprobs:
            choice["logprobs"] = {"content": [{"token": engine.tok.decode([t]), "logprob": lp}
                                              for t, lp in zip(r.output_ids, r.output_logprobs)]}
        return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": served_name,
                "choices": [choice], "usage": usage(r), "weight_version": str(reply_version(r))}

    async def stream_openai(r: GenRequest, cid: str, obj: str, chat: bool):
        sent = ""
        first = True
        async for kind in chunks(r):
            text = text_of(r) if (kind == "finish" or r.finish) else settled(text_of(r), r.params.stop)
            if text.startswith(sent):
                delta, sent = text[len(sent):], text
            else:  # the request finished while this view was taken: nothing new now, the final event sends the rest
                delta = ""
            fin = finish_reason(r) if kind == "finish" else None
            if chat:
                d = {"content": delta}
                if first:
                    d["role"] = "assistant"
                choice = {"index": 0, "delta": d, "finish_reason": fin}
            else:
                choice = {"index": 0, "text": delta, "finish_reason": fin}
            first = False
            yield f"data: {json.dumps({'id': cid, 'object': obj, 'model': served_name, 'choices': [choice]})}\n\n"
        yield "data: [DONE]\n\n"

    app.state.engine = engine
    return app


def settled(text: str, stops: list[str]) -> str:
    """The part of an unfinished output that cannot change any more: without a trailing incomplete UTF-8 character
    (decoded as U+FFFD until its last byte arrives) and without a trailing piece that could be the start of a stop
    string (trimmed from the text if the stop completes). Streaming only this makes the streamed text equal the
    non-streamed one. A stop string already whole in the text is cut at its first occurrence: the engine may have
    appended the stopping token without having marked the request finished yet, and the finished text ends before
    the stop string (the earliest occurrence of any stop is never past where the final text ends)."""
    whole = [text.index(st) for st in stops if st and st in text]
    if whole:
        return text[: min(whole)].rstrip("\ufffd")
    text = text.rstrip("\ufffd")
    hold = 0
    for st in stops:
        for n in range(min(len(st) - 1, len(text)), 0, -1):
            if text.endswith(st[:n]):
                hold = max(hold, n)
                break
    return text[: len(text) - hold]


def serve(checkpoint: str, host: str = "127.0.0.1", port: int = 30000, n_slots: int = 16, max_len: int = 2048,
          spec_drafts: int = 0, max_queue: int = 256, device: str = "cpu", dtype: str | None = None,
          cuda_graphs: bool = False) -> None:
    """`device`: where the weights, the cache and sampling live; `dtype`: "float32" | "bfloat16" (None: the
    checkpoint's)."""
    import torch
    import uvicorn

    from model import load_checkpoint, read_checkpoint_meta

    model = load_checkpoint(checkpoint, device=device, dtype=getattr(torch, dtype) if dtype else None)
    engine = Engine(model, n_slots=n_slots, max_len=max_len, spec_drafts=spec_drafts, max_queue=max_queue,
                    policy_version=int(read_checkpoint_meta(checkpoint).get("policy_version", 0)),
                    cuda_graphs=cuda_graphs)
    uvicorn.run(create_app(engine, model_path=checkpoint), host=host, port=port, log_level="warning")


class ServerThread:
    """Run an app with uvicorn on 127.0.0.1 in a background thread (port 0 picks a free one).

        with ServerThread(create_app(engine)) as srv:
            httpx.get(srv.url + "/health")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        import threading

        import uvicorn

        self.config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(self.config)
        self.server.install_signal_handlers = lambda: None
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = ""

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        sock = self.server.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
