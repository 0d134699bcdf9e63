"""Where rollouts are generated: embedded temper servers, or SGLang servers (optionally behind a router).

    with embedded_servers(model_config, n=2) as urls:            # started here, stopped on exit
        asyncio.run(load_weights(urls, "runs/x/checkpoint"))
        policy = await open_policy(urls)                         # Router over the workers (or one client)

The same calls drive real SGLang servers: `/update_weights_from_disk` with an HF-layout checkpoint,
`/generate` with token ids. With an sglang-router in front, pass the workers' URLs for weight loading and
the router's URL for generation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .client import EngineClient
from .router import Router


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


async def open_policy(urls: list[str], router_url: str = ""):
    """A `generate`-capable policy: the external router, one client, or temper's Router over several workers."""
    if router_url:
        return EngineClient(router_url)
    if len(urls) == 1:
        return EngineClient(urls[0])
    return await Router(urls).start()


async def close_policy(policy) -> None:
    await (policy.close() if isinstance(policy, Router) else policy.aclose())
