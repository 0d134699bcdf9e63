"""Reference batched generation over the incremental API (ragged prompts, latent cache).

A small, readable decoder for smoke runs and as the slow twin of the rollout engine: one chunked
prefill of all prompts (right-padded), then one token per step for the sequences still running.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .cache import KVCache
from .transformer import Transformer


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    stop_ids: Sequence[int] = (),
    seed: int = 0,
) -> list[list[int]]:
    """Return the new tokens of each prompt (stop token included when hit)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    model.eval()
    b = len(prompts)
    dev = model.embed_tokens.weight.device
    cache = KVCache(model.config, b, max(len(p) for p in prompts) + max_new_tokens, device=dev,
                    dtype=model.embed_tokens.weight.dtype)
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    batch = torch.zeros(b, int(lens.max()), dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        batch[i, : len(p)] = torch.tensor(list(p))
    logits = model(batch, cache=cache, n_new=lens)
    last = logits[torch.arange(b), lens - 1]
    gen = torch.Generator(device=dev).manual_seed(seed)
    stop = set(int(s) for s in stop_ids)
    out: list[list[int]] = [[] for _ in range(b)]
    running = torch.ones(b, dtype=torch.bool, device=dev)
    for _ in range(max_new_tokens):
        nxt = _sample(last, temperature, top_k, gen)
        for i in running.nonzero().flatten().tolist():
            tok = int(nxt[i])
            out[i].append(tok)
            if tok in stop:
                running[i] = False
        if not running.any():
            break
        last = model(nxt[:, None], cache=cache, n_new=running.long())[:, 0]
    return out


def _sample(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), -1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=gen).squeeze(-1)
