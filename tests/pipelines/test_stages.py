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
