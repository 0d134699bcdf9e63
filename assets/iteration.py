"""Dagster assets of one post-training iteration (partitioned by iteration number).

Thin bodies: read the config, run the stage, record metadata and MLflow. The long stages (validation, SFT,
rollouts, SAO, OPD, evaluation) run as `python -m stages.step` subprocesses that report through Dagster
Pipes, so cancelling a run kills them, and a retried step resumes from the stage's last checkpoint. A stage's
result comes back through Pipes (a message, and the child's own report of the materialisation) and is stored
as the materialisation's `result` JSON metadata, with absolute paths; each asset reads its parents' results
from there (`_upstream`). Copies under `<run_root>/iteration-N/*.json` are for people and `temper run`.

Iteration N's warm start is what iteration N−1 hands off (`hand_off`: its OPD student if it became the
champion, else its own warm start), read from partition N of the `policy` asset, which iteration N−1's evaluation
materialises (creating partition N). The graph draws the hand-off as the partition dependency policy[N] →
env_specs[N], warm_start[N]; evaluation[N−1] → policy[N] is not an edge of the graph (Dagster refuses cycles of
asset keys, and a dynamic partition cannot depend on an earlier one of itself), so policy[N]'s materialisation
names it (`source_partition`, and `source_run`: a link to the run that recorded it). It is also `parent_checkpoint`
metadata and the `warm_start` MLflow run's `parent_checkpoint` parameter.
"""


import ast
import base64
import hashlib
import inspect
import json
import sys
from contextvars import ContextVar
from pathlib import Path

import dagster as dg

from stages.inputs import checkpoint_identity

from .keys import POLICY_KEY, record_root
from .launch import refuse_in_run
from .memo import AssetMemo
from .resources import RolloutBackend, SandboxResource, StageRunner, TemperResource, TrainerBackend

ITERATIONS = dg.DynamicPartitionsDefinition(name="iteration")
# iteration N reads policy[N], what iteration N−1 handed off (see the module docstring)
HANDED_OFF = dg.AssetDep(POLICY_KEY, partition_mapping=dg.IdentityPartitionMapping())
# a retried long step resumes from its last checkpoint; exponential backoff with jitter spaces the attempts
LONG_STEP_RETRY = dg.RetryPolicy(max_retries=2, delay=2, backoff=dg.Backoff.EXPONENTIAL, jitter=dg.Jitter.PLUS_MINUS)
OWNERS = ["team:post-training"]
_STAGES = Path(__file__).parents[1] / "stages"  # one module per stage or group of stages


def _code_version(fn, stage: str | None) -> str:
    """A hash of the asset body and of the stage function it runs: the UI flags a partition materialised by
    older code."""
    text = inspect.getsource(fn)
    if stage:
        fns = (f for m in sorted(_STAGES.glob("*.py")) for f in ast.parse(m.read_text()).body)
        text += next(ast.unparse(f) for f in fns if isinstance(f, ast.FunctionDef) and f.name == stage)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _asset(*, stage: str | None, kinds: tuple[str, ...] = (), **kw):
    """`dg.asset` on the iteration partitions, with owners, kinds and a code version."""
    def wrap(fn):
        return dg.asset(partitions_def=ITERATIONS, group_name="iteration", owners=OWNERS, kinds={"python", *kinds},
                        code_version=_code_version(fn, stage), **kw)(fn)
    return wrap


def _memo(context, temper: TemperResource, asset: str, work: tuple[str, ...] = (), sandbox: SandboxResource | None = None,
          **extra) -> AssetMemo:
    """The asset's result record in the run directory (`assets/memo.py`): `cached()` is the result to reuse when its
    inputs (the config the stage reads, with `sandbox`'s choice; the parents' data versions; the code version;
    `extra`) are unchanged, else None, with `work` (paths under the iteration directory) cleared if they changed.
    `save(out)` writes the result copy for people and `temper run`'s summary (downstream assets read results from
    the materialisation metadata, not from these files) and the record that makes it reusable."""
    import configs

    cfg = configs.load(temper.preset_name, temper.all_overrides() + (sandbox.overrides() if sandbox else []))
    memo = AssetMemo(context, temper.dir(context.partition_key), asset, cfg, work, **extra)
    _INPUT_KEY.set(memo.key)  # the stage's MLflow run is the one of these inputs (`_stage`, `_track`)
    return memo


# the input key of the asset computing now: a stage recomputed on changed inputs logs into a new MLflow run (a run's
# params cannot change), a retry or repair on the same inputs into the same one (`Tracker.stage_run`)
_INPUT_KEY: ContextVar[str | None] = ContextVar("temper_input_key", default=None)


def _meta(out: dict) -> dict:
    skip = {"curves", "reward_curve", "reverse_kl"}
    return {k: (dg.MetadataValue.json(v) if isinstance(v, dict | list) else v) for k, v in out.items()
            if v is not None and k not in skip}


