"""`warm_start`: the checkpoint an iteration starts from (the shipped base, or iteration N-1's hand-off), and
the checks that it is the model it claims to be."""

from __future__ import annotations

import json
from pathlib import Path

from .common import (
    WARM_VERSION,
    _no_metrics,
    _quiet,
    under_torchrun,
)


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


def recipe_mismatch(card: dict, bc) -> list[str]:
    """How the base's card says its demonstrations were drawn, where that differs from the preset's `base` section
    (which the held-out set is kept disjoint from: `stages/env_sets.py`); [] when they agree or the card has no
    recipe. A mismatch would leave tasks the base was trained on in the held-out set, unseen."""
    from trainers.config import BaseConfig

    if not card.get("recipe"):
        return []
    theirs = BaseConfig.model_validate({k: v for k, v in card["recipe"].items() if k in BaseConfig.model_fields})
    out = [f"base.{k}: {getattr(theirs, k)!r} on the card, {getattr(bc, k)!r} here"
           for k in ("n_per_pattern", "data_seed") if getattr(theirs, k) != getattr(bc, k)]
    if theirs.patterns != bc.patterns:  # a pattern's data seed is its index in this list
        a, b = set(theirs.patterns), set(bc.patterns)
        what = (f"only on the card {sorted(a - b)}, only here {sorted(b - a)}" if a != b else
                "the same patterns in another order (a pattern's data seed is its place)")
        out.append(f"base.curriculum / base.phase2.add_patterns: {what}")
    return out


def check_recipe(bc, card: dict | None = None) -> None:
    """ValueError when `base.checkpoint`'s card (`card`, else read from the checkpoint) was drawn by another recipe
    than `bc` (the preset's `base`)."""
    from trainers.base import CARD_JSON

    if not bc.checkpoint:
        return
    if card is None:
        card_path = resolve_base(bc.checkpoint) / CARD_JSON
        card = json.loads(card_path.read_text()) if card_path.exists() else {}
    if diff := recipe_mismatch(card, bc):
        raise ValueError(f"base: the held-out set is kept disjoint from the preset's base recipe, but "
                         f"{bc.checkpoint} was trained on another ({'; '.join(diff)}): set these keys to its card's "
                         "recipe")


def hand_off(rule: str, student: str, warm_start: str, champion_moved: bool, better: bool) -> tuple[str, str]:
    """The checkpoint iteration N hands to N+1 as its warm start, and why (`hand_off` in the config), from N's
    validation decision (`stages.decision`): under "better", the student when it was better than its warm start on
    the validation set (more tasks gained than lost, no domain significantly down); under "champion", the student
    only when it became the champion (a significant gain); otherwise N's own warm start. Under "student", the
    student."""
    if rule == "student":
        return student, "its student (hand_off: student)"
    if rule not in ("better", "champion"):
        raise ValueError(f"hand_off: {rule!r} is not one of 'better', 'champion', 'student'")
    if rule == "champion" and champion_moved:
        return student, "its student, the new champion"
    if rule == "better" and better:
        return student, ("its student, better than its warm start on the validation set (more tasks gained than "
                         "lost, no domain significantly down)")
    why = ("did not become the champion (no significant gain)" if rule == "champion" else
           "was not better on the validation set (no more tasks gained than lost, or a domain significantly down)")
    return warm_start, (f"its warm start: its student {why}, so the next iteration retries from the same policy on "
                        "fresh environments")


def hand_off_of(rule: str, evaluation: dict, warm_start: str, student: str | None = None) -> tuple[str, str]:
    """`hand_off` on an evaluation's result (`evaluation.json`): its registered champion move and its validation
    decision's `better` verdict; `student` defaults to the evaluation's own."""
    return hand_off(rule, evaluation["student"] if student is None else student, warm_start,
                    bool((evaluation.get("registered") or {}).get("champion_moved")),
                    bool((evaluation.get("decision") or {}).get("better")))


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
    from trainers.checkpoint import complete_checkpoints, load_training_state, restore, save_training_state
    from trainers.lm import LMTrainer, train_lm
    from trainers.runtime import make_train_backend
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
        check_recipe(cfg.base, card)
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
