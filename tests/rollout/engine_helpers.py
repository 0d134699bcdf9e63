"""What the engine tests share: a few prompts of different lengths, and driving an engine (not started) until done."""

PROMPTS = [list(range(1, 14)), [5, 6, 7], list(range(30, 52)), [200, 201]]


def run_all(engine, reqs):
    """Submit `reqs` and step the engine until every one has finished; return them."""
    for r in reqs:
        engine.submit(r)
    while any(not r.future.done() for r in reqs):
        engine.step()
    return reqs