def _stage(context, pipes: StageRunner, temper: TemperResource, sandbox: SandboxResource,
           trainer: TrainerBackend, stage: str, materialize: bool = True, mlflow_stage: str | None = None, **kwargs):
    """Run `stages.<stage>` in a Pipes subprocess. Returns (result, Pipes materialisation): the result
    comes back as a Pipes message, and with `materialize` the child also reports the asset's materialisation
    (the result as `result` JSON metadata, beside its scalar fields)."""
    it = _partition(context)
    tr = temper.tracker()  # the child logs its training curves into the stage's MLflow run as it trains
    live = {"uri": tr.uri, "run_id": tr.stage_run(_iteration_run(temper, it), it, mlflow_stage or stage,
                                                  key=_INPUT_KEY.get())}
    inv = pipes.run(context, stage, [sys.executable, "-m", "stages.step", stage], trainer.env(),
                    {"stage": stage, "preset": temper.preset_name, "overrides": temper.all_overrides() + sandbox.overrides(),
                     "kwargs": kwargs, "materialize": materialize, "mlflow": live}, temper.root())
    msgs = [m for m in inv.get_custom_messages() if isinstance(m, dict) and m.get("stage") == stage]
    if not msgs:
        raise dg.Failure(f"stage {stage} ended without reporting its result through Pipes")
    return msgs[-1]["result"], (inv.get_materialize_result() if materialize else None)


def _upstream(context, name: str) -> dict:
    """The result of asset `name` for this iteration, from its latest materialisation's `result` metadata."""
    it = _partition(context)
    res = context.instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(name), asset_partitions=[it]), limit=1)
    if not res.records or "result" not in res.records[0].asset_materialization.metadata:
        raise dg.Failure(f"{name} has no materialisation for iteration {it}: materialise it first")
    return res.records[0].asset_materialization.metadata["result"].value


def _materialize(pipes_result: dg.MaterializeResult | None, out: dict, meta: dict,
                 memo: AssetMemo | None = None) -> dg.MaterializeResult:
    """The asset's materialisation: what the child reported through Pipes (or, for in-process assets and reused
    results, the same fields built here), plus the parent's MLflow link and plot, whether the result was reused
    (`memo`), and the result's identity as the data version."""
    if pipes_result is None:
        from stages.step import materialization_metadata

        pipes_meta = {k: _raw(v) for k, v in materialization_metadata(json.loads(json.dumps(out, default=str))).items()}
    else:
        pipes_meta = dict(pipes_result.metadata or {})
    return dg.MaterializeResult(metadata={**_meta(out), **pipes_meta, **meta, **(memo.meta() if memo else {})},
                                data_version=memo.data_version() if memo else None)


def _raw(v: dict):
    t, x = v["type"], v["raw_value"]
    return {"json": dg.MetadataValue.json, "path": dg.MetadataValue.path, "text": dg.MetadataValue.text}.get(t, lambda y: y)(x)


def _iteration_run(temper: TemperResource, iteration: str) -> str:
    """The iteration's MLflow run, tagged with the Dagster run and partition, the git commit, the preset and
    overrides, with the resolved config logged as `config/config.json`."""
    from store.tracking import git_commit

    ctx = dg.AssetExecutionContext.get()
    tags = {"dagster_run_id": ctx.run.run_id if ctx else "", "dagster_partition": iteration,
            "mlflow.source.git.commit": git_commit(), "preset": temper.preset_name,
            "overrides": ",".join(temper.all_overrides())[:4000]}
    tr = temper.tracker()
    if ctx is not None and ctx.run.tags.get("temper/mlflow_uri") != tr.uri:  # where a run-failure sensor looks
        ctx.instance.add_run_tags(ctx.run.run_id, {"temper/mlflow_uri": tr.uri})
    return tr.iteration_run(iteration, tags=tags, config=temper.config().model_dump(mode="json"))


def _track(temper: TemperResource, iteration: str, stage: str, out: dict, metrics: dict | None = None,
           params: dict | None = None, bars: dict[str, dict[str, float]] | None = None, live: bool = False) -> dict:
    """Log the stage into its nested MLflow run; return metadata (run link, plot) for the materialisation. With
    `live`, the child already logged its curves step by step as it trained: only the plot is made from them. A stage
    that ran episodes logs its crashed share, overall and per family, from its `crashes` report."""
    from rollout.crashes import crash_metrics

    metrics = {**(metrics or {}), **crash_metrics(out.get("crashes"))}
    tr = temper.tracker()
    run = tr.stage_run(_iteration_run(temper, iteration), iteration, stage, key=_INPUT_KEY.get())
    curves = out.get("curves") or {}
    tr.log(run, metrics={k: v for k, v in (metrics or {}).items() if v is not None}, params=params,
           steps=None if live else curves)
    meta = {"mlflow_run": dg.MetadataValue.url(temper.run_url(tr, run)) if temper.mlflow_ui
            else dg.MetadataValue.text(tr.run_link(run))}
    png = tr.log_plot(run, f"iteration {iteration} · {stage}", curves, temper.dir(iteration) / "plots" / f"{stage}.png",
                      bars=bars)
    if png is not None:
        meta["plot"] = dg.MetadataValue.md(f"![{stage}](data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()})")
        meta["plot_path"] = dg.MetadataValue.path(str(png))
    tr.finish(run)  # the stage is done: its run is not left RUNNING in the MLflow UI
    return meta


