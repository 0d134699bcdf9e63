"""The base recipe and the shipped base checkpoint.

* the shipped checkpoint's weights are the ones its card describes, and loading it reproduces the card's
  greedy outcomes task by task on the card's fixed sample;
* the recipe is a pure function of (config, seed, steps): the first N steps of a longer run are the N-step run;
* iteration 1 starts from the base and refuses weights that do not match their card.
"""

import json
import math
from pathlib import Path

import pytest
import torch

import configs
from envs import make_sandbox
from model import ByteTokenizer, Transformer, load_checkpoint
from trainers.base import CARD_JSON, batch_at, eval_specs, tokens_sha256, train_base, weights_sha256
from trainers.config import BaseConfig

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / configs.load("tiny").base.checkpoint


def test_shipped_base_card_hash_matches_the_weights():
    card = json.loads((BASE / CARD_JSON).read_text())
    assert weights_sha256(BASE) == card["weights_sha256"]
    size = sum(f.stat().st_size for f in BASE.iterdir())
    assert size < 20 * 2**20, f"the shipped base is {size / 2**20:.1f} MiB"
    for k in ("command", "seed", "commit", "steps", "data", "eval"):
        assert k in card, k
    for p, v in card["eval"]["pattern"].items():
        assert v["ci95"][0] <= v["pass@1"] <= v["ci95"][1], p


def test_shipped_base_reproduces_its_cards_greedy_outcomes(one_thread):
    from rollout.config import AgentConfig
    from trainers.sft import evaluate

    card = json.loads((BASE / CARD_JSON).read_text())
    bc = BaseConfig(**card["recipe"])
    n = card["sample"]["n"]
    specs = eval_specs(bc)[:n]
    assert [s.id for s in specs] == card["sample"]["spec_ids"]  # the same tasks, regenerated from the recipe
    done = []  # the benches' progress bars count episodes through this hook
    ev = evaluate(load_checkpoint(BASE), specs, ByteTokenizer(), make_sandbox("auto"), AgentConfig(**card["agent"]),
                  on_done=done.append)
    assert sorted(id(t) for t in done) == sorted(id(t) for t in ev["trajectories"])  # each episode once, as it ends
    assert [t.reward for t in ev["trajectories"]] == card["sample"]["rewards"]
    assert tokens_sha256(ev["trajectories"]) == card["sample"]["tokens_sha256"]  # the very same greedy episodes


def _micro(n_steps: int):
    return configs.load("micro", ["base.n_per_pattern=2", "base.batch_size=2", f"base.steps={n_steps}",
                                  "base.snapshot_every=2", "base.warmup_steps=1", "base.decay_steps=0"])


def test_the_stable_phase_of_a_longer_run_is_the_shorter_run(tmp_path, one_thread):
    tok, sb = ByteTokenizer(), make_sandbox("auto")
    short, _ = train_base(_micro(2), tmp_path / "a", tok, sb, log=lambda m: None)
    longer, rec = train_base(_micro(4), tmp_path / "b", tok, sb, log=lambda m: None)
    snap = load_checkpoint(tmp_path / "b" / "snapshots" / "step-2")
    for (k, v), (_, w) in zip(short.state_dict().items(), snap.state_dict().items()):
        torch.testing.assert_close(v, w, rtol=0, atol=0, msg=k)
    assert any(not torch.equal(v, w) for v, w in zip(short.state_dict().values(), longer.state_dict().values()))
    assert rec["steps"] == 4 and all(m["segments"] > 0 for m in rec["data"].values())


def test_curriculum_batches_follow_the_stage_and_are_pure():
    bc = BaseConfig(batch_size=8, curriculum=[{"from_step": 0, "patterns": ["a"]}, {"from_step": 5, "patterns": ["a", "b"]}])
    from rollout.types import Segment

    pools = {"a": [Segment([1, 2, 3], [False, True, True], [0.0] * 3, [0] * 3)],
             "b": [Segment([7, 7, 7, 7], [False, False, True, True], [0.0] * 4, [0] * 4)]}
    ids0, _ = batch_at(bc, pools, 0, pad_id=0)
    assert (ids0[:, 0] == 1).all()  # stage 0: only pattern a
    ids5, mask5 = batch_at(bc, pools, 5, pad_id=0)
    assert {int(x) for x in ids5[:, 0]} == {1, 7}  # stage 1 mixes both (8 rows: both drawn with this seed)
    ids5b, mask5b = batch_at(bc, pools, 5, pad_id=0)
    assert torch.equal(ids5, ids5b) and torch.equal(mask5, mask5b)
    with pytest.raises(ValueError, match="from_step 0"):
        BaseConfig(curriculum=[{"from_step": 3, "patterns": ["a"]}]).stage_at(0)


