"""The stages of one post-training iteration as plain functions (no Dagster): the assets in `assets/`
call these and record what they return as metadata. Every stage reads and writes files under the
iteration's run directory, so a stage can be re-run (or inspected) on its own.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from rollout.crashes import CrashedShareExceeded, CrashTally

from .recorder import Recorder  # noqa: F401 - the stages' store writer, imported from here


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
                        max_len=cfg.agent.max_context + 8, version=version, name=name)


ITERATION_SEED_STRIDE = 7_919
ROLLOUT_CHUNK = 16  # rollouts stored per write: what a kill of `rollout_batches` can cost
# Within an iteration the warm start is policy version 1 (its checkpoint says so); every trainer counts on from it.
# `rollout_batches` serves it at this version, so SAO's first step sees those rollouts at staleness 0.
WARM_VERSION = 1


def env_specs(cfg, out: Path, iteration: int = 1) -> dict:
    """Generate the iteration's environments: the held-out set (the same every iteration, so iterations compare),
    the RL set and, without a base checkpoint, the SFT set — fresh instances every iteration (seeds offset by
    the iteration), so RL never revisits environments an earlier iteration trained on."""
    from envs.dataset import write_dataset

    from .env_sets import build_sets

    off = ITERATION_SEED_STRIDE * (iteration - 1)
    e = cfg.envs.model_copy(update={"seed": cfg.envs.seed + off, "rl_seed": cfg.envs.rl_seed + off,
                                    "val_seed": cfg.envs.val_seed + off})
    sets = build_sets(e, cfg.base)  # hashed seeds per purpose; held-out disjoint from the base recipe and every set
    skipped = sets["skipped"]
    held = write_dataset(sets["eval"], out / "eval", {"seed": e.eval_seed, "purpose": "held-out",
                                                      "skipped_base_or_repeated": skipped["eval"]})
    res = {"train": None, "eval": str(out / "eval"), "n_train": 0, "n_eval": held["n"], "n_rl": 0,
           "families": {}, "eval_families": held["families"], "eval_sha256": held["sha256"], "skipped": skipped}
    if sets["val"] is not None:  # model selection's own tasks: the same patterns as the held-out set, none of its tasks
        val = write_dataset(sets["val"], out / "val", {"seed": e.val_seed, "purpose": "validation",
                                                       "held_out_removed": skipped["val"]})
        res.update(val=str(out / "val"), n_val=val["n"], val_sha256=val["sha256"])
    if sets["train"] is not None:  # the SFT set (RL's too when there is no RL set); empty sets fail the triad check
        train = write_dataset(sets["train"], out / "train", {"seed": e.seed, "purpose": "sft"})
        res.update(train=str(out / "train"), n_train=train["n"], families=train["families"], sha256=train["sha256"])
    if sets["rl"] is not None:
        rl = write_dataset(sets["rl"], out / "rl", {"seed": e.rl_seed, "purpose": "rl"})
        res.update(rl=str(out / "rl"), n_rl=rl["n"], rl_families=rl["families"], rl_sha256=rl["sha256"])
    return res


def _task_content(spec) -> str:
    from envs.generator import task_content

    return task_content(spec)


def rl_set(envs: dict) -> str:
    """The environments RL trains in: the separate RL set when the preset has one, else the SFT set."""
    return envs.get("rl") or envs["train"]


def verified_envs(cfg, specs: dict, out: Path, log=_quiet) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from envs import make_sandbox
    from envs.dataset import read_dataset, write_dataset
    from envs.gate import GateReport, acceptance, validate

    from .crashes import gate_crash, gate_tally

    sb = make_sandbox(cfg.envs.sandbox)
    sets = [k for k in ("train", "rl") if specs.get(k)]
    every = [(k, s) for k in sets for s in read_dataset(specs[k])]
    # each verdict is kept as it comes, under the spec's content hash and the legs asked: a rerun after a kill
    # (or with the same environments) judges only what is not judged yet
    cache = out / "reports"
    cache.mkdir(parents=True, exist_ok=True)

    def judge(i: int) -> tuple[GateReport, bool]:
        """(the verdict, whether it was kept from an earlier attempt)"""
        spec, probes = every[i][1], cfg.envs.probes and i % cfg.envs.probe_every == 0
        path = cache / f"{spec.spec_hash}-{'probes' if probes else 'triad'}-{sb.name}.json"
        if path.exists():
            try:
                return GateReport(**json.loads(path.read_text())), True
            except (ValueError, TypeError):  # a torn write: judge again
                pass
        rep = validate(spec, sb, probes=probes)
        if gate_crash(rep.to_dict()) is None:  # a crash is the sandbox's, not the spec's: a rerun judges it again
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(rep.to_dict(), default=str))
            tmp.replace(path)
        return rep, False

    with ThreadPoolExecutor(cfg.envs.validate_workers) as pool:  # each validation is sandboxed subprocesses
        judged = list(pool.map(judge, range(len(every))))
    reports, reused = [r for r, _ in judged], sum(kept for _, kept in judged)
    log(f"validated {len(every)} environments: {sum(r.accepted for r in reports)} accepted"
        + (f" ({reused} verdicts kept from an earlier attempt)" if reused else ""))
    res: dict = {"eval": specs["eval"], **({"val": specs["val"]} if specs.get("val") else {})}
    for k in sets:  # the last one is the set RL trains in: its domains get experts
        ok = [s for (kk, s), r in zip(every, reports) if kk == k and r.accepted]
        write_dataset(ok, out / k, {"validated_from": specs[k]})
        res.update({k: str(out / k), f"accepted_{k}": len(ok)})
    _dump(out / "validation.json", [r.to_dict() for r in reports])  # (read it when the crash check below fails)
    crashes = gate_tally([r.to_dict() for r in reports]).check(cfg.loop.max_crashed_share, "verified_envs")
    accepted = sum(r.accepted for r in reports)
    probe_hits = sum(1 for r in reports if r.accepted for p in r.probes.values() if p.get("reward", 0) > 0)
    return {**res, "accepted": accepted, "total": len(every), "sandbox": sb.name, "verdicts_reused": reused,
            "acceptance": acceptance(reports), "triad_pass_rate": accepted / max(1, len(every)),
            "accepted_probe_hits": probe_hits, "probed": sum(1 for r in reports if r.probes),
            "domains": sorted({s.domain for s in ok}), "crashes": crashes, "crashed_share": crashes["share"]}


def resolve_base(path: str) -> Path:
    """A base checkpoint path from the config: absolute, or relative to the repository root."""
    p = Path(path)
    return p if p.is_absolute() else Path(__file__).resolve().parents[1] / p


def check_base(ckpt: Path) -> dict:
    """The card of a shipped base checkpoint, after checking that its weights are the ones the card describes."""
    from trainers.base import CARD_JSON, weights_sha256

    if not (ckpt / "config.json").exists():
        raise FileNotFoundError(f"base.checkpoint: {ckpt} is not an HF-layout checkpoint (no config.json)")
    card_path = ckpt / CARD_JSON
    if not card_path.exists():
        return {}
    card = json.loads(card_path.read_text())
    got = weights_sha256(ckpt)
    if got != card["weights_sha256"]:
        raise ValueError(f"base.checkpoint: {ckpt} weights sha256 {got[:12]}… differ from its card's "
                         f"{card['weights_sha256'][:12]}…")
    return card


def hand_off(rule: str, student: str, warm_start: str, champion_moved: bool) -> tuple[str, str]:
    """The checkpoint iteration N hands to N+1 as its warm start, and why (`hand_off` in the config): under
    "champion", the student only if it became the champion, else N's own warm start; under "student", the
    student."""
    if rule == "student":
        return student, "its student (hand_off: student)"
    if rule != "champion":
        raise ValueError(f"hand_off: {rule!r} is not one of 'champion', 'student'")
    if champion_moved:
        return student, "its student, the new champion"
    return warm_start, ("its warm start: its student did not become the champion (no significant gain), so the "
                        "next iteration retries from the same policy on fresh environments")


def warm_start(cfg, envs: dict, out: Path, parent_checkpoint: str | None, log=_quiet, metrics=_no_metrics,
               train_backend=None) -> dict:
    """The policy this iteration starts from: what iteration N−1 handed off (`hand_off`), else the shipped base checkpoint
    (`base.checkpoint`), else — only when a preset has no base — SFT from scratch for `train.max_steps` steps on
    oracle trajectories (resumable from `out/state`; under torchrun when `trainer.world_size > 1`, every rank
    training on its share of each batch, rank 0 saving)."""
    import torch

    from envs.dataset import read_dataset
    from envs.sandbox import make_sandbox
    from model import ByteTokenizer, Transformer, save_checkpoint
    from trainers.backends import make_train_backend
    from trainers.checkpoint import complete_checkpoints, load_training_state, restore, save_training_state
    from trainers.lm import LMTrainer, train_lm
    from trainers.sft import oracle_trajectories, sft_batches

    if parent_checkpoint:
        _same_model(cfg, parent_checkpoint, "iteration N−1's hand-off")
        log(f"warm start: iteration N−1's hand-off {parent_checkpoint}")
        return {"checkpoint": parent_checkpoint, "parent": parent_checkpoint, "source": "previous iteration",
                "sft_steps": 0, "resumed_from_step": 0}
    if cfg.base.checkpoint:
        ckpt = resolve_base(cfg.base.checkpoint)
        card = check_base(ckpt)
        _same_model(cfg, str(ckpt), "base.checkpoint")
        log(f"warm start: base checkpoint {ckpt} ({card.get('steps', '?')} recipe steps, card pass@1 "
            f"{card.get('eval', {}).get('all', {}).get('pass@1', float('nan')):.2f})")
        return {"checkpoint": str(ckpt), "parent": None, "source": "base", "sft_steps": 0, "resumed_from_step": 0,
                "base_weights_sha256": card.get("weights_sha256"), "base_commit": card.get("commit"),
                "base_card_pass@1": card.get("eval", {}).get("domain")}
    if not envs.get("train"):
        raise ValueError("warm start: no base.checkpoint and no SFT set (envs.n_train is 0)")
    if cfg.trainer.world_size > 1 and train_backend is None:
        return under_torchrun("warm_start", cfg, {"envs": envs, "out": out, "parent_checkpoint": None}, out, log,
                              metrics)
    dp = train_backend or make_train_backend(cfg.trainer)
    tok, sb = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    losses: list[float] = []
    start = 0
    torch.manual_seed(cfg.seed)
    trajs = oracle_trajectories(read_dataset(envs["train"]), tok, sb, cfg.agent)
    log(f"SFT data: {len(trajs)} oracle trajectories, {sum(t.n_trainable for t in trajs):,} trainable tokens")
    model = dp.wrap(Transformer(cfg.model))
    trainer, elapsed = LMTrainer(model, cfg.train, backend=dp), 0.0
    if complete_checkpoints(out / "state"):
        state = restore(load_training_state(out / "state"), model, trainer.opt, backend=dp)
        start = trainer.step_no = state.step
        elapsed, losses = state.extra["elapsed"], list(state.extra["loss"])
        log(f"SFT: resumed from {state.path} (step {start})")
    batches = sft_batches(trajs, cfg.train.batch_size, tok.pad_id, cfg.seed)
    for _ in range(start):  # the data cursor: the batch stream is deterministic given the seed
        next(batches)
    save_every = max(1, cfg.loop.save_every * 20)

    def on_step(st) -> None:
        losses.append(round(st.loss, 5))
        metrics({"sft_loss": losses[-1]}, len(losses) - 1)
        if trainer.step_no % save_every == 0 and (dp.is_main or dp.sharded_state):  # sharded: every rank its part
            save_training_state(out / "state", policy=model, optimizer=trainer.opt, step=trainer.step_no,
                                policy_version=0, data_cursor=trainer.step_no, keep=2,
                                extra={"elapsed": elapsed + st.seconds, "loss": losses}, backend=dp)
            log(f"SFT step {trainer.step_no}/{cfg.train.max_steps}: loss {st.loss:.4f}")

    train_lm(model, batches, cfg.train, on_step, trainer=trainer, elapsed=elapsed)
    final = dp.export(model)  # temper's model (gathered from the shards on a Megatron backend)
    ranks = _rank_checksums(dp, final, "SFT")
    if not dp.is_main:
        return {}
    save_checkpoint(final, out / "checkpoint", policy_version=WARM_VERSION)
    return {**ranks, "checkpoint": str(out / "checkpoint"), "parent": None, "source": "sft",
            "sft_steps": len(losses), "resumed_from_step": start, "curves": {"sft_loss": losses}}


def _same_model(cfg, checkpoint: str, what: str) -> None:
    """Refuse a warm start whose model is not the preset's (another preset's iteration in the same run root, or a
    `base.checkpoint` of another size): the engines, trainers and experts would all be built from the preset's
    `model`."""
    from model import load_config

    have = load_config(checkpoint).model_dump()
    want = cfg.model.model_dump()
    diff = sorted(k for k in want if k != "dtype" and have.get(k) != want[k])
    if diff:
        shown = ", ".join(f"{k}: {have.get(k)!r} there, {want[k]!r} here" for k in diff[:4])
        raise ValueError(f"warm start: {what} {checkpoint} is another model than this preset's ({shown}"
                         f"{', …' if len(diff) > 4 else ''}): run this preset in its own run root (--run-root), or "
                         "use the preset that iteration used")


def _rank_checksums(dp, model, what: str) -> dict:
    """With several trainer ranks: every rank's weights checksum, checked equal (else the stage fails). Every rank
    counts, data-parallel or not: a Megatron rank's `model` is the whole model gathered from the shards."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        return {}
    from model import weights_checksum

    sums: list = [None] * world
    dist.all_gather_object(sums, weights_checksum(model))
    if len(set(sums)) != 1:
        raise RuntimeError(f"{what}: trainer ranks ended with different weights: {sums}")
    return {"trainer_ranks": world, "rank_checksums": sums}


