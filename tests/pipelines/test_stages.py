"""Stage functions on their own: validation with sampled hack probes, held-out patterns."""

import configs
from envs.dataset import read_dataset
from pipelines import stages


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
