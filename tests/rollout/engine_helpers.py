"""What the engine tests share: a few prompts of different lengths, driving an engine (not started) until done, and the
reference a greedy engine must match (the model's own full forward, token by token)."""

import torch

PROMPTS = [list(range(1, 14)), [5, 6, 7], list(range(30, 52)), [200, 201]]


def run_all(engine, reqs):
    """Submit `reqs` and step the engine until every one has finished; return them."""
    for r in reqs:
        engine.submit(r)
    while any(not r.future.done() for r in reqs):
        engine.step()
    return reqs


def full_forward_greedy(model, prompt, n):
    """`n` greedy tokens after `prompt`, each the argmax of a full forward over everything so far (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]
