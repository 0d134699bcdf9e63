"""The agent loop over real environments: scripted policies, compaction, crashes, and a live engine."""

import asyncio

import pytest

from envs import FAMILIES, make_sandbox
from envs.sandbox import Sandbox
from model import ByteTokenizer, ChatTemplate
from rollout.agent import SUMMARY_PROMPT, Agent, AgentConfig, run_episodes

TOK = ByteTokenizer()
TPL = ChatTemplate(TOK)


class Scripted:
    """A policy that emits fixed actions (and a fixed summary when asked to summarise)."""

    def __init__(self, actions: list[str], summary: str = "read boxes; value pending", version: int = 7):
        self.actions, self.summary, self.version = list(actions), summary, version
        self.prompts: list[list[int]] = []

    async def generate(self, input_ids, sampling_params=None, **kw):
        self.prompts.append(list(input_ids))
        asking_summary = TOK.decode(input_ids[-60:]).find(SUMMARY_PROMPT[-40:]) >= 0
        text = self.summary if asking_summary else (self.actions.pop(0) if self.actions else "<tool_call>done</tool_call>")
        ids = TOK.encode(text, allow_special=True) + [TPL.end_id]
        return {"output_ids": ids, "meta_info": {"output_token_logprobs": [[-0.5, t, None] for t in ids],
                                                 "output_token_versions": [self.version] * len(ids)}}


@pytest.fixture(scope="module")
def sandbox():
    return make_sandbox("bwrap")


def test_oracle_episode_earns_the_reward(sandbox):
    spec = FAMILIES["kv-lookup"].make(4, {"horizon": 2})
    agent = Agent(Scripted(spec.reference), TOK, sandbox)
    t = asyncio.run(agent.run(spec, iteration=3))
    assert t.status == "completed" and t.reward == 1.0 and t.iteration == 3
    assert t.env_spec_hash == spec.spec_hash and t.verifier_hash == spec.verifier_hash
    [seg] = t.segments
    trained = TOK.decode([tok for tok, m in zip(seg.tokens, seg.loss_mask) if m])
    want = "".join(TOK.decode(TOK.encode(a, allow_special=True)) + "<|end|>" for a in spec.reference)
    assert trained == want  # exactly the policy's own tokens are trainable
    assert all(v == 7 for v, m in zip(seg.versions, seg.loss_mask) if m)
    assert all(v == -1 and lp == 0.0 for v, lp, m in zip(seg.versions, seg.logprobs, seg.loss_mask) if not m)
    assert "<|observation|>" in TOK.decode(seg.tokens)  # observations are in context, masked out
    assert t.policy_versions() == (7, 7)


def test_wrong_answer_and_malformed_actions(sandbox):
    spec = FAMILIES["calc-chain"].make(1)
    agent = Agent(Scripted(["I think <tool_call>calcc 1+1</tool_call>", "<tool_call>submit 0</tool_call>"]), TOK, sandbox)
    t = asyncio.run(agent.run(spec))
    assert t.status == "completed" and t.reward == 0.0
    assert "unknown tool 'calcc'" in TOK.decode(t.segments[0].tokens)


def test_turn_budget_truncates(sandbox):
    spec = FAMILIES["kv-lookup"].make(0)
    agent = Agent(Scripted(["<tool_call>ls</tool_call>"] * 100), TOK, sandbox)
    t = asyncio.run(agent.run(spec))
    assert t.status == "truncated" and t.reward == 0.0


def test_compaction_fires_and_rebuilds_the_context(sandbox):
    spec = FAMILIES["kv-lookup"].make(5, {"horizon": 4})
    reads = [f"<tool_call>read box{i}.txt</tool_call>" for i in range(1, 6)]
    policy = Scripted(reads + spec.reference)
    cfg = AgentConfig(max_context=700, compact_margin=150, max_action_tokens=40, max_compactions=2, summary_tokens=40)
    t = asyncio.run(Agent(policy, TOK, sandbox, cfg).run(spec))
    assert len(t.segments) >= 2 and t.segments[1].summary
    first, second = t.segments[0], t.segments[1]
    assert second.start_turn == first.end_turn > 0
    # the summary closes segment 1 and is trained there
    assert TOK.decode([x for x, m in zip(first.tokens, first.loss_mask) if m]).endswith(policy.summary + "<|end|>")
    # segment 2 = system + goal + summary + the last two action/observation pairs, verbatim
    head = TPL.render([{"role": "system", "content": Agent(policy, TOK, sandbox).cfg.system_prompt},
                       {"role": "user", "content": spec.instruction}]).ids
    assert second.tokens[: len(head)] == head
    text = TOK.decode(second.tokens)
    assert "Summary of earlier work: " + policy.summary in text
    ctx1 = TOK.decode(first.tokens)
    last_two = [a for a in reads[:5] if a in ctx1][-2:]
    for a in last_two:
        assert a in text
    assert not any(second.loss_mask[: len(head)])
    assert all(len(s.tokens) <= 700 for s in t.segments)


