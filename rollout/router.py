"""In-process router over several engine servers (embedded or SGLang), with the client's interface.

* Least outstanding work: a request goes to the healthy worker with the fewest outstanding tokens
  (prompt + max_new_tokens) among those with a free slot; when every worker is full it waits and is
  dispatched the moment any worker frees a slot (dynamic refill, no static batches).
* Session affinity: requests with the same `session_id` stay on one worker so its prefix cache is
  reused across an episode's turns (re-pinned if that worker goes down).
* Health: a background task polls `/health`; a worker that fails a request is marked down and the
  request is retried on another worker (up to `retries`).
* Rejoin: a worker that answers again is given back work only after `on_rejoin(client)` succeeds — the
  weight sync uses it to load the current policy version into a restarted server first, so no request is
  ever served by stale weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from .client import EngineClient, EngineUnavailable

log = logging.getLogger(__name__)


@dataclass
class Worker:
    client: EngineClient
    slots: int
    outstanding: int = 0  # requests in flight
    work: int = 0  # outstanding tokens
    healthy: bool = True
    served: int = 0
    failures: int = 0
    last_check: float = field(default_factory=time.time)


class NoHealthyWorker(RuntimeError):
    pass


class Router:
    scores = True  # answers pure-scoring requests; the agent checks `exact_scoring` in the reply

    def __init__(self, urls: list[str], slots_per_worker: int | None = None, retries: int = 2,
                 health_interval: float = 2.0, on_rejoin=None):
        if not urls:
            raise ValueError("router needs at least one worker URL")
        self.workers = [Worker(EngineClient(u), slots_per_worker or 0) for u in urls]
        self.retries, self.health_interval = retries, health_interval
        self.on_rejoin = on_rejoin  # async (EngineClient) -> None, raising if the worker must stay out
        self.affinity: dict[str, Worker] = {}
        self._cv: asyncio.Condition | None = None
        self._health_task: asyncio.Task | None = None

    async def start(self) -> Router:
        self._cv = asyncio.Condition()
        for w in self.workers:
            if not w.slots:
                try:
                    w.slots = int((await w.client.server_info()).get("max_running_requests", 8))
                except Exception:  # noqa: BLE001 - unknown capacity: a conservative default
                    w.slots = 8
            w.healthy = await w.client.health()
        self._health_task = asyncio.create_task(self._health_loop())
        return self

    async def close(self) -> None:
        if self._health_task:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        for w in self.workers:
            await w.client.aclose()

    async def __aenter__(self) -> Router:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            for w in self.workers:
                ok = await w.client.health()
                if ok and not w.healthy and self.on_rejoin is not None:
                    try:
                        await self.on_rejoin(w.client)
                    except Exception as e:  # noqa: BLE001 - it stays out until a later check succeeds
                        log.warning("worker %s answers but could not rejoin: %s", w.client.url, e)
                        ok = False
                if ok != w.healthy:
                    log.warning("worker %s is now %s", w.client.url, "up" if ok else "down")
                w.healthy, w.last_check = ok, time.time()
            async with self._cv:
                self._cv.notify_all()

    def _pick(self, session_id: str | None) -> Worker | None:
        if session_id is not None:
            w = self.affinity.get(session_id)
            if w is not None and w.healthy:
                return w if w.outstanding < w.slots else None
        free = [w for w in self.workers if w.healthy and w.outstanding < w.slots]
        if not free:
            return None
        return min(free, key=lambda w: (w.work, w.outstanding))

    async def _acquire(self, session_id: str | None, cost: int) -> Worker:
        async with self._cv:
            while True:
                if not any(w.healthy for w in self.workers):
                    raise NoHealthyWorker("no healthy engine worker")
                w = self._pick(session_id)
                if w is not None:
                    w.outstanding += 1
                    w.work += cost
                    if session_id is not None:
                        self.affinity[session_id] = w
                    return w
                await self._cv.wait()

    async def _release(self, w: Worker, cost: int) -> None:
        async with self._cv:
            w.outstanding -= 1
            w.work -= cost
            self._cv.notify_all()

    async def generate(self, input_ids: list[int], sampling_params: dict | None = None, **kw) -> dict:
        cost = len(input_ids) + int((sampling_params or {}).get("max_new_tokens", 128))
        session = kw.get("session_id")
        last: Exception | None = None
        for _attempt in range(self.retries + 1):
            w = await self._acquire(session, cost)
            try:
                out = await w.client.generate(input_ids, sampling_params, **kw)
                w.served += 1
                out.setdefault("meta_info", {})["worker"] = w.client.url
                return out
            except EngineUnavailable as e:
                last = e
                w.failures += 1
                w.healthy = False  # until the health loop sees it answer again
                if session is not None:
                    self.affinity.pop(session, None)
                log.warning("worker %s failed (%s); retrying elsewhere", w.client.url, e)
            finally:
                await self._release(w, cost)
        raise EngineUnavailable(f"request failed on {self.retries + 1} attempts: {last}")

    async def score(self, input_ids: list[int]) -> list[float | None]:
        out = await self.generate(input_ids, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
        return [lp for lp, _t, _x in out["meta_info"]["input_token_logprobs"]]

    async def broadcast(self, method: str, *args, **kw) -> list:
        """Call a client method (e.g. update_weights_from_disk) on every healthy worker."""
        return await asyncio.gather(*(getattr(w.client, method)(*args, **kw) for w in self.workers if w.healthy))

    def stats(self) -> list[dict]:
        return [{"url": w.client.url, "healthy": w.healthy, "served": w.served, "failures": w.failures,
                 "outstanding": w.outstanding} for w in self.workers]
