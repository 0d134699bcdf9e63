"""`sao_expert`: one domain expert trained with SAO from the warm start (resumable), and what it reads back
from the store."""

from __future__ import annotations

from pathlib import Path

from rollout.crashes import CrashedShareExceeded

from .common import (
    SAO_CURVES,
    WARM_VERSION,
    _backend,
    _no_metrics,
    _quiet,
    under_torchrun,
)
from .environments import rl_set
from .recorder import Recorder
from .warm import _rank_checksums


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
    from trainers.checkpoint import complete_checkpoints, load_training_state
    from trainers.loop import RLLoop
    from trainers.runtime import make_train_backend

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
            "trained_tokens": int(sum(h.get("tokens", 0) for h in hist)),  # the scaling curve's compute
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
