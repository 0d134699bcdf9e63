"""Stage functions on their own: validation with sampled hack probes, held-out patterns."""

import json
from pathlib import Path

import pytest

import configs
import stages
from envs.dataset import read_dataset
from envs.generator import task_content


def test_probe_every_and_eval_patterns(tmp_path):
    cfg = configs.load("micro", ["envs.n_train=5", "envs.n_eval=3", "envs.probe_every=2",
                                 "envs.patterns=[\"kv-lookup?horizon=1&keys=1\"]",
                                 "envs.eval_patterns=[\"calc-chain?horizon=1\"]"])
    specs = stages.env_specs(cfg, tmp_path / "envs")
    assert {s.family for s in read_dataset(specs["eval"])} == {"calc-chain"}
    assert {s.knobs["keys"] for s in read_dataset(specs["train"])} == {1}
    out = stages.verified_envs(cfg, specs, tmp_path / "verified")
    assert out["total"] == 5 and out["probed"] == 3  # environments 0, 2 and 4
    assert out["accepted"] == 5 and out["accepted_probe_hits"] == 0


def test_rl_set_is_disjoint_from_the_sft_set(tmp_path):
    cfg = configs.load("micro", ["envs.n_train=4", "envs.n_eval=2", "envs.n_rl=3",
                                 "envs.patterns=[\"kv-lookup?horizon=1&keys=1\"]"])
    specs = stages.env_specs(cfg, tmp_path / "envs")
    assert specs["n_rl"] == 3
    out = stages.verified_envs(cfg, specs, tmp_path / "verified")
    assert out["total"] == 7 and out["accepted_train"] == 4 and out["accepted_rl"] == 3
    sft, rl = read_dataset(out["train"]), read_dataset(stages.rl_set(out))
    assert len(rl) == 3 and not {s.id for s in sft} & {s.id for s in rl}
    assert not {s.spec_hash for s in sft} & {s.spec_hash for s in rl}  # different instances, not only names
    # without an RL set, RL reuses the SFT set
    plain = stages.verified_envs(cfg, stages.env_specs(configs.load("micro", ["envs.n_train=2", "envs.n_eval=1"]),
                                                       tmp_path / "e2"), tmp_path / "v2")
    assert "rl" not in plain and stages.rl_set(plain) == plain["train"]
    # the CLI and the benches draw the same environments: (n_rl, rl_seed), or the SFT set's (n_train, seed)
    assert cfg.envs.rl_source == (3, cfg.envs.rl_seed) and configs.load("micro", ["envs.n_train=2"]).envs.rl_source == (2, 0)


def test_a_domain_without_reward_signal_is_skipped_with_its_reason(tmp_path):
    cfg = configs.load("micro")
    assert stages.skip_reason(cfg, "math", None) is None
    assert stages.skip_reason(cfg, "math", 0.5) is None
    assert "no successes" in stages.skip_reason(cfg, "math", 0.0)
    assert "nothing left" in stages.skip_reason(cfg, "math", 1.0)
    envs = {"train": None, "rl": "unused"}
    # skipped before any environment or checkpoint is touched: the expert is the warm start, with the reason
    import pytest

    from envs.dataset import write_dataset
    from envs.generator import generate

    write_dataset(generate(["calc-chain?horizon=1"], 2, 5), tmp_path / "rl")
    envs["rl"] = str(tmp_path / "rl")
    out = stages.sao_expert(cfg, "/no/such/checkpoint", envs, "math", tmp_path / "x", domain_reward=0.0)
    assert out["steps"] == 0 and out["checkpoint"] == "/no/such/checkpoint" and "no successes" in out["skipped"]
    with pytest.raises(FileNotFoundError):  # a trainable domain does load its checkpoint
        stages.sao_expert(cfg, "/no/such/checkpoint", envs, "math", tmp_path / "y", domain_reward=0.5)
    opd = stages.opd_student(cfg, "/warm/start", {}, envs, tmp_path / "s")
    assert opd["checkpoint"] == "/warm/start" and opd["steps"] == 0 and "no domain experts" in opd["skipped"]


