"""Stages fail on a family's crashed share, naming the family and the cause, and report the shares when they pass:
the gate (`verified_envs`) and `evaluation`, with the episodes' outcomes set by the test (no sandbox, no model)."""

import pytest

import configs
import stages
from rollout.crashes import CrashedShareExceeded
from rollout.types import Segment, Trajectory


def _gate(monkeypatch, crash_every: dict[str, int]):
    """`validate` stand-in: the oracle leg of every k-th environment of a family crashed (`crash_every`)."""
    import envs.gate

    seen: dict[str, int] = {}
    judged: list[str] = []

    def validate(spec, sb, probes=True, limits=None):
        judged.append(spec.id)
        n = seen[spec.family] = seen.get(spec.family, 0) + 1
        k = crash_every.get(spec.family)
        if k and n % k == 0:
            return envs.gate.GateReport(spec.id, spec.family, False, ["oracle: verifier crashed (no ready line)"],
                                        {"oracle": {"reward": 0.0, "status": "crashed", "calls": 1, "checks": []}})
        return envs.gate.GateReport(spec.id, spec.family, True, [], {"oracle": {"reward": 1.0, "status": "ok"}})

    monkeypatch.setattr(envs.gate, "validate", validate)
    return judged


def test_the_gate_fails_on_a_family_whose_judging_crashed(tmp_path, monkeypatch):
    cfg = configs.load("micro", ["envs.n_train=40", "envs.n_eval=1", "envs.patterns=[kv-lookup, calc-chain]"])
    specs = stages.env_specs(cfg, tmp_path / "envs")  # 20 of each family
    _gate(monkeypatch, {"kv-lookup": 20})  # 1 of 20: 5%, at the threshold
    out = stages.verified_envs(cfg, specs, tmp_path / "v1")
    assert out["crashes"]["families"]["kv-lookup"] == {"episodes": 20, "crashed": 1, "aborted": 0, "share": 0.05,
                                                       "aborted_share": 0.0,
                                                       "causes": {"oracle: verifier crashed (no ready line)": 1}}
    assert out["crashes"]["families"]["calc-chain"]["crashed"] == 0 and out["crashed_share"] == 0.025
    _gate(monkeypatch, {"kv-lookup": 10})  # 2 of 20: above
    with pytest.raises(CrashedShareExceeded, match=r"verified_envs: the crashed share of kv-lookup .* 2 of 20 .*"
                                                   r"'oracle: verifier crashed \(no ready line\)' ×2"):
        stages.verified_envs(cfg, specs, tmp_path / "v2")
    # a crashed verdict is the sandbox's, not the spec's: it is not kept, so once the sandbox is fixed a rerun judges
    # those two again (and only those) and passes
    judged = _gate(monkeypatch, {})
    assert stages.verified_envs(cfg, specs, tmp_path / "v2")["crashed_share"] == 0.0 and len(judged) == 2


def _episodes(specs, crashed: set[int]) -> list[Trajectory]:
    return [Trajectory(f"t{i}-{s.id}", s.id, s.family, s.domain, s.spec_hash, s.verifier_hash, 0,
                       [Segment([], [], [], [])], 0.0 if i in crashed else float(i % 2),
                       "crashed" if i in crashed else "completed", error="OSError: sandbox exploded" if i in crashed
                       else None) for i, s in enumerate(specs)]


def test_evaluation_fails_rather_than_score_what_is_left(tmp_path, monkeypatch):
    import model
    import trainers.sft
    from envs.dataset import read_dataset

    cfg = configs.load("micro", ["envs.n_eval=40", "envs.patterns=[kv-lookup, calc-chain]"])
    specs = stages.env_specs(cfg, tmp_path / "envs")
    held = read_dataset(specs["eval"])
    kv = [i for i, s in enumerate(held) if s.family == "kv-lookup"]
    lost = {"student": set(kv[:1])}  # 1 of 20: at the threshold

    def evaluate(m, specs, *a, **kw):
        trajs = _episodes(specs, lost.get(m, set()) if len(specs) == len(held) else set())
        return {"pass@1": sum(t.reward for t in trajs) / len(trajs), "family": {}, "domain": {}, "pattern": {},
                "trajectories": trajs}

    monkeypatch.setattr(model, "load_checkpoint", lambda path: path)  # the "model" is its name
    monkeypatch.setattr(trainers.sft, "evaluate", evaluate)
    ev = stages.evaluation(cfg, "student", "warm_start", specs)
    assert ev["crashes"]["families"]["kv-lookup"]["crashed"] == 1 and ev["crashes"]["episodes"] == 80
    lost["warm_start"] = set(kv[:2])  # the warm start's episodes: 2 of 20
    with pytest.raises(CrashedShareExceeded, match=r"evaluation \(warm_start\): the crashed share of kv-lookup .*"
                                                   r"2 of 20 .*'OSError: sandbox exploded' ×2"):
        stages.evaluation(cfg, "student", "warm_start", specs)
