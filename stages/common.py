"""What every stage shares: the quiet log and metrics sinks, the dump helper, running a stage under torchrun,
the rollout backend of a stage, and the iteration's constants."""

from __future__ import annotations

import json
from pathlib import Path


def _quiet(msg: str) -> None:
    """Drop a progress message: the log of a stage run without one."""



def _no_metrics(values: dict[str, float], step: int) -> None:
    """Where a training stage reports each step's metrics as it trains (the Pipes child logs them to MLflow)."""


SAO_CURVES = ("batch_reward", "clip_frac", "kl", "kl_ref", "replay_kl", "entropy", "value_loss", "mismatch_fresh_mean",
              "mismatch_fresh_max")

def _dump(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str))


def under_torchrun(stage: str, cfg, kwargs: dict, out: Path, log=_quiet, metrics=_no_metrics) -> dict:
    """Run `stage` with `kwargs` under `torchrun` with `cfg.trainer.world_size` ranks (`stages/ranks.py`) and
    return rank 0's result. Rank 0's `@log` / `@metrics` lines are relayed to `log` / `metrics`; a rank that fails
    fails the stage, with the tail of the output in the error."""
    from trainers.backends import run_torchrun

    world = cfg.trainer.world_size
    d = out / "ranks"
    d.mkdir(parents=True, exist_ok=True)
    result = d / "result.json"
    result.unlink(missing_ok=True)
    spec = {"stage": stage, "config": cfg.model_dump(mode="json"), "result": str(result),
            "kwargs": {k: (str(v) if isinstance(v, Path) else v) for k, v in kwargs.items()}}
    _dump(d / "spec.json", spec)
    log(f"{stage}: {world} trainer ranks under torchrun")

    def relay(line: str) -> bool:  # rank 0's log lines and metrics go on; the rest is the error tail
        if line.startswith("@log "):
            log(json.loads(line[5:]))
        elif line.startswith("@metrics "):
            m = json.loads(line[9:])
            metrics(m["values"], m["step"])
        else:
            return True
        return False

    status, tail = run_torchrun(world, ["stages.ranks", str(d / "spec.json")], relay,
                                lambda: log(f"{stage}: the rendezvous port was taken before torchrun bound it; again "
                                            "on another"))
    if status != 0 or not result.exists():
        raise RuntimeError(f"{stage} under torchrun ({world} ranks) failed with exit status {status}:\n"
                           + "\n".join(tail))
    return json.loads(result.read_text())


def _backend(cfg, model, tok, out: Path, urls: list[str] | None, router_url: str, version: int, name: str):
    """The stage's rollout backend: the servers at `urls` (given `model` as `version` through
    `/update_weights_from_disk`) or, without URLs, an in-process engine."""
    from rollout.backend import make_backend

    return make_backend(model, tok, urls=urls, router_url=router_url, sync_dir=out / "sync", n_slots=cfg.loop.n_slots,
                        max_len=cfg.agent.max_context + 8, version=version, name=name,
                        compile_decode=cfg.loop.compile_decode)


ITERATION_SEED_STRIDE = 7_919
ROLLOUT_CHUNK = 16  # rollouts stored per write: what a kill of `rollout_batches` can cost
# Within an iteration the warm start is policy version 1 (its checkpoint says so); every trainer counts on from it.
# `rollout_batches` serves it at this version, so SAO's first step sees those rollouts at staleness 0.
WARM_VERSION = 1