def test_each_iteration_draws_fresh_rl_environments_and_the_same_held_out_set(tmp_path):
    cfg = configs.load("micro", ["envs.n_train=0", "envs.n_rl=3", "envs.n_eval=2"])
    one = stages.env_specs(cfg, tmp_path / "1", iteration=1)
    two = stages.env_specs(cfg, tmp_path / "2", iteration=2)
    assert one["train"] is None and one["n_rl"] == 3
    h1, h2 = read_dataset(one["eval"]), read_dataset(two["eval"])
    assert [s.spec_hash for s in h1] == [s.spec_hash for s in h2]
    assert not {s.spec_hash for s in read_dataset(one["rl"])} & {s.spec_hash for s in read_dataset(two["rl"])}


def test_the_miner_reads_rewarded_rollouts_and_quarantines_the_hacked_environment(tmp_path):
    """A rollout rewarded without the family's essential action (a calc-chain answer submitted without one `calc`)
    gets its environment quarantined: listed with the miner's flag, and its rollouts left out of what SAO reads
    back. A genuine rewarded rollout and an unrewarded shortcut flag nothing; `mine_every` samples."""
    from envs import FAMILIES, Action
    from envs.dataset import write_dataset
    from model import ByteTokenizer
    from rollout.types import Segment, Trajectory
    from store import TrajectoryStore

    tok = ByteTokenizer()
    specs = [FAMILIES["calc-chain"].make(i, {"horizon": 1}) for i in range(3)]
    write_dataset(specs, tmp_path / "rl")

    def traj(i, spec, actions, reward):
        toks, mask = tok.encode("task: "), []
        mask = [False] * len(toks)
        for a in actions:  # as the policy writes them: the call markers are special tokens
            inner = a.render().removeprefix("<tool_call>").removesuffix("</tool_call>")
            body = [tok.special("<tool_call>")] + tok.encode(inner) + [tok.special("</tool_call>"), tok.eos_id]
            toks += body + tok.encode("\nobs\n")
            mask += [True] * len(body) + [False] * len(tok.encode("\nobs\n"))
        versions = [1 if m else -1 for m in mask]
        return Trajectory(f"t{i}", spec.id, spec.family, spec.domain, spec.spec_hash, spec.verifier_hash, 1,
                          [Segment(toks, mask, [-0.5 if m else 0.0 for m in mask], versions)], reward)

    calc = Action("calc", {"expr": "1+2"})
    answer = Action("submit", {"answer": "3"})
    trajs = [traj(0, specs[0], [calc, answer], 1.0),  # genuine
             traj(1, specs[1], [answer], 1.0),  # rewarded without calc: a hack's signature
             traj(2, specs[2], [answer], 0.0)]  # the same shortcut, unrewarded: nothing to flag
    with TrajectoryStore(tmp_path / "s.duckdb") as st:
        st.write(trajs)
    assert [a.tool for a in stages.trajectory_actions(trajs[0])] == ["calc", "submit"]
    out = stages.rewards(tmp_path / "s.duckdb", 1, ["t0", "t1", "t2"], rl_set_dir=str(tmp_path / "rl"))
    assert out["mined"] == 2 and out["quarantined"] == [specs[1].id]
    assert out["miner_flags"] == {specs[1].id: ["rewarded without essential action calc"]}
    assert sorted(out["domains"]["math"]["ids"]) == ["t0", "t2"]  # the quarantined env's rollout is left out
    assert out["domain_reward"]["math"] == 2 / 3  # the measured reward is still what happened
    plain = stages.rewards(tmp_path / "s.duckdb", 1, ["t0", "t1", "t2"])
    assert plain["quarantined"] == [] and sorted(plain["domains"]["math"]["ids"]) == ["t0", "t1", "t2"]
    sampled = stages.rewards(tmp_path / "s.duckdb", 1, ["t0", "t1", "t2"], rl_set_dir=str(tmp_path / "rl"),
                             mine_every=2)
    assert sampled["mined"] == 1 and sampled["quarantined"] == []  # t0 only (every 2nd of t0, t1)


