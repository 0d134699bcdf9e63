"""In-process router over several engine servers (embedded or SGLang), with the client's interface.

* Least outstanding work: a request goes to the healthy worker with the fewest outstanding tokens
  (prompt + max_new_tokens) among those with a free slot; when every worker is full it waits and is
  dispatched the moment any worker frees a slot (dynamic refill, no static batches).
* Session affinity: requests with the same `session_id` stay on one worker so its prefix cache is
  reused across an episode's turns (re-pinned if that worker goes down).
* Health: a background task polls `/health`; a worker that fails a request is marked down and the
  request is retried on another worker (up to `retries`).
* Admission: with `expect` (a callable giving the (version, weights checksum) pairs a worker may serve — the
  current one, and during a weight push the one being pushed — or None while none is known), a worker gets work
  only after its `/get_model_info` shows one of them (the checksum where both sides report one): when the router
  starts, at every health poll (a server restarted between two polls answers `/health` like any other), and
  right after it sent a stale reply. A worker that does not is out of the rotation while `on_rejoin(client)` (the
  weight sync's loader) brings it up to date; it comes back only once it shows an expected version.
* Replies (`check_reply`): every reply must be an object with `meta_info`, and its `output_token_versions`, where
  present, must name one version per output token. With an expectation, the reply must name its versions, and every
  one of them (each token's and its `weight_version`) must lie between the lowest version expected when the request
  was sent and the highest expected then or now (versions only grow while a router serves; a push may land
  mid-request). A reply from other weights — older, newer (another policy numbered higher), or not a version — is
  refused, its worker taken out and re-admitted, and the request retried on another worker; a malformed one (no
  version, too few token versions, not an object) counts as that worker's failure like a dropped connection. So
  the caller never gets a reply stamped with a version the weight sync did not make current.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from .client import EngineClient, EngineUnavailable
from .schemas import parse_version

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
    stale: int = 0  # replies refused for their weight version
    admitting: bool = False  # out of the rotation while its version is checked and brought up to date
    last_check: float = field(default_factory=time.time)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one admission check at a time


class NoHealthyWorker(RuntimeError):
    pass


class StaleReply(EngineUnavailable):
    """A worker answered with weights other than the ones every worker must serve (older, or newer than expected)."""


class BadReply(EngineUnavailable):
    """A worker's reply that does not say, in the shape the API promises, which weights computed it."""


def reply_versions(out: dict) -> list:
    """The weight versions a reply names, as sent: each of its per-token versions, then its `weight_version`; [] when
    it names none. (`parse_version` reads each; SGLang says "default" before any version was set.)"""
    meta = out.get("meta_info") or {}
    toks = meta.get("output_token_versions")
    got = list(toks) if isinstance(toks, list) else []
    return got + ([meta["weight_version"]] if meta.get("weight_version") is not None else [])


Want = list[tuple[int, str | None]]  # the (version, checksum) pairs a worker may serve


def lowest(want: Want | None) -> int | None:
    return None if not want else min(v for v, _ in want)


def highest(*wants: Want | None) -> int | None:
    vs = [v for want in wants for v, _ in (want or [])]
    return max(vs) if vs else None


def check_reply(out, sent: Want | None, now: Want | None = None) -> None:
    """Refuse a reply that cannot be returned to the caller: BadReply when it is not an object with `meta_info`, when
    its `output_token_versions` do not name one version per output token, or (with an expectation `sent`, what was
    expected when the request was sent) when it names no version; StaleReply when a version it names is not an
    integer from the lowest version of `sent` to the highest of `sent` and `now` (what is expected as it arrives)."""
    if not isinstance(out, dict) or not isinstance(out.get("meta_info"), dict):
        raise BadReply(f"a reply that is not an object with meta_info ({type(out).__name__})")
    meta, ids = out["meta_info"], out.get("output_ids")
    toks = meta.get("output_token_versions")
    if toks is not None and (not isinstance(toks, list) or not isinstance(ids, list) or len(toks) != len(ids)):
        n = len(toks) if isinstance(toks, list) else repr(toks)[:20]
        raise BadReply(f"output_token_versions names {n} versions for {len(ids) if isinstance(ids, list) else '?'} "
                       "output tokens")
    lo = lowest(sent)
    if lo is None:
        return
    versions = reply_versions(out)
    if not versions:
        raise BadReply(f"a reply that names no weight version (policy v{lo} expected)")
    hi = highest(sent, now)
    for v in versions:
        got = parse_version(v)
        if got is None or not lo <= got <= hi:
            rel = "not a version" if got is None else "older than" if got < lo else "newer than"
            raise StaleReply(f"weight version {str(v)[:20]!r}, {rel} the policy v{lo}" +
                             (f"..v{hi}" if hi != lo else "") + " every worker must serve")


def wanted(x) -> Want | None:
    """`expect()`'s answer as a list of pairs: None, one (version, checksum) pair, or a list of them."""
    if x is None:
        return None
    return [x] if isinstance(x, tuple) else list(x)


def shows(info: dict, want) -> bool:
    """Does a worker's model info show one of the expected (version, checksum) pairs (`wanted`)? A reported checksum
    must match where the pair has one."""
    v = parse_version(info.get("weight_version"))
    got = info.get("weights_checksum")
    return v is not None and any(v == version and (checksum is None or got is None or got == checksum)
                                 for version, checksum in wanted(want) or [])