def rollout_batches(cfg, checkpoint: str, envs: dict, store_path: Path, iteration: int, urls: list[str],
                    router_url: str = "", log=_quiet, inputs_key: str = "") -> dict:
    """One rollout per verified environment, generated by the rollout backend at `urls` (embedded servers or
    SGLang workers; `router_url` when a router fronts them) after loading `checkpoint` into every worker."""
    from envs.dataset import read_dataset
    from envs.sandbox import make_sandbox
    from model import ByteTokenizer
    from rollout.agent import Agent, run_episodes
    from rollout.backend import close_policy, load_weights, open_policy
    from store import TrajectoryStore

    tok, sb = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    specs = read_dataset(rl_set(envs))
    # one rollout per environment, under an id fixed by the iteration, the policy's weights and the environment:
    # a rerun after a kill finds what the killed attempt stored (written in chunks as episodes finish) and rolls
    # out only the rest; another warm start or other inputs (`inputs_key`, the asset's) get new ids, never reuse these
    from stages.inputs import input_key
    from trainers.base import weights_sha256

    tag = input_key({"weights": weights_sha256(checkpoint), "inputs": inputs_key})[:12]  # who made a stored rollout
    tid = {s.id: f"rollout-{iteration}-{tag}-{s.id}" for s in specs}
    progress = store_path.parent / f"rollouts-{iteration:04d}.progress.json"
    with TrajectoryStore(store_path) as st:
        stored = st.read(iteration, ids=list(tid.values()))
        done, crashes = {t.trajectory_id for t in stored}, CrashTally(stored)
        todo = [s for s in specs if tid[s.id] not in done]
        if done:
            log(f"resuming: {len(done)} of {len(specs)} rollouts already stored")
        pending: list = []

        def store(t=None, final: bool = False) -> None:
            if t is not None:
                pending.append(t)
            if pending and (final or len(pending) >= ROLLOUT_CHUNK):
                st.write(pending)
                done.update(x.trajectory_id for x in pending)
                crashes.add(pending)  # stored first: a failure below loses nothing
                pending.clear()
                _dump(progress, {"stored": len(done), "total": len(specs)})
                crashes.check(cfg.loop.max_crashed_share, "rollout_batches", planned=len(specs))

        async def go():
            await load_weights(urls, checkpoint, version=WARM_VERSION)
            log(f"loaded {checkpoint} into {len(urls)} worker(s); rolling out {len(todo)} environments")
            # replies from other weights are refused; a worker restarted meanwhile gets the checkpoint again first
            policy = await open_policy(urls, router_url, checkpoint=checkpoint, version=WARM_VERSION)
            try:
                return await run_episodes(Agent(policy, tok, sb, cfg.agent), todo, iteration, cfg.loop.batch_in_flight,
                                          on_done=store, trajectory_ids=[tid[s.id] for s in todo])
            finally:
                await close_policy(policy)

        if todo:
            asyncio.run(go())
        store(final=True)
        trajs = st.read(iteration, ids=list(tid.values()))
        n = len(trajs)
        export = st.export_parquet(iteration, store_path.parent / "parquet")
    lost = CrashTally(trajs).check(cfg.loop.max_crashed_share, "rollout_batches")  # every one, resumed or not
    return {"trajectories": n, "resumed_with": len(specs) - len(todo), "tokens": sum(t.n_tokens for t in trajs),
            "crashes": lost, "crashed_share": lost["share"],
            "store": str(store_path), "parquet": str(export),
            "trajectory_ids": [t.trajectory_id for t in trajs], "policy_version": WARM_VERSION,
            "mean_reward": sum(t.reward for t in trajs) / max(1, len(trajs)), "workers": urls,
            "compactions": sum(max(0, len(t.segments) - 1) for t in trajs),  # per-domain rewards: `rewards`
            "family_reward": {f: sum(t.reward for t in trajs if t.family == f) / sum(1 for t in trajs if t.family == f)
                              for f in sorted({t.family for t in trajs})}}