def test_warm_rollouts_come_back_in_environment_order_whatever_order_they_finished_in(tmp_path):
    """The critic pre-trains on the warm rollouts a batch at a time in the order `_read_warm` returns them: that
    order must not be the store's (creation time, random ids), or a busy machine trains another critic."""
    from envs.generator import generate
    from rollout.types import Segment, Trajectory
    from store import TrajectoryStore

    specs = generate(["set-const?horizon=1"], 4, 5)

    def traj(s, tid):
        return Trajectory(tid, s.id, s.family, s.domain, s.spec_hash, "v", 1,
                          [Segment([1, 2], [0, 1], [0.0, -1.0], [stages.WARM_VERSION] * 2)], 1.0)

    got = []
    for order, ids in ((specs, ["z1", "y2", "x3", "w4"]), (specs[::-1], ["a1", "b2", "c3", "d4"])):
        path = tmp_path / f"{ids[0]}.duckdb"
        with TrajectoryStore(path) as st:
            for s, tid in zip(order, ids):  # one write each: later writes are created later
                st.write([traj(s, tid)])
        got.append([t.env_id for t in stages._read_warm(path, 1, "code", ids)])
    assert got[0] == got[1] == sorted(s.id for s in specs)


def test_patterns_whose_warm_rollouts_all_earned_one_reward_are_left_out(tmp_path):
    """DAPO's filter with the task pattern as the group: a pattern whose warm rollouts (≥ sao.constant_pattern_min)
    all earned one reward gives no outcome signal; a domain made only of such patterns gets no expert."""
    import pytest

    from envs.dataset import write_dataset
    from envs.generator import generate
    from rollout.types import Segment, Trajectory

    specs = generate(["set-const?horizon=1", "set-const?horizon=2"], 20, 5)  # 10 of each, alternating
    h1 = "set-const?horizon=1"

    def traj(s, reward, status="completed"):
        return Trajectory(f"r-{s.id}", s.id, s.family, s.domain, s.spec_hash, "v", 1,
                          [Segment([1, 2], [0, 1], [0.0, -1.0], [-1, 1])], reward, status)

    warm = [traj(s, 1.0 if s.knobs["horizon"] == 1 else 0.0) for s in specs]
    assert stages.constant_patterns(specs, warm, 8) == {h1: 1.0, "set-const?horizon=2": 0.0}
    assert stages.constant_patterns(specs, warm, 11) == {}  # 10 rollouts each: too few to call it
    assert stages.constant_patterns(specs, warm, 0) == {}  # off
    warm[1] = traj(specs[1], 1.0)  # one success among the two-constant edits: that pattern has signal
    assert stages.constant_patterns(specs, warm, 8) == {h1: 1.0}
    # ... unless one reward in ten is "nearly constant" (sao.constant_pattern_share 0.9): reported with its mean
    assert stages.constant_patterns(specs, warm, 8, share=0.9) == {h1: 1.0, "set-const?horizon=2": 0.1}
    assert stages.constant_patterns(specs, warm, 8, share=0.91) == {h1: 1.0}
    warm[2] = traj(specs[2], 0.0)  # and a failure of h1: 9 in 10, the same share the other way
    assert stages.constant_patterns(specs, warm, 8, share=0.9) == {h1: 0.9, "set-const?horizon=2": 0.1}
    assert stages.constant_patterns(specs, warm, 8) == {}
    warm[2] = traj(specs[2], 1.0)
    warm[0] = traj(specs[0], 0.0, "crashed")  # a crash says nothing of the policy: not counted (9 of h1 left)
    assert stages.constant_patterns(specs, warm, 9) == {h1: 1.0} and stages.constant_patterns(specs, warm, 10) == {}
    warm[1] = traj(specs[1], 0.0, "truncated")  # out of turns: a failure like the others, counted with its 0
    assert stages.constant_patterns(specs, warm, 9) == {h1: 1.0, "set-const?horizon=2": 0.0}

    cfg = configs.load("micro")
    write_dataset(specs, tmp_path / "rl")
    envs = {"train": None, "rl": str(tmp_path / "rl")}
    both = {h1: 1.0, "set-const?horizon=2": 0.0}
    out = stages.sao_expert(cfg, "/no/such/checkpoint", envs, "code", tmp_path / "x", domain_reward=0.5,
                            constant=both)
    assert out["steps"] == 0 and out["checkpoint"] == "/no/such/checkpoint"
    assert "every task pattern's warm rollouts earned (nearly) a single reward" in out["skipped"]
    assert out["constant_patterns"] == both
    with pytest.raises(FileNotFoundError):  # one pattern with signal left: the expert trains (loads its checkpoint)
        stages.sao_expert(cfg, "/no/such/checkpoint", envs, "code", tmp_path / "y", domain_reward=0.5,
                          constant={h1: 1.0})


