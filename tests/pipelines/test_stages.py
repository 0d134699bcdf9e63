"""Stage functions on their own: validation with sampled hack probes, held-out patterns."""

import configs
import stages
from envs.dataset import read_dataset


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
