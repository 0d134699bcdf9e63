"""The trainer as its own process group: one SFT step and two SAO steps (critic and replay anchor included) under
`torchrun` with 2 gloo ranks end with the gradients, weights and step statistics of one process on the whole batch —
uneven token counts per rank, an odd number of trajectories and replay rows, several micro-batches per rank, MTP and
the indexer KL included.

The steps use SGD (tests/trainers/ddp_step.py says why): its update is linear in the gradient, so weights that
differ by more than lr × the gradients' summation noise mean the ranks computed a different gradient, on any CPU and
at any thread count. And the comparison is shown to catch the ways data parallelism goes silently wrong: each of
ddp_step.MUTANTS (a rank's share skipped, a micro-batch counted twice, the loss normalised by the rank's tokens in
SFT and in SAO) breaks the trainers' code once, and must fail it."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainers.backends import free_port

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from ddp_step import MUTANTS  # noqa: E402

VARIANTS = ["plain", *sorted(MUTANTS)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict, list[dict]]]:
    """Per variant (the trainers as they are, and each mutant: its break is in shared code, so in both runs), one
    process on the whole batch and two torchrun ranks; one launch each runs every variant."""
    out = tmp_path_factory.mktemp("ddp")
    arg = ",".join(VARIANTS)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                    "127.0.0.1", "--master_port", str(free_port()), str(HERE / "ddp_step.py"), str(out), arg],
                   check=True, timeout=600, capture_output=True)
    subprocess.run([sys.executable, str(HERE / "ddp_step.py"), str(out), "single", arg], check=True, timeout=600,
                   capture_output=True)
    return {v: (torch.load(out / f"single-{v}.pt", weights_only=False),
                [torch.load(out / f"rank{r}-{v}.pt", weights_only=False) for r in range(2)]) for v in VARIANTS}


def assert_ranks_equal_one(one: dict, ranks: list[dict]) -> None:
    # gradients: the same sums in another order (1e-12 apart); weights: init − lr·(that), so as close
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
    # statistics, the entropy, the critic's loss, the replay anchor's KL and the train/rollout mismatch over every
    # rank's tokens (the count, the mean, the max)
    for r in ranks:
        assert r["stats"].keys() == one["stats"].keys()
        for k, v in one["stats"].items():
            assert r["stats"][k] == pytest.approx(v, rel=1e-4, abs=1e-7), k


def test_two_rank_sft_and_sao_equal_one_rank(runs):
    one, ranks = runs["plain"]
    assert one["updated"] and all(r["updated"] for r in ranks)
    # the figures compared are away from 0: the second step's replay KL (the first is taken at the reference), the
    # clip fraction, the mismatch
    assert one["stats"]["replay_kl"] > 1e-5 and one["stats"]["clip_frac"] > 0
    assert one["stats"]["mismatch_all_tokens"] > 0 and one["stats"]["mismatch_all_max"] > 0
    # the steps moved the weights well past the tolerance (so equal weights are not just untouched ones)
    moved = lambda part, init: max(float((w - init[n]).abs().max()) for n, (_, w) in one[part].items())  # noqa: E731
    assert moved("sao", one["init"]) > 1e-3 and moved("sft", one["init_sft"]) > 1e-3
    assert_ranks_equal_one(one, ranks)


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_comparison_catches_a_broken_data_parallel_step(runs, mutant):
    one, ranks = runs[mutant]
    with pytest.raises(AssertionError):
        assert_ranks_equal_one(one, ranks)