def _partition(context) -> str:
    return context.run.tags.get("dagster/partition") or context.partition_key


@_asset(stage="env_specs", deps=[HANDED_OFF], retry_policy=LONG_STEP_RETRY,
        description="Task specs generated from the patterns: the fixed held-out ladder, validation, and the RL set whose "
                    "pattern mix the frontier curriculum chooses from samples of the policy this iteration starts from")
def env_specs(context: dg.AssetExecutionContext, temper: TemperResource, pipes: StageRunner,
              sandbox: SandboxResource, trainer: TrainerBackend) -> dg.MaterializeResult:
    it = context.partition_key
    refuse_in_run(context, temper.root())  # a bad partition key, or no iteration N−1 here: fails now, once
    d = temper.dir(it)
    cfg = temper.config()
    parent, why = (None, "none")
    if cfg.envs.curriculum.enabled:  # the curriculum reads the policy iteration N−1 hands off (the `policy` asset)
        parent, why = _handed_off(context, it, cfg.hand_off, temper.root())
    memo = _memo(context, temper, "env_specs", ("envs",), sandbox, parent=parent,
                 parent_checksum=checkpoint_identity(parent))
    if (hit := memo.cached()) is not None:
        return _materialize(None, hit, _curriculum_meta(hit), memo)
    out, reported = _stage(context, pipes, temper, sandbox, trainer, "env_specs", out=str(d / "envs"),
                           iteration=int(it), parent_checkpoint=parent)
    memo.save(out)
    meta = _track(temper, it, "env_specs", out, {"n_train": out["n_train"], "n_eval": out["n_eval"], "n_rl": out["n_rl"]},
                  {"train_dir": out["train"], "eval_dir": out["eval"],
                   "curriculum_policy": (out.get("curriculum") or {}).get("policy", "none")},
                  bars={"specs per family": out["families"] or out.get("rl_families", {}),
                        **({"RL tasks per pattern": out["curriculum"]["mix"]} if out.get("curriculum") else {})})
    sets = {"held_out": (out["eval_sha256"], out["eval"], "evaluation")}
    if out.get("rl"):
        sets["rl"] = (out["rl_sha256"], out["rl"], "training")
    if out.get("train"):
        sets["sft"] = (out["sha256"], out["train"], "training")
    temper.tracker().log_datasets(_iteration_run(temper, it), {f"iteration-{it}-{k}": v for k, v in sets.items()})
    return _materialize(reported, out, {**meta, **_curriculum_meta(out),
                                        "curriculum_from": why if parent else "the shipped base (iteration 1)"}, memo)


def _curriculum_meta(out: dict) -> dict:
    """The curriculum's choice as a table: per pattern, the tasks it got, why, and the probe's figures."""
    cur = out.get("curriculum")
    if not cur:
        return {}
    rows = "\n".join(f"| `{p}` | {c['tasks']} | {c['choice']} | {c['expected_signal']:.3f} | "
                     f"{cur['figures'][p]['sampled']:.2f} | {cur['figures'][p]['mixed']:.2f} | {c['why']} |"
                     for p, c in cur["choice"].items())
    return {"curriculum": dg.MetadataValue.md("| pattern | RL tasks | choice | expected signal | sampled success | "
                                              "mixed | why |\n|---|---|---|---|---|---|---|\n" + rows)}


@_asset(stage="verified_envs", kinds=("bubblewrap",), deps=[env_specs], retry_policy=LONG_STEP_RETRY,
          description="Specs that passed the solvability judge, the triad and the hack probes (in the sandbox)")
