"""The stages of one post-training iteration as plain functions (no Dagster): the assets in `assets/`
call these and record what they return as metadata. Every stage reads and writes files under the
iteration's run directory, so a stage can be re-run (or inspected) on its own.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path


def _dump(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str))


def env_specs(cfg, out: Path) -> dict:
    from envs.dataset import write_dataset
    from envs.generator import generate

    e = cfg.envs
    train = write_dataset(generate(e.patterns, e.n_train, e.seed), out / "train", {"seed": e.seed})
    held = write_dataset(generate(e.patterns, e.n_eval, e.eval_seed), out / "eval", {"seed": e.eval_seed})
    return {"train": str(out / "train"), "eval": str(out / "eval"), "n_train": train["n"], "n_eval": held["n"],
            "families": train["families"], "sha256": train["sha256"]}


def verified_envs(cfg, specs: dict, out: Path) -> dict:
    from envs import make_sandbox
    from envs.dataset import read_dataset, write_dataset
    from envs.gate import acceptance, validate

    sb = make_sandbox(cfg.envs.sandbox)
    train = read_dataset(specs["train"])
    reports = [validate(s, sb, probes=cfg.envs.probes) for s in train]
    ok = [s for s, r in zip(train, reports) if r.accepted]
    write_dataset(ok, out / "train", {"validated_from": specs["train"]})
    _dump(out / "validation.json", [r.to_dict() for r in reports])
    probe_hits = sum(1 for r in reports if r.accepted for p in r.probes.values() if p.get("reward", 0) > 0)
    return {"train": str(out / "train"), "eval": specs["eval"], "accepted": len(ok), "total": len(train),
            "acceptance": acceptance(reports), "triad_pass_rate": len(ok) / max(1, len(train)),
            "accepted_probe_hits": probe_hits}


def warm_start(cfg, envs: dict, out: Path, parent_checkpoint: str | None) -> dict:
    """Iteration 1: SFT on oracle trajectories; later iterations start from the previous student."""
    from envs.dataset import read_dataset
    from envs.sandbox import make_sandbox
    from model import ByteTokenizer, Transformer, load_checkpoint, save_checkpoint
    from trainers.lm import train_lm
    from trainers.sft import evaluate, oracle_trajectories, sft_batches

    tok, sb = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    held = read_dataset(envs["eval"])
    if parent_checkpoint:
        model = load_checkpoint(parent_checkpoint)
        steps = 0
    else:
        trajs = oracle_trajectories(read_dataset(envs["train"]), tok, sb, cfg.agent)
        model = Transformer(cfg.model)
        steps = len(train_lm(model, sft_batches(trajs, cfg.train.batch_size, tok.pad_id, cfg.seed), cfg.train))
    ev = evaluate(model, held, tok, sb, cfg.agent)
    save_checkpoint(model, out / "checkpoint", policy_version=1)
    return {"checkpoint": str(out / "checkpoint"), "parent": parent_checkpoint, "sft_steps": steps,
            "pass@1": ev["pass@1"], "domain": ev["domain"]}


def rollout_batches(cfg, checkpoint: str, envs: dict, store_path: Path, iteration: int) -> dict:
    """Sample one rollout per verified environment with the warm-start policy into the trajectory store."""
    from envs.dataset import read_dataset
    from envs.sandbox import make_sandbox
    from model import ByteTokenizer, load_checkpoint
    from rollout.agent import Agent, EnginePolicy, run_episodes
    from rollout.engine import Engine
    from store import TrajectoryStore

    tok, sb = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    engine = Engine(load_checkpoint(checkpoint), tok, n_slots=cfg.loop.n_slots, max_len=cfg.agent.max_context + 8)
    try:
        agent = Agent(EnginePolicy(engine), tok, sb, cfg.agent)
        trajs = asyncio.run(run_episodes(agent, read_dataset(envs["train"]), iteration, cfg.loop.in_flight))
    finally:
        engine.shutdown()
    with TrajectoryStore(store_path) as st:
        n = st.write(trajs)
        export = st.export_parquet(iteration, store_path.parent / "parquet")
    return {"trajectories": n, "tokens": sum(t.n_tokens for t in trajs), "store": str(store_path), "parquet": str(export)}


def rewards(store_path: Path, iteration: int) -> dict:
    from store import TrajectoryStore

    with TrajectoryStore(store_path, read_only=True) as st:
        return st.stats(iteration)


def sao_expert(cfg, checkpoint: str, envs: dict, domain: str, out: Path) -> dict:
    from envs.dataset import read_dataset
    from envs.sandbox import make_sandbox
    from model import ByteTokenizer, load_checkpoint, save_checkpoint
    from trainers.loop import RLLoop

    tok, sb = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    specs = [s for s in read_dataset(envs["train"]) if s.domain == domain]
    model = load_checkpoint(checkpoint)
    if not specs or cfg.loop.steps == 0:
        save_checkpoint(model, out / "checkpoint", policy_version=1)
        return {"checkpoint": str(out / "checkpoint"), "steps": 0, "domain": domain}
    loop = RLLoop(model, specs, tok, sb, cfg.agent, cfg.sao, cfg.loop, version=1)
    hist = loop.run(cfg.loop.steps)
    save_checkpoint(model, out / "checkpoint", policy_version=loop.version)
    return {"checkpoint": str(out / "checkpoint"), "steps": len(hist), "domain": domain, "version": loop.version,
            "reward_curve": [h.get("batch_reward", 0.0) for h in hist]}


def opd_student(cfg, init: str, experts: dict[str, str], envs: dict, out: Path) -> dict:
    from envs.dataset import read_dataset
    from envs.sandbox import make_sandbox
    from model import ByteTokenizer, load_checkpoint, save_checkpoint
    from rollout.agent import Agent, EnginePolicy, run_episodes
    from rollout.engine import Engine
    from trainers.opd import OPDTrainer
    from trainers.teachers import TeacherPool

    tok, sb = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    student = load_checkpoint(init)
    specs = [s for s in read_dataset(envs["train"]) if s.domain in experts]
    pool = TeacherPool(experts, max_resident=1)
    trainer = OPDTrainer(student, pool, cfg.opd)
    engine = Engine(load_checkpoint(init), tok, n_slots=cfg.loop.n_slots, max_len=cfg.agent.max_context + 8)
    hist = []
    try:
        for step in range(cfg.opd.steps if specs else 0):
            batch = [specs[(step * cfg.loop.batch_size + i) % len(specs)] for i in range(cfg.loop.batch_size)]
            agent = Agent(EnginePolicy(engine), tok, sb, cfg.agent)
            hist.append(trainer.step(asyncio.run(run_episodes(agent, batch, concurrency=cfg.loop.in_flight))))
            engine.update_weights(state_dict={k: v.detach().clone() for k, v in student.state_dict().items()})
    finally:
        engine.shutdown()
        pool.close()
    save_checkpoint(student, out / "checkpoint", policy_version=2)
    return {"checkpoint": str(out / "checkpoint"), "steps": len(hist), "teachers": experts,
            "reverse_kl": [h.get("reverse_kl", 0.0) for h in hist], "pool": pool.stats().as_dict()}


def evaluation(cfg, student: str, baseline: str, envs: dict) -> dict:
    from envs.dataset import read_dataset
    from envs.sandbox import make_sandbox
    from model import ByteTokenizer, load_checkpoint
    from trainers.sft import evaluate

    tok, sb = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    held = read_dataset(envs["eval"])
    after = evaluate(load_checkpoint(student), held, tok, sb, cfg.agent)
    before = evaluate(load_checkpoint(baseline), held, tok, sb, cfg.agent)
    return {"pass@1_before": before["pass@1"], "pass@1_after": after["pass@1"], "domain_before": before["domain"],
            "domain_after": after["domain"], "student": student}