def rewards(store_path: Path, iteration: int, trajectory_ids: list[str] | None = None, rl_set_dir: str | None = None,
            mine_every: int = 1) -> dict:
    """The verifier rewards of `rollout_batches`' trajectories (`trajectory_ids`; None: all of the iteration's),
    read back from the store: counts and mean reward per family and status, and per domain with the ids that
    SAO reads back (its critic pre-training and first batch).

    With the RL set (`rl_set_dir`), the trajectory miner also runs on every `mine_every`-th rewarded rollout: an
    environment whose reward came with a hack's signature (no essential action, a path outside the workspace,
    test machinery written) is quarantined: listed with its flags, and its rollouts left out of the ids SAO reads
    back; SAO and OPD skip it."""
    from store import TrajectoryStore

    with TrajectoryStore(store_path, read_only=True) as st:
        if trajectory_ids is None:
            trajectory_ids = st.read_arrow(iteration)[0].column("trajectory_id").to_pylist()
        out = st.stats(iteration, ids=trajectory_ids)
        doms = st.domain_rewards(trajectory_ids, iteration)
        rewarded = ([t for t in st.read(iteration, ids=trajectory_ids) if t.reward > 0 and t.status == "completed"]
                    if rl_set_dir else [])
    flagged: dict[str, list[str]] = {}
    if rl_set_dir:
        from envs.dataset import read_dataset
        from envs.gate import mine

        specs = {s.id: s for s in read_dataset(rl_set_dir)}
        # environment order (ids are random, the store's order is the finish order): the same rollouts are sampled
        sample = sorted(rewarded, key=lambda t: (t.env_id, t.trajectory_id))[::max(1, mine_every)]
        for t in sample:
            spec = specs.get(t.env_id)
            flags = mine(spec, trajectory_actions(t), t.reward) if spec is not None else ["environment not in the RL set"]
            if flags:
                flagged.setdefault(t.env_id, []).extend(f for f in flags if f not in flagged.get(t.env_id, []))
        out["mined"] = len(sample)
    quarantined = sorted(flagged)
    if quarantined:
        with TrajectoryStore(store_path, read_only=True) as st:
            drop = {t.trajectory_id for t in st.read(iteration, ids=trajectory_ids) if t.env_id in flagged}
        for d in doms.values():
            d["ids"] = [i for i in d["ids"] if i not in drop]
    out["domains"] = doms
    out["domain_reward"] = {d: v["mean_reward"] for d, v in doms.items()}
    out["quarantined"] = quarantined
    out["miner_flags"] = flagged
    return out


