"""Where rollouts are generated, and how the trainer's weights get there: the Policy / WeightSync roles.

Every stage that generates (rollout batches, SAO's async loop and sync GRPO, OPD, evaluation) asks a
`RolloutBackend` for two things:

* **Policy** — `async with backend.session() as policy`: an object with `generate(input_ids, sampling_params,
  ...)` returning token ids, per-token log-probs and per-token policy versions (`EnginePolicy`, `EngineClient`
  or `Router`). Open it inside the event loop that uses it.
* **WeightSync** — `backend.push(model, version)`: after it returns, every engine serves `version` and the
  record says so (version and weights checksum checked on every worker).

Two implementations, chosen by configuration (`make_backend`), with nothing above them changing:

* `InProcessBackend` — one engine in this process holding a copy of the weights; a push copies the state dict
  between decoding steps (the CPU default, no HTTP hop).
* `ServerBackend` — engine servers by URL (`temper serve`, the embedded servers below, or SGLang), behind
  temper's `Router` or an external router (sglang-router). A push writes the checkpoint once, then on every
  worker: `/pause_generation`, `/update_weights_from_disk`, a check of `weight_version` (and of the weights
  checksum where the server reports one — temper's do, SGLang's do not), `/continue_generation`. Every Router
  the backend opens (a new one per batch in the sync and pipelined loops) admits a worker only once its
  `/get_model_info` shows the current version and checksum, loading it first when not (a server restarted at an
  older checkpoint, or down when a version was pushed); a reply computed by older weights is refused and retried
  on another worker (behind an external router: sent again, then refused).

    with embedded_servers(model_config, n=2) as urls:            # started here, stopped on exit
        asyncio.run(load_weights(urls, "runs/x/checkpoint"))
        policy = await open_policy(urls)                         # Router over the workers (or one client)

The same calls drive real SGLang servers: `/update_weights_from_disk` with an HF-layout checkpoint,
`/generate` with token ids. With an sglang-router in front, pass the workers' URLs for weight loading and
the router's URL for generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import shutil
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from .client import EngineClient, EngineUnavailable
from .router import CheckedClient, Router, shows

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """A weight push did not leave every live engine serving the pushed version with the pushed weights."""


@contextlib.contextmanager
def embedded_servers(model_config, n: int = 1, n_slots: int = 8, max_len: int = 2048,
                     seed: int = 0) -> Iterator[list[str]]:
    """Start `n` embedded engine servers on 127.0.0.1 (fresh weights; load a policy with `load_weights`)."""
    import torch

    from model import ByteTokenizer, Transformer

    from .engine import Engine
    from .server import ServerThread, create_app

    if n < 1:
        raise ValueError(f"embedded_servers: n must be at least 1, got {n}")
    started: list[tuple[Engine, ServerThread]] = []
    try:
        for i in range(n):
            torch.manual_seed(seed)
            eng = Engine(Transformer(model_config).eval(), ByteTokenizer(), n_slots=n_slots, max_len=max_len,
                         name=f"embedded-{i}")
            started.append((eng, ServerThread(create_app(eng)).start()))
        yield [srv.url for _, srv in started]
    finally:
        for eng, srv in started:
            srv.stop()
            eng.shutdown()


def wait_healthy(url: str, proc=None, timeout: float = 300.0) -> None:
    """Poll `GET url/health` until it answers 200. Raises RuntimeError if `proc` (a Popen) exits first, and
    TimeoutError past `timeout` seconds (a safety cap on start-up: model loading, never a budget)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited with {proc.returncode} before answering /health")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}: no /health answer within {timeout:g} s")
        time.sleep(0.2)