def test_warm_start_uses_the_base_and_rejects_tampered_weights(tmp_path):
    import shutil

    import stages

    cfg = configs.load("tiny")
    out = stages.warm_start(cfg, {"train": None}, tmp_path / "ws", None)
    assert out["source"] == "base" and Path(out["checkpoint"]) == BASE and out["sft_steps"] == 0
    bad = tmp_path / "bad"
    shutil.copytree(BASE, bad)
    w = bad / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 1
    w.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="differ from its card"):
        stages.warm_start(configs.load("tiny", [f"base.checkpoint={bad}"]), {"train": None}, tmp_path / "ws2", None)
    handed = stages.warm_start(cfg, {}, tmp_path / "ws3", str(bad))  # N−1's hand-off: taken as it is (no card check)
    assert handed["source"] == "previous iteration" and handed["checkpoint"] == str(bad)
    with pytest.raises(FileNotFoundError, match="no config.json"):  # not a checkpoint at all: said, not deferred
        stages.warm_start(cfg, {}, tmp_path / "ws4", str(tmp_path / "some" / "student"))


def test_warmup_stable_decay_schedule_by_hand():
    from trainers.base import decay_progress
    from trainers.config import TrainConfig
    from trainers.lm import LMTrainer

    bc = BaseConfig(decay_steps=4, final_lr_ratio=0.1)
    tr = LMTrainer(Transformer(configs.load("micro").model),
                   TrainConfig(lr=1e-3, warmup_steps=2, min_lr_ratio=bc.final_lr_ratio))
    lrs = [tr.lr_at(s, decay_progress(bc, s, 10)) for s in range(10)]
    assert lrs[:2] == pytest.approx([0.5e-3, 1e-3])  # linear warmup
    assert lrs[2:6] == pytest.approx([1e-3] * 4)  # stable until step 10 - 4
    # cosine from lr to 0.1·lr over steps 6..9: progress 0, 1/4, 2/4, 3/4
    want = [1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert lrs[6:] == pytest.approx(want)
    assert decay_progress(BaseConfig(decay_steps=0), 5, 10) == 0.0  # no decay: constant after warmup


def _two_phase(p1: int, p2: int):
    return configs.load("micro", ["base.n_per_pattern=2", "base.batch_size=2", f"base.steps={p1}",
                                  "base.snapshot_every=1", "base.warmup_steps=1", "base.decay_steps=0",
                                  f"base.phase2={{\"steps\": {p2}, \"lr\": 5e-4, \"warmup_steps\": 2, "
                                  "\"add_patterns\": [\"set-const?horizon=2\"]}"])


def _same(a, b) -> bool:
    return all(torch.equal(v, w) for v, w in zip(a.state_dict().values(), b.state_dict().values()))


def test_second_phase_from_given_weights_and_after_a_resume_is_the_one_run(tmp_path, one_thread, monkeypatch):
    """Phase 1 then phase 2 in one run == phase 2 alone from phase 1's saved weights == phase 2 resumed mid-way;
    phase 2 trains on its own mix (the added pattern) at its own constant lr, and the record keeps the first
    phase's sha256."""
    from trainers.lm import LMTrainer

    seen: list[tuple[torch.Tensor, float]] = []
    real_step = LMTrainer.step

    def spy(self, ids, mask=None, **kw):
        st = real_step(self, ids, mask, **kw)
        seen.append((ids.clone(), st.lr))
        return st

    monkeypatch.setattr(LMTrainer, "step", spy)
    tok, sb = ByteTokenizer(), make_sandbox("auto")
    cfg = _two_phase(2, 3)
    whole, rec = train_base(cfg, tmp_path / "a", tok, sb, log=lambda m: None)
    assert rec["steps"] == 5 and rec["phases"]["phase1_steps"] == 2
    p1_dir = tmp_path / "a" / "snapshots" / "step-2"
    assert rec["phases"]["phase1_weights_sha256"] == weights_sha256(p1_dir)
    assert "set-const?horizon=2" in rec["data"]  # the added pattern's oracle replays are in the data
    assert not _same(load_checkpoint(p1_dir), whole)  # the second phase moves the weights
    # the lr: phase 1 at base.lr (warmup 1, no decay), phase 2 warms up over 2 steps to phase2.lr, then holds
    bc = cfg.base
    assert [lr for _, lr in seen] == pytest.approx([bc.lr, bc.lr, 2.5e-4, 5e-4, 5e-4])
    # the batches: phase 2 draws from the last stage's mix plus the added pattern, phase 1 from the curriculum
    pools = torch.load(tmp_path / "a" / "data.pt", weights_only=False)["pools"]
    for step, (ids, _) in enumerate(seen):
        want, _ = batch_at(bc if step < 2 else bc.with_phase2(2), pools, step, tok.pad_id)
        assert torch.equal(ids, want), step
    assert any(not torch.equal(seen[s][0], batch_at(bc, pools, s, tok.pad_id)[0]) for s in range(2, 5))
    only2, rec2 = train_base(cfg, tmp_path / "b", tok, sb, log=lambda m: None, phase1=p1_dir)
    assert _same(whole, only2) and rec2["phases"]["phase1_weights_sha256"] == rec["phases"]["phase1_weights_sha256"]
    # a run stopped one step into phase 2 (its state at step 3), resumed under the full recipe
    train_base(_two_phase(2, 1), tmp_path / "c", tok, sb, log=lambda m: None)
    resumed, _ = train_base(cfg, tmp_path / "c", tok, sb, log=lambda m: None)
    assert _same(whole, resumed)
    with pytest.raises(ValueError, match="base.phase2 is not set"):
        train_base(_micro(2), tmp_path / "d", tok, sb, log=lambda m: None, phase1=p1_dir)


def test_second_phase_mix_by_hand():
    bc = BaseConfig(steps=10, curriculum=[{"from_step": 0, "patterns": ["a"]}, {"from_step": 4, "patterns": ["a", "b"]},
                                          {"from_step": 20, "patterns": ["z"]}],
                    phase2={"steps": 5, "lr": 1e-4, "warmup_steps": 2, "add_patterns": ["c", "a"]})
    assert bc.patterns == ["a", "b", "z", "c"]  # data seeds follow this order
    b2 = bc.with_phase2(10)
    assert b2.stage_at(9).patterns == ["a", "b"] and b2.stage_at(10).patterns == ["a", "b", "c", "a"]  # a: 2 of 4
    assert b2.stage_at(30).patterns == ["a", "b", "c", "a"]  # a first-phase stage past its end is dropped


def test_sloppy_patterns_are_the_careless_demonstrations(one_thread):
    from trainers.base import base_data

    tok, sb, agent = ByteTokenizer(), make_sandbox("auto"), configs.load("micro").agent
    bc = BaseConfig(curriculum=[{"from_step": 0, "patterns": ["calc-chain?horizon=1", "sloppy:calc-chain?horizon=1"]}],
                    n_per_pattern=3)
    assert bc.task_patterns == ["calc-chain?horizon=1"]  # the card evaluates the task, whoever demonstrated it
    pools, manifest = base_data(bc, tok, sb, agent)
    assert manifest["calc-chain?horizon=1"]["demonstrator"] == "oracle"
    assert manifest["sloppy:calc-chain?horizon=1"]["demonstrator"] == "sloppy"
    for p, calls in (("calc-chain?horizon=1", 1), ("sloppy:calc-chain?horizon=1", 0)):
        assert len(pools[p]) == 3
        for seg in pools[p]:
            said = tok.decode([t for t, m in zip(seg.tokens, seg.loss_mask) if m])  # what the demonstrator said
            assert said.count("<tool_call>calc ") == calls and said.count("<tool_call>submit ") == 1, said
    one_hop = BaseConfig(curriculum=[{"from_step": 0, "patterns": ["sloppy:kv-lookup?horizon=1&keys=1"]}],
                         n_per_pattern=2)
    with pytest.raises(ValueError, match="must complete and earn nothing"):  # no pointer: it is the oracle
        base_data(one_hop, tok, sb, agent)