def verified_envs(context: dg.AssetExecutionContext, temper: TemperResource, pipes: StageRunner,
                  sandbox: SandboxResource, trainer: TrainerBackend) -> dg.MaterializeResult:
    it = context.partition_key
    d = temper.dir(it)
    specs = _upstream(context, "env_specs")
    memo = _memo(context, temper, "verified_envs", ("verified",), sandbox)
    if (hit := memo.cached()) is not None:
        return _materialize(None, hit, {}, memo)
    out, reported = _stage(context, pipes, temper, sandbox, trainer, "verified_envs", specs=specs,
                           out=str(d / "verified"))
    memo.save(out)
    meta = _track(temper, it, "verified_envs", out, {"accepted": out["accepted"], "triad_pass_rate": out["triad_pass_rate"],
                                                     "accepted_probe_hits": out["accepted_probe_hits"],
                                                     **{k: v for k, v in out.items() if k.startswith("accepted_")}},
                  bars={"admitted share per family": {f: a["accepted"] / max(1, a["total"])
                                                      for f, a in out["acceptance"].items()}})
    return _materialize(reported, out, meta, memo)


@dg.asset_check(asset=verified_envs, partitions_def=ITERATIONS, blocking=True,
                description="Enough environments pass the verifier triad")
def triad_pass_rate(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
    out = _upstream(context, "verified_envs")
    ok = out["triad_pass_rate"] >= 0.5 and out["accepted"] > 0
    return dg.AssetCheckResult(passed=ok, metadata={"triad_pass_rate": out["triad_pass_rate"], "accepted": out["accepted"]})


@dg.asset_check(asset=verified_envs, partitions_def=ITERATIONS, blocking=True,
                description="No admitted environment rewards a hack probe")
def hack_probes(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
    out = _upstream(context, "verified_envs")
    return dg.AssetCheckResult(passed=out["accepted_probe_hits"] == 0,
                               metadata={"accepted_probe_hits": out["accepted_probe_hits"]})


def _handed_off(context: dg.AssetExecutionContext, iteration: str, rule: str, run_root: Path
                ) -> tuple[str | None, str]:
    """What iteration N−1 of this run root hands to this iteration, read from the `policy` asset (evaluation records
    each iteration's student, its warm start and whether it became the champion there, so the graph shows the
    N−1 → N edge: evaluation ⇢ policy → warm_start), chosen by the `hand_off` rule (`stages.hand_off`). A run root
    keeps its own lineage: the instance's iterations are shared by every run root, and another root's iteration
    N−1 (another preset, say) is never this one's parent."""
    import stages

    prev = str(int(iteration) - 1)
    if int(prev) < 1:
        return None, "none"
    res = context.instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=POLICY_KEY), limit=1000)
    elsewhere = set()
    for rec in res.records:  # newest first: a repaired iteration's latest student wins
        meta = rec.asset_materialization.metadata
        if meta.get("iteration") is None or str(meta["iteration"].value) != prev:
            continue
        root = record_root(meta)
        if root is not None and root.resolve() != run_root.resolve():
            elsewhere.add(str(root))
            continue
        student = meta["checkpoint"].value
        ws = meta["warm_start"].value if "warm_start" in meta else student  # records from before the rule
        better = bool(meta["better"].value) if "better" in meta else False  # records from before the rule
        return stages.hand_off(rule, student, ws, bool(meta["champion"].value), better)
    if elsewhere:
        raise dg.Failure(f"iteration {iteration} in run root {run_root} starts from what iteration {prev} of that run "
                         f"root hands off, but iteration {prev} ran in {', '.join(sorted(elsewhere))} only: each run "
                         "root keeps its own lineage; start this one at iteration 1 (`temper run --run-root "
                         f"{run_root} --iteration 1`), or keep to the run root iteration {prev} used",
                         allow_retries=False)  # a launch error, not a fault: retrying cannot help
    raise dg.Failure(f"iteration {iteration} starts from what iteration {prev} hands off, which is not materialised "
                     f"(no `policy` record for iteration {prev}: run iteration {prev} to its evaluation first)",
                     allow_retries=False)


def _domain_metrics(prefix: str, domains: dict) -> dict:
    return {f"{prefix}_{k}": v for k, v in domains.items()}


@_asset(stage="warm_start", kinds=("pytorch",), deps=[verified_envs, HANDED_OFF], retry_policy=LONG_STEP_RETRY,
          description="The policy this iteration starts from: the base (iteration 1) or what iteration N−1 "
                      "hands off (`hand_off`: the champion by default)")
def warm_start(context: dg.AssetExecutionContext, temper: TemperResource, pipes: StageRunner,
               sandbox: SandboxResource, trainer: TrainerBackend) -> dg.MaterializeResult:
    it = context.partition_key
    d = temper.dir(it)
    parent, why = _handed_off(context, it, temper.config().hand_off, temper.root())
    if parent:
        context.log.info(f"warm start: iteration {int(it) - 1} hands off {why}: {parent}")
    envs = _upstream(context, "verified_envs")
    memo = _memo(context, temper, "warm_start", ("warm_start",), sandbox, parent=parent,
                 parent_checksum=checkpoint_identity(parent))
    if (hit := memo.cached()) is not None:
        return _materialize(None, hit, {"parent_checkpoint": parent or "none",
                                        "hand_off": why if parent else "none (iteration 1)"}, memo)
    out, reported = _stage(context, pipes, temper, sandbox, trainer, "warm_start",
                           envs=envs, out=str(d / "warm_start"), parent_checkpoint=parent)
    memo.save(out)
    meta = _track(temper, it, "warm_start", out, {"sft_steps": out["sft_steps"]},
                  {"checkpoint": out["checkpoint"], "parent_checkpoint": parent or "none", "source": out["source"]},
                  live=True)
    where = {"base": f"none (the shipped base {out['checkpoint']})", "sft": "none (SFT from scratch)"}
    return _materialize(reported, out, {**meta, "parent_checkpoint": parent or where[out["source"]],
                                          "hand_off": why if parent else "none (iteration 1)"}, memo)