async def load_weights(urls: list[str], checkpoint: str, version: int | None = None) -> list[dict]:
    """Point every worker at `checkpoint` (HF layout); raises if any refuses."""
    out = []
    for u in urls:
        c = EngineClient(u)
        try:
            res = await c.update_weights_from_disk(str(checkpoint), weight_version=version, flush_cache=True)
        finally:
            await c.aclose()
        if not res.get("success", False):
            raise RuntimeError(f"{u}: update_weights_from_disk({checkpoint}) failed: {res.get('message')}")
        out.append(res)
    return out


async def open_policy(urls: list[str], router_url: str = "", checkpoint: str | None = None,
                      version: int | None = None, checksum: str | None = None):
    """A `generate`-capable policy: the external router, one client, or temper's Router over several workers.

    With `version` (what `load_weights` loaded), replies from older weights are refused and retried, and temper's
    Router admits a worker only once it shows that version (and `checksum`, if given), loading `checkpoint` into
    one that does not (a server restarted meanwhile)."""
    expect = None if version is None else (lambda: (int(version), checksum))
    if router_url:
        client = EngineClient(router_url)
        return client if expect is None else CheckedClient(client, expect)
    if len(urls) == 1 and expect is None:
        return EngineClient(urls[0])

    async def rejoin(client: EngineClient) -> None:
        res = await client.update_weights_from_disk(str(checkpoint), weight_version=version, flush_cache=True)
        if not res.get("success", False):
            raise WeightSyncError(f"{client.url}: update_weights_from_disk({checkpoint}) failed: {res.get('message')}")

    return await Router(urls, expect=expect, on_rejoin=rejoin if checkpoint is not None else None).start()


async def close_policy(policy) -> None:
    await (policy.close() if isinstance(policy, Router) else policy.aclose())


class InProcessBackend:
    """Policy + WeightSync in this process: an `Engine` over a copy of `model` (the CPU default)."""

    kind = "in-process"

    def __init__(self, model, tok, n_slots: int = 8, max_len: int = 2048, version: int = 0, name: str = "in-process",
                 compile_decode: bool = False):
        from .engine import Engine

        self.engine = Engine(copy.deepcopy(model).eval(), tok, n_slots=n_slots, max_len=max_len,
                             policy_version=version, name=name, compile_decode=compile_decode)
        self.version = version

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator:
        from .agent import EnginePolicy

        yield EnginePolicy(self.engine)

    def push(self, model, version: int) -> dict:
        from model import weights_checksum

        t0 = time.perf_counter()
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        res = self.engine.update_weights(state_dict=sd, version=version)
        want = weights_checksum(model)
        if weights_checksum(self.engine.model) != want:
            raise WeightSyncError(f"weight push v{version}: the engine's checksum differs from the trainer's")
        self.version = version
        return {"version": version, "checksum": want, "seconds": time.perf_counter() - t0,
                "in_flight": res["num_paused_requests"], "workers": 1}

    def abort(self) -> None:
        self.engine.abort()

    def close(self) -> None:
        self.engine.shutdown()


