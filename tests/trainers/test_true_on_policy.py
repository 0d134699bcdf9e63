"""True on-policy on the embedded path: the log-probs a rollout records are the trainer's, bit for bit.

The engine decodes through its KV cache, whose kernels reduce in a different order from the trainer's
full-sequence forward (a few 1e-7 apart). With `agent.rescore` (the default) the engine scores every finished
segment with `token_logprobs`, the trainers' own function, and the trainer forwards each row alone at its length
(`exact_rows`): on the same weights the two sides then compute the same bits, so the mismatch is exactly 0.
"""

import asyncio

import pytest
import torch

import configs
from envs import make_sandbox
from envs.generator import generate
from model import ByteTokenizer, Transformer, rows_logprobs
from rollout.agent import Agent, AgentConfig, EnginePolicy, run_episodes
from rollout.engine import Engine
from trainers.config import SAOConfig
from trainers.sao import SAOTrainer, layout

TOK = ByteTokenizer()
pytestmark = pytest.mark.usefixtures("one_thread")


def _episodes(model: Transformer, rescore: bool, n: int = 6) -> list:
    agent_cfg = AgentConfig(system_prompt="Use tools.", max_context=384, max_action_tokens=12, max_total_tokens=24,
                            max_obs_tokens=32, compact_margin=0, seed=5, rescore=rescore)
    engine = Engine(Transformer(model.config), TOK, n_slots=4, max_len=400, policy_version=3)
    engine.model.load_state_dict(model.state_dict())
    try:
        agent = Agent(EnginePolicy(engine), TOK, make_sandbox(), agent_cfg)
        return asyncio.run(run_episodes(agent, generate(["kv-lookup", "calc-chain"], n, seed=11), concurrency=4))
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def actor():
    torch.manual_seed(0)
    return Transformer(configs.load("micro").model)


def test_rescored_rollout_logprobs_equal_the_trainers_bit_for_bit(actor):
    trajs = _episodes(actor, rescore=True)
    rows = layout(trajs)
    assert int(rows.mask.sum()) > 20 and set(rows.versions[rows.mask].tolist()) == {3}
    with torch.no_grad():
        lp, _ = rows_logprobs(actor, rows.ids, rows.lengths)
    assert torch.equal(lp[rows.mask], rows.logp_rollout[rows.mask])
    # the same through a training step: SAO's mismatch on the version it trains is exactly zero
    tr = SAOTrainer(actor_copy := Transformer(actor.config), SAOConfig(critic_updates=0, value_pretrain_steps=0))
    actor_copy.load_state_dict(actor.state_dict())
    for t, r in zip(trajs, [1.0, 0.0] * len(trajs)):
        t.reward = r
    st = tr.step(trajs, current_version=3)
    assert st["mismatch_fresh_tokens"] == int(rows.mask.sum()) and st["mismatch_fresh_max"] == 0.0


def test_decoded_logprobs_differ_in_the_last_bits_without_rescoring(actor):
    """What rescoring removes: the same seeded episodes, decoded log-probs kept. The same tokens are sampled, the
    log-probs differ from the trainer's by float32 rounding only."""
    exact, decoded = layout(_episodes(actor, rescore=True)), layout(_episodes(actor, rescore=False))
    assert torch.equal(exact.ids, decoded.ids)  # seeded sampling: the same episodes either way
    with torch.no_grad():
        lp, _ = rows_logprobs(actor, decoded.ids, decoded.lengths)
    gap = (lp - decoded.logp_rollout)[decoded.mask].abs()
    assert 0.0 < float(gap.max()) < 1e-4


def test_padded_rows_are_not_forwarded_when_exact(actor):
    """`exact_rows`: a row's log-probs do not depend on the other rows of its micro-batch or on the padding."""
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (3, 90))
    lengths = [90, 41, 67]
    with torch.no_grad():
        both = rows_logprobs(actor, ids, lengths)[0]
        for i, n in enumerate(lengths):
            alone = rows_logprobs(actor, ids[i : i + 1, :n], [n])[0]
            assert torch.equal(both[i, :n], alone[0]) and not both[i, n:].any()


