"""The in-process router and the real sglang-router in front of embedded servers."""

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from engine_helpers import full_forward_greedy

from model import Transformer
from rollout.engine import Engine
from rollout.router import Router
from rollout.server import ServerThread, create_app


@pytest.fixture(scope="module")
def two_servers(micro_model):
    engines, servers = [], []
    for _ in range(2):
        m = Transformer(micro_model.config)
        m.load_state_dict(micro_model.state_dict())
        e = Engine(m, n_slots=2, max_len=128)
        engines.append(e)
        servers.append(ServerThread(create_app(e)).start())
    yield servers, engines
    for s in servers:
        s.stop()
    for e in engines:
        e.shutdown()


class _Dropper(BaseHTTPRequestHandler):
    """A worker that looks healthy but dies on every /generate (connection closed mid-request)."""

    def do_GET(self):  # noqa: N802
        body = b'{"max_running_requests": 4}' if "server_info" in self.path else b'{"status": "ok"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.connection.shutdown(socket.SHUT_RDWR)

    def log_message(self, *a):
        pass


def test_spreads_work_and_keeps_sessions(two_servers):
    servers, engines = two_servers

    async def main():
        async with Router([s.url for s in servers]) as router:
            sp = {"max_new_tokens": 6, "ignore_eos": True}
            outs = await asyncio.gather(*(router.generate([1, 2, 3, i], sp) for i in range(8)))
            assert all(len(o["output_ids"]) == 6 for o in outs)
            used = {o["meta_info"]["worker"] for o in outs}
            assert used == {s.url for s in servers}  # least-outstanding-work uses both
            w1 = [(await router.generate([5, 6, i], {"max_new_tokens": 2}, session_id="ep-1"))["meta_info"]["worker"]
                  for i in range(4)]
            assert len(set(w1)) == 1  # session affinity
            return router.stats()

    stats = asyncio.run(main())
    assert sum(s["served"] for s in stats) == 12


def test_failover_to_a_healthy_worker(two_servers):
    servers, _ = two_servers
    dead = ThreadingHTTPServer(("127.0.0.1", 0), _Dropper)
    threading.Thread(target=dead.serve_forever, daemon=True).start()
    dead_url = f"http://127.0.0.1:{dead.server_address[1]}"

    async def main():
        async with Router([dead_url, servers[0].url], health_interval=60) as router:
            sp = {"max_new_tokens": 3, "ignore_eos": True}
            outs = await asyncio.gather(*(router.generate([1, 2, i], sp) for i in range(6)))
            return outs, router.stats()

    try:
        outs, stats = asyncio.run(main())
    finally:
        dead.shutdown()
        dead.server_close()
    assert all(len(o["output_ids"]) == 3 and o["meta_info"]["worker"] == servers[0].url for o in outs)
    dead_stats = next(s for s in stats if s["url"] == dead_url)
    assert dead_stats["failures"] >= 1 and not dead_stats["healthy"]


