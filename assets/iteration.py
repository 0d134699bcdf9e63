"""Dagster assets of one post-training iteration (partitioned by iteration number).

Thin bodies: read the config, call `pipelines.stages`, record metadata. Stage outputs are JSON files
under `<run_root>/iteration-N/`, so each asset reads what its parents wrote. Iteration N's warm start is
iteration N−1's OPD student, looked up from the previous partition's materialisation (dynamic partitions
cannot depend on themselves) and recorded as `parent_checkpoint` metadata.
"""


import json
from pathlib import Path

import dagster as dg

ITERATIONS = dg.DynamicPartitionsDefinition(name="iteration")
DOMAINS = ("code", "math", "reasoning")


class TemperResource(dg.ConfigurableResource):
    """The IterationConfig (a preset plus Launchpad overrides) and where runs and tracking live."""

    preset: str = "tiny"
    overrides: list[str] = []
    run_root: str = "runs/pipeline"
    mlflow_uri: str = ""

    def config(self):
        import configs

        return configs.load(self.preset, self.overrides)

    def dir(self, iteration: str) -> Path:
        p = Path(self.run_root) / f"iteration-{int(iteration):04d}"
        p.mkdir(parents=True, exist_ok=True)
        return p

    def tracker(self):
        from store.tracking import Tracker

        uri = self.mlflow_uri or f"sqlite:///{Path(self.run_root).resolve() / 'mlflow.db'}"
        return Tracker(uri)


def _save(d: Path, name: str, out: dict) -> None:
    (d / f"{name}.json").write_text(json.dumps(out, indent=1, default=str))


def _load(d: Path, name: str) -> dict:
    return json.loads((d / f"{name}.json").read_text())


def _meta(out: dict) -> dict:
    return {k: (dg.MetadataValue.json(v) if isinstance(v, dict | list) else v) for k, v in out.items()
            if v is not None}


@dg.asset(partitions_def=ITERATIONS, group_name="iteration", description="Task specs generated from the patterns")
def env_specs(context: dg.AssetExecutionContext, temper: TemperResource) -> dg.MaterializeResult:
    from pipelines import stages

    d = temper.dir(context.partition_key)
    out = stages.env_specs(temper.config(), d / "envs")
    _save(d, "env_specs", out)
    return dg.MaterializeResult(metadata=_meta(out))


@dg.asset(partitions_def=ITERATIONS, group_name="iteration", deps=[env_specs],
          description="Specs that passed the solvability judge, the triad and the hack probes")
def verified_envs(context: dg.AssetExecutionContext, temper: TemperResource) -> dg.MaterializeResult:
    from pipelines import stages

    d = temper.dir(context.partition_key)
    out = stages.verified_envs(temper.config(), _load(d, "env_specs"), d / "verified")
    _save(d, "verified_envs", out)
    return dg.MaterializeResult(metadata=_meta(out))


@dg.asset_check(asset=verified_envs, blocking=True, description="Enough environments pass the verifier triad")
def triad_pass_rate(context: dg.AssetCheckExecutionContext, temper: TemperResource) -> dg.AssetCheckResult:
    out = _load(temper.dir(_partition(context)), "verified_envs")
    ok = out["triad_pass_rate"] >= 0.5 and out["accepted"] > 0
    return dg.AssetCheckResult(passed=ok, metadata={"triad_pass_rate": out["triad_pass_rate"], "accepted": out["accepted"]})


@dg.asset_check(asset=verified_envs, blocking=True, description="No admitted environment rewards a hack probe")
def hack_probes(context: dg.AssetCheckExecutionContext, temper: TemperResource) -> dg.AssetCheckResult:
    out = _load(temper.dir(_partition(context)), "verified_envs")
    return dg.AssetCheckResult(passed=out["accepted_probe_hits"] == 0,
                               metadata={"accepted_probe_hits": out["accepted_probe_hits"]})


def _partition(context) -> str:
    return context.run.tags.get("dagster/partition") or context.partition_key


def _previous_student(context: dg.AssetExecutionContext, iteration: str) -> str | None:
    prev = str(int(iteration) - 1)
    if int(prev) < 1:
        return None
    res = context.instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("opd_student"), asset_partitions=[prev]), limit=1)
    if not res.records:
        raise dg.Failure(f"iteration {iteration} starts from iteration {prev}'s student, which is not materialised")
    return res.records[0].asset_materialization.metadata["checkpoint"].value


@dg.asset(partitions_def=ITERATIONS, group_name="iteration", deps=[verified_envs],
          description="The policy this iteration starts from: SFT warm start (iteration 1) or the previous student")
