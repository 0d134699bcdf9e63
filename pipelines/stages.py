"""The stages of one post-training iteration as plain functions (no Dagster): the assets in `assets/`
call these and record what they return as metadata. Every stage reads and writes files under the
iteration's run directory, so a stage can be re-run (or inspected) on its own.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path


def _quiet(msg: str) -> None:
    """Drop a progress message: the log of a stage run without one."""


def _dump(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str))


def env_specs(cfg, out: Path) -> dict:
    from envs.dataset import write_dataset
    from envs.generator import generate

    e = cfg.envs
    train = write_dataset(generate(e.patterns, e.n_train, e.seed), out / "train", {"seed": e.seed})
    held = write_dataset(generate(e.held_out_patterns, e.n_eval, e.eval_seed), out / "eval", {"seed": e.eval_seed})
    res = {"train": str(out / "train"), "eval": str(out / "eval"), "n_train": train["n"], "n_eval": held["n"],
           "families": train["families"], "sha256": train["sha256"], "n_rl": 0}
    if e.n_rl:
        rl = write_dataset(generate(e.patterns, e.n_rl, e.rl_seed), out / "rl", {"seed": e.rl_seed})
        res.update(rl=str(out / "rl"), n_rl=rl["n"])
    return res


def rl_set(envs: dict) -> str:
    """The environments RL trains in: the separate RL set when the preset has one, else the SFT set."""
    return envs.get("rl") or envs["train"]


def verified_envs(cfg, specs: dict, out: Path, log=_quiet) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from envs import make_sandbox
    from envs.dataset import read_dataset, write_dataset
    from envs.gate import acceptance, validate

    sb = make_sandbox(cfg.envs.sandbox)
    sets = [k for k in ("train", "rl") if specs.get(k)]
    every = [(k, s) for k in sets for s in read_dataset(specs[k])]
    with ThreadPoolExecutor(cfg.envs.validate_workers) as pool:  # each validation is sandboxed subprocesses
        reports = list(pool.map(lambda i: validate(every[i][1], sb,
                                                   probes=cfg.envs.probes and i % cfg.envs.probe_every == 0),
                                range(len(every))))
    log(f"validated {len(every)} environments: {sum(r.accepted for r in reports)} accepted")
    res: dict = {"eval": specs["eval"]}
    for k in sets:  # the last one is the set RL trains in: its domains get experts
        ok = [s for (kk, s), r in zip(every, reports) if kk == k and r.accepted]
        write_dataset(ok, out / k, {"validated_from": specs[k]})
        res.update({k: str(out / k), f"accepted_{k}": len(ok)})
    _dump(out / "validation.json", [r.to_dict() for r in reports])
    accepted = sum(r.accepted for r in reports)
    probe_hits = sum(1 for r in reports if r.accepted for p in r.probes.values() if p.get("reward", 0) > 0)
    return {**res, "accepted": accepted, "total": len(every),
            "acceptance": acceptance(reports), "triad_pass_rate": accepted / max(1, len(every)),
            "accepted_probe_hits": probe_hits, "probed": sum(1 for r in reports if r.probes),
            "domains": sorted({s.domain for s in ok})}


def warm_start(cfg, envs: dict, out: Path, parent_checkpoint: str | None, log=_quiet) -> dict:
    """Iteration 1: SFT on oracle trajectories (resumable from `out/state`); later iterations start from the
    previous student."""
    import time

    import torch

    from envs.dataset import read_dataset
    from envs.sandbox import make_sandbox
    from model import ByteTokenizer, Transformer, load_checkpoint, save_checkpoint
    from trainers.checkpoint import complete_checkpoints, load_training_state, restore, save_training_state
    from trainers.lm import LMTrainer, train_lm
    from trainers.sft import evaluate, oracle_trajectories, sft_batches

    tok, sb = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    held = read_dataset(envs["eval"])
    losses: list[float] = []
    start = 0
    if parent_checkpoint:
        model = load_checkpoint(parent_checkpoint)
    else:
        torch.manual_seed(cfg.seed)
        trajs = oracle_trajectories(read_dataset(envs["train"]), tok, sb, cfg.agent)
        log(f"SFT data: {len(trajs)} oracle trajectories, {sum(t.n_trainable for t in trajs):,} trainable tokens")
        model = Transformer(cfg.model)
        trainer, elapsed = LMTrainer(model, cfg.train), 0.0
        if complete_checkpoints(out / "state"):
            state = restore(load_training_state(out / "state"), model, trainer.opt)
            start = trainer.step_no = state.step
            elapsed, losses = state.extra["elapsed"], list(state.extra["loss"])
            log(f"SFT: resumed from {state.path} (step {start}, {elapsed:.0f} s in)")
        batches = sft_batches(trajs, cfg.train.batch_size, tok.pad_id, cfg.seed)
        for _ in range(start):  # the data cursor: the batch stream is deterministic given the seed
            next(batches)
        t0 = time.perf_counter() - elapsed
        save_every = max(1, cfg.loop.save_every * 20)

        def on_step(st) -> None:
            losses.append(round(st.loss, 5))
            if trainer.step_no % save_every == 0:
                save_training_state(out / "state", policy=model, optimizer=trainer.opt, step=trainer.step_no,
                                    policy_version=0, data_cursor=trainer.step_no, keep=2,
                                    extra={"elapsed": time.perf_counter() - t0, "loss": losses})
                log(f"SFT step {trainer.step_no}: loss {st.loss:.4f} ({time.perf_counter() - t0:.0f} s)")

        train_lm(model, batches, cfg.train, on_step, trainer=trainer, elapsed=elapsed)
    ev = evaluate(model, held, tok, sb, cfg.agent)
    save_checkpoint(model, out / "checkpoint", policy_version=1)
    return {"checkpoint": str(out / "checkpoint"), "parent": parent_checkpoint, "sft_steps": len(losses),
            "resumed_from_step": start, "pass@1": ev["pass@1"], "domain": ev["domain"], "family": ev["family"],
            "curves": {"sft_loss": losses}}


def rollout_batches(cfg, checkpoint: str, envs: dict, store_path: Path, iteration: int, urls: list[str],
                    router_url: str = "", log=_quiet) -> dict:
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

    async def go():
        await load_weights(urls, checkpoint, version=iteration)
        log(f"loaded {checkpoint} into {len(urls)} worker(s); rolling out {len(specs)} environments")
        policy = await open_policy(urls, router_url)
        try:
            return await run_episodes(Agent(policy, tok, sb, cfg.agent), specs, iteration, cfg.loop.in_flight)
        finally:
            await close_policy(policy)

    trajs = asyncio.run(go())
    with TrajectoryStore(store_path) as st:
        n = st.write(trajs)
        export = st.export_parquet(iteration, store_path.parent / "parquet")
    return {"trajectories": n, "tokens": sum(t.n_tokens for t in trajs), "store": str(store_path), "parquet": str(export),
            "mean_reward": sum(t.reward for t in trajs) / max(1, len(trajs)), "workers": urls,
            "family_reward": {f: sum(t.reward for t in trajs if t.family == f) / sum(1 for t in trajs if t.family == f)
                              for f in sorted({t.family for t in trajs})}}


def rewards(store_path: Path, iteration: int) -> dict:
    from store import TrajectoryStore

    with TrajectoryStore(store_path, read_only=True) as st:
        return st.stats(iteration)


def sao_expert(cfg, checkpoint: str, envs: dict, domain: str, out: Path, log=_quiet) -> dict:
    """SAO-train one domain's expert from `checkpoint`. Training state is saved atomically every
    `loop.save_every` steps under `out/state`; when that exists (a retried or resumed step), training
    continues from it instead of starting over."""
    import torch

    from envs.dataset import read_dataset
    from envs.sandbox import make_sandbox
    from model import ByteTokenizer, load_checkpoint, save_checkpoint
    from trainers.checkpoint import complete_checkpoints, load_training_state
    from trainers.loop import RLLoop

    tok, sb = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    specs = [s for s in read_dataset(rl_set(envs)) if s.domain == domain]
    model = load_checkpoint(checkpoint)
    if not specs or cfg.loop.steps == 0:
        save_checkpoint(model, out / "checkpoint", policy_version=1)
        return {"checkpoint": str(out / "checkpoint"), "steps": 0, "domain": domain, "resumed_from_step": 0}
    torch.manual_seed(cfg.seed)
    state = load_training_state(out / "state") if complete_checkpoints(out / "state") else None
    loop = RLLoop(model, specs, tok, sb, cfg.agent, cfg.sao, cfg.loop, version=1)
    hist: list[dict] = []
    start = n0 = 0
    if state is not None:
        loop.resume(state)
        start, hist = state.step, list(state.extra.get("history", []))
        n0 = len(hist)
        log(f"{domain}: resumed from {state.path} (step {start}, policy v{loop.version})")

    def on_step(st: dict) -> None:
        hist.append({k: v for k, v in st.items() if isinstance(v, int | float)})
        step = start + len(hist) - n0
        if step % cfg.loop.save_every == 0 or step == cfg.loop.steps:
            loop.save_state(out / "state", step, extra={"history": hist}, keep=2)
        log(f"{domain}: SAO step {step}/{cfg.loop.steps} reward {st['batch_reward']:.2f} v{st['version']}")

    loop.run(max(0, cfg.loop.steps - start), on_step)
    save_checkpoint(model, out / "checkpoint", policy_version=loop.version)
    return {"checkpoint": str(out / "checkpoint"), "steps": len(hist), "domain": domain, "version": loop.version,
            "resumed_from_step": start, "dropped_stale": loop.trainer.dropped["stale"],
            "reward_curve": [h.get("batch_reward", 0.0) for h in hist],
            "curves": {k: [h.get(k, 0.0) for h in hist] for k in ("batch_reward", "clip_frac", "kl", "entropy", "value_loss")}}


def opd_student(cfg, init: str, experts: dict[str, str], envs: dict, out: Path, log=_quiet) -> dict:
    """Multi-teacher OPD from `init` with each domain's expert as its teacher; resumable like `sao_expert`."""
    import copy

    import torch

    from envs.dataset import read_dataset
    from envs.sandbox import make_sandbox
    from model import ByteTokenizer, load_checkpoint, save_checkpoint
    from rollout.agent import Agent, EnginePolicy, run_episodes
    from rollout.engine import Engine
    from trainers.checkpoint import complete_checkpoints, load_training_state, restore, save_training_state
    from trainers.opd import OPDTrainer
    from trainers.teachers import TeacherPool

    tok, sb = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    torch.manual_seed(cfg.seed)
    student = load_checkpoint(init)
    specs = [s for s in read_dataset(rl_set(envs)) if s.domain in experts]
    pool = TeacherPool(experts, max_resident=1)
    trainer = OPDTrainer(student, pool, cfg.opd)
    start, hist = 0, []
    if complete_checkpoints(out / "state"):
        state = restore(load_training_state(out / "state"), student, trainer.opt)
        start, hist = state.step, list(state.extra.get("history", []))
        log(f"OPD: resumed from {state.path} (step {start})")
    engine = Engine(copy.deepcopy(student), tok, n_slots=cfg.loop.n_slots, max_len=cfg.agent.max_context + 8)
    try:
        for step in range(start, cfg.opd.steps if specs else 0):
            batch = [specs[(step * cfg.loop.batch_size + i) % len(specs)] for i in range(cfg.loop.batch_size)]
            agent = Agent(EnginePolicy(engine), tok, sb, cfg.agent)
            st = trainer.step(asyncio.run(run_episodes(agent, batch, concurrency=cfg.loop.in_flight)))
            hist.append({k: v for k, v in st.items() if isinstance(v, int | float)})
            engine.update_weights(state_dict={k: v.detach().clone() for k, v in student.state_dict().items()})
            if (step + 1) % cfg.loop.save_every == 0 or step + 1 == cfg.opd.steps:
                save_training_state(out / "state", policy=student, optimizer=trainer.opt, step=step + 1, policy_version=2,
                                    data_cursor=step + 1, extra={"history": hist}, keep=2)
            log(f"OPD step {step + 1}/{cfg.opd.steps} reverse KL {st.get('reverse_kl', 0.0):.4f}")
    finally:
        engine.shutdown()
        pool.close()
    save_checkpoint(student, out / "checkpoint", policy_version=2)
    return {"checkpoint": str(out / "checkpoint"), "steps": len(hist), "teachers": experts, "resumed_from_step": start,
            "reverse_kl": [h.get("reverse_kl", 0.0) for h in hist], "pool": pool.stats().as_dict()}