@_asset(stage="rollout_batches", kinds=("pytorch", "duckdb"), deps=[warm_start, verified_envs], pool="duckdb_writer",
          retry_policy=LONG_STEP_RETRY, description="One rollout per verified environment, in the DuckDB trajectory store")
def rollout_batches(context: dg.AssetExecutionContext, temper: TemperResource, pipes: StageRunner,
                    sandbox: SandboxResource, trainer: TrainerBackend, rollout: RolloutBackend) -> dg.MaterializeResult:
    it = context.partition_key
    cfg = temper.config()
    ws = _upstream(context, "warm_start")["checkpoint"]
    envs = _upstream(context, "verified_envs")
    memo = _memo(context, temper, "rollout_batches", (), sandbox, rollout=rollout.kind)
    if (hit := memo.cached()) is not None:
        return _materialize(None, hit, {}, memo)
    with rollout.serving(cfg, ws) as (urls, router_url):  # rollouts stored under other inputs' key are not resumed
        out, reported = _stage(context, pipes, temper, sandbox, trainer, "rollout_batches",
                               checkpoint=ws, envs=envs, inputs_key=memo.key,
                               store_path=str(temper.store_path()), iteration=int(it), urls=urls, router_url=router_url)
    memo.save(out)
    meta = _track(temper, it, "rollout_batches", out, {"trajectories": out["trajectories"], "tokens": out["tokens"],
                                                       "mean_reward": out["mean_reward"]},
                  {"backend": rollout.kind, "store": out["store"]},
                  bars={"mean reward per family": out["family_reward"]})
    return _materialize(reported, out, meta, memo)


@_asset(stage="rewards", kinds=("duckdb",), deps=[rollout_batches, verified_envs], pool="duckdb_writer",
          description="Verifier rewards of the rollouts, per domain, family and status, read from the DuckDB store")
def rewards(context: dg.AssetExecutionContext, temper: TemperResource) -> dg.MaterializeResult:
    import stages

    it = context.partition_key
    # the store is opened under the writer pool: DuckDB refuses a reader while another process writes
    envs = _upstream(context, "verified_envs")
    memo = _memo(context, temper, "rewards")
    if (hit := memo.cached()) is not None:
        return _materialize(None, hit, {}, memo)
    out = stages.rewards(temper.store_path(), int(it), _upstream(context, "rollout_batches").get("trajectory_ids"),
                         rl_set_dir=stages.rl_set(envs), mine_every=temper.config().envs.mine_every)
    if out["quarantined"]:
        context.log.warning(f"quarantined {len(out['quarantined'])} environment(s) the miner flagged: "
                            f"{out['miner_flags']}")
    memo.save(out)
    flat = {k: v for k, v in out.items() if isinstance(v, int | float)}
    flat.update({f"{dom}_mean_reward": v for dom, v in out["domain_reward"].items()})
    fams = out.get("by_family", {})
    meta = _track(temper, it, "rewards", out, flat,
                  bars={"mean reward per family": {f: v["mean_reward"] for f, v in fams.items()},
                        "trajectories per family": {f: v["trajectories"] for f, v in fams.items()}})
    return _materialize(None, out, meta, memo)


@_asset(stage="sao_expert", kinds=("pytorch", "duckdb"), deps=[rewards, warm_start, verified_envs],
          retry_policy=LONG_STEP_RETRY, pool="duckdb_writer",
          description="One SAO-trained expert per domain, each from the warm start; its critic and first step "
                      "read the domain's scored rollouts back from the store")