def warm_start(context: dg.AssetExecutionContext, temper: TemperResource) -> dg.MaterializeResult:
    from pipelines import stages

    d = temper.dir(context.partition_key)
    parent = _previous_student(context, context.partition_key)
    out = stages.warm_start(temper.config(), _load(d, "verified_envs"), d / "warm_start", parent)
    _save(d, "warm_start", out)
    return dg.MaterializeResult(metadata={**_meta(out), "parent_checkpoint": parent or "none (SFT from scratch)"})


@dg.asset(partitions_def=ITERATIONS, group_name="iteration", deps=[warm_start],
          description="One rollout per verified environment, in the DuckDB trajectory store")
def rollout_batches(context: dg.AssetExecutionContext, temper: TemperResource) -> dg.MaterializeResult:
    from pipelines import stages

    d = temper.dir(context.partition_key)
    out = stages.rollout_batches(temper.config(), _load(d, "warm_start")["checkpoint"], _load(d, "verified_envs"),
                                 Path(temper.run_root) / "trajectories.duckdb", int(context.partition_key))
    _save(d, "rollout_batches", out)
    return dg.MaterializeResult(metadata=_meta(out))


@dg.asset(partitions_def=ITERATIONS, group_name="iteration", deps=[rollout_batches],
          description="Verifier rewards of the rollouts, per family and status")
def rewards(context: dg.AssetExecutionContext, temper: TemperResource) -> dg.MaterializeResult:
    from pipelines import stages

    d = temper.dir(context.partition_key)
    out = stages.rewards(Path(temper.run_root) / "trajectories.duckdb", int(context.partition_key))
    _save(d, "rewards", out)
    return dg.MaterializeResult(metadata=_meta(out))


@dg.asset(partitions_def=ITERATIONS, group_name="iteration", deps=[rewards],
          description="One SAO-trained expert per domain, each from the warm start")
def sao_experts(context: dg.AssetExecutionContext, temper: TemperResource) -> dg.MaterializeResult:
    from pipelines import stages

    d = temper.dir(context.partition_key)
    cfg, envs, ws = temper.config(), _load(d, "verified_envs"), _load(d, "warm_start")["checkpoint"]
    out = {dom: stages.sao_expert(cfg, ws, envs, dom, d / "experts" / dom) for dom in DOMAINS}
    _save(d, "sao_experts", out)
    return dg.MaterializeResult(metadata={f"{k}_checkpoint": v["checkpoint"] for k, v in out.items()})


@dg.asset(partitions_def=ITERATIONS, group_name="iteration", deps=[sao_experts],
          description="The student distilled from the domain experts by multi-teacher on-policy distillation")
def opd_student(context: dg.AssetExecutionContext, temper: TemperResource) -> dg.MaterializeResult:
    from pipelines import stages

    d = temper.dir(context.partition_key)
    experts = {k: v["checkpoint"] for k, v in _load(d, "sao_experts").items() if v.get("steps", 0) > 0}
    out = stages.opd_student(temper.config(), _load(d, "warm_start")["checkpoint"], experts, _load(d, "verified_envs"),
                             d / "student")
    _save(d, "opd_student", out)
    return dg.MaterializeResult(metadata=_meta(out))


@dg.asset(partitions_def=ITERATIONS, group_name="iteration", deps=[opd_student],
          description="Held-out pass@1 of the student vs the warm start; MLflow run; champion alias")
def evaluation(context: dg.AssetExecutionContext, temper: TemperResource) -> dg.MaterializeResult:
    from pipelines import stages

    it = context.partition_key
    d = temper.dir(it)
    out = stages.evaluation(temper.config(), _load(d, "opd_student")["checkpoint"], _load(d, "warm_start")["checkpoint"],
                            _load(d, "verified_envs"))
    tr = temper.tracker()
    run = tr.iteration_run(it)
    tr.log(run, metrics={"pass_at_1_before": out["pass@1_before"], "pass_at_1_after": out["pass@1_after"]},
           params={"preset": temper.preset, "overrides": ",".join(temper.overrides)})
    reg = tr.register_student("temper-student", run, out["student"], out["pass@1_after"])
    tr.finish(run)
    out.update(mlflow_run=tr.run_link(run), registered=reg)
    _save(d, "evaluation", out)
    return dg.MaterializeResult(metadata=_meta(out))


ALL_ASSETS = [env_specs, verified_envs, warm_start, rollout_batches, rewards, sao_experts, opd_student, evaluation]
ALL_CHECKS = [triad_pass_rate, hack_probes]