def evaluation(cfg, student: str, baseline: str, envs: dict, experts: dict[str, str] | None = None, log=_quiet) -> dict:
    """Held-out pass@1 of the student and of the warm start (per domain and family), and of each domain's
    expert on its own domain (the teacher the student is measured against)."""
    from envs.dataset import read_dataset
    from envs.sandbox import make_sandbox
    from model import ByteTokenizer, load_checkpoint
    from trainers.sft import evaluate

    tok, sb = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    held = read_dataset(envs["eval"])
    after = evaluate(load_checkpoint(student), held, tok, sb, cfg.agent)
    log(f"student pass@1 {after['pass@1']:.3f} {after['domain']}")
    before = evaluate(load_checkpoint(baseline), held, tok, sb, cfg.agent)
    log(f"warm start pass@1 {before['pass@1']:.3f} {before['domain']}")
    teachers, teacher_pattern = {}, {}
    for dom, ckpt in (experts or {}).items():
        mine = [s for s in held if s.domain == dom]
        if mine:
            ev = evaluate(load_checkpoint(ckpt), mine, tok, sb, cfg.agent)
            teachers[dom] = ev["pass@1"]
            teacher_pattern.update(ev["pattern"])
    log(f"experts on their own domains: {teachers}")
    return {"pass@1_before": before["pass@1"], "pass@1_after": after["pass@1"], "domain_before": before["domain"],
            "domain_after": after["domain"], "family_before": before["family"], "family_after": after["family"],
            "pattern_before": before["pattern"], "pattern_after": after["pattern"], "pattern_teacher": teacher_pattern,
            "domain_teacher": teachers, "n_eval": len(held), "student": student}