class Router:
    scores = True  # answers pure-scoring requests; the agent checks `exact_scoring` in the reply

    def __init__(self, urls: list[str], slots_per_worker: int | None = None, retries: int = 2,
                 health_interval: float = 2.0, on_rejoin=None, expect=None):
        if not urls:
            raise ValueError("router needs at least one worker URL")
        self.workers = [Worker(EngineClient(u), slots_per_worker or 0) for u in urls]
        self.retries, self.health_interval = retries, health_interval
        self.on_rejoin = on_rejoin  # async (EngineClient) -> None: load the expected weights, raising if it cannot
        self.expect = expect  # () -> None | (version, checksum) | [(version, checksum), …]: what a worker may serve
        self.affinity: dict[str, Worker] = {}
        self._cv: asyncio.Condition | None = None
        self._health_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> Router:
        self._cv = asyncio.Condition()

        async def first(w: Worker) -> None:
            if not w.slots:
                try:
                    w.slots = int((await w.client.server_info()).get("max_running_requests", 8))
                except Exception:  # noqa: BLE001 - unknown capacity: a conservative default
                    w.slots = 8
            try:
                w.healthy = await self._admit(w)
            finally:
                w.admitting = False

        await asyncio.gather(*(first(w) for w in self.workers))
        self._health_task = asyncio.create_task(self._health_loop())
        return self

    def _want(self) -> Want | None:
        return wanted(self.expect()) if self.expect is not None else None

    async def _admit(self, w: Worker) -> bool:
        """Does `w` answer and serve the expected weights? If it answers with others, it is out of the rotation while
        `on_rejoin` loads them; True only once it shows them. (What is expected is read after the worker answered:
        a push may have moved both meanwhile.)"""
        if not await w.client.health():
            return False
        if self._want() is None:
            return True
        try:
            info = await w.client.model_info()
            if shows(info, self._want()):
                return True
            w.healthy, w.admitting = False, True
            if self.on_rejoin is None:
                log.warning("worker %s serves weight version %s, not one of %s, and nothing can load it: kept out",
                            w.client.url, info.get("weight_version"), self._want())
                return False
            await self.on_rejoin(w.client)
            info = await w.client.model_info()
            if shows(info, self._want()):
                log.warning("worker %s admitted after loading weight version %s", w.client.url,
                            info.get("weight_version"))
                return True
            log.warning("worker %s still serves weight version %s after a load, not one of %s: kept out",
                        w.client.url, info.get("weight_version"), self._want())
        except Exception as e:  # noqa: BLE001 - it stays out until a later check succeeds
            log.warning("worker %s answers but could not be admitted: %s", w.client.url, e)
        return False

    async def _check(self, w: Worker) -> None:
        async with w.lock:
            try:
                ok = await self._admit(w)
            finally:
                w.admitting = False
        if ok != w.healthy:
            log.warning("worker %s is now %s", w.client.url, "up" if ok else "down")
        w.healthy, w.last_check = ok, time.time()
        async with self._cv:
            self._cv.notify_all()

    def _recheck(self, w: Worker) -> None:
        """Take `w` out now and re-admit it in the background (a stale reply: it may have been restarted)."""
        w.healthy, w.admitting = False, True
        task = asyncio.create_task(self._check(w))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for t in [self._health_task, *self._tasks]:
            if t is None:
                continue
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
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
                if not w.admitting:  # (a re-admission in flight decides for itself)
                    await self._check(w)

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
                if not any(w.healthy or w.admitting for w in self.workers):
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
            sent = self._want()  # the reply must come from these weights (or from those a push made current since)
            w = await self._acquire(session, cost)
            try:
                out = await w.client.generate(input_ids, sampling_params, **kw)
                try:
                    check_reply(out, sent, self._want())
                except StaleReply as e:
                    w.stale += 1
                    self._recheck(w)
                    raise StaleReply(f"{w.client.url} answered with {e}") from None
                except BadReply as e:
                    raise BadReply(f"{w.client.url} answered with {e}") from None
                w.served += 1
                out.setdefault("meta_info", {})["worker"] = w.client.url
                return out
            except EngineUnavailable as e:
                last = e
                if not isinstance(e, StaleReply):
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
                 "stale": w.stale, "outstanding": w.outstanding} for w in self.workers]


class CheckedClient:
    """One `EngineClient` (an external router, say) whose replies must come from the expected weights: a reply that
    `check_reply` refuses (from weights other than `expect()`'s when it was sent, or naming none) is sent again (the
    router in front may pick another worker), up to `retries` times; then the last refusal (StaleReply, BadReply)."""

    scores = True

    def __init__(self, client: EngineClient, expect, retries: int = 2):
        self.client, self.expect, self.retries = client, expect, retries
        self.url = client.url
        self.stale = 0

    async def generate(self, input_ids: list[int], sampling_params: dict | None = None, **kw) -> dict:
        last: EngineUnavailable | None = None
        for _attempt in range(self.retries + 1):
            sent = wanted(self.expect())
            out = await self.client.generate(input_ids, sampling_params, **kw)
            try:
                check_reply(out, sent, wanted(self.expect()))
                return out
            except (StaleReply, BadReply) as e:
                last = e
            self.stale += 1
            log.warning("%s answered with %s: sent again", self.url, last)
        raise type(last)(f"{self.url}: {self.retries + 1} replies refused; the last one: {last}")

    async def score(self, input_ids: list[int]) -> list[float | None]:
        out = await self.generate(input_ids, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
        return [lp for lp, _t, _x in out["meta_info"]["input_token_logprobs"]]

    async def aclose(self) -> None:
        await self.client.aclose()