def sao_experts(context: dg.AssetExecutionContext, temper: TemperResource, pipes: StageRunner,
                sandbox: SandboxResource, trainer: TrainerBackend, rollout: RolloutBackend) -> dg.MaterializeResult:
    import stages

    it = context.partition_key
    d = temper.dir(it)
    envs, ws = _upstream(context, "verified_envs"), _upstream(context, "warm_start")["checkpoint"]
    rew = _upstream(context, "rewards")
    scored, quarantined = rew.get("domains", {}), rew.get("quarantined", [])
    memo = _memo(context, temper, "sao_experts", ("experts",), sandbox, rollout=rollout.kind)
    if (hit := memo.cached()) is not None:
        return _materialize(None, hit, _experts_meta(hit), memo)
    out, meta = {}, {}
    for dom in envs["domains"]:  # one expert per domain that has admitted environments
        res = d / "experts" / dom / "result.json"
        if res.exists():  # finished by an earlier attempt on the same inputs (else cleared): its MLflow run is complete
            context.log.info(f"{dom} expert: kept from an earlier attempt on the same inputs ({res})")
            out[dom] = json.loads(res.read_text())
            continue
        with rollout.stage_serving(temper.config(), ws) as (urls, router_url):
            out[dom], _ = _stage(context, pipes, temper, sandbox, trainer, "sao_expert", materialize=False,
                                 mlflow_stage=f"sao_expert_{dom}",
                                 checkpoint=ws, envs=envs, domain=dom, out=str(d / "experts" / dom),
                                 domain_reward=scored.get(dom, {}).get("mean_reward"),
                                 warm_rollouts=scored.get(dom, {}).get("ids"),
                                 replay_rollouts=stages.replay_ids(scored, dom),
                                 quarantine=quarantined,
                                 urls=urls, router_url=router_url, store_path=str(temper.store_path()),
                                 iteration=int(it))
        res.parent.mkdir(parents=True, exist_ok=True)
        tmp = res.with_suffix(".tmp")  # a retry of the asset keeps the finished experts
        tmp.write_text(json.dumps(out[dom], indent=1))
        tmp.replace(res)
        m = _track(temper, it, f"sao_expert_{dom}", out[dom], {"steps": out[dom]["steps"]},
                   {"checkpoint": out[dom]["checkpoint"], "init": ws, "skipped": out[dom].get("skipped") or "no"},
                   live=True)
        if out[dom].get("skipped"):
            context.log.warning(f"no {dom} expert this iteration: {out[dom]['skipped']}")
        meta.update({f"{dom}_{k}": v for k, v in m.items()})
    memo.save(out)
    return _materialize(None, out, {**_experts_meta(out), **meta}, memo)


def _experts_meta(out: dict) -> dict:
    return {**{f"{k}_checkpoint": dg.MetadataValue.path(v["checkpoint"]) for k, v in out.items()},
            **{f"{k}_steps": v["steps"] for k, v in out.items()},
            **{f"{k}_resumed_from_step": v.get("resumed_from_step", 0) for k, v in out.items()},
            **{f"{k}_skipped": v["skipped"] for k, v in out.items() if v.get("skipped")},
            **{f"{k}_updates": v.get("updates", 0) for k, v in out.items()},
            **{f"{k}_crashed_share": v["crashed_share"] for k, v in out.items() if "crashed_share" in v}}


@_asset(stage="opd_student", kinds=("pytorch", "duckdb"), deps=[sao_experts, warm_start, verified_envs],
          retry_policy=LONG_STEP_RETRY, pool="duckdb_writer",
          description="The student distilled from the domain experts by multi-teacher on-policy distillation")
def opd_student(context: dg.AssetExecutionContext, temper: TemperResource, pipes: StageRunner,
                sandbox: SandboxResource, trainer: TrainerBackend, rollout: RolloutBackend) -> dg.MaterializeResult:
    it = context.partition_key
    d = temper.dir(it)
    sao = _upstream(context, "sao_experts")
    experts = {k: v["checkpoint"] for k, v in sao.items() if v.get("steps", 0) > 0}
    quarantine = sorted({q for v in sao.values() for q in v.get("quarantined", [])})  # what the miner flagged
    ws = _upstream(context, "warm_start")["checkpoint"]
    envs = _upstream(context, "verified_envs")
    memo = _memo(context, temper, "opd_student", ("student",), sandbox, rollout=rollout.kind)
    if (hit := memo.cached()) is not None:
        return _materialize(None, hit, {}, memo)
    with rollout.stage_serving(temper.config(), ws) as (urls, router_url), \
            rollout.teacher_serving(temper.config(), ws) as teacher_urls:  # the teachers' own servers
        out, reported = _stage(context, pipes, temper, sandbox, trainer, "opd_student",
                               init=ws, experts=experts, envs=envs,
                               out=str(d / "student"), urls=urls, router_url=router_url,
                               store_path=str(temper.store_path()), iteration=int(it),
                               teacher_urls=teacher_urls if experts else None, quarantine=quarantine)
    memo.save(out)
    out["curves"] = {"reverse_kl": out["reverse_kl"]}
    gate = out.get("gate") or {}
    meta = _track(temper, it, "opd_student", out,
                  {"steps": out["steps"], **{f"gate_{d}_{w}": g[w] for d, g in gate.items() for w in ("expert", "warm_start")}},
                  {"checkpoint": out["checkpoint"], "student_init": out.get("init", "warm_start"),
                   **{f"teacher_{k}": v for k, v in out.get("teachers", {}).items()},
                   **{f"teacher_{k}": f"warm start {ws}" for k in out.get("anchored", [])}}, live=True)
    left_out = {d: f"{g['expert']:.2f} vs warm start {g['warm_start']:.2f} ({g['gained']} gained / {g['lost']} lost "
                   f"of {g['n']} validation tasks)" for d, g in gate.items() if not g["teaches"]}
    return _materialize(reported, out, {**meta, "teachers": ", ".join(sorted(out.get("teachers", {}))) or "none",
                                        "anchored_to_warm_start": ", ".join(out.get("anchored", [])) or "none",
                                        "teachers_left_out": dg.MetadataValue.json(left_out) if left_out else "none"},
                        memo)


