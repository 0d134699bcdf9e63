"""The base model recipe (`temper train base`): SFT on oracle trajectories of the task distribution with a
pattern curriculum, bounded in steps, then a card with held-out pass@1 per pattern and 95% intervals.

Real post-training starts from a pretrained base; on `tiny` the project trains its own once (an hour on two
CPU cores) and ships the result under `checkpoints/`, so `make run` starts RL from a competent policy.

Determinism: the data are the oracle replays of `generate([pattern], n_per_pattern, data_seed)`; the batch
of step s is drawn from `random.Random((data_seed, s))` over the curriculum stage active at s (uniform over
patterns, then over their segments); the lr is warmup-stable-decay (constant, then a cosine to
`final_lr_ratio` over the last `decay_steps`). So every run of a recipe shares its stable phase, and a resumed
run continues the same stream.
"""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from envs import TaskSpec
from envs.generator import generate
from envs.sandbox import Sandbox
from model import Transformer
from model.tokenizer import Tokenizer
from rollout.config import AgentConfig
from rollout.types import Segment

from .config import SLOPPY, SYNTH, BaseConfig, TrainConfig
from .sft import pad_segments
from .stats import summarize

CARD_JSON = "card.json"
CARD_MD = "CARD.md"


def base_data(bc: BaseConfig, tok: Tokenizer, sandbox: Sandbox, agent: AgentConfig) -> tuple[dict[str, list[Segment]], dict]:
    """Demonstration segments per pattern (the oracle's; the careless demonstrator's for `sloppy:PATTERN`; byte
    drills for `synth:KIND`) and a manifest (spec sha256 and token sha256 per pattern)."""
    from .sft import oracle_trajectories, sloppy_trajectories
    from .synthetic import synthetic_segments

    pools: dict[str, list[Segment]] = {}
    manifest: dict[str, dict] = {}
    for j, p in enumerate(bc.patterns):
        if p.startswith(SYNTH):
            segs = synthetic_segments(p.removeprefix(SYNTH), bc.n_synthetic, bc.data_seed + 1000 * j, tok)
            pools[p] = segs
            h = hashlib.sha256()
            for s in segs:
                h.update(json.dumps([s.tokens, s.loss_mask]).encode())
            manifest[p] = {"synthetic": True, "segments": len(segs), "tokens_sha256": h.hexdigest(),
                           "trainable_tokens": sum(s.n_trainable for s in segs)}
            continue
        sloppy = p.startswith(SLOPPY)
        specs = generate([p.removeprefix(SLOPPY)], bc.n_per_pattern, bc.data_seed + 1000 * j)
        trajs = (sloppy_trajectories if sloppy else oracle_trajectories)(specs, tok, sandbox, agent, concurrency=8)
        segs = [s for t in trajs for s in t.segments if any(s.loss_mask)]
        if not segs:
            raise ValueError(f"base.curriculum: pattern {p!r} produced no trainable demonstration segments")
        pools[p] = segs
        h = hashlib.sha256()
        for s in segs:
            h.update(json.dumps([s.tokens, s.loss_mask]).encode())
        manifest[p] = {"demonstrator": "sloppy" if sloppy else "oracle",
                       "specs": len(specs), "trajectories": len(trajs), "segments": len(segs),
                       "spec_sha256": hashlib.sha256("".join(s.spec_hash for s in specs).encode()).hexdigest(),
                       "tokens_sha256": h.hexdigest(), "trainable_tokens": sum(s.n_trainable for s in segs)}
    return pools, manifest