def test_hand_off_keeps_a_student_that_did_not_validate_out_of_the_next_iteration():
    # "better" (the default): the student when it was better on the validation set, whatever the champion did
    assert configs.load("tiny").hand_off == "better"
    assert stages.hand_off("better", "s", "w", champion_moved=False, better=True)[0] == "s"
    ckpt, why = stages.hand_off("better", "s", "w", champion_moved=True, better=False)
    assert ckpt == "w" and why.startswith("its warm start") and "validation" in why
    # "champion": the student only if it became the champion, else the iteration's own warm start
    assert stages.hand_off("champion", "s", "w", champion_moved=True, better=False)[0] == "s"
    ckpt, why = stages.hand_off("champion", "s", "w", champion_moved=False, better=True)
    assert ckpt == "w" and why.startswith("its warm start") and "champion" in why
    # "student": the student, whatever it scored
    assert stages.hand_off("student", "s", "w", champion_moved=False, better=False)[0] == "s"
    with pytest.raises(ValueError, match="hand_off"):
        stages.hand_off("best", "s", "w", True, True)
    with pytest.raises(configs.ConfigError, match="hand_off"):
        configs.load("tiny", ["hand_off=best"])


def test_the_validation_set_is_fresh_every_iteration_and_never_a_held_out_task(tmp_path):
    cfg = configs.load("tiny", ["envs.n_rl=0", "envs.n_train=0", "envs.n_eval=60", "envs.n_val=60"])
    one, two = (stages.env_specs(cfg, tmp_path / f"e{i}", iteration=i) for i in (1, 2))
    held = {task_content(s) for s in read_dataset(one["eval"])}
    v1, v2 = ({task_content(s) for s in read_dataset(x["val"])} for x in (one, two))
    assert v1 and v2 and not v1 & held and not v2 & held
    assert v1 != v2 and read_dataset(one["eval"])[0].id == read_dataset(two["eval"])[0].id  # val moves, eval does not
    assert {s.family for s in read_dataset(one["val"])} == {s.family for s in read_dataset(one["eval"])}
    # the size asked: a draw the held-out set holds is replaced by the pattern's next one (stages/env_sets.py)
    assert one["n_val"] == len(v1) == 60 and one["n_eval"] == len(held) == 60
    assert stages.verified_envs(cfg, one, tmp_path / "v")["val"] == one["val"]  # passed on, like the held-out set


