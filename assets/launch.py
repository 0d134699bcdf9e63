"""Every configuration error at launch, none at step N: the checks a launch passes before a partition or a run exists.

One set of rules, used by `temper run` (pipelines/run_cli.py), the Launchpad (`launch_checked`: the resources'
config mapping, which Dagster applies when it validates a run config, before it creates the run) and the sensors
(pipelines/defs/automation.py):

- the preset resolves with its overrides and settings (every override parses as `key.path=value`, every key exists,
  every value is in range: `configs.load`);
- `rollout: {kind: sglang}` names its servers (`urls`) or launches them (`launch: true`);
- `pipes: {kind: k8s}` names an `image`, and `pipes.stages` names stages that exist;
- iteration N ≥ 2 starts from what iteration N−1 of the same run root handed off, so N−1 must have been evaluated
  there (`check_parent`; the Launchpad cannot see the partition when it checks a config, so a run it starts is
  refused by its first step instead, once, without retries);
- a partition key is an iteration number: 1, 2, … (`iteration_number`);
- `base.checkpoint`'s card records the recipe of the preset's `base` section, which the held-out set is kept disjoint
  from (`stages.warm.check_recipe`);
- the MLflow tracking URI (`temper.mlflow_uri`, else $TEMPER_MLFLOW_URI) is a database SQLAlchemy can open with the
  drivers installed (`store.tracking.sql_url_problem`).

A refused launch raises `LaunchRefused` (a ValueError) naming every problem at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import dagster as dg

from .keys import POLICY_KEY, LaunchRefused, iteration_number, record_root
from .resources import RolloutBackend, StageRunner, TemperResource

# the stages `pipes.stages` may name (what `_stage` runs: `python -m stages.step <stage>`)
STAGES = ("verified_envs", "warm_start", "rollout_batches", "sao_expert", "opd_student", "evaluation")


def _section(run_config: Mapping | None, resource: str) -> dict:
    res = (run_config or {}).get("resources") or {}
    return dict((res.get(resource) or {}).get("config") or {})


def resource_problems(run_config: Mapping | None) -> list[str]:
    """Every problem of the run config's `temper`, `rollout` and `pipes` resources (unset ones take their defaults)."""
    problems = []
    try:
        temper = TemperResource(**_section(run_config, "temper"))  # the preset, overrides and settings resolve
        from stages.warm import check_recipe
        from store.tracking import sql_url_problem, tracking_uri

        if why := sql_url_problem(tracking_uri(temper.run_root, temper.mlflow_uri)):  # or $TEMPER_MLFLOW_URI
            problems.append(f"temper: the MLflow tracking URI: {why}")
        check_recipe(temper.config().base)  # the shipped base's card against the preset's recipe
    except ValueError as e:
        problems.append(f"temper: {_short(e)}")
    try:
        rollout = RolloutBackend(**_section(run_config, "rollout"))
        if rollout.kind == "sglang" and not rollout.launch and not rollout.urls:
            problems.append("rollout: kind 'sglang' needs `urls` (the running SGLang servers' base URLs) or "
                            "`launch: true` (start them for each step)")
    except ValueError as e:
        problems.append(f"rollout: {_short(e)}")
    try:
        pipes = StageRunner(**_section(run_config, "pipes"))
        if pipes.kind == "k8s" and not pipes.image:
            problems.append("pipes: kind 'k8s' needs `image` (an image with temper installed)")
        unknown = sorted(set(pipes.stages) - set(STAGES))
        if unknown:
            problems.append(f"pipes: `stages` names {unknown}, which are not stages (known: {', '.join(STAGES)})")
    except ValueError as e:
        problems.append(f"pipes: {_short(e)}")
    return problems


def _short(e: ValueError) -> str:
    """A pydantic error as `path: message` lines, without its input dump and link; a ConfigError as is."""
    if not callable(getattr(e, "errors", None)):
        return str(e)
    return "; ".join((".".join(map(str, x.get("loc") or ())) + ": " if x.get("loc") else "")
                     + str(x.get("msg", "")).removeprefix("Value error, ") for x in e.errors())


def check_run_config(run_config: Mapping | None) -> None:
    if problems := resource_problems(run_config):
        raise LaunchRefused("refused before launch: " + "; ".join(problems))


def launch_checked(resources: dict) -> dict:
    """The resources with the launch check as their config mapping: Dagster runs it whenever it resolves a run config
    into a plan (a launch from the Launchpad, a sensor's request, `execute_in_process`, `validate_run_config`), which
    it does before it creates the run, so a refused config creates none and the Launchpad shows the reason. (Its live
    check while you type is schema-only.) The Launchpad shows the same fields, defaults and types: the mapping's
    schema is the resource's own."""
    out = dict(resources)
    for name in ("temper", "rollout", "pipes"):
        if name not in out or not isinstance(out[name], dg.ConfigurableResource):
            continue
        rd = out[name].get_resource_definition()

        def check(config, _name=name):
            check_run_config({"resources": {_name: {"config": config}}})
            return config

        out[name] = rd.configured(check, config_schema=rd.config_schema.config_type)
    return out


@dataclass(frozen=True)
class Evaluated:
    """An iteration that was evaluated and handed off (a `policy` record)."""

    iteration: int
    root: Path
    run_id: str
    storage_id: int


def evaluated(instance, run_root: Path | str | None = None, limit: int = 1000) -> list[Evaluated]:
    """The evaluated iterations (`policy` records: what warm_start reads), newest first; with `run_root`, of that run
    root only."""
    want = Path(run_root).expanduser().resolve() if run_root is not None else None
    out = []
    for rec in instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=POLICY_KEY), limit=limit).records:
        meta = rec.asset_materialization.metadata
        try:
            n, root = int(meta["iteration"].value), record_root(meta)
        except (KeyError, TypeError, ValueError):
            continue
        if root is not None and (want is None or root.resolve() == want):
            out.append(Evaluated(n, root.resolve(), rec.run_id or "", rec.storage_id))
    return out


def check_parent(instance, iteration: int, run_root: Path | str) -> None:
    """Iteration N ≥ 2 needs iteration N−1 evaluated in the same run root (each run root keeps its own lineage)."""
    if iteration <= 1:
        return
    done = sorted({e.iteration for e in evaluated(instance, run_root)})
    if iteration - 1 not in done:
        root = Path(run_root).expanduser().resolve()
        have = f"evaluated there: {', '.join(map(str, done))}" if done else "nothing has been evaluated there yet"
        nxt = done[-1] + 1 if done else 1
        raise LaunchRefused(f"iteration {iteration} starts from what iteration {iteration - 1} of run root {root} hands "
                            f"off, but iteration {iteration - 1} has not been evaluated there ({have}); the next "
                            f"iteration of that run root is {nxt}")


def refuse_in_run(context, run_root: Path) -> None:
    """The first step of an iteration run: a partition key that is not an iteration number, or an iteration whose
    N−1 is missing from this run root (a run the Launchpad or a backfill started: `temper run` and the sensors check
    before launching), fails here once, clearly, without retries."""
    try:
        it = iteration_number(context.partition_key)
        sel = context.run.asset_selection
        if not sel or dg.AssetKey("warm_start") in sel:  # runs that reach the warm start (none or empty: all) need N−1
            check_parent(context.instance, it, run_root)
    except LaunchRefused as e:
        raise dg.Failure(str(e), allow_retries=False) from None