class _Broken(Sandbox):
    name = "broken"

    def wrap(self, argv, workspace, extra_ro, limits=None):
        raise OSError("sandbox exploded")

    def run(self, *a, **k):
        raise OSError("sandbox exploded")


def test_crashed_environment_marks_its_trajectory_and_the_rest_go_on(sandbox):
    good = FAMILIES["kv-lookup"].make(1)
    bad = FAMILIES["kv-lookup"].make(2)

    agents = {"good": Agent(Scripted(good.reference), TOK, sandbox), "bad": Agent(Scripted(bad.reference), TOK, _Broken())}

    async def main():
        return await asyncio.gather(agents["good"].run(good), agents["bad"].run(bad))

    t_good, t_bad = asyncio.run(main())
    assert t_good.status == "completed" and t_good.reward == 1.0
    assert t_bad.status == "crashed" and "sandbox exploded" in t_bad.error and t_bad.reward == 0.0


def test_many_episodes_against_a_live_engine_through_the_router(micro_model, sandbox):
    from model import Transformer
    from rollout.engine import Engine
    from rollout.router import Router
    from rollout.server import ServerThread, create_app

    engines = []
    servers = []
    for _ in range(2):
        m = Transformer(micro_model.config)
        m.load_state_dict(micro_model.state_dict())
        engines.append(Engine(m, n_slots=4, max_len=1024))
        servers.append(ServerThread(create_app(engines[-1])).start())
    specs = [FAMILIES[f].make(i) for i, f in enumerate(["kv-lookup", "calc-chain", "set-const"] * 3)]
    got = []
    try:
        async def main():
            async with Router([s.url for s in servers]) as router:
                agent = Agent(router, TOK, sandbox, AgentConfig(max_context=1024, max_action_tokens=24, seed=0))
                return await run_episodes(agent, specs, iteration=1, concurrency=6, on_done=got.append)

        trajs = asyncio.run(main())
    finally:
        for s in servers:
            s.stop()
        for e in engines:
            e.shutdown()
    assert len(trajs) == len(specs) == len(got)
    assert all(t.status in ("completed", "truncated") for t in trajs)
    assert all(t.n_trainable > 0 and t.engine.startswith("http://127.0.0.1") for t in trajs)
    assert sum(e.stats.reused_tokens for e in engines) > 0  # later turns reused their episode's prefix


def test_tight_context_never_asks_the_engine_for_more_than_fits(sandbox):
    """Every request the loop makes fits the context, however the compaction budget falls."""
    spec = FAMILIES["kv-lookup"].make(5, {"horizon": 4})
    limit = 300

    class Bounded(Scripted):
        async def generate(self, input_ids, sampling_params=None, **kw):
            n = sampling_params["max_new_tokens"]
            assert n >= 1 and len(input_ids) + n <= limit
            out = await super().generate(input_ids, sampling_params, **kw)  # an engine stops at max_new_tokens
            out["output_ids"] = out["output_ids"][:n]
            out["meta_info"]["output_token_logprobs"] = out["meta_info"]["output_token_logprobs"][:n]
            out["meta_info"]["output_token_versions"] = out["meta_info"]["output_token_versions"][:n]
            return out

    for margin, summary in ((64, 96), (200, 40), (0, 8)):
        cfg = AgentConfig(system_prompt="Use tools.", max_context=limit, compact_margin=margin, summary_tokens=summary,
                          max_action_tokens=32, max_compactions=3)
        t = asyncio.run(Agent(Bounded(["<tool_call>read box1.txt</tool_call>"] * 30), TOK, sandbox, cfg).run(spec))
        assert t.status in ("truncated", "completed") and t.error is None
        assert all(len(s.tokens) <= limit for s in t.segments)