@pytest.mark.slow
def test_an_expert_teaches_only_if_it_beats_the_warm_start_on_validation(tmp_path):
    import torch

    from envs.dataset import write_dataset
    from envs.generator import generate
    from envs.sandbox import make_sandbox
    from model import ByteTokenizer, Transformer, load_checkpoint, save_checkpoint
    from trainers.sft import evaluate

    cfg = configs.load("tiny")
    base = str(stages.resolve_base(cfg.base.checkpoint))
    torch.manual_seed(0)
    save_checkpoint(Transformer(cfg.model), tmp_path / "random")  # solves nothing
    rand = str(tmp_path / "random")
    val = generate(["set-const?horizon=1", "calc-chain?horizon=1"], 8, 3)
    write_dataset(val, tmp_path / "val")
    envs = {"val": str(tmp_path / "val")}
    code = [s for s in val if s.domain == "code"]
    base_code = evaluate(load_checkpoint(base), code, ByteTokenizer(), make_sandbox(cfg.envs.sandbox), cfg.agent)
    k = sum(t.reward for t in base_code["trajectories"])
    assert k > 0  # the shipped base solves some one-constant edits

    up = stages.teacher_gate(cfg, rand, {"code": base}, envs)["code"]
    crashes = up.pop("crashes")  # per family, each policy's episodes on the domain: none lost here
    # the warm start's outcomes per validation task, for evaluation's decision to reuse (stages/decision.py)
    assert up.pop("warm_ckpt") == str(Path(rand).resolve()) and up.pop("warm_rewards") == {s.id: 0.0 for s in code}
    assert up == {"n": len(code), "warm_start": 0.0, "expert": k / len(code), "gained": k, "lost": 0, "teaches": True}
    assert {w: (c["episodes"], c["share"]) for w, c in crashes.items()} == {"warm_start": (len(code), 0.0),
                                                                          "expert": (len(code), 0.0)}
    down = stages.teacher_gate(cfg, base, {"code": rand}, envs)["code"]
    assert (down["gained"], down["lost"], down["teaches"]) == (0, k, False)
    same = stages.teacher_gate(cfg, rand, {"code": rand, "math": rand}, envs)
    assert not same["code"]["teaches"] and not same["math"]["teaches"]  # a tie does not teach

    # in OPD: a worse expert is left out (of the merge too); with none left, the student is the warm start
    spec_envs = {**envs, "rl": str(tmp_path / "val"), "train": None}
    opd = stages.opd_student(configs.load("tiny", ["opd.init=merged"]), base, {"code": rand}, spec_envs,
                             tmp_path / "s")
    assert opd["checkpoint"] == base and opd["steps"] == 0 and opd["gate"]["code"]["teaches"] is False
    assert "validation" in opd["skipped"]
    # one expert teaches, one is left out: the left-out domain is the warm start's to teach, and only the teaching
    # expert joins the merge
    mixed = stages.opd_student(configs.load("tiny", ["opd.init=merged", "opd.steps=0"]), rand,
                               {"code": base, "math": rand}, spec_envs, tmp_path / "s-mixed")
    assert mixed["teachers"] == {"code": base} and mixed["anchored"] == ["math"] and mixed["merged_from"] == [base]
    # the verdict is kept: a resumed stage reads it back instead of evaluating again
    import trainers.sft

    def boom(*a, **kw):
        raise AssertionError("evaluated again")

    real, trainers.sft.evaluate = trainers.sft.evaluate, boom
    try:
        again = stages.opd_student(configs.load("tiny"), base, {"code": rand}, spec_envs, tmp_path / "s")
    finally:
        trainers.sft.evaluate = real
    assert again["gate"] == opd["gate"]
    # without a validation set (or with the gate off) every expert teaches
    off = stages.opd_student(configs.load("tiny", ["opd.gate_teachers=false", "opd.steps=0"]), base, {"code": rand},
                             spec_envs, tmp_path / "s2")
    assert off["gate"] == {} and off["teachers"] == {"code": rand}


