"""The RL loop disaggregated: the trainer here, rollouts on two `temper serve` processes behind the Router, weights
synced through `/update_weights_from_disk`. The same code as the in-process loop, given a ServerBackend.

Rewards are set by the `on_trajectory` hook (a random micro policy never earns one), as in test_loop.py.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

import configs
from envs import make_sandbox
from envs.generator import generate
from model import ByteTokenizer, Transformer, save_checkpoint, weights_checksum
from rollout.agent import AgentConfig
from rollout.backend import ServerBackend, wait_healthy
from stages import Recorder
from store import TrajectoryStore
from trainers.loop import LoopConfig, RLLoop
from trainers.sao import SAOConfig

TOK = ByteTokenizer()
AGENT = AgentConfig(system_prompt="Use tools.", max_context=384, max_action_tokens=8, max_total_tokens=16,
                    max_obs_tokens=32, compact_margin=0, seed=0)
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_thread")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(ckpt: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "pipelines.cli", "serve", "--checkpoint", str(ckpt), "--port",
                             str(port), "--slots", "4", "--max-len", "512"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _wait_up(url: str, proc: subprocess.Popen) -> None:
    wait_healthy(url, proc, timeout=120.0)


@pytest.fixture()
def servers(tmp_path):
    """Two `temper serve` processes on the micro policy (policy version 0); killed at the end."""
    torch.manual_seed(0)
    actor = Transformer(configs.load("micro").model)
    ckpt = tmp_path / "init"
    save_checkpoint(actor, ckpt, policy_version=0)
    ports = [_free_port(), _free_port()]
    procs = {p: _start(ckpt, p) for p in ports}
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for u, p in zip(urls, ports):
            _wait_up(u, procs[p])
        yield actor, ckpt, urls, procs
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _loop(actor, backend, mode="async", **kw):
    specs = generate(["kv-lookup", "calc-chain"], 6, seed=3)
    seen = []

    def on_trajectory(t):
        t.reward = float(len(seen) % 2)
        seen.append(t)
        if extra := kw.get("on_trajectory"):
            extra(t)

    cfg = SAOConfig(critic_updates=1, staleness=4, value_pretrain_steps=0, lr=1e-3,
                    loss="sao" if mode == "async" else "grpo")
    loop = RLLoop(actor, specs, TOK, make_sandbox(), AGENT, cfg,
                  LoopConfig(mode=mode, batch_size=4, in_flight=4, n_slots=4, group_size=2 if mode == "sync" else 1,
                             push_every=1), on_trajectory=on_trajectory, backend=backend)
    return loop, seen


def test_sao_against_two_server_processes(servers, tmp_path):
    actor, _, urls, _ = servers
    backend = ServerBackend(urls, tmp_path / "sync")
    backend.push(actor, 0)
    loop, seen = _loop(actor, backend)
    hist = loop.run(3)
    assert [h["updated"] for h in hist] == [True] * 3 and loop.version == 3
    # every worker holds the trainer's weights at its version: checked by the push, and here independently
    for u in urls:
        info = httpx.get(u + "/get_model_info").json()
        assert info["weight_version"] == "3" and info["weights_checksum"] == weights_checksum(actor)
    assert all(p["workers"] == 2 and p["checksum_checked"] for p in loop.pushes)
    # the router spread episodes over both processes (an episode that crashed or was aborted before its first
    # generation, as a loaded machine can make one, names no engine and is not counted)
    assert {t.engine for t in seen if t.n_trainable} == set(urls)
    assert all(t.engine in (*urls, "") for t in seen)
    # per-token versions: every generated token carries a version the trainer pushed, never a future one
    gen = [v for t in seen for s in t.segments for v, m in zip(s.versions, s.loss_mask) if m]
    assert set(gen) <= {0, 1, 2, 3} and 0 in gen
    rows = loop.consumption
    assert [r["step"] for r in rows] == [1] * 4 + [2] * 4 + [3] * 4
    # train/inference mismatch across processes on the version being trained: the servers rescored each finished
    # segment with the trainer's own forward (and JSON carries the float32 values exactly): the same bits
    assert hist[0]["mismatch_fresh_tokens"] > 0
    assert all(h["mismatch_fresh_max"] == 0.0 for h in hist if "mismatch_fresh_tokens" in h)


def test_same_seeded_sync_step_in_process_and_on_servers(servers, tmp_path):
    """Sync GRPO with seeded sampling: one step on an in-process engine and one on two server processes consume
    the same episodes (tokens, versions, rewards) and so leave the actor with the same weights."""
    actor, _, urls, _ = servers
    a = Transformer(actor.config)
    a.load_state_dict(actor.state_dict())
    b = Transformer(actor.config)
    b.load_state_dict(actor.state_dict())
    la, seen_a = _loop(a, None, mode="sync")
    backend = ServerBackend(urls, tmp_path / "sync")
    backend.push(b, 0)
    lb, seen_b = _loop(b, backend, mode="sync")
    la.run(1)
    lb.run(1)

    def key(ts):
        return sorted((t.env_id, [s.tokens for s in t.segments], [s.versions for s in t.segments], t.reward) for t in ts)

    assert len(seen_a) == len(seen_b) == 4 and key(seen_a) == key(seen_b)
    # a GRPO group's two rollouts of one environment sample their own streams (the same seed would make them
    # identical and every advantage cancel)
    for t, u in (seen_a[0:2], seen_a[2:4]):
        assert t.env_id == u.env_id and [s.tokens for s in t.segments] != [s.tokens for s in u.segments]
    # the rollout log-probs agree to float noise (co-batching differs between one engine and two servers),
    # so the step's gradients agree to that noise too
    def tokens(t):
        return t.env_id, tuple(x for s in t.segments for x in s.tokens)

    lp = {tokens(t): [x for s in t.segments for x in s.logprobs] for t in seen_a}
    for t in seen_b:
        torch.testing.assert_close(torch.tensor([x for s in t.segments for x in s.logprobs]),
                                   torch.tensor(lp[tokens(t)]), rtol=0, atol=1e-5)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-6, msg=name)
    assert not all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), actor.state_dict().values()))  # it moved
    assert la.version == lb.version == 1


def test_kill_one_server_loses_and_duplicates_nothing(servers, tmp_path):
    """One of two servers is SIGKILLed after the first step: its episodes are retried on the other, every
    trajectory lands in the store exactly once, and pushes go on to the live worker. Restarted, it rejoins
    the router only after loading the current version (the trainer is blocked meanwhile, so no push did it)."""
    actor, ckpt, urls, procs = servers
    backend = ServerBackend(urls, tmp_path / "sync", health_interval=0.5)
    backend.push(actor, 0)
    rec = Recorder(tmp_path / "store.duckdb")
    loop, seen = _loop(actor, backend, on_trajectory=rec.add)
    port0 = int(urls[0].rsplit(":", 1)[1])
    events = {}

    def on_step(st):
        step = len(events.setdefault("steps", [])) + 1
        events["steps"].append(st)
        rec.flush(loop.consumption)
        if step == 1:
            os.killpg(procs[port0].pid, signal.SIGKILL)
            procs[port0].wait()
        if step == 2:
            procs[port0] = _start(ckpt, port0)  # serves policy v0 from its command line at first
            _wait_up(urls[0], procs[port0])
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if httpx.get(urls[0] + "/get_model_info").json()["weight_version"] == str(loop.version):
                    events["rejoined_at"] = loop.version
                    break
                time.sleep(0.2)

    loop.run(4, on_step)
    rec.flush(loop.consumption)
    assert events.get("rejoined_at") == 2  # loaded v2 through the router's rejoin, before any later push
    assert loop.pushes[1]["down"] == 1 and loop.pushes[1]["workers"] == 1  # the push right after the kill
    assert loop.pushes[-1]["down"] == 0 and loop.pushes[-1]["workers"] == 2  # after the rejoin
    ids = [t.trajectory_id for t in seen]
    assert len(ids) == len(set(ids))
    with TrajectoryStore(tmp_path / "store.duckdb", read_only=True) as st:
        stored = [r[0] for r in st.cursor().execute("SELECT trajectory_id FROM trajectories").fetchall()]
        consumed = st.consumption("sao")
    assert sorted(stored) == sorted(ids)  # nothing lost, nothing twice
    assert [r["step"] for r in consumed] == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
    assert {r["trajectory_id"] for r in consumed} <= set(stored)
    assert all(t.status != "crashed" for t in seen)


def test_a_server_restarted_at_an_older_checkpoint_serves_only_the_current_version(servers, tmp_path):
    """Sync mode opens a new Router for every batch. After step 1 (v1 pushed to both), one `temper serve` is killed and
    restarted from the v0 checkpoint: it answers /health like any other. The next batch's router admits it only after
    it shows v1 (it loads v1 first; the health loop, an hour apart here, never runs), so every token of every batch
    was generated by the version the batch was started with, and the restarted server takes its share of the work.
    (Routers that trusted /health once ran 8 of 16 requests on v0 here while the other server was on v5.)"""
    actor, ckpt, urls, procs = servers
    backend = ServerBackend(urls, tmp_path / "sync", health_interval=3600)
    backend.push(actor, 0)
    batches = []
    loop, _ = _loop(actor, backend, mode="sync", on_trajectory=lambda t: batches.append((loop.version, t)))
    port0 = int(urls[0].rsplit(":", 1)[1])

    def on_step(st):
        if st["version"] == 1:
            os.killpg(procs[port0].pid, signal.SIGKILL)
            procs[port0].wait()
            procs[port0] = _start(ckpt, port0)  # the older checkpoint: policy v0
            _wait_up(urls[0], procs[port0])
            assert httpx.get(urls[0] + "/get_model_info").json()["weight_version"] == "0"

    loop.run(3, on_step)
    assert loop.version == 3 and sorted({v for v, _ in batches}) == [0, 1, 2]
    for v, t in batches:
        gen = [x for s in t.segments for x, m in zip(s.versions, s.loss_mask) if m]
        assert t.status not in ("aborted", "crashed") and gen and set(gen) == {v}, (v, t.engine, sorted(set(gen)))
    assert urls[0] in {t.engine for v, t in batches if v == 1}  # the restarted server served the batch after it
    info = httpx.get(urls[0] + "/get_model_info").json()
    assert info["weight_version"] == "3" and info["weights_checksum"] == weights_checksum(actor)