def trajectory_actions(t) -> list:
    """The tool calls of a stored trajectory: each run of generated tokens, decoded and parsed (calls that do not
    parse are left out: the environment refused them too)."""
    from envs.actions import Action, parse_action
    from model import ByteTokenizer

    tok = ByteTokenizer()
    acts = []
    for seg in t.segments:
        run: list[int] = []
        for tid, trainable in [*zip(seg.tokens, seg.loss_mask), (None, False)]:
            if trainable:
                run.append(tid)
            elif run:
                a = parse_action(tok.decode(run))  # the call markers are special tokens: keep them
                if isinstance(a, Action):
                    acts.append(a)
                run = []
    return acts


def skip_reason(cfg, domain: str, reward: float | None) -> str | None:
    """Why a domain gets no expert this iteration (None: train it). A batch whose rewards are all equal has
    no outcome signal: its policy update would be driven by the critic's errors alone."""
    if reward is None:
        return None
    lo, hi = cfg.sao.min_domain_reward, cfg.sao.max_domain_reward
    if reward < lo:
        return f"{domain}: rollout reward {reward:.3f} < sao.min_domain_reward {lo}: (almost) no successes to learn from"
    if reward > hi:
        return f"{domain}: rollout reward {reward:.3f} > sao.max_domain_reward {hi}: (almost) nothing left to learn"
    return None


def constant_patterns(specs: list, warm: list, min_n: int, share: float = 1.0) -> dict[str, float]:
    """{pattern: mean reward} of the task patterns whose warm rollouts (at least `min_n` of them) earned one reward,
    all of them or at least a `share` of them. Such a pattern carries (almost) no outcome signal: its reward is (nearly)
    a function of the prompt's pattern, which the critic learns, so its advantages are mostly the critic's errors,
    and an expert trained on a pattern it already solves 39 times in 40 drifts (iteration 2 of tiny: 0.97 → 0.85).
    A truncated episode counts with its reward (it ran out of turns: a failure); a crashed or aborted one says
    nothing about the policy and is not counted."""
    from collections import Counter

    from trainers.sft import pattern_key

    if min_n <= 0:
        return {}
    key = {s.id: pattern_key(s) for s in specs}
    by: dict[str, list[float]] = {}
    for t in warm:
        if t.env_id in key and t.status not in ("crashed", "aborted"):
            by.setdefault(key[t.env_id], []).append(t.reward)
    return {p: sum(r) / len(r) for p, r in sorted(by.items())
            if len(r) >= min_n and Counter(r).most_common(1)[0][1] >= share * len(r)}


