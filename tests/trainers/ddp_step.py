"""One SFT step and two SAO steps (with the replay anchor) of the micro model under `torchrun` (gloo): run by
test_ddp_torchrun.py, which compares the gradients, weights and step statistics every rank ends with against one
process on the whole batch.

    python -m torch.distributed.run --nproc_per_node 2 tests/trainers/ddp_step.py OUT_DIR
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import configs  # noqa: E402
from model import Transformer  # noqa: E402
from rollout.types import Segment, Trajectory  # noqa: E402
from trainers.backends import DDPBackend, TorchBackend  # noqa: E402
from trainers.config import SAOConfig  # noqa: E402
from trainers.lm import LMTrainer  # noqa: E402
from trainers.sao import SAOTrainer  # noqa: E402


def sft_batch():
    """4 rows of uneven trainable spans (so per-rank token counts differ), padded to one width."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 256, (4, 40), generator=g)
    mask = torch.zeros(4, 40, dtype=torch.bool)
    for r, (a, b) in enumerate([(5, 39), (20, 26), (2, 12), (30, 40)]):
        mask[r, a:b] = True
    return ids, mask


def trajectories():
    """5 trajectories (an odd count: the ranks get 3 and 2), some with two segments, rewards 0/1."""
    g = torch.Generator().manual_seed(12)
    out = []
    for j in range(5):
        segs = []
        for _ in range(1 + j % 2):
            n = 18 + 3 * j
            toks = torch.randint(0, 256, (n,), generator=g).tolist()
            mask = [False] * 8 + [True] * (n - 8)
            lps = [(-5.6 + 0.01 * (k % 5)) if m else 0.0 for k, m in enumerate(mask)]  # near a random policy
            segs.append(Segment(toks, mask, lps, [0 if m else -1 for m in mask]))
        out.append(Trajectory(f"t{j}", f"e{j}", "f", "math", "h", "v", 0, segs, float(j % 2)))
    return out


def run(backend):
    cfg = configs.load("micro", ["train.mtp_loss_weight=0.5"])
    torch.manual_seed(0)
    model = backend.wrap(Transformer(cfg.model))
    init_sft = {n: p.detach().clone() for n, p in model.named_parameters()}
    lm = LMTrainer(model, cfg.train, backend=backend)
    lm.step(*sft_batch())
    sft = {n: (p.grad.clone() if p.grad is not None else None, p.detach().clone()) for n, p in model.named_parameters()}
    torch.manual_seed(1)
    actor = backend.wrap(Transformer(cfg.model))
    init = {n: p.detach().clone() for n, p in actor.named_parameters()}
    # with the replay anchor on 3 of the trajectories (the ranks get 2 and 1 of each step's rows); two steps, so
    # the second one's replay KL is away from 0 (the first is taken at the reference)
    sao = SAOTrainer(actor, SAOConfig(critic_updates=2, lr=1e-3, warmup_steps=0, replay_coef=1.0, replay_rows=3),
                     backend=backend)
    sao.set_replay(trajectories()[:3])
    first = sao.step(trajectories(), 0)
    st = sao.step(trajectories(), 1)
    rl = {n: (p.grad.clone() if p.grad is not None else None, p.detach().clone()) for n, p in actor.named_parameters()}
    critic = {n: p.detach().clone() for n, p in sao.critic.named_parameters()}
    stats = {k: v for k, v in st.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {"sft": sft, "sao": rl, "critic": critic, "updated": st["updated"] and first["updated"], "init": init,
            "init_sft": init_sft, "stats": stats}


if __name__ == "__main__":
    torch.set_num_threads(1)
    if len(sys.argv) > 2 and sys.argv[2] == "single":
        torch.save(run(TorchBackend()), Path(sys.argv[1]) / "single.pt")
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        b = DDPBackend(rank, world)
        try:
            torch.save(run(b), Path(sys.argv[1]) / f"rank{rank}.pt")
        finally:
            b.close()
