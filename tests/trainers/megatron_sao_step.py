"""Two SAO steps of the micro model on Megatron ranks whose experts are split over them (EP = 2: every forward is a
collective over the two data-parallel ranks), on 5 trajectories of uneven lengths and segment counts (the ranks hold
3 and 2), or the same two steps in one process on the torch backend: run by test_megatron.py, which compares the two.

    python -m torch.distributed.run --nproc_per_node 2 tests/trainers/megatron_sao_step.py OUT_DIR
    python tests/trainers/megatron_sao_step.py OUT_DIR single
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ddp_step import trajectories  # noqa: E402

import configs  # noqa: E402
from model import Transformer  # noqa: E402
from model.checkpoint import to_hf_state  # noqa: E402
from trainers.backends import TorchBackend  # noqa: E402
from trainers.config import SAOConfig  # noqa: E402
from trainers.sao import SAOTrainer  # noqa: E402


def run(backend, export) -> dict:
    cfg = configs.load("micro")
    torch.manual_seed(1)
    init = Transformer(cfg.model)
    before = {k: v.clone() for k, v in to_hf_state(init)}
    actor = backend.wrap(init)
    sao = SAOTrainer(actor, SAOConfig(critic_updates=2, lr=1e-3, warmup_steps=0, exact_rows=False), backend=backend)
    first = sao.step(trajectories(), 0)
    second = sao.step(trajectories(), 1)
    return {"before": before, "after": {k: v.detach().clone() for k, v in to_hf_state(export(actor))},
            "updated": first["updated"] and second["updated"], "tokens": second.get("mismatch_all_tokens"),
            "value_loss": second.get("value_loss")}


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    if len(sys.argv) > 2 and sys.argv[2] == "single":
        torch.save(run(TorchBackend(), lambda m: m), out / "single.pt")
    else:
        from trainers.megatron.backend import MegatronBackend

        be = MegatronBackend(1, 1, 2, 1)
        try:
            assert be.lockstep and be.world_size == 2
            torch.save(run(be, be.export), out / f"rank{os.environ['RANK']}.pt")
        finally:
            be.close()