class ServerBackend:
    """Policy + WeightSync over HTTP: engine servers at `urls`, behind temper's Router (or `router_url`).

    Pushed checkpoints go to `sync_dir/v<version>` (the newest `keep` are kept); every worker must be able to read
    that path (one machine, or a shared filesystem)."""

    kind = "servers"

    def __init__(self, urls: list[str], sync_dir: str | Path, router_url: str = "", keep: int = 2,
                 health_interval: float = 1.0, retries: int = 2):
        if not urls:
            raise ValueError("ServerBackend needs at least one worker URL")
        self.urls, self.router_url = list(urls), router_url
        self.sync_dir, self.keep = Path(sync_dir), keep
        self.health_interval, self.retries = health_interval, retries
        self.version: int | None = None
        self.current: tuple[str, int, str] | None = None  # (checkpoint path, version, checksum) every worker serves
        self.pushes: list[dict] = []
        self.incoming: tuple[str, int, str | None] | None = None  # a push or load in flight: what it loads
        self._locks: dict[str, threading.Lock] = {u: threading.Lock() for u in self.urls}  # one load per worker

    # ---- Policy --------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator:
        if self.router_url:  # an external router picks the worker: stale replies are refused and retried here
            policy = CheckedClient(EngineClient(self.router_url), self._expected, retries=self.retries)
            try:
                yield policy
            finally:
                await policy.aclose()
            return
        router = Router(self.urls, retries=self.retries, health_interval=self.health_interval,
                        on_rejoin=self._rejoin, expect=self._expected)
        await router.start()  # admits each worker only once it shows the current version and checksum
        try:
            yield router
        finally:
            await router.close()

    def _expected(self) -> list[tuple[int, str | None]] | None:
        """The (version, checksum) pairs a worker may serve: the last completed push or load, and the one in flight
        (None before the first)."""
        pairs = [(x[1], x[2]) for x in (self.current, self.incoming) if x is not None]
        return pairs or None

    async def _rejoin(self, client: EngineClient) -> None:
        """Bring a worker that does not serve the current version (restarted, say, at an older checkpoint) up to it
        (to the version being pushed, if a push is in flight)."""
        async with self._locked(client.url):  # never beside a push's load of the same worker
            want = self.incoming or self.current
            if want is None or shows(await client.model_info(), self._expected()):
                return
            path, version, checksum = want
            await self._load(client, path, version, checksum, locked=True)
        log.warning("worker %s rejoined after loading policy v%s", client.url, version)

    @contextlib.asynccontextmanager
    async def _locked(self, url: str):
        """The worker's load lock (pushes and rejoins run on different threads' event loops), polled: a wait that is
        cancelled (its router closing) leaves it as it was."""
        lock = self._locks.setdefault(url, threading.Lock())
        while not lock.acquire(blocking=False):
            await asyncio.sleep(0.01)
        try:
            yield
        finally:
            lock.release()

    # ---- WeightSync ----------------------------------------------------------------------------------
    async def _load(self, client: EngineClient, path: str, version: int, checksum: str | None,
                    locked: bool = False) -> dict:
        if not locked:
            async with self._locked(client.url):
                return await self._load(client, path, version, checksum, locked=True)
        await client.pause()
        try:
            res = await client.update_weights_from_disk(path, weight_version=version)
            if not res.get("success", False):
                raise WeightSyncError(f"{client.url}: update_weights_from_disk({path}) refused: {res.get('message')}")
            info = await client.model_info()
        finally:
            await client.resume()
        if str(info.get("weight_version")) != str(version):
            raise WeightSyncError(f"{client.url}: serves weight_version {info.get('weight_version')} after a push of v{version}")
        got = info.get("weights_checksum")
        if checksum is not None and got is not None and got != checksum:
            raise WeightSyncError(f"{client.url}: weights checksum {got} after a push of v{version} ({checksum})")
        return {"url": client.url, "in_flight": res.get("num_paused_requests", 0), "checksum_checked": got is not None}

    async def _push_all(self, path: str, version: int, checksum: str | None) -> list:
        clients = [EngineClient(u) for u in self.urls]
        try:
            return await asyncio.gather(*(self._load(c, path, version, checksum) for c in clients),
                                        return_exceptions=True)
        finally:
            for c in clients:
                await c.aclose()

    def load(self, checkpoint: str | Path, version: int, checksum: str | None = None) -> dict:
        """Point every worker at an existing checkpoint (the stage's starting policy)."""
        t0 = time.perf_counter()
        self.incoming = (str(checkpoint), version, checksum)  # workers that already serve it are admitted meanwhile
        try:
            results = asyncio.run(self._push_all(str(checkpoint), version, checksum))
            live = [r for r in results if isinstance(r, dict)]
            errors = [r for r in results if isinstance(r, BaseException)]
            hard = [e for e in errors if not isinstance(e, EngineUnavailable)]
            if hard or not live:
                raise WeightSyncError(f"weight push v{version}: " + "; ".join(str(e) for e in (hard or errors)))
            for e in errors:  # unreachable: it is out of the router until it answers and loads this version
                log.warning("weight push v%s skipped a worker that is down: %s", version, e)
            self.current = (str(checkpoint), version, checksum)  # (before `incoming` goes: never neither)
            self.version = version
        finally:
            self.incoming = None
        rec = {"version": version, "checksum": checksum, "seconds": time.perf_counter() - t0, "workers": len(live),
               "down": len(errors), "in_flight": sum(r["in_flight"] for r in live),
               "checksum_checked": all(r["checksum_checked"] for r in live)}
        self.pushes.append(rec)
        return rec

    def push(self, model, version: int) -> dict:
        from model import save_checkpoint, weights_checksum

        t0 = time.perf_counter()
        path = self.sync_dir / f"v{version:06d}"
        save_checkpoint(model, path, policy_version=version)
        rec = self.load(path, version, weights_checksum(model))
        rec["seconds"] = time.perf_counter() - t0
        old = sorted(p for p in self.sync_dir.glob("v*") if p.is_dir())[: -self.keep]
        for p in old:
            shutil.rmtree(p, ignore_errors=True)
        return rec

    def abort(self) -> None:
        async def go():
            for u in self.urls:
                c = EngineClient(u, timeout=10)
                with contextlib.suppress(Exception):
                    await c.abort()
                await c.aclose()

        asyncio.run(go())

    def close(self) -> None:
        """The servers belong to whoever started them: nothing to stop here."""


