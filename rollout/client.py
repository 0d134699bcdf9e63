"""One async client for the embedded server and real SGLang servers (same paths, same fields)."""

from __future__ import annotations

from typing import Any

import httpx


class EngineUnavailable(RuntimeError):
    """The server could not be reached or died mid-request (the router retries elsewhere)."""


def _decoded(r: httpx.Response, where: str) -> Any:
    """A reply's JSON object (or list: a batch); anything else is a broken worker (EngineUnavailable: the router
    retries elsewhere), never an exception from deep in the caller."""
    try:
        got = r.json()
    except ValueError:
        raise EngineUnavailable(f"{where}: HTTP {r.status_code} with a body that is not JSON: {r.text[:120]!r}") from None
    if not isinstance(got, (dict, list)):
        raise EngineUnavailable(f"{where}: HTTP {r.status_code} with a JSON {type(got).__name__}, not an object")
    return got


class EngineClient:
    scores = True  # answers pure-scoring requests; the agent checks `exact_scoring` in the reply

    def __init__(self, base_url: str, timeout: float = 600.0, client: httpx.AsyncClient | None = None):
        self.url = base_url.rstrip("/")
        self.http = client or httpx.AsyncClient(timeout=timeout)

    async def _post(self, path: str, body: dict) -> Any:
        try:
            r = await self.http.post(self.url + path, json=body)
        except (httpx.TransportError, httpx.TimeoutException) as e:
            raise EngineUnavailable(f"{self.url}{path}: {type(e).__name__}: {e}") from None
        if r.status_code >= 500 and r.status_code != 503:
            raise EngineUnavailable(f"{self.url}{path}: HTTP {r.status_code}: {r.text[:200]}")
        if r.status_code >= 400:
            raise ValueError(f"{self.url}{path}: HTTP {r.status_code}: {r.text[:300]}")
        return _decoded(r, self.url + path)

    async def _get(self, path: str) -> Any:
        try:
            r = await self.http.get(self.url + path)
        except (httpx.TransportError, httpx.TimeoutException) as e:
            raise EngineUnavailable(f"{self.url}{path}: {type(e).__name__}: {e}") from None
        r.raise_for_status()
        return _decoded(r, self.url + path)

    async def generate(self, input_ids: list[int], sampling_params: dict | None = None, *, return_logprob: bool = True,
                       session_id: str | None = None, rid: str | None = None, logprob_start_len: int = -1) -> dict:
        body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling_params or {},
                                "return_logprob": return_logprob}
        if session_id is not None:
            body["session_id"] = session_id
        if rid is not None:
            body["rid"] = rid
        if logprob_start_len >= 0:
            body["logprob_start_len"] = logprob_start_len
        return await self._post("/generate", body)

    async def score(self, input_ids: list[int]) -> list[float | None]:
        """Log-prob of every token given its prefix (first is None): how a teacher scores a student's tokens."""
        out = await self.generate(input_ids, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
        return [lp for lp, _tok, _txt in out["meta_info"]["input_token_logprobs"]]

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None,
                                       flush_cache: bool = False, abort_all_requests: bool = False,
                                       verify: bool = True) -> dict:
        """`verify=False` (temper's servers only): load a checkpoint that records no checksums, trusting it."""
        body: dict[str, Any] = {"model_path": model_path, "flush_cache": flush_cache,
                                "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if not verify:  # (sent only when false: SGLang's servers do not know the field)
            body["verify"] = False
        return await self._post("/update_weights_from_disk", body)

    async def flush_cache(self) -> dict:
        return await self._post("/flush_cache", {})

    async def abort(self, rid: str | None = None) -> dict:
        return await self._post("/abort_request", {"rid": rid} if rid else {"abort_all": True})

    async def pause(self) -> dict:
        return await self._post("/pause_generation", {})

    async def resume(self) -> dict:
        return await self._post("/continue_generation", {})

    async def health(self) -> bool:
        try:
            r = await self.http.get(self.url + "/health", timeout=5)
            return r.status_code == 200
        except (httpx.TransportError, httpx.TimeoutException):
            return False

    async def server_info(self) -> dict:
        return await self._get("/get_server_info")

    async def model_info(self) -> dict:
        return await self._get("/get_model_info")

    async def aclose(self) -> None:
        await self.http.aclose()