def sao_expert(cfg, checkpoint: str, envs: dict, domain: str, out: Path, log=_quiet, metrics=_no_metrics,
               domain_reward: float | None = None, urls: list[str] | None = None, router_url: str = "",
               store_path: Path | None = None, iteration: int = 0, warm_rollouts: list[str] | None = None,
               quarantine: list[str] | None = None, train_backend=None,
               constant: dict[str, float] | None = None, replay_rollouts: list[str] | None = None) -> dict:
    """SAO-train one domain's expert from `checkpoint`. Training state is saved atomically every
    `loop.save_every` steps under `out/state`; when that exists (a retried or resumed step), training
    continues from it instead of starting over. A domain whose rollout reward (`domain_reward`, from
    `rollout_batches`) leaves [sao.min_domain_reward, sao.max_domain_reward] is skipped with its reason.

    Rollouts run on the servers at `urls` (behind temper's Router, or `router_url`) or, without URLs, on an
    in-process engine; every trajectory and what SAO did with it (trained at step s, or dropped) goes to the
    store at `store_path`. `warm_rollouts`: ids of this domain's `rollout_batches` trajectories (from `rewards`),
    read back from that store for the critic's pre-training and the first step (`loop.warm_rollouts`).

    `trainer.world_size > 1`: the stage re-launches itself under torchrun (`under_torchrun`); rank 0 drives the
    rollouts, writes the store, the state and the checkpoint, and every rank trains on its share of each batch
    (`train_backend`, given by `stages/ranks.py`). The result then records each rank's weights checksum.

    Task patterns whose warm rollouts (nearly) all earned one reward (`constant_patterns`, `sao.constant_pattern_*`) are
    left out of training: their environments are not rolled out and their warm rollouts are not trained on. They
    are worked out once, before any torchrun re-launch (`constant`), so every rank drops the same ones.

    With `sao.replay_coef` > 0 the warm rollouts this expert does not train on are its replay anchor's rows
    (`SAOTrainer.set_replay`): `replay_rollouts` (ids of the other domains' `rollout_batches` trajectories, from
    `rewards`) and this domain's warm rollouts of its left-out patterns."""
    from envs.dataset import read_dataset
    from trainers.sft import pattern_key

    specs = [s for s in read_dataset(rl_set(envs)) if s.domain == domain and s.id not in set(quarantine or ())]
    read: list = []  # this domain's warm rollouts, read from the store at most once (`own_warm`)

    def own_warm() -> list:
        if not read:
            read.append(_read_warm(store_path, iteration, domain, warm_rollouts))
        return read[0]

    if constant is None:
        constant = constant_patterns(specs, own_warm(), cfg.sao.constant_pattern_min, cfg.sao.constant_pattern_share)
    if cfg.trainer.world_size > 1 and train_backend is None:
        return under_torchrun("sao_expert", cfg, {
            "checkpoint": checkpoint, "envs": envs, "domain": domain, "out": out, "domain_reward": domain_reward,
            "urls": urls, "router_url": router_url, "store_path": store_path, "iteration": iteration,
            "warm_rollouts": warm_rollouts, "quarantine": quarantine, "constant": constant,
            "replay_rollouts": replay_rollouts}, out, log, metrics)
    import torch

    from envs.sandbox import make_sandbox
    from model import ByteTokenizer, load_checkpoint, save_checkpoint
    from trainers.backends import make_train_backend
    from trainers.checkpoint import complete_checkpoints, load_training_state
    from trainers.loop import RLLoop

    tok, sb = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    kept = [s for s in specs if pattern_key(s) not in constant]
    shown = ", ".join(f"{p}: {r:.2f}" for p, r in constant.items())
    if constant:
        log(f"{domain}: left out of training, (nearly) every warm rollout earned one reward "
            f"(sao.constant_pattern_share {cfg.sao.constant_pattern_share}): {shown}")
    reason = skip_reason(cfg, domain, domain_reward) or (None if specs else f"{domain}: no admitted RL environments")
    if not reason and specs and not kept:
        reason = (f"{domain}: every task pattern's warm rollouts earned (nearly) a single reward ({shown}): no outcome "
                  f"signal within a pattern (sao.constant_pattern_min {cfg.sao.constant_pattern_min}, "
                  f"sao.constant_pattern_share {cfg.sao.constant_pattern_share})")
    left_out = {s.id for s in specs} - {s.id for s in kept}
    specs = kept
    if reason or cfg.loop.steps == 0:
        log(f"skipping the {domain} expert: {reason or 'loop.steps is 0'}")
        return {"checkpoint": checkpoint, "steps": 0, "domain": domain, "resumed_from_step": 0,
                "skipped": reason or "loop.steps is 0", "rollout_reward": domain_reward,
                "constant_patterns": constant}
    replay = []
    if cfg.sao.replay_coef > 0:  # every rank reads them: each anchors its share of every step's replay rows
        replay = ([t for t in own_warm() if t.env_id in left_out]
                  + _read_warm(store_path, iteration, None, replay_rollouts))
        if not replay:
            raise ValueError(f"sao.replay_coef is {cfg.sao.replay_coef} but the {domain} expert has no warm rollouts "
                             "it does not train on to replay (pass replay_rollouts: the other domains' ids)")
    dp = train_backend or make_train_backend(cfg.trainer)
    main = dp.is_main
    model = dp.wrap(load_checkpoint(checkpoint))
    torch.manual_seed(cfg.seed)
    state = load_training_state(out / "state") if complete_checkpoints(out / "state") else None
    # rank 0 alone talks to engines and to the store; the other ranks get every batch from it
    served = dp.export(model)  # what the engines get: temper's model
    backend = _backend(cfg, served, tok, out, urls, router_url, version=WARM_VERSION, name=f"sao-{domain}") \
        if main else None
    rec = Recorder(store_path if main else None)
    ids = {s.id for s in specs}
    warm = [t for t in own_warm() if t.env_id in ids] if state is None and main else []
    loop = RLLoop(model, specs, tok, sb, cfg.agent, cfg.sao, cfg.loop, version=WARM_VERSION, backend=backend,
                  on_trajectory=rec.add, iteration=iteration, consumer=f"sao:{domain}", warm=warm, train_backend=dp,
                  replay=replay, max_crashed_share=cfg.loop.max_crashed_share)
    if replay:
        log(f"{domain}: replay anchor on {len(replay)} warm rollouts it does not train on "
            f"({loop.replay_tokens} policy tokens, β {cfg.sao.replay_coef})")
    hist: list[dict] = []
    start = n0 = 0
    if state is not None:
        loop.resume(state)
        start, hist = state.step, list(state.extra.get("history", []))
        n0 = len(hist)
        dropped = rec.repair(f"sao:{domain}", start) if main else 0
        log(f"{domain}: resumed from {state.path} (step {start}, policy v{loop.version})"
            + (f"; dropped {dropped} consumption rows of the steps being redone" if dropped else ""))

    def on_step(st: dict) -> None:
        hist.append({k: v for k, v in st.items() if isinstance(v, int | float)})
        step = start + len(hist) - n0
        metrics({k: hist[-1][k] for k in SAO_CURVES if k in hist[-1]}, len(hist) - 1)
        if step % cfg.loop.save_every == 0 or step == cfg.loop.steps:
            if main:  # the store first: a kill between the two leaves it ahead (repaired on resume)
                rec.flush(loop.consumption)
            if main or dp.sharded_state:  # sharded (Megatron ranks): every rank saves its own part
                loop.save_state(out / "state", step, extra={"history": hist}, keep=2)
        mm = (f" mismatch {st['mismatch_fresh_mean']:.1e} (max {st['mismatch_fresh_max']:.1e})"
              if "mismatch_fresh_mean" in st else "")
        log(f"{domain}: SAO step {step}/{cfg.loop.steps} reward {st['batch_reward']:.2f} v{st['version']}{mm}")

    try:
        loop.run(max(0, cfg.loop.steps - start), on_step)
    except CrashedShareExceeded:
        rec.flush(loop.consumption)  # the lost episodes go to the store, to be read (a resumed run repairs the rows)
        raise
    finally:
        if backend is not None:
            backend.close()
    final = dp.export(model)
    ranks = _rank_checksums(dp, final, f"{domain} expert")
    if not main:
        return {}
    rec.flush(loop.consumption)
    save_checkpoint(final, out / "checkpoint", policy_version=loop.version)
    crashes = loop.crashes.report()
    return {**ranks, "checkpoint": str(out / "checkpoint"), "steps": len(hist), "domain": domain, "version": loop.version,
            "crashes": crashes, "crashed_share": crashes["share"],
            "resumed_from_step": start, "dropped_stale": loop.trainer.dropped["stale"], "rollout_reward": domain_reward,
            "updates": sum(1 for h in hist if h.get("updated")),
            "degenerate_batches": sum(1 for h in hist if h.get("degenerate")),
            "reward_curve": [h.get("batch_reward", 0.0) for h in hist],
            "curves": {k: [h.get(k, 0.0) for h in hist] for k in SAO_CURVES},
            "backend": backend.kind, "pushes": len(loop.pushes), "stored_trajectories": rec.written,
            "warm_rollouts": len(warm), "warm_rollouts_use": cfg.loop.warm_rollouts if warm else "none",
            "stored_consumption": rec.rows, "quarantined": sorted(quarantine or []), "constant_patterns": constant,
            "replay_rollouts": len(replay), "replay_tokens": loop.replay_tokens, **_mismatch_summary(hist)}


def replay_ids(scored: dict, domain: str) -> list[str]:
    """The ids of every other domain's warm rollouts in `rewards`' per-domain result: `domain`'s expert's
    `replay_rollouts`."""
    return [i for d, v in scored.items() if d != domain for i in v.get("ids", [])]


def _read_warm(store_path: Path | None, iteration: int, domain: str | None, ids: list[str] | None) -> list:
    """This domain's (`None`: any domain's) warm-start rollouts, read back from the store. They must be what
    `rollout_batches` stored: a missing id, another domain or another policy version is an error, not a silent
    skip."""
    if not ids or store_path is None:
        return []
    from store import TrajectoryStore

    with TrajectoryStore(store_path, read_only=True) as st:
        trajs = st.read(iteration, ids=ids)
    missing = sorted(set(ids) - {t.trajectory_id for t in trajs})
    if missing:
        raise ValueError(f"{len(missing)} warm rollout(s) are not in {store_path} for iteration {iteration}: "
                         f"{', '.join(missing[:5])}")
    bad = [t.trajectory_id for t in trajs if (domain is not None and t.domain != domain) or
           (t.n_trainable and t.policy_versions() != (WARM_VERSION, WARM_VERSION))]
    if bad:
        raise ValueError(f"warm rollouts {', '.join(bad[:5])} are not {domain or 'the'} trajectories of the warm start "
                         f"(policy version {WARM_VERSION})")
    # in environment order, not the store's (the order they finished in): the critic's pre-training batches are
    # cut from this list, so the same seed gives the same critic on a busy machine and on a quiet one
    return sorted(trajs, key=lambda t: (t.env_id, t.trajectory_id))


