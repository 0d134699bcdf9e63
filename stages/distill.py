"""`teacher_gate` and `opd_student`: the experts that beat the warm start on validation teach one student by
multi-teacher on-policy distillation."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from rollout.crashes import CrashedShareExceeded, CrashTally

from .common import (
    _backend,
    _no_metrics,
    _quiet,
    under_torchrun,
)
from .environments import rl_set
from .experts import _mismatch_summary
from .recorder import Recorder
from .warm import _rank_checksums


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
                      concurrency=cfg.loop.batch_in_flight, compile_decode=cfg.loop.compile_decode)
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
    from trainers.backends import from_main
    from trainers.checkpoint import complete_checkpoints, load_training_state, restore, save_training_state
    from trainers.opd import OPDTrainer
    from trainers.runtime import make_train_backend
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
    return {**ranks, "checkpoint": str(out / "checkpoint"), "steps": len(hist), "teachers": experts,
            "trained_tokens": int(sum(h.get("tokens", 0) for h in hist)), "anchored": anchored,
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