def test_seeded_sampling_repeats_an_episode_whatever_runs_beside_it(sandbox):
    """With `agent.seed`, an episode's samples depend on (seed, environment, iteration, weights) only: the same
    environment gives the same tokens alone or among other episodes, and another seed gives other tokens."""
    import torch

    import configs
    from model import Transformer
    from rollout.agent import EnginePolicy
    from rollout.engine import Engine

    cfg = configs.load("micro")
    torch.manual_seed(0)
    engine = Engine(Transformer(cfg.model).eval(), TOK, n_slots=4, max_len=cfg.agent.max_context + 8)
    try:
        specs = [FAMILIES["calc-chain"].make(i, {"horizon": 1}) for i in range(3)]

        def run(seed, which):
            agent = Agent(EnginePolicy(engine), TOK, sandbox, cfg.agent.model_copy(update={"seed": seed}))
            return asyncio.run(run_episodes(agent, which, iteration=1, concurrency=4))

        alone = run(5, specs[:1])[0]
        among = run(5, specs)[0]
        other = run(6, specs[:1])[0]
    finally:
        engine.shutdown()
    toks = lambda t: [x for s in t.segments for x in s.tokens]  # noqa: E731
    assert toks(alone) == toks(among)
    assert toks(alone) != toks(other)  # an untrained model samples near-uniformly: another seed, other bytes


class _Faulty(Scripted):
    """Replies like an engine that failed mid-episode: the first turn is fine, the second is cut by `fault`."""

    def __init__(self, actions, fault):
        super().__init__(actions)
        self.fault, self.turns = fault, 0

    async def generate(self, input_ids, sampling_params=None, **kw):
        out = await super().generate(input_ids, sampling_params, **kw)
        self.turns += 1
        if self.turns == 2:
            self.fault(out)
        return out


def _abort(out):
    out["output_ids"] = out["output_ids"][:3]
    out["meta_info"]["output_token_logprobs"] = out["meta_info"]["output_token_logprobs"][:3]
    out["meta_info"]["finish_reason"] = {"type": "abort", "matched": None, "error": "engine step failed"}


def _no_logprobs(out):
    del out["meta_info"]["output_token_logprobs"]


@pytest.mark.parametrize("fault", [_abort, _no_logprobs])
def test_an_engine_fault_marks_the_episode_aborted_not_completed(sandbox, fault):
    """An aborted generation, or tokens without log-probs, is the engine's fault: the trajectory is `aborted`
    (dropped by the trainers, counted), never `completed` with made-up log-probs."""
    spec = FAMILIES["kv-lookup"].make(3)
    t = asyncio.run(Agent(_Faulty(spec.reference, fault), TOK, sandbox).run(spec))
    assert t.status == "aborted" and t.reward == 0.0 and "EngineFault" in t.error
    ok = asyncio.run(Agent(Scripted(spec.reference), TOK, sandbox).run(spec))
    assert ok.status == "completed" and ok.reward == 1.0


def test_sglang_string_weight_version_takes_the_pushed_version(sandbox):
    spec = FAMILIES["kv-lookup"].make(4)

    class Sgl(Scripted):
        async def generate(self, input_ids, sampling_params=None, **kw):
            out = await super().generate(input_ids, sampling_params, **kw)
            del out["meta_info"]["output_token_versions"]
            out["meta_info"]["weight_version"] = "default"
            return out

    t = asyncio.run(Agent(Sgl(spec.reference, version=5), TOK, sandbox).run(spec))
    assert t.status == "completed" and t.policy_versions() == (5, 5)


def test_an_episode_that_ends_before_any_generation_names_no_engine(sandbox, monkeypatch):
    import rollout.agent

    def boom(self):
        raise OSError("reset failed")

    spec = FAMILIES["kv-lookup"].make(3)
    monkeypatch.setattr(rollout.agent.Environment, "reset", boom)
    t = asyncio.run(Agent(Scripted(spec.reference), TOK, sandbox).run(spec))
    assert t.status == "crashed" and "reset failed" in t.error and t.n_trainable == 0
    assert t.engine == ""  # not the agent's default name: no engine answered