def _mismatch_summary(hist: list[dict]) -> dict:
    """Training/inference mismatch over a stage: the mean of the per-step means and the largest gap seen."""
    out = {}
    for key in ("fresh", "all"):
        means = [h[f"mismatch_{key}_mean"] for h in hist if f"mismatch_{key}_mean" in h]
        if means:
            out[f"mismatch_{key}_mean"] = sum(means) / len(means)
            out[f"mismatch_{key}_max"] = max(h[f"mismatch_{key}_max"] for h in hist if f"mismatch_{key}_max" in h)
            out[f"mismatch_{key}_frac_over_1e-3"] = sum(h[f"mismatch_{key}_frac_over_1e-3"] for h in hist
                                                       if f"mismatch_{key}_mean" in h) / len(means)
    return out


def teacher_gate(cfg, warm: str, experts: dict[str, str], envs: dict, cache: Path | None = None,
                 log=_quiet) -> dict:
    """Each expert against the warm start, greedy, on its domain's validation tasks (`envs["val"]`), paired: it
    teaches only if it solves more of the tasks the warm start fails than the reverse (`gained > lost`). Returns,
    per domain, both pass@1s, the flips and `teaches`. Deterministic (greedy), so a resumed stage reads it back
    from `cache`, written once."""
    from envs.dataset import read_dataset
    from envs.sandbox import make_sandbox
    from model import ByteTokenizer, load_checkpoint
    from trainers.sft import evaluate

    key = {"warm": str(Path(warm).resolve()), "experts": {d: str(Path(p).resolve()) for d, p in experts.items()},
           "val": envs["val"]}
    if cache is not None and cache.exists():
        kept = json.loads(cache.read_text())
        if kept.get("key") == key:
            return kept["gate"]
    tok, sb = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    val = [s for s in read_dataset(envs["val"]) if s.domain in experts]

    def episodes(ckpt: str, specs, who: str) -> list:
        ev = evaluate(load_checkpoint(ckpt), specs, tok, sb, cfg.agent, n_slots=cfg.loop.n_slots,
                      concurrency=cfg.loop.batch_in_flight)
        CrashTally(ev["trajectories"]).check(cfg.loop.max_crashed_share, f"teacher_gate ({who})")
        return ev["trajectories"]

    base = dict(zip((s.id for s in val), episodes(warm, val, "warm start")))
    gate = {}
    for dom, ckpt in sorted(experts.items()):
        mine = [s for s in val if s.domain == dom]
        got_t, was_t = episodes(ckpt, mine, f"{dom} expert"), [base[s.id] for s in mine]
        got, was = [t.reward for t in got_t], [t.reward for t in was_t]
        gained = sum(1 for a, b in zip(was, got) if b > a)
        lost = sum(1 for a, b in zip(was, got) if b < a)
        n = max(1, len(mine))
        gate[dom] = {"n": len(mine), "warm_start": sum(was) / n, "expert": sum(got) / n, "gained": gained,
                     "lost": lost, "teaches": gained > lost, "warm_ckpt": str(Path(warm).resolve()),
                     "warm_rewards": {s.id: t.reward for s, t in zip(mine, was_t)},  # (evaluation's decision reuses)
                     "crashes": {"warm_start": CrashTally(was_t).report(), "expert": CrashTally(got_t).report()}}
        log(f"OPD gate: {dom} expert {gate[dom]['expert']:.2f} vs warm start {gate[dom]['warm_start']:.2f} on "
            f"{len(mine)} validation tasks ({gained} gained / {lost} lost): "
            + ("teaches" if gained > lost else "left out, the student keeps the warm start there"))
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "gate": gate}))
        tmp.replace(cache)
    return gate


WARM_TEACHER = "warm start"  # the teacher key of the domains OPD anchors to the warm start (not a domain's name)


