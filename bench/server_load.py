"""Server under load: 64 clients for 30 s against one `temper serve` process, with weight updates under way.

    .venv/bin/python bench/server_load.py [--clients 64 --seconds 30 --update-every 5 --checkpoint PATH]

Each client loops: a native `/generate` (token ids, log-probs), an OpenAI `/v1/completions` (half of them
streamed), a `/v1/chat/completions`, and now and then a malformed request, an abort of its own request, or a
request it abandons mid-stream. Meanwhile the weights are reloaded from disk every few seconds
(`/update_weights_from_disk`) and `/get_load` is polled. Counted per kind: held (the answer it should get: 200, or
the 4xx a bad request should get), failed (5xx, a 200 where a 4xx belonged, a dropped connection, a timeout), and
the server's resident memory (VmRSS) after warm-up and at the end. The load is bounded by the clock on purpose —
it measures what the server holds for 30 s — and no test depends on it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from common import table

import configs
from model import Transformer, save_checkpoint
from rollout.backend import wait_healthy
from trainers.backends import free_port


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def client(http, url: str, cid: int, until: float, held: Counter, failed: Counter, rng: random.Random):
    import httpx

    async def call(kind: str, path: str, body, want: int = 200, stream: bool = False) -> None:
        try:
            if stream:
                async with http.stream("POST", url + path, json=body) as r:
                    n = 0
                    async for _ in r.aiter_lines():
                        n += 1
                        if kind == "abandoned" and n >= 2:
                            break  # the client goes away mid-stream: the server must abort, not keep generating
                    code = r.status_code
            else:
                r = await http.post(url + path, json=body) if not isinstance(body, bytes) else \
                    await http.post(url + path, content=body, headers={"Content-Type": "application/json"})
                code = r.status_code
        except (httpx.TransportError, httpx.TimeoutException) as e:
            failed[f"{kind}: {type(e).__name__}"] += 1
            return
        (held if code == want else failed)[kind if code == want else f"{kind}: HTTP {code}"] += 1

    while time.perf_counter() < until:
        ids = [rng.randrange(256) for _ in range(rng.randrange(4, 64))]
        n = rng.randrange(4, 32)
        pick = rng.random()
        if pick < 0.35:
            await call("generate", "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": n,
                                                 "temperature": 1.0}, "return_logprob": True})
        elif pick < 0.55:
            await call("completions", "/v1/completions", {"prompt": "abc " * rng.randrange(1, 20), "max_tokens": n,
                                                          "stream": cid % 2 == 0}, stream=cid % 2 == 0)
        elif pick < 0.75:
            await call("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * n}],
                                                         "max_tokens": n})
        elif pick < 0.85:
            bad = rng.choice([b"{not json", json.dumps({"input_ids": [], "sampling_params": {}}).encode(),
                              json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}).encode(),
                              json.dumps({"input_ids": [10**9], "sampling_params": {"max_new_tokens": 4}}).encode()])
            await call("bad input", "/generate", bad, want=400)
        elif pick < 0.93:
            await call("abandoned", "/v1/completions", {"prompt": "xyz", "max_tokens": 64, "stream": True},
                       stream=True)
        else:
            rid = f"c{cid}-{rng.randrange(10**9)}"
            gen = asyncio.create_task(call("aborted", "/generate", {"input_ids": ids, "rid": rid,
                                                                    "sampling_params": {"max_new_tokens": 64}}))
            await asyncio.sleep(0.05)
            await call("abort", "/abort_request", {"rid": rid})
            await gen


async def updater(http, url: str, ckpt: str, every: float, until: float, held: Counter, failed: Counter) -> None:
    v = 1
    while time.perf_counter() + every < until:
        await asyncio.sleep(every)
        v += 1
        try:
            r = await http.post(url + "/update_weights_from_disk", json={"model_path": ckpt, "weight_version": str(v)})
            ok = r.status_code == 200 and r.json().get("success")
        except Exception as e:  # noqa: BLE001 - counted
            failed[f"update: {type(e).__name__}"] += 1
            continue
        (held if ok else failed)["weight update" if ok else f"weight update: HTTP {r.status_code}"] += 1
        try:
            lr = await http.get(url + "/get_load")
            (held if lr.status_code == 200 else failed)["get_load"] += 1
        except Exception as e:  # noqa: BLE001
            failed[f"get_load: {type(e).__name__}"] += 1


async def main_async(args, url: str, pid: int, ckpt: str) -> dict:
    import httpx

    held, failed = Counter(), Counter()
    limits = httpx.Limits(max_connections=args.clients * 2)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        warm_until = time.perf_counter() + args.warmup
        await asyncio.gather(*(client(http, url, i, warm_until, Counter(), Counter(), random.Random(i))
                               for i in range(8)))
        rss0 = rss_mib(pid)
        peak = rss0
        until = time.perf_counter() + args.seconds

        async def sample():
            nonlocal peak
            while time.perf_counter() < until:
                peak = max(peak, rss_mib(pid))
                await asyncio.sleep(0.5)

        await asyncio.gather(sample(), updater(http, url, ckpt, args.update_every, until, held, failed),
                             *(client(http, url, i, until, held, failed, random.Random(1000 + i))
                               for i in range(args.clients)))
        await asyncio.sleep(1.0)  # abandoned requests are aborted, not left running
        load = (await http.get(url + "/get_load")).json()
        alive = (await http.get(url + "/health")).status_code == 200
    return {"held": held, "failed": failed, "rss0": rss0, "rss1": rss_mib(pid), "peak": peak, "alive": alive,
            "load_after": load}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--update-every", type=float, default=5.0)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--checkpoint", default=None, help="served and reloaded (default: a fresh model of the preset)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.checkpoint
        if ckpt is None:
            ckpt = str(Path(tmp) / "ckpt")
            save_checkpoint(Transformer(configs.load(args.preset).model), ckpt, policy_version=1)
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "serve", "--checkpoint", ckpt, "--port",
                                 str(port), "--slots", "16", "--max-len", "512"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc, timeout=120)
            out = asyncio.run(main_async(args, url, proc.pid, ckpt))
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
    held, failed = out["held"], out["failed"]
    rows = [[k, held.get(k, 0), sum(v for f, v in failed.items() if f.split(":")[0] == k)]
            for k in sorted({*held, *(f.split(":")[0] for f in failed)})]
    rows.append(["all", sum(held.values()), sum(failed.values())])
    table(f"{args.clients} clients for {args.seconds:g} s, weights reloaded every {args.update_every:g} s",
          ["request kind", "held", "failed"], rows)
    if failed:
        print("failures:", dict(failed))
    growth = (out["rss1"] - out["rss0"]) / out["rss0"]
    table("server memory (VmRSS, MiB)", ["after warm-up", "end", "peak", "growth"],
          [[out["rss0"], out["rss1"], out["peak"], f"{growth:+.1%}"]])
    la = out["load_after"]
    ld = la[0] if isinstance(la, list) else la.get("loads", [la])[0]
    print(f"server alive after the run: {out['alive']}; still running / waiting 1 s later: "
          f"{ld.get('num_running_reqs')} / {ld.get('num_waiting_reqs')}")
    return 0 if out["alive"] and not failed and growth < 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
