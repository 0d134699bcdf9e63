"""One rank of a training stage under `torchrun` (`trainer.world_size > 1`).

    python -m torch.distributed.run --nproc_per_node W -m stages.ranks SPEC.json

`stages.under_torchrun` writes SPEC (the stage, its resolved config, its arguments, where the result goes) and
launches this. Every rank joins the process group (`DDPBackend`) and calls the stage function with it; rank 0
drives the rollout backend and writes the result, and reports progress on stdout as `@log` / `@metrics` lines,
which the launching process relays to its own log and metrics (the Dagster run's log, MLflow's step curves).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from stages.step import PATH_ARGS


def _emit(kind: str, payload) -> None:
    print(f"@{kind} {json.dumps(payload, default=str)}", flush=True)


def main(spec_path: str) -> int:
    import stages
    from configs import IterationConfig
    from trainers.runtime import make_train_backend

    spec = json.loads(Path(spec_path).read_text())
    cfg = IterationConfig.model_validate(spec["config"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dp = make_train_backend(cfg.trainer, rank, world)
    main_rank = dp.is_main
    kwargs = {k: (Path(v) if k in PATH_ARGS and v is not None else v) for k, v in spec["kwargs"].items()}
    try:
        out = getattr(stages, spec["stage"])(
            cfg, **kwargs, train_backend=dp,
            log=(lambda m: _emit("log", m)) if main_rank else (lambda m: None),
            metrics=(lambda values, step: _emit("metrics", {"values": values, "step": step})) if main_rank
            else (lambda values, step: None))
        if main_rank:
            tmp = Path(spec["result"]).with_suffix(".tmp")
            tmp.write_text(json.dumps(out, default=str))
            tmp.replace(spec["result"])
    finally:
        dp.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