def opd_student(cfg, init: str, experts: dict[str, str], envs: dict, out: Path, log=_quiet, metrics=_no_metrics,
                urls: list[str] | None = None, router_url: str = "", store_path: Path | None = None,
                iteration: int = 0, teacher_urls: list[str] | None = None, quarantine: list[str] | None = None,
                gate: dict | None = None, train_backend=None) -> dict:
    """Multi-teacher OPD from `init` with each domain's expert as its teacher; resumable like `sao_expert`.
    The student's episodes run on the rollout backend (servers at `urls`, else in-process), which gets the
    student after every step; every trajectory and its consuming step go to the store. With `teacher_urls`
    the teachers score on those servers (`/generate` input log-probs; the next teacher prefetched into an idle
    server), else in this process. With a validation set and `opd.gate_teachers`, an expert that does not beat
    the warm start on its domain's validation tasks (`teacher_gate`) neither teaches nor joins the merge. Under
    `opd.untaught=warm_start` the warm start itself teaches every domain of the RL set left without an expert (the
    result's `anchored`), so the other experts' deltas in the merged student are distilled back out of it there.

    On a sharded Megatron layout (`trainer.kind: megatron`, `trainer.world_size > 1`) the training runs under torchrun
    after the gate (`gate`: its verdicts, handed to the ranks): rank 0 runs the episodes, scores them with the teachers
    and writes the store, every rank trains its shard on the whole batch (each rank of a data-parallel layout repeats
    it), and every rank saves its part of the training state."""
    import torch

    from envs.dataset import read_dataset
    from envs.sandbox import make_sandbox
    from model import ByteTokenizer, load_checkpoint, save_checkpoint
    from rollout.agent import Agent, run_episodes
    from trainers.backends import from_main, make_train_backend
    from trainers.checkpoint import complete_checkpoints, load_training_state, restore, save_training_state
    from trainers.opd import OPDTrainer
    from trainers.teachers import TeacherPool

    if gate is None:
        gate = {}
        if experts and cfg.opd.gate_teachers and envs.get("val"):
            gate = teacher_gate(cfg, init, experts, envs, out / "gate.json", log)
    if gate:
        experts = {d: p for d, p in experts.items() if gate[d]["teaches"]}
    if not experts:  # every domain was skipped: nothing to distil, the student is the warm start
        why = ("no expert beat the warm start on its validation tasks" if gate else
               "no domain experts (every domain was skipped)")
        log(f"OPD: {why}; the student is the warm start")
        return {"checkpoint": init, "steps": 0, "teachers": {}, "resumed_from_step": 0, "reverse_kl": [],
                "skipped": why, "gate": gate, "anchored": []}
    if cfg.trainer.kind == "megatron" and cfg.trainer.world_size > 1 and train_backend is None:
        return under_torchrun("opd_student", cfg, {
            "init": init, "experts": experts, "envs": envs, "out": out, "urls": urls, "router_url": router_url,
            "store_path": store_path, "iteration": iteration, "teacher_urls": teacher_urls, "quarantine": quarantine,
            "gate": gate}, out, log, metrics)
    tok, sb = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    torch.manual_seed(cfg.seed)
    dp = train_backend or make_train_backend(cfg.trainer)
    main = dp.is_main  # the one rank that runs episodes, holds the teachers and writes the store
    model = load_checkpoint(init)
    resuming = complete_checkpoints(out / "state")
    merged_from: list[str] = []  # task arithmetic: the warm start plus every expert's delta (a skipped domain's
    if cfg.opd.init == "merged":  # expert is the warm start itself: nothing to add)
        merged_from = sorted({p for p in experts.values() if Path(p).resolve() != Path(init).resolve()})
    if merged_from and not resuming:  # a resumed student's weights come from its training state
        from trainers.opd import merge_experts

        model.load_state_dict(merge_experts(model.state_dict(), (load_checkpoint(p).state_dict() for p in merged_from),
                                            cfg.opd.merge_scale))
        log(f"OPD: the student starts from the warm start + {cfg.opd.merge_scale:g} × the sum of "
            f"{len(merged_from)} expert delta(s)")
    student = dp.wrap(model)
    specs = [s for s in read_dataset(rl_set(envs)) if s.id not in set(quarantine or ())]
    teachers = dict(experts)  # teacher → its checkpoint; an expert's key is its domain
    anchored = sorted({s.domain for s in specs} - set(experts)) if cfg.opd.untaught == "warm_start" else []
    route = dict.fromkeys(anchored, WARM_TEACHER)  # every anchored domain shares one teacher: the warm start
    if anchored:
        teachers[WARM_TEACHER] = init
        log(f"OPD: the warm start teaches {', '.join(anchored)} (no expert of its own: opd.untaught=warm_start)")
    specs = [s for s in specs if s.domain in experts or s.domain in route]
    if not main:
        pool = None  # rank 0 scores every batch and shares the scores
    elif teacher_urls:
        from rollout.backend import ServerTeacherPool

        pool = ServerTeacherPool(teachers, teacher_urls)
    else:
        pool = TeacherPool(teachers, max_resident=2 if anchored else 1,  # the anchor is every step's second teacher
                           device=next(student.parameters()).device)  # the teachers score where the student trains
    trainer = OPDTrainer(student, pool, cfg.opd, backend=dp, route=route)
    start, hist, crashes = 0, [], CrashTally()
    if resuming:
        state = restore(load_training_state(out / "state"), student, trainer.opt, backend=dp)
        crashes = CrashTally.from_state(state.extra.get("crashes"))
        was = state.extra.get("anchored", anchored)  # states saved before the anchor existed carry none
        if was != anchored:
            raise ValueError(f"OPD state in {out / 'state'} was saved with the warm start teaching "
                             f"{', '.join(was) or 'nothing'}, this run has it teach {', '.join(anchored) or 'nothing'} "
                             "(opd.untaught, or the gate's verdicts "
                             "changed): its task cursor would point into another task list; remove the state or "
                             "restore the settings")
        start, hist = state.step, list(state.extra.get("history", []))
        log(f"OPD: resumed from {state.path} (step {start})")
    version = 1 + start  # the student's policy version on the engines: one per OPD step
    served = dp.export(student)  # a collective on a sharded layout: every rank
    backend = _backend(cfg, served, tok, out, urls, router_url, version=version, name="opd") if main else None
    rec, consumption = Recorder(store_path if main else None), []
    if start and main:
        dropped = rec.repair("opd", start)
        if dropped:
            log(f"OPD: dropped {dropped} consumption rows of the steps being redone")

    async def episodes(batch):
        async with backend.session() as policy:
            agent = Agent(policy, tok, sb, cfg.agent)
            return await run_episodes(agent, batch, iteration, concurrency=cfg.loop.in_flight)

    try:
        for step in range(start, cfg.opd.steps if specs else 0):
            batch = [specs[(step * cfg.loop.batch_size + i) % len(specs)] for i in range(cfg.loop.batch_size)]
            trajs = from_main(dp, lambda b=batch: asyncio.run(episodes(b)))  # every rank trains on rank 0's episodes
            crashes.add(trajs)
            try:  # before training on them: fail as soon as the crashed share is certain to be too high
                crashes.check(cfg.loop.max_crashed_share, "opd", planned=cfg.opd.steps * cfg.loop.batch_size)
            except CrashedShareExceeded:
                for t in trajs:  # the lost episodes go to the store, to be read
                    rec.add(t)
                rec.flush(consumption)
                raise
            for t in trajs:
                rec.add(t)
                vs = t.policy_versions()
                outcome = ("dropped_crashed" if t.status in ("crashed", "aborted") else
                           "dropped_empty" if not t.n_trainable else "trained")
                consumption.append({"trajectory_id": t.trajectory_id, "stage": "opd", "consumer": "opd", "step": step + 1,
                                    "policy_version": version, "staleness": version - vs[0] if vs else 0,
                                    "outcome": outcome})
            st = trainer.step(trajs, current_version=version)
            hist.append({k: v for k, v in st.items() if isinstance(v, int | float)})
            metrics({k: hist[-1][k] for k in ("reverse_kl", "clip_frac", "reward_mean") if k in hist[-1]}, len(hist) - 1)
            version += 1
            pushed = dp.export(student)  # every rank (gathers the shards)
            if main:
                backend.push(pushed, version)
            if (step + 1) % cfg.loop.save_every == 0 or step + 1 == cfg.opd.steps:
                rec.flush(consumption)  # the store first, as in sao_expert
                if main or dp.sharded_state:
                    save_training_state(out / "state", policy=student, optimizer=trainer.opt, step=step + 1,
                                        policy_version=2, data_cursor=step + 1,
                                        extra={"history": hist, "anchored": anchored, "crashes": crashes.state()},
                                        keep=2, backend=dp)
            log(f"OPD step {step + 1}/{cfg.opd.steps} reverse KL {st.get('reverse_kl', 0.0):.4f}")
        rec.flush(consumption)
    finally:
        if backend is not None:
            backend.close()
        if pool is not None:
            pool.close()
    final = dp.export(student)
    ranks = _rank_checksums(dp, final, "OPD student")
    if not main:
        return {}
    save_checkpoint(final, out / "checkpoint", policy_version=2)
    return {**ranks, "checkpoint": str(out / "checkpoint"), "steps": len(hist), "teachers": experts, "anchored": anchored,
            "resumed_from_step": start, "init": cfg.opd.init, "merged_from": merged_from, "gate": gate,
            "reverse_kl": [h.get("reverse_kl", 0.0) for h in hist], "pool": pool.stats().as_dict(),
            "backend": backend.kind, "stored_trajectories": rec.written, "stored_consumption": rec.rows,
            "crashes": (lost := crashes.report()), "crashed_share": lost["share"], **_mismatch_summary(hist)}