@_asset(stage="evaluation", kinds=("pytorch", "mlflow"),
        deps=[opd_student, sao_experts, warm_start, verified_envs], retry_policy=LONG_STEP_RETRY, pool="duckdb_writer",
          description="Held-out pass@1 of the student vs the warm start; MLflow run; champion alias")
def evaluation(context: dg.AssetExecutionContext, temper: TemperResource, pipes: StageRunner,
               sandbox: SandboxResource, trainer: TrainerBackend, rollout: RolloutBackend) -> dg.MaterializeResult:
    import stages
    from stages.decision import warm_rewards_from_gate

    it = context.partition_key
    d = temper.dir(it)
    experts = _upstream(context, "sao_experts")
    ws = _upstream(context, "warm_start")["checkpoint"]
    memo = _memo(context, temper, "evaluation", ("eval",), sandbox, rollout=rollout.kind)
    if (hit := memo.cached()) is not None:  # registered, and handed off (`policy`), when it was computed
        return _materialize(None, hit, {}, memo)
    with rollout.stage_serving(temper.config(), ws) as (urls, router_url):
        out, reported = _stage(context, pipes, temper, sandbox, trainer, "evaluation",
                               student=_upstream(context, "opd_student")["checkpoint"], baseline=ws,
                               envs=_upstream(context, "verified_envs"),
                               experts={k: v["checkpoint"] for k, v in experts.items() if v.get("steps", 0) > 0},
                               taught=stages.taught_domains(_upstream(context, "opd_student")),
                               warm_val=warm_rewards_from_gate(_upstream(context, "opd_student"), ws),
                               urls=urls, router_url=router_url, store_path=str(temper.store_path()),
                               out=str(d / "eval"), iteration=int(it))
    st = out["stats"]
    ci = {f"{w}_{g}_ci{e}": v[w]["ci95"][i] for g, v in st.items() for w in ("before", "after")
          for i, e in ((0, "lo"), (1, "hi"))}
    flips = {f"{k}_{g}": v["test"][k] for g, v in st.items() for k in ("gained", "lost", "p_value")}
    meta = _track(temper, it, "evaluation", out, {"pass_at_1_before": out["pass@1_before"],
                                                  "pass_at_1_after": out["pass@1_after"],
                                                  **_domain_metrics("before", out["domain_before"]),
                                                  **_domain_metrics("after", out["domain_after"]), **ci, **flips},
                  bars={"warm start": out["domain_before"], "student": out["domain_after"],
                        "experts (own domain)": out["domain_teacher"]})
    tr = temper.tracker()
    run = _iteration_run(temper, it)
    curves = {f"{dom}_reward": e.get("reward_curve", []) for dom, e in experts.items()}
    tr.log(run, metrics={"pass_at_1_before": out["pass@1_before"], "pass_at_1_after": out["pass@1_after"]})
    tr.client.set_tag(run, "student", out["student"])  # a tag: `temper run --iteration N -o ...` may change it
    tr.log_plot(run, f"iteration {it} · SAO reward per expert", curves, d / "plots" / "reward_curves.png")
    # the decision reads the validation set, never the held-out one (stages/decision.py)
    dec = out["decision"]
    # the student and each expert as MLflow LoggedModels: held-out pass@1 (with its 95% bounds) and the last training
    # value, each tied to its dataset; the models come from their stage runs
    from store.tracking import pass_at_1_metrics

    envs, last = _upstream(context, "verified_envs"), lambda v: (v or [None])[-1]
    sets = {(held := f"iteration-{it}-held_out"): (envs["eval"], "evaluation"),
            (rl := f"iteration-{it}-rl_verified"): (stages.rl_set(envs), "training")}
    for dom, s in out["teacher_stats"].items():
        tr.log_model(f"temper-expert-{dom}", tr.stage_run(run, it, f"sao_expert_{dom}"), experts[dom]["checkpoint"],
                     copy=False, datasets=sets, metrics={held: pass_at_1_metrics({dom: s}),
                                                         rl: {"train_reward_final": last(experts[dom].get("reward_curve"))}})
    reg = tr.register_student("temper-student", run, out["student"],
                              dec["pass@1_after"] if dec["set"] else out["pass@1_after"],
                              significant=dec["significant"], p_value=dec["p_value"],
                              model_run_id=tr.stage_run(run, it, "opd_student"), datasets=sets,
                              metrics={held: pass_at_1_metrics({g: v["after"] for g, v in st.items()}),
                                       rl: {"train_reverse_kl_final": last(_upstream(context, "opd_student").get("reverse_kl"))}})
    tr.finish(run)
    out.update(registered=reg)
    _hand_off_record(context, temper, it, out, ws, reg)
    memo.save(out)  # reusable once handed off
    table = ("| group | warm start | 95% CI | student | 95% CI | gained | lost | p (McNemar) |\n"
             "|---|---|---|---|---|---|---|---|\n")
    table += "\n".join(f"| {g} | {v['before']['pass@1']:.3f} | [{v['before']['ci95'][0]:.2f}, {v['before']['ci95'][1]:.2f}] | "
                       f"{v['after']['pass@1']:.3f} | [{v['after']['ci95'][0]:.2f}, {v['after']['ci95'][1]:.2f}] | "
                       f"{v['test']['gained']} | {v['test']['lost']} | {v['test']['p_value']:.4f} |" for g, v in st.items())
    return _materialize(reported, out, {**meta, "paired_comparison": dg.MetadataValue.md(table),
                                          "champion_moved": reg["champion_moved"], "champion_reason": reg["reason"],
                                          "registered_model_uri": dg.MetadataValue.text(reg["model_uri"]),
                                          "logged_model_id": reg["model_id"],
                                          "mlflow_iteration_run": dg.MetadataValue.text(tr.run_link(run))}, memo)