def batch_at(bc: BaseConfig, pools: dict[str, list[Segment]], step: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of optimizer step `step` (a pure function of the config, the data and the step)."""
    rng = random.Random(f"{bc.data_seed}:{step}")
    pats = bc.stage_at(step).patterns
    pick = []
    for _ in range(bc.batch_size):
        segs = pools[pats[rng.randrange(len(pats))]]
        pick.append(segs[rng.randrange(len(segs))])
    return pad_segments(pick, pad_id)


def decay_progress(bc: BaseConfig, step: int, total: int) -> float:
    """Where step `step` of a `total`-step run sits in the decay phase: 0 through the stable phase, rising to 1
    over the last `decay_steps` steps (the LM trainer's cosine goes from lr to final_lr_ratio·lr over it)."""
    decay_from = total - min(bc.decay_steps, total)
    return max(0.0, (step - decay_from) / max(1, total - decay_from))


def eval_specs(bc: BaseConfig) -> list[TaskSpec]:
    """The card's held-out tasks: `n_eval_per_pattern` fresh instances of every curriculum task pattern
    (synthetic ones have no environment), interleaved (so any prefix covers every pattern)."""
    pats = bc.task_patterns
    return generate(pats, bc.n_eval_per_pattern * len(pats), bc.eval_seed)


def card_eval(model: Transformer, specs: list[TaskSpec], tok: Tokenizer, sandbox: Sandbox, agent: AgentConfig) -> dict:
    """Greedy pass@1 with 95% Wilson intervals per pattern, per domain and overall, plus per-task rewards."""
    from .sft import evaluate, pattern_key

    ev = evaluate(model, specs, tok, sandbox, agent)
    rewards = [t.reward for t in ev["trajectories"]]
    by_pat, by_dom = defaultdict(list), defaultdict(list)
    for s, r in zip(specs, rewards):
        by_pat[pattern_key(s)].append(r)
        by_dom[s.domain].append(r)
    return {"pattern": {k: summarize(v) for k, v in by_pat.items()},
            "domain": {k: summarize(v) for k, v in sorted(by_dom.items())},
            "all": summarize(rewards), "rewards": rewards, "trajectories": ev["trajectories"]}


def tokens_sha256(trajs) -> str:
    """sha256 of every segment's token ids of `trajs`, in order: greedy episodes repeat exactly."""
    h = hashlib.sha256()
    for t in trajs:
        for s in t.segments:
            h.update(json.dumps(s.tokens).encode())
    return h.hexdigest()


def weights_sha256(ckpt: str | Path) -> str:
    h = hashlib.sha256()
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


def _commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).parent).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def train_base(cfg, out: Path, tok: Tokenizer, sandbox: Sandbox, steps: int | None = None,
               log: Callable[[str], None] = print, phase1: str | Path | None = None) -> tuple[Transformer, dict]:
    """Run the recipe into `out` (resumable from `out/state`); returns the model and the training record.
    Snapshots every `base.snapshot_every` steps land in `out/snapshots/step-N` (HF layout).

    `steps` is the first phase's length (default `base.steps`). With `base.phase2`, `base.phase2.steps` more
    steps follow from the first phase's final weights (its snapshot `out/snapshots/step-<steps>`, whose sha256
    the record keeps) with a fresh AdamW at a constant lr; `phase1` (a checkpoint of those weights) skips the
    first phase and runs only the second."""
    from model import load_checkpoint, save_checkpoint

    from .checkpoint import complete_checkpoints, load_training_state, restore, save_training_state
    from .lm import LMTrainer, TimeCapExceeded

    bc: BaseConfig = cfg.base
    p1 = steps or bc.steps
    p2 = bc.phase2
    total = p1 + (p2.steps if p2 else 0)
    if phase1 is not None and p2 is None:
        raise ValueError("phase1: the recipe has one phase (base.phase2 is not set), so there is no second phase "
                         "to run from given first-phase weights")
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    cache = out / "data.pt"
    key = json.dumps([bc.patterns, bc.n_per_pattern, bc.n_synthetic, bc.data_seed, cfg.agent.model_dump(mode="json")])
    if cache.exists() and (blob := torch.load(cache, weights_only=False))["key"] == key:
        pools, manifest = blob["pools"], blob["manifest"]  # the same oracle replays: regenerate only on change
    else:
        pools, manifest = base_data(bc, tok, sandbox, cfg.agent)
        torch.save({"key": key, "pools": pools, "manifest": manifest}, cache)
    log(f"base data: {sum(m['segments'] for m in manifest.values())} oracle segments over {len(pools)} patterns "
        f"({time.perf_counter() - t0:.0f} s)")
    tc = TrainConfig(**{**cfg.train.model_dump(), "lr": bc.lr, "warmup_steps": bc.warmup_steps,
                        "min_lr_ratio": bc.final_lr_ratio,
                        "batch_size": bc.batch_size, "max_steps": p1, "max_seconds": bc.max_seconds,
                        "mtp_train_steps": bc.mtp_train_steps})
    model = Transformer(cfg.model)
    trainer = LMTrainer(model, tc)
    second = None
    if p2:
        second = LMTrainer(model, tc.model_copy(update={"lr": p2.lr, "warmup_steps": p2.warmup_steps,
                                                        "min_lr_ratio": 1.0, "max_steps": p2.steps}))
    bc2 = bc.with_phase2(p1)
    losses: list[float] = []
    elapsed = 0.0
    phase1_sha = None
    if complete_checkpoints(out / "state"):
        st = load_training_state(out / "state")
        in_p2 = second is not None and st.step > p1  # a state at step p1 is the first phase's last
        restore(st, model, (second if in_p2 else trainer).opt)
        if in_p2:
            trainer.step_no, second.step_no = p1, st.step - p1
        else:
            trainer.step_no = st.step
        losses, elapsed = list(st.extra["loss"]), float(st.extra["elapsed"])
        phase1_sha = st.extra.get("phase1_weights_sha256")
        log(f"base: resumed at step {st.step}")
    elif phase1 is not None:
        src = load_checkpoint(phase1)
        model.load_state_dict(src.state_dict())
        trainer.step_no = p1
        phase1_sha = weights_sha256(phase1)
        log(f"base: the first phase's weights from {phase1} (sha256 {phase1_sha[:12]}…); second phase only")
    start = time.perf_counter() - elapsed

    def at() -> int:
        return trainer.step_no + (second.step_no if second else 0)

    while at() < total:
        if time.perf_counter() - start > bc.max_seconds:
            raise TimeCapExceeded(f"base training hit its safety cap base.max_seconds={bc.max_seconds:g} at step "
                                  f"{at()} of {total}")
        step = at()
        if step < p1:
            s = trainer.step(*batch_at(bc, pools, step, tok.pad_id), progress=decay_progress(bc, step, p1),
                             dense=step < bc.dense_steps)
        else:
            s = second.step(*batch_at(bc2, pools, step, tok.pad_id), progress=0.0, dense=False)
        losses.append(round(s.loss, 5))
        step = at()
        if step % 50 == 0 and step % bc.snapshot_every:
            log(f"base step {step}/{total}: loss {sum(losses[-50:]) / 50:.4f} ({time.perf_counter() - start:.0f} s)")
        if step % bc.snapshot_every == 0 or step in (p1, total):
            save_checkpoint(model, out / "snapshots" / f"step-{step}", policy_version=0)
            if step == p1 and second is not None:  # the first phase's final weights: phase 2 starts from them
                phase1_sha = weights_sha256(out / "snapshots" / f"step-{step}")
            save_training_state(out / "state", policy=model, optimizer=(trainer if step <= p1 else second).opt,
                                step=step, policy_version=0, data_cursor=step, keep=1,
                                extra={"loss": losses, "elapsed": time.perf_counter() - start,
                                       "phase1_weights_sha256": phase1_sha})
            window = losses[-bc.snapshot_every:]
            log(f"base step {step}/{total}: loss {sum(window) / len(window):.4f} "
                f"({time.perf_counter() - start:.0f} s)")
    record = {"steps": total, "data": manifest, "loss_first_last": [losses[0], losses[-1]] if losses else [],
              "train_seconds": round(time.perf_counter() - start, 1)}
    if p2:
        record["phases"] = {"phase1_steps": p1, "phase2_steps": p2.steps, "phase1_weights_sha256": phase1_sha,
                            "phase1_from": str(phase1) if phase1 is not None else None}
    return model, record


