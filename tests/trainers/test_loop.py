"""The RL loop end to end on the micro model: async and sync modes, weight pushes, version stamps."""

import pytest
import torch

import configs
from envs import make_sandbox
from envs.generator import generate
from model import ByteTokenizer, Transformer
from rollout.agent import AgentConfig
from trainers.loop import LoopConfig, RLLoop, weights_checksum
from trainers.sao import SAOConfig

TOK = ByteTokenizer()


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_loop_trains_and_pushes_versioned_weights(mode):
    torch.manual_seed(0)
    actor = Transformer(configs.load("micro").model)
    specs = generate(["kv-lookup", "calc-chain"], 6, seed=3)
    seen = []
    loop = RLLoop(actor, specs, TOK, make_sandbox(), AgentConfig(system_prompt="Use tools.", max_context=384,
                                                                  max_action_tokens=24, max_obs_tokens=64),
                  SAOConfig(critic_updates=1, staleness=4, loss="sao" if mode == "async" else "grpo"),
                  LoopConfig(mode=mode, batch_size=4, in_flight=4, n_slots=4, group_size=2 if mode == "sync" else 1),
                  on_trajectory=seen.append)
    hist = loop.run(3)
    assert len(hist) == 3 and loop.version == 3 and [p["version"] for p in loop.pushes] == [1, 2, 3]
    assert loop.pushes[-1]["checksum"] == weights_checksum(actor)  # the engine holds exactly the trainer's weights
    assert all(h["trajectories"] + h["dropped_crashed"] + h["dropped_stale"] + h["dropped_empty"] >= 0 for h in hist)
    assert len(seen) >= 12
    versions = {v for t in seen for s in t.segments for v, m in zip(s.versions, s.loss_mask) if m}
    assert versions <= set(range(0, 4)) and 0 in versions
    if mode == "sync":  # every batch was generated entirely by the weights of its step
        assert all(t.policy_versions()[0] == t.policy_versions()[1] for t in seen)
