"""The in-process router and the real sglang-router in front of embedded servers."""

import asyncio
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

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

    def full_forward_greedy(model, prompt, n):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        return ids[len(prompt):]

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
        with pytest.raises(StaleReply, match="2 replies came from weights older than policy v4"):
            asyncio.run(go(srv.url, 4))