def taught_domains(opd: dict) -> list[str] | None:
    """The domains whose expert taught the student, from `opd_student`'s result (`evaluation`'s `taught`); None when
    the result does not say (every expert then counts as teaching)."""
    return None if opd.get("teachers") is None else sorted(opd["teachers"])


def teacher_cell(evaluation: dict, domain: str, anchored, digits: int = 2) -> str:
    """A report's teacher column for `domain`: the expert's own-domain pass@1, marked when OPD's gate left it out,
    and the warm start where it taught the domain instead (`anchored`: `opd_student`'s)."""
    by = "warm start" if domain in anchored else ""
    if domain not in evaluation.get("domain_teacher", {}):
        return by
    cell = f"{evaluation['domain_teacher'][domain]:.{digits}f}"
    if evaluation.get("teaching", {}).get(domain, True):
        return cell
    return f"{cell} (left out; {by} taught)" if by else f"{cell} (left out)"


def evaluation(cfg, student: str, baseline: str, envs: dict, experts: dict[str, str] | None = None, log=_quiet,
               urls: list[str] | None = None, router_url: str = "", store_path: Path | None = None,
               out: Path | None = None, iteration: int = 0, taught: list[str] | None = None,
               warm_val: dict[str, float] | None = None) -> dict:
    """Held-out greedy pass@1 of the student and of the warm start on the same tasks, per domain and overall,
    with 95% Wilson intervals and an exact McNemar test of the paired outcomes (tasks that flipped each way);
    and each domain expert on its own domain (the teacher the student is measured against). `taught`: the
    domains whose expert taught the student (OPD's gate); the others' experts are still scored, and marked
    `teaching: false` so no report reads them as the student's teacher. Episodes run on
    the servers at `urls` when given (each policy loaded in turn), else in-process; every trajectory goes to the
    store as `evaluated` by `eval:student`, `eval:warm_start` or `eval:teacher:<domain>`.

    The decision (`decision`: whether the student is a significant gain, which moves the `champion` and so the
    hand-off) reads the validation set, never the held-out one: the student and the warm start on `envs["val"]`,
    paired (the warm start's greedy outcomes reused from OPD's teacher gate where it ran the same checkpoint on the
    same tasks: `warm_val`, spec id -> reward). Without a validation set there is no decision: the champion stays."""
    import itertools
    import tempfile
    from collections import defaultdict

    from envs.dataset import read_dataset
    from envs.sandbox import make_sandbox
    from model import ByteTokenizer, load_checkpoint
    from trainers.sft import evaluate
    from trainers.stats import compare, significant_gain, summarize

    tok, sb = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    held = read_dataset(envs["eval"])
    rec, consumption = Recorder(store_path), []
    work = Path(out) if out else Path(tempfile.mkdtemp(prefix="temper-eval-"))
    loads = itertools.count(1)  # each policy the servers load gets its own version

    def run(ckpt: str, specs, who: str) -> dict:
        from rollout.backend import ServerBackend

        backend = None
        if urls:  # the servers load the checkpoint as it is on disk: no second copy
            backend = ServerBackend(urls, work / "sync", router_url=router_url)
            backend.load(ckpt, next(loads))
        ev = evaluate(None if backend else load_checkpoint(ckpt), specs, tok, sb, cfg.agent, backend=backend,
                      n_slots=cfg.loop.n_slots, concurrency=cfg.loop.batch_in_flight)
        for t in ev["trajectories"]:
            t.iteration = iteration
            rec.add(t)
            consumption.append({"trajectory_id": t.trajectory_id, "stage": "eval", "consumer": f"eval:{who}",
                                "step": None, "policy_version": 0, "staleness": 0, "outcome": "evaluated"})
        crashes.add(ev["trajectories"])
        try:  # a pass@1 over what is left would read a broken sandbox as a worse policy
            CrashTally(ev["trajectories"]).check(cfg.loop.max_crashed_share, f"evaluation ({who})")
        except CrashedShareExceeded:
            rec.flush(consumption)  # the lost episodes go to the store, to be read
            raise
        return ev

    crashes = CrashTally()  # every episode of the stage, every policy's

    after = run(student, held, "student")
    log(f"student pass@1 {after['pass@1']:.3f} {after['domain']}")
    if Path(student).resolve() == Path(baseline).resolve():  # OPD had no teacher: greedy play would repeat itself
        before = after
        consumption += [{**c, "consumer": "eval:warm_start"} for c in list(consumption)]
        log("warm start: the student itself (no expert taught), its episodes count for both")
    else:
        before = run(baseline, held, "warm_start")
        log(f"warm start pass@1 {before['pass@1']:.3f} {before['domain']}")

    def by_domain(ev, specs=held):
        d = defaultdict(list)
        for s, t in zip(specs, ev["trajectories"]):
            d[s.domain].append(t.reward)
        return dict(d)

    decision = {"set": None, "significant": False, "p_value": None,
                "reason": "no validation set (envs.n_val = 0): no decision, the champion stays"}
    if envs.get("val"):
        from .decision import validation_decision

        decision = validation_decision(read_dataset(envs["val"]), student, baseline, warm_val or {}, run, log)

    stats = compare(by_domain(before), by_domain(after))
    teachers, teacher_pattern, teacher_stats = {}, {}, {}
    for dom, ckpt in (experts or {}).items():
        mine = [s for s in held if s.domain == dom]
        if mine:
            ev = run(ckpt, mine, f"teacher:{dom}")
            teachers[dom] = ev["pass@1"]
            teacher_pattern.update(ev["pattern"])
            teacher_stats[dom] = summarize([t.reward for t in ev["trajectories"]])
    log(f"experts on their own domains: {teachers}")
    rec.flush(consumption)
    overall = stats["all"]["test"]
    log(f"student vs warm start on {overall['n']} paired tasks: {overall['gained']} gained, {overall['lost']} lost, "
        f"exact McNemar p = {overall['p_value']:.4f}")
    return {"pass@1_before": before["pass@1"], "pass@1_after": after["pass@1"], "domain_before": before["domain"],
            "domain_after": after["domain"], "family_before": before["family"], "family_after": after["family"],
            "pattern_before": before["pattern"], "pattern_after": after["pattern"], "pattern_teacher": teacher_pattern,
            "domain_teacher": teachers, "teacher_stats": teacher_stats, "n_eval": len(held), "student": student,
            "teaching": {d: taught is None or d in taught for d in teachers},
            "stats": stats, "gained": overall["gained"], "lost": overall["lost"], "p_value": overall["p_value"],
            "significant": significant_gain(overall), "decision": decision, "stored_trajectories": rec.written,
            "crashes": (lost := crashes.report()), "crashed_share": lost["share"],
            "domains_fell_significantly": [d for d, v in stats.items() if d != "all" and v["test"]["lost"] > v["test"]["gained"]
                                           and v["test"]["p_value"] < 0.05]}
