"""Two SAO steps of the micro model on two Megatron data-parallel ranks, with the experts split over them (`ep2`:
every forward is a collective over the ranks) or whole on each (`dp2`: every gradient is summed over them), on the
trajectories A:B of 5 of uneven lengths and segment counts; or the same two steps in one process on the torch
backend (`single`): run by test_megatron.py, which compares the two.

    python -m torch.distributed.run --nproc_per_node 2 tests/trainers/megatron_sao_step.py OUT_DIR ep2|dp2 A:B
    python tests/trainers/megatron_sao_step.py OUT_DIR single A:B
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


def run(backend, export, pick: slice = slice(0, 5)) -> dict:
    cfg = configs.load("micro")
    torch.manual_seed(1)
    init = Transformer(cfg.model)
    before = {k: v.clone() for k, v in to_hf_state(init)}
    actor = backend.wrap(init)
    sao = SAOTrainer(actor, SAOConfig(critic_updates=2, lr=1e-3, warmup_steps=0, exact_rows=False), backend=backend)
    first = sao.step(trajectories()[pick], 0)
    second = sao.step(trajectories()[pick], 1)
    return {"before": before, "after": {k: v.detach().clone() for k, v in to_hf_state(export(actor))},
            "updated": first["updated"] and second["updated"], "tokens": second.get("mismatch_all_tokens"),
            "value_loss": second.get("value_loss")}


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("TEMPER_TEST_THREADS") or 1))  # tests/conftest.py
    out, what = Path(sys.argv[1]), sys.argv[2]
    pick = slice(*map(int, sys.argv[3].split(":")))  # which of the 5 trajectories, e.g. 0:5
    if what == "single":
        torch.save(run(TorchBackend(), lambda m: m, pick), out / "single.pt")
    else:  # "ep2": the experts over the two data-parallel ranks; "dp2": two data-parallel ranks, each all experts
        from trainers.megatron.backend import MegatronBackend

        be = MegatronBackend(1, 1, 2 if what == "ep2" else 1, 1)
        try:
            assert be.lockstep and be.world_size == 2
            torch.save(run(be, be.export, pick), out / f"rank{os.environ['RANK']}.pt")
        finally:
            be.close()