def test_waits_for_a_free_slot_then_refills(two_servers):
    servers, _ = two_servers

    async def main():
        async with Router([servers[0].url], slots_per_worker=1) as router:
            t = time.perf_counter()
            outs = await asyncio.gather(*(router.generate([1, i], {"max_new_tokens": 4}) for i in range(5)))
            return outs, time.perf_counter() - t, router.stats()

    outs, _, stats = asyncio.run(main())
    assert len(outs) == 5 and stats[0]["served"] == 5 and stats[0]["outstanding"] == 0


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_real_sglang_router_in_front_of_two_embedded_servers(two_servers):
    servers, engines = two_servers
    before = [e.stats.generated_tokens for e in engines]
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
         "--worker-urls", *[s.url for s in servers], "--policy", "round_robin", "--log-level", "warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        ok = False
        with httpx.Client(timeout=30) as c:
            while time.time() < deadline and not ok:
                try:
                    r = c.post(url + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
                    ok = r.status_code == 200
                except httpx.TransportError:
                    pass
                if not ok:
                    time.sleep(0.5)
            assert ok, "sglang-router never routed a request"
            for i in range(6):
                sp = {"max_new_tokens": 3, "ignore_eos": True}
                r = c.post(url + "/generate", json={"input_ids": [3, i], "sampling_params": sp})
                assert r.status_code == 200 and len(r.json()["output_ids"]) == 3
        after = [e.stats.generated_tokens for e in engines]
        assert all(a > b for a, b in zip(after, before))  # both embedded servers did work
    finally:
        import os
        import signal

        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_stale_reply_is_refused_and_its_worker_reloaded_before_it_serves_again(micro_server, micro_model, tmp_path):
    """A worker on the v0 checkpoint when the router starts is given v5 (`on_rejoin`) before it is admitted. Then it is
    put back on v0 (as a server restarted from an older checkpoint between two health polls is; the polls here are an
    hour apart): its v0 replies are refused and retried on the other worker, it is taken out and given v5 again, and
    every reply the caller gets was computed by v5: the tokens v5's own forward picks, stamped 5."""
    import copy

    import torch

    from model import save_checkpoint
    from rollout.client import EngineClient

    v5 = copy.deepcopy(micro_model)
    with torch.no_grad():
        for p in v5.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    save_checkpoint(micro_model, tmp_path / "v0", policy_version=0)
    save_checkpoint(v5, tmp_path / "v5", policy_version=5)
    loads = []

    async def rejoin(client):
        loads.append(client.url)
        assert (await client.update_weights_from_disk(str(tmp_path / "v5"), weight_version=5))["success"]

    async def main(a, b, ea):
        for s, v in ((a, 0), (b, 5)):
            c = EngineClient(s.url)
            await c.update_weights_from_disk(str(tmp_path / f"v{v}"), weight_version=v)
            await c.aclose()
        async with Router([a.url, b.url], health_interval=3600, on_rejoin=rejoin, expect=lambda: (5, None)) as router:
            assert loads == [a.url] and ea.version == 5  # admitted at start only once it serves v5
            c = EngineClient(a.url)
            assert (await c.update_weights_from_disk(str(tmp_path / "v0"), weight_version=0))["success"]
            await c.aclose()
            sp = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
            outs = await asyncio.gather(*(router.generate([1, 2, 3 + i % 4], sp) for i in range(16)))
            return outs, router.stats()

    with micro_server(16) as (a, ea), micro_server(16) as (b, _):
        outs, stats = asyncio.run(main(a, b, ea))
        assert ea.version == 5
    assert all(o["meta_info"]["output_token_versions"] == [5] * 4 for o in outs)
    for i, o in enumerate(outs):
        assert o["output_ids"] == full_forward_greedy(v5, [1, 2, 3 + i % 4], 4)
    sa = next(s for s in stats if s["url"] == a.url)
    assert sa["stale"] >= 1 and loads == [a.url, a.url] and sa["healthy"]


def test_behind_an_external_router_replies_from_older_weights_are_refused(micro_server):
    """Behind sglang-router the worker is not ours to pick: a reply older than the pushed version is sent again, and
    refused with StaleReply once the retries are spent; a current one passes."""
    from rollout.client import EngineClient
    from rollout.router import CheckedClient, StaleReply

    async def go(url, want):
        c = CheckedClient(EngineClient(url), lambda: (want, None), retries=1)
        try:
            return await c.generate([1, 2], {"max_new_tokens": 2, "ignore_eos": True}), c.stale
        finally:
            await c.aclose()

    with micro_server(8) as (srv, eng):
        eng.version = 3
        out, stale = asyncio.run(go(srv.url, 3))
        assert out["meta_info"]["output_token_versions"] == [3, 3] and stale == 0
        with pytest.raises(StaleReply, match="2 replies refused; the last one: weight version '3', older than the policy v4"):
            asyncio.run(go(srv.url, 4))


class _Fake:
    """A worker on 127.0.0.1 that claims `version` in /get_model_info (`then` once it has answered a /generate: it was
    reloaded after the router admitted it) and answers every /generate with `reply` (a callable gets the request
    body), counting the /generate calls in `hits`."""

    def __init__(self, version, reply, then=None):
        fake = self
        self.hits, self.version = 0, version

        class Handler(BaseHTTPRequestHandler):
            def _send(self, obj):
                body = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802
                self._send({"weight_version": str(fake.version)} if "model_info" in self.path else
                           {"max_running_requests": 4} if "server_info" in self.path else {"status": "ok"})

            def do_POST(self):  # noqa: N802
                sent = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                fake.hits += 1
                fake.version = fake.version if then is None else then
                self._send(reply(sent) if callable(reply) else reply)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def _reply(ids, versions, weight_version):
    meta = {"weight_version": weight_version} if weight_version is not None else {}
    if versions is not None:
        meta["output_token_versions"] = versions
    return {"text": "", "output_ids": ids, "meta_info": meta}


GOOD = _reply([7, 8], [5, 5], "5")
BAD = {  # what a worker answers, what its /get_model_info claims after that, and whether it is stale or malformed
    "no version at all": (_reply([7, 8], None, None), 5, "failures"),
    "token versions shorter than the tokens": (_reply([7, 8], [5], "5"), 5, "failures"),
    "token versions missing while tokens came": (_reply([7, 8], [], "5"), 5, "failures"),
    "a list for one prompt": ([GOOD], 5, "failures"),
    "newer tokens": (_reply([7, 8], [6, 6], "6"), 6, "stale"),
    "newer weight_version over current tokens": (_reply([7, 8], [5, 5], "6"), 6, "stale"),
    "older tokens": (_reply([7, 8], [4, 5], "5"), 4, "stale"),
    "not a version": (_reply([7, 8], None, "default"), "default", "stale"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_reply_that_misstates_its_version_is_never_returned(case):
    """With v5 expected, a worker's reply that names no version, names fewer token versions than tokens, is not an
    object, or names another version (older, newer, not one) is refused: the request is retried on the other worker,
    every reply the caller gets is the good worker's v5 reply, and the bad worker is out of the rotation. With the bad
    worker alone, the request fails rather than return its reply."""
    from rollout.client import EngineUnavailable
    from rollout.router import NoHealthyWorker

    reply, claims, counter = BAD[case]

    async def main(urls, n):
        async with Router(urls, health_interval=3600, expect=lambda: (5, None)) as router:
            outs = await asyncio.gather(*(router.generate([1, i], {"max_new_tokens": 2}) for i in range(n)))
            return outs, {s["url"]: s for s in router.stats()}

    with _Fake(5, reply, then=claims) as bad, _Fake(5, GOOD) as good:
        outs, stats = asyncio.run(main([bad.url, good.url], 6))
        assert bad.hits >= 1 and good.hits == 6  # the bad worker was tried (listed first: first pick) and refused
        assert [o["meta_info"]["worker"] for o in outs] == [good.url] * 6
        assert all(o["meta_info"]["output_token_versions"] == [5, 5] and o["output_ids"] == [7, 8] for o in outs)
        assert stats[bad.url][counter] >= 1 and not stats[bad.url]["healthy"] and stats[bad.url]["served"] == 0
        bad.version, hits = 5, bad.hits  # it shows v5 again: admitted, tried, refused
        with pytest.raises((EngineUnavailable, NoHealthyWorker)):
            asyncio.run(main([bad.url], 1))
        assert bad.hits > hits


def test_a_reply_from_a_version_pushed_mid_request_is_taken():
    """A push of v6 that lands while a request runs: its tokens span v5 and v6, and the reply is taken (v6 is expected
    when it arrives); the same reply with v6 never expected is refused as newer."""
    from rollout.router import StaleReply

    want = [(5, None)]

    def reply(_sent):
        want[:] = [(5, None), (6, None)]  # the push begins while the worker generates
        return _reply([7, 8], [5, 6], "6")

    async def main(url):
        async with Router([url], health_interval=3600, expect=lambda: list(want)) as router:
            return await router.generate([1, 2], {"max_new_tokens": 2}), router.stats()[0]

    with _Fake(5, reply) as w:
        out, stats = asyncio.run(main(w.url))
        assert w.hits == 1 and stats["stale"] == stats["failures"] == 0  # taken the first time, not on a retry
    assert out["meta_info"]["output_token_versions"] == [5, 6] and out["meta_info"]["worker"] == w.url

    from rollout.router import check_reply

    with pytest.raises(StaleReply, match="'6', newer than the policy v5"):
        check_reply(_reply([7, 8], [5, 6], "6"), [(5, None)], [(5, None)])


def test_behind_an_external_router_a_reply_without_versions_is_refused():
    """CheckedClient (behind sglang-router) sends a malformed reply's request again and refuses it once the retries
    are spent; without an expectation (nothing pushed yet) a reply that names no version is passed on."""
    from rollout.client import EngineClient
    from rollout.router import BadReply, CheckedClient

    async def go(url, want):
        c = CheckedClient(EngineClient(url), lambda: want, retries=2)
        try:
            return await c.generate([1, 2], {"max_new_tokens": 2})
        finally:
            await c.aclose()

    with _Fake(5, _reply([7, 8], None, None)) as w:
        with pytest.raises(BadReply, match="3 replies refused; the last one: a reply that names no weight version"):
            asyncio.run(go(w.url, (5, None)))
        assert w.hits == 3
        assert asyncio.run(go(w.url, None))["output_ids"] == [7, 8]
    with _Fake(5, _reply([7, 8], [5], "5")) as w, pytest.raises(BadReply, match="names 1 versions for 2 output"):
        asyncio.run(go(w.url, None))  # a short token-version list is refused even without an expectation