def test_the_champion_rule_and_an_evaluation_of_a_student_that_is_its_warm_start(tmp_path, monkeypatch):
    from envs.dataset import write_dataset
    from envs.generator import generate
    from trainers.stats import moves_champion

    # a significant gain and a score above the champion's; with no champion yet, the gain alone
    assert moves_champion(True, 0.5, 0.4) and moves_champion(True, 0.1, None)
    assert not moves_champion(True, 0.4, 0.4) and not moves_champion(False, 0.9, None)
    # when OPD had no teacher the student is the warm start: played once, counted for both, every flip zero
    import trainers.sft

    cfg = configs.load("tiny")
    base = str(stages.resolve_base(cfg.base.checkpoint))
    write_dataset(generate(["set-const?horizon=1", "calc-chain?horizon=1"], 6, 11), tmp_path / "eval")
    calls, real = [], trainers.sft.evaluate

    def counted(*a, **kw):
        calls.append(len(a[1]))
        return real(*a, **kw)

    monkeypatch.setattr(trainers.sft, "evaluate", counted)
    # the warm start spelled differently (a trailing slash): the same checkpoint on disk
    write_dataset(generate(["set-const?horizon=1", "calc-chain?horizon=1"], 4, 11, "validation"), tmp_path / "val")
    ev = stages.evaluation(cfg, base, base + "/", {"eval": str(tmp_path / "eval"), "val": str(tmp_path / "val")},
                           store_path=tmp_path / "t.duckdb", iteration=2)
    # the held-out tasks once, and the decision's validation tasks once (the student is its warm start)
    assert calls == [6, 4] and ev["pass@1_before"] == ev["pass@1_after"] > 0
    assert ev["decision"]["set"] == "validation" and ev["decision"]["n"] == 4 and not ev["decision"]["significant"]
    assert ev["gained"] == ev["lost"] == 0 and ev["p_value"] == 1.0
    from store import TrajectoryStore

    with TrajectoryStore(tmp_path / "t.duckdb", read_only=True) as st:
        rows = st.consumption("eval")
    by = {c: sorted(r["trajectory_id"] for r in rows if r["consumer"] == c) for c in ("eval:student", "eval:warm_start")}
    assert len(by["eval:student"]) == 6 and by["eval:student"] == by["eval:warm_start"]
    # experts the gate left out are still scored on their own domain, and marked as not the student's teacher
    calls.clear()
    ev = stages.evaluation(cfg, base, base + "/", {"eval": str(tmp_path / "eval")}, {"code": base, "math": base},
                           store_path=tmp_path / "t.duckdb", iteration=3, taught=["code"])
    assert calls == [6, 3, 3] and ev["teaching"] == {"code": True, "math": False}
    assert ev["decision"]["set"] is None and not ev["decision"]["significant"]  # no validation set: no decision
    assert set(ev["domain_teacher"]) == {"code", "math"}


def test_run_summary_names_who_taught_each_domain(tmp_path):
    """The summary's teacher column: an expert that taught shows its own-domain pass@1, one the gate left out says so
    (and who taught instead), and a domain with no expert names the warm start that anchored it."""
    from rich.console import Console

    from pipelines.run_cli import summary

    def teacher_column(evaluation: dict, opd: dict) -> dict[str, str]:
        (tmp_path / "evaluation.json").write_text(json.dumps(evaluation))
        (tmp_path / "opd_student.json").write_text(json.dumps(opd))
        con = Console(record=True, width=200)
        summary(tmp_path, {}, 1.0, con)
        cells = [[c.strip() for c in ln.split("│")[1:-1]] for ln in con.export_text().splitlines() if ln.count("│") > 3]
        return {c[0]: c[-1] for c in cells if c[0] in ("code", "math", "reasoning", "all")}

    stat = {"pass@1": 0.5, "k": 1, "n": 2, "ci95": [0.1, 0.9]}
    test = {"n": 2, "gained": 0, "lost": 0, "delta": 0.0, "p_value": 1.0}
    ev = {"stats": {d: {"before": stat, "after": stat, "test": test} for d in ("code", "math", "reasoning", "all")},
          "domain_teacher": {"code": 0.375, "reasoning": 0.675, "math": 0.25},
          "teaching": {"code": False, "reasoning": True, "math": False}}
    assert teacher_column(ev, {"anchored": ["math"], "steps": 16}) == {
        "code": "0.38 (left out)", "math": "0.25 (left out; warm start taught)", "reasoning": "0.68", "all": ""}
    ev["domain_teacher"].pop("math")  # a skipped domain's expert is not evaluated: who taught it still shows
    assert teacher_column(ev, {"anchored": ["math"], "steps": 16})["math"] == "warm start"