class _Scorer:
    """A policy whose scoring reply says `exact` (or not) and which version scored: every input log-prob is -1.0."""

    scores = True

    def __init__(self, exact: bool, version: int):
        self.exact, self.version, self.calls = exact, version, 0

    async def generate(self, input_ids, sampling_params=None, **kw):
        self.calls += 1
        meta = {"input_token_logprobs": [[None if i == 0 else -1.0, t, None] for i, t in enumerate(input_ids)],
                "weight_version": str(self.version), "finish_reason": {"type": "length"}}
        if self.exact:
            meta["exact_scoring"] = True
        return {"output_ids": [], "meta_info": meta}


def test_rescoring_replaces_only_the_scoring_versions_tokens():
    """A push landed mid-segment: tokens 3-4 came from version 2, tokens 6-7 from version 3, and version 3 scored
    the segment. Only 6-7 take the scores; 3-4 keep what they were decoded with; prompt tokens stay 0. An engine
    that does not score exactly changes nothing and is not asked again."""
    from rollout.agent import _Seg

    def segment():
        seg = _Seg()
        seg.add([1, 2, 3])
        seg.add([4, 5], True, [-0.3, -0.4], [2, 2])
        seg.add([6])
        seg.add([7, 8], True, [-0.6, -0.7], [3, 3])
        return seg

    agent = Agent(_Scorer(exact=True, version=3), TOK, make_sandbox(), AgentConfig())
    out = asyncio.run(agent._close(segment(), 1, "sid"))
    assert out.logprobs == [0.0, 0.0, 0.0, -0.3, -0.4, 0.0, -1.0, -1.0]
    inexact = _Scorer(exact=False, version=3)
    agent = Agent(inexact, TOK, make_sandbox(), AgentConfig())
    first, second = (asyncio.run(agent._close(segment(), 1, "sid")) for _ in range(2))
    assert first.logprobs == second.logprobs == [0.0, 0.0, 0.0, -0.3, -0.4, 0.0, -0.6, -0.7]
    assert inexact.calls == 1
    off = _Scorer(exact=True, version=3)
    assert asyncio.run(Agent(off, TOK, make_sandbox(), AgentConfig(rescore=False))._close(segment(), 1, "s")).logprobs \
        == [0.0, 0.0, 0.0, -0.3, -0.4, 0.0, -0.6, -0.7] and off.calls == 0


def test_greedy_evaluation_does_not_rescore(actor, monkeypatch):
    """`trainers.sft.evaluate` (held-out and validation play) and the curriculum's probes read rewards, never
    log-probs: their segments are not rescored (a scoring forward per segment was about half of an evaluation's
    engine time). The engine sees no scoring request; the same play with rescoring on does."""
    from rollout.engine import Engine as RealEngine
    from stages.curriculum import sample_rewards
    from trainers.sft import evaluate

    engines = []

    class Counting(RealEngine):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.scored = 0
            engines.append(self)

        def _score(self, r):
            self.scored += 1
            super()._score(r)

    monkeypatch.setattr("rollout.engine.Engine", Counting)
    cfg = AgentConfig(system_prompt="Use tools.", max_context=384, max_action_tokens=12, max_total_tokens=24,
                      max_obs_tokens=32, compact_margin=0, seed=5)
    specs = generate(["kv-lookup"], 3, seed=11)
    ev = evaluate(actor, specs, TOK, make_sandbox(), cfg, n_slots=4, concurrency=3)
    assert len(ev["trajectories"]) == 3 and engines[-1].scored == 0
    full = configs.load("micro", ["agent.max_context=384", "agent.max_action_tokens=12", "agent.max_total_tokens=24",
                                  "agent.max_obs_tokens=32", "agent.compact_margin=0"])
    sample_rewards(actor, specs, 1, full, TOK, make_sandbox(), n_slots=4)
    assert engines[-1].scored == 0
    control = Counting(actor, TOK, n_slots=4, max_len=400)  # the control: a rescoring agent's scores are counted
    try:
        asyncio.run(run_episodes(Agent(EnginePolicy(control), TOK, make_sandbox(), cfg), specs, concurrency=3))
    finally:
        control.shutdown()
    assert control.scored > 0
