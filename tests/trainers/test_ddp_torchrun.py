"""The trainer as its own process group: one SFT step and two SAO steps (critic and replay anchor included) under
`torchrun` with 2 gloo ranks end with the gradients, weights and step statistics of one process on the whole batch —
uneven token counts per rank, an odd number of trajectories and replay rows, MTP and the indexer KL included."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainers.backends import free_port

HERE = Path(__file__).resolve().parent


def test_two_rank_sft_and_sao_equal_one_rank(tmp_path):
    env_run = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), str(HERE / "ddp_step.py"), str(tmp_path)]
    subprocess.run(env_run, check=True, timeout=600, capture_output=True)
    subprocess.run([sys.executable, str(HERE / "ddp_step.py"), str(tmp_path), "single"], check=True, timeout=600)
    one = torch.load(tmp_path / "single.pt", weights_only=False)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert one["updated"] and all(r["updated"] for r in ranks)
    for part in ("sft", "sao"):
        for name, (g1, w1) in one[part].items():
            for r in ranks:
                g, w = r[part][name]
                assert (g is None) == (g1 is None), (part, name)
                if g1 is not None:
                    torch.testing.assert_close(g, g1, rtol=1e-5, atol=1e-7, msg=f"{part} grad {name}")
                torch.testing.assert_close(w, w1, rtol=1e-5, atol=1e-6, msg=f"{part} weight {name}")
    for name, w1 in one["critic"].items():
        for r in ranks:
            torch.testing.assert_close(r["critic"][name], w1, rtol=1e-5, atol=1e-6, msg=f"critic {name}")
    # the step's figures are the whole batch's on every rank, not the rank's share of it: the policy loss's
    # statistics, the entropy, the critic's loss, the replay anchor's KL (away from 0 on this second step) and the
    # train/rollout mismatch over every rank's tokens (the count, the mean, the max)
    assert one["stats"]["replay_kl"] > 1e-5 and one["stats"]["clip_frac"] > 0
    assert one["stats"]["mismatch_all_tokens"] > 0 and one["stats"]["mismatch_all_max"] > 0
    for r in ranks:
        assert r["stats"].keys() == one["stats"].keys()
        for k, v in one["stats"].items():
            assert r["stats"][k] == pytest.approx(v, rel=1e-4, abs=1e-7), k
    # the step moved the weights (so equal weights are not just untouched ones)
    assert any(not torch.equal(w1, one["init"][n]) for n, (_, w1) in one["sao"].items())
    assert any(not torch.equal(w1, one["init_sft"][n]) for n, (_, w1) in one["sft"].items())