def make_backend(model, tok, *, urls: list[str] | None = None, router_url: str = "", sync_dir: str | Path | None = None,
                 n_slots: int = 8, max_len: int = 2048, version: int = 0, name: str = "in-process",
                 compile_decode: bool = False):
    """`ServerBackend` over `urls` (the model is pushed to them as `version`), else an `InProcessBackend`
    (`compile_decode`: its engine's decode step compiled, rollout/compiled.py)."""
    if urls:
        if sync_dir is None:
            raise ValueError("a server rollout backend needs sync_dir (where pushed checkpoints are written)")
        b = ServerBackend(urls, sync_dir, router_url=router_url)
        b.push(model, version)
        return b
    return InProcessBackend(model, tok, n_slots=n_slots, max_len=max_len, version=version, name=name,
                            compile_decode=compile_decode)


class ServerTeacherPool:
    """OPD's teachers on engine servers: scoring is `/generate` with `max_new_tokens: 0`, `return_logprob` and
    `logprob_start_len: 0` (the teacher's log-prob of every token of the student's sequence).

    Each teacher checkpoint is loaded into a server with `/update_weights_from_disk`; with fewer servers than
    teachers, a teacher takes the least recently used server that is not scoring. While one teacher scores its
    batches, the next teacher of the list is loaded into another server (prefetch), so a swap costs only what
    scoring did not cover. Same `score_batches(batches, fn)` as `trainers.teachers.TeacherPool` (fn unused: the
    servers compute the scores); batches are `(domain, rows)` with `rows.ids`, `rows.lengths`."""

    def __init__(self, paths: dict, urls: list[str], concurrency: int = 8):
        if not urls:
            raise ValueError("ServerTeacherPool needs at least one server URL")
        if not paths:
            raise ValueError("ServerTeacherPool needs at least one teacher checkpoint")
        self.paths = {str(d): str(p) for d, p in paths.items()}
        self.ids = {d: 10_000 + i for i, d in enumerate(self.paths)}  # the weight_version that names a teacher
        self.urls, self.concurrency = list(urls), concurrency
        self.on: dict[str, str | None] = dict.fromkeys(self.urls)  # server → teacher loaded there
        self.used: dict[str, float] = dict.fromkeys(self.urls, 0.0)
        self.loads = self.swaps = 0
        self.load_seconds = self.wait_seconds = 0.0

    def _where(self, domain: str) -> str | None:
        return next((u for u, d in self.on.items() if d == domain), None)

    async def _load(self, domain: str, busy: set[str]) -> str:
        url = self._where(domain)
        if url is not None:
            return url
        free = [u for u in self.urls if u not in busy] or self.urls
        url = min(free, key=lambda u: self.used[u])
        self.on[url] = None  # mid-load: it serves no teacher until the load is done
        t0 = time.perf_counter()
        c = EngineClient(url)
        try:
            res = await c.update_weights_from_disk(self.paths[domain], weight_version=self.ids[domain], flush_cache=True)
        finally:
            await c.aclose()
        if not res.get("success", False):
            raise WeightSyncError(f"{url}: loading teacher {domain!r} failed: {res.get('message')}")
        self.load_seconds += time.perf_counter() - t0
        self.loads += 1
        self.swaps += 1
        self.on[url] = domain
        return url

    async def _score_rows(self, url: str, rows, domain: str):
        import torch

        c = EngineClient(url)
        sem = asyncio.Semaphore(self.concurrency)

        async def one(i: int) -> list[float | None]:
            async with sem:
                out = await c.generate(rows.ids[i, : rows.lengths[i]].tolist(), {"max_new_tokens": 0},
                                       return_logprob=True, logprob_start_len=0)
            got = out.get("meta_info", {}).get("weight_version")
            if got is not None and str(got) != str(self.ids[domain]):  # restarted, or loaded by someone else
                self.on[url] = None  # what it serves is unknown now: the next call loads the teacher again
                raise WeightSyncError(f"{url}: scored with weight version {got}, not teacher {domain!r} "
                                      f"(version {self.ids[domain]}): refused")
            return [lp for lp, _t, _x in out["meta_info"]["input_token_logprobs"]]

        try:
            got = await asyncio.gather(*(one(i) for i in range(rows.ids.shape[0])))
        finally:
            await c.aclose()
        out = torch.zeros(rows.ids.shape, dtype=torch.float32)
        for i, lps in enumerate(got):
            out[i, 1 : len(lps)] = torch.tensor([float(x) for x in lps[1:]])
        return out

    async def _score_all(self, batches):
        groups: dict[str, list[int]] = {}
        for i, (d, _) in enumerate(batches):
            if d not in self.paths:
                raise KeyError(f"no teacher for domain {d!r} (have {', '.join(self.paths)})")
            groups.setdefault(d, []).append(i)
        order = sorted(groups, key=lambda d: self._where(d) is None)  # loaded teachers first
        results: list = [None] * len(batches)
        nxt: asyncio.Task | None = None
        for k, d in enumerate(order):
            t0 = time.perf_counter()
            url = await nxt if nxt is not None and nxt.get_name() == d else await self._load(d, set())
            self.wait_seconds += time.perf_counter() - t0
            nxt = None
            if k + 1 < len(order) and len(self.urls) > 1:  # prefetch the next teacher into another server
                nxt = asyncio.create_task(self._load(order[k + 1], {url}), name=order[k + 1])
            self.used[url] = time.perf_counter()
            scored = await asyncio.gather(*(self._score_rows(url, batches[i][1], d) for i in groups[d]))
            for i, r in zip(groups[d], scored):
                results[i] = r
        if nxt is not None:
            await nxt
        return results

    def score_batches(self, batches, fn=None, prefetch: bool = True) -> list:
        return asyncio.run(self._score_all(batches))

    def stats(self):
        hidden = max(0.0, self.load_seconds - self.wait_seconds)
        return _PoolStats({"swaps": self.swaps, "loads": self.loads, "load_seconds": self.load_seconds,
                           "wait_seconds": self.wait_seconds,
                           "hidden_fraction": hidden / self.load_seconds if self.load_seconds else 0.0})

    def close(self) -> None:
        """The servers belong to whoever started them."""


class _PoolStats(dict):
    def as_dict(self) -> dict:
        return dict(self)
