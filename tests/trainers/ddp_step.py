"""One SFT step and two SAO steps (with the replay anchor) of the micro model under `torchrun` (gloo): run by
test_ddp_torchrun.py, which compares the gradients, weights and step statistics every rank ends with against one
process on the whole batch.

    python -m torch.distributed.run --nproc_per_node 2 tests/trainers/ddp_step.py OUT_DIR [VARIANTS]
    python tests/trainers/ddp_step.py OUT_DIR single [VARIANTS]

The optimizers here are plain SGD (the backends' `optimizer` overridden), not the trainers' AdamW: SGD's update is
linear in the gradient, so two runs whose gradients agree to summation noise (1e-12, which depends on the CPU's
reduction order and thread count) end with weights that agree to lr × that noise. AdamW divides by √v: where a
gradient is near 0 it turns that noise into a weight difference of order lr, and the comparison of weights would
pass or fail with the machine. The trainers' parallel logic (the row split, the token normalisation, the gradient
average, the clip, the critic and replay steps) is the same whatever the optimizer; AdamW itself is compared to a
hand step in tests/trainers/test_backends.py.

VARIANTS is a comma-separated list of runs, each written to OUT_DIR/{single,rank0,rank1}-{variant}.pt: "plain" is
the trainers as they are; any other name is one of MUTANTS, a deliberate break the comparison must catch (the
module's source re-executed with one line changed, and restored after the run). One process runs them all, so the
interpreter and torch start once.
"""

import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# name -> (module, the line as written, the broken line): each is a way data parallelism goes silently wrong
MUTANTS = {
    # rank 1's share of every gradient never reaches the average (as if its backward were skipped)
    "skip_share": ("trainers.backends", "flat = torch.cat([g.reshape(-1) for g in bucket])",
                   "flat = torch.cat([g.reshape(-1) for g in bucket]) * float(self.rank == 0)"),
    # the first micro-batch of every SAO pass is back-propagated twice
    "double_micro": ("trainers.sao", "(loss * share).backward()",
                     "(loss * share * (2.0 if i == 0 else 1.0)).backward()"),
    # the SFT loss is a mean over the rank's own tokens, not its share of the batch's
    "rank_norm_sft": ("trainers.lm",
                      "lm_scale = float(mask[:, 1:].sum()) * w / max(1.0, float(g_mask[:, 1:].sum()))",
                      "lm_scale = 1.0"),
    # the SAO policy loss is normalised by the rank's tokens
    "rank_norm_sao": ("trainers.sao", "n = torch.tensor(n_global / self.backend.world_size)",
                      "n = rows.mask.sum().clamp_min(1).float() if rows is not None else torch.tensor(1.0)"),
}


def apply_mutant(name: str, undo: bool = False) -> None:
    """Re-execute one trainers module in place with MUTANTS[name]'s line swapped (`undo`: as written). Its classes
    are new objects: the run imports them after this."""
    import importlib

    module, old, new = MUTANTS[name]
    mod = importlib.import_module(module)
    src = Path(mod.__file__).read_text()
    if src.count(old) != 1:
        raise SystemExit(f"mutant {name}: the line to break is not in {mod.__file__} exactly once: {old!r}")
    exec(compile(src if undo else src.replace(old, new), mod.__file__, "exec"), mod.__dict__)


def sgd(params, lr, weight_decay=0.0, **_adam):
    """What the backends' `optimizer` returns here: an update linear in the gradient (see the module docstring)."""
    return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)


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
    from rollout.types import Segment, Trajectory

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
    import configs
    from model import Transformer
    from trainers.config import SAOConfig
    from trainers.lm import LMTrainer
    from trainers.sao import SAOTrainer

    backend.optimizer = sgd
    # SGD's steps are lr · g (AdamW's are ~lr per weight): a larger lr moves the policy as far, so the second SAO
    # step's replay KL and clip fraction are away from 0
    cfg = configs.load("micro", ["train.mtp_loss_weight=0.5", "train.lr=3.0", "train.warmup_steps=0"])
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
    # the second one's replay KL is away from 0 (the first is taken at the reference); micro-batches of 2 rows, so
    # each rank's share is several micro-batches
    sao = SAOTrainer(actor, SAOConfig(critic_updates=2, lr=3.0, warmup_steps=0, replay_coef=1.0, replay_rows=3,
                                      micro_rows=2), backend=backend)
    sao.set_replay(trajectories()[:3])
    first = sao.step(trajectories(), 0)
    st = sao.step(trajectories(), 1)
    rl = {n: (p.grad.clone() if p.grad is not None else None, p.detach().clone()) for n, p in actor.named_parameters()}
    critic = {n: p.detach().clone() for n, p in sao.critic.named_parameters()}
    stats = {k: v for k, v in st.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {"sft": sft, "sao": rl, "critic": critic, "updated": st["updated"] and first["updated"], "init": init,
            "init_sft": init_sft, "stats": stats}


def main() -> None:
    torch.set_num_threads(int(os.environ.get("TEMPER_TEST_THREADS") or 1))  # tests/conftest.py
    single = len(sys.argv) > 2 and sys.argv[2] == "single"
    rest = sys.argv[3 if single else 2:]
    variants = rest[0].split(",") if rest else ["plain"]
    first = None
    for v in variants:
        if v != "plain":
            apply_mutant(v)
        from trainers.backends import DDPBackend, TorchBackend  # this variant's classes

        if single:
            torch.save(run(TorchBackend()), Path(sys.argv[1]) / f"single-{v}.pt")
        else:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            b = DDPBackend(rank, world)  # joins the process group once; later variants' backends reuse it
            first = first or b
            torch.save(run(b), Path(sys.argv[1]) / f"rank{rank}-{v}.pt")
        if v != "plain":
            apply_mutant(v, undo=True)
    if first is not None:
        first.close()


if __name__ == "__main__":
    main()