def write_card(ckpt: Path, cfg, record: dict, ev: dict, specs: list[TaskSpec], command: str) -> dict:
    """card.json + CARD.md next to the weights."""
    bc: BaseConfig = cfg.base
    n = min(bc.sample_size, len(specs))
    card = {
        "command": command, "seed": cfg.seed, "commit": _commit(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "recipe": bc.model_dump(mode="json", exclude={"checkpoint"}), "model": cfg.model.model_dump(mode="json"),
        "agent": cfg.agent.model_dump(mode="json"), "steps": record["steps"], "data": record["data"],
        "train_seconds": record.get("train_seconds"), "loss_first_last": record.get("loss_first_last"),
        "phases": record.get("phases"),
        "weights_sha256": weights_sha256(ckpt),
        "eval": {"seed": bc.eval_seed, "n_per_pattern": bc.n_eval_per_pattern, "n": len(specs), "greedy": True,
                 "pattern": ev["pattern"], "domain": ev["domain"], "all": ev["all"]},
        "sample": {"n": n, "spec_ids": [s.id for s in specs[:n]], "rewards": ev["rewards"][:n],
                   "tokens_sha256": tokens_sha256(ev["trajectories"][:n])},
    }
    (ckpt / CARD_JSON).write_text(json.dumps(card, indent=1))
    ph = record.get("phases")
    how = (f"{record['steps']} steps" if not ph else
           f"{ph['phase1_steps']} steps, then a second phase of {ph['phase2_steps']} steps that adds "
           + ", ".join(f"`{p}`" for p in bc.phase2.add_patterns)
           + f" (from the first phase's weights, sha256 `{ph['phase1_weights_sha256']}`)")
    if any(p.startswith(SLOPPY) for p in bc.patterns):
        how += (". A `sloppy:P` pool holds P's tasks demonstrated by its family's careless demonstrator (the "
                "family's typical mistake, which its verifier refuses), drawn as often as the pattern is listed")
    rows = "\n".join(f"| `{k}` | {v['pass@1']:.2f} | [{v['ci95'][0]:.2f}, {v['ci95'][1]:.2f}] | {v['n']} |"
                     for k, v in [*ev["pattern"].items(), *ev["domain"].items(), ("all", ev["all"])])
    (ckpt / CARD_MD).write_text(
        f"# base policy, {record['steps']} steps\n\nThe base policy of the `tiny` preset: SFT on oracle "
        f"trajectories of the task patterns with a curriculum, {how}.\n\n"
        f"```bash\n{command}\n```\n\nseed {cfg.seed} · commit "
        f"`{card['commit']}` · weights sha256 `{card['weights_sha256']}`\n\nHeld-out greedy pass@1 (fresh "
        f"instances, seed {bc.eval_seed}), 95% Wilson intervals:\n\n| pattern / domain | pass@1 | 95% CI | n |\n"
        f"|---|---|---|---|\n{rows}\n\nData (oracle replays per pattern; sha256 of the specs and of the token "
        f"streams) and the full recipe are in `card.json`.\n")
    return card