def _hand_off_record(context, temper: TemperResource, it: str, out: dict, ws: str, reg: dict) -> None:
    """Materialise policy[N+1] (creating partition N+1): what iteration N hands to iteration N+1, whose warm start
    picks the student or N's warm start by its `hand_off` rule. `iteration` is N, the iteration that produced it."""
    import stages

    nxt = str(int(it) + 1)
    if not context.instance.has_dynamic_partition(ITERATIONS.name, nxt):
        context.instance.add_dynamic_partitions(ITERATIONS.name, [nxt])
    student, warm = str(Path(out["student"]).resolve()), str(Path(ws).resolve())
    rule = temper.config().hand_off
    better = bool(out["decision"].get("better"))
    chosen, why = stages.hand_off(rule, student, warm, bool(reg["champion_moved"]), better)
    context.log_event(dg.AssetMaterialization(POLICY_KEY, partition=nxt, description=(
        f"what iteration {it} hands to iteration {nxt}: {why}"), metadata={
        "iteration": int(it), "for_iteration": int(nxt),
        "checkpoint": dg.MetadataValue.path(student),  # the student (`_handed_off` applies the reader's rule)
        "warm_start": dg.MetadataValue.path(warm),
        "handed_off": dg.MetadataValue.path(str(chosen)), "hand_off": why, "hand_off_rule": rule,
        "run_root": dg.MetadataValue.path(str(temper.root())),  # the lineage it belongs to (see `_handed_off`)
        "source_partition": dg.MetadataValue.text(f"evaluation[{it}]"),
        "source_run": dg.MetadataValue.dagster_run(context.run_id),
        "pass@1": out["pass@1_after"], "champion": reg["champion_moved"], "better": better,
        "registered_version": reg["version"], "logged_model_id": reg["model_id"]}))


# not computed by a step of its own: evaluation[N] materialises policy[N+1], env_specs[N+1] and warm_start[N+1] read it
POLICY = dg.AssetSpec(POLICY_KEY, group_name="iteration", owners=OWNERS, kinds={"python", "pytorch"},
                      partitions_def=ITERATIONS,
                      code_version=_code_version(evaluation.op.compute_fn.decorated_fn, "evaluation"),
                      description="The policy an iteration starts from: policy[N] is what iteration N−1's evaluation "
                                  "hands off (metadata: iteration N−1, its student `checkpoint`, its `warm_start`, "
                                  "`handed_off` under its `hand_off` rule, champion, run_root, and the evaluation "
                                  "partition and run it came from); iteration N's warm start reads it. Iteration 1 "
                                  "starts from `base.checkpoint` (policy[1] is not materialised).")

ALL_ASSETS = [env_specs, verified_envs, warm_start, rollout_batches, rewards, sao_experts, opd_student, evaluation,
              POLICY]  # + `scaling` (assets/scaling.py), appended in `assets/__init__.py`
ALL_CHECKS = [triad_pass_rate, hack_probes]
