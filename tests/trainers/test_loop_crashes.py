"""The SAO loop (`sao_expert`'s) fails on a family's crashed share instead of training on what is left: before the
batch that settles it is trained on, with the family and the cause named, and as early as failing is certain."""

import pytest
import torch

import configs
from model import ByteTokenizer, Transformer
from rollout.agent import AgentConfig
from rollout.crashes import CrashedShareExceeded
from rollout.types import Segment, Trajectory
from trainers.loop import LoopConfig, RLLoop
from trainers.sao import SAOConfig

pytestmark = pytest.mark.usefixtures("one_thread")


class _Engines:
    """The rollout side of a loop whose batches the test hands in: takes the pushes, generates nothing."""

    kind = "none"

    def push(self, model, version: int) -> dict:
        return {"version": version}

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


def _episode(family: str, i: int, crashed: bool) -> Trajectory:
    if crashed:
        return Trajectory(f"{family}-{i}", f"e{i}", family, "code", "h", "v", 1, [Segment([], [], [], [])], 0.0,
                          "crashed", error="OSError: the sandbox could not start")
    seg = Segment([1, 2, 40 + i % 7, 41], [False, False, True, True], [0.0, 0.0, -1.0, -1.0], [-1, -1, 0, 0])
    return Trajectory(f"{family}-{i}", f"e{i}", family, "code", "h", "v", 1, [seg], float(i % 2), "completed")


def _loop(crashes: list[int], threshold: float) -> RLLoop:
    """Three batches of two kv-lookup and two calc-chain episodes each; the kv-lookup episodes numbered in `crashes`
    (0-5, in batch order) crash."""
    torch.manual_seed(0)
    loop = RLLoop(Transformer(configs.load("micro").model), [], ByteTokenizer(), None, AgentConfig(),
                  SAOConfig(critic_updates=1, value_pretrain_steps=0, staleness=None, lr=1e-3),
                  LoopConfig(mode="sync", batch_size=4), backend=_Engines(), consumer="sao:code",
                  max_crashed_share=threshold)
    kv = iter(range(6))
    batches = iter([[_episode("kv-lookup", k, k in crashes) for k in (next(kv), next(kv))]
                    + [_episode("calc-chain", 2 * b + j, False) for j in (0, 1)] for b in range(3)])
    loop._generate = lambda: next(batches)
    return loop


def test_a_family_at_the_threshold_trains_and_is_reported():
    loop = _loop(crashes=[4], threshold=1 / 6)  # kv-lookup: 1 of 6, exactly the threshold
    assert len(loop.run(3)) == 3
    rep = loop.crashes.report()
    assert rep["families"]["kv-lookup"] == {"episodes": 6, "crashed": 1, "aborted": 0, "share": round(1 / 6, 6),
                                            "aborted_share": 0.0,
                                            "causes": {"OSError: the sandbox could not start": 1}}
    assert rep["families"]["calc-chain"]["crashed"] == 0 and rep["episodes"] == 12
    assert sum(r["outcome"] == "dropped_crashed" for r in loop.consumption) == 1


def test_a_family_above_the_threshold_fails_before_its_last_batch_is_trained_on():
    # both crashes in the first batch: 2 of the 12 episodes (1/6) could still pass, so the loop trains on; at the
    # last batch kv-lookup's share is 2 of 6, and the loop fails before training on it
    loop = _loop(crashes=[0, 1], threshold=1 / 6)
    with pytest.raises(CrashedShareExceeded) as e:
        loop.run(3)
    assert loop.loop_steps == 2
    msg = str(e.value)
    assert "sao:code: the crashed share of kv-lookup is above loop.max_crashed_share" in msg
    assert "kv-lookup: 2 of 6 episodes" in msg and "'OSError: the sandbox could not start' ×2" in msg
    assert "calc-chain" not in msg


def test_a_broken_sandbox_stops_the_loop_at_once():
    loop = _loop(crashes=[0, 1, 2], threshold=1 / 6)  # 3 of the 12 episodes lost by the second batch: certain
    with pytest.raises(CrashedShareExceeded, match="3 of the 12 episodes this stage runs already crashed"):
        loop.run(3)
    assert loop.loop_steps == 1
