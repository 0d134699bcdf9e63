"""Staleness ablation: SAO at bound τ ∈ {0, 2, 4} vs naive async PPO (no bound) vs synchronous GRPO.

    python bench/staleness_ablation.py --steps 30 --seeds 0 1 2                 # from the shipped base
    python bench/staleness_ablation.py --preset micro --steps 2 --seeds 0      # smoke run from a random init

τ counts policy versions. Every async run pushes the trainer's weights to the engine after every updating
step (`loop.push_every = 1`: one new policy version per actor update), and keeps `--in-flight` episodes
running (by default 4 × the batch size), so a trajectory finishes — and waits in the queue — while the
trainer makes several versions: its oldest generated token is `lag` versions behind the trainer when it is
trained on. SAO bounds the lag at τ in two places: admission control starts an episode only if, trained in its
turn, it would be within τ versions (`loop.bound_admission`, so `--in-flight` is a ceiling: at most τ + 1 batches
run ahead of the trainer), and the trainer drops every sample that still finished with lag > τ
(`--no-admission`: the drop alone, with every episode in flight). Naive async PPO (symmetric clip, no band mask,
no bound) trains on all of them; GRPO generates synchronously in groups of 4 (lag 0 by construction). SAO at τ = 0
is synchronous SAO: each batch starts on the weights of the step before it.

Reported per config (mean ± standard deviation over `--seeds`):
* stale share: samples dropped by the staleness bound / samples that reached the trainer, and the mean reward
  and trainable length of the kept and of the dropped samples (what the bound selects for),
* lag of the trained samples in policy versions (mean and max), and the mean lag of every sample received
  (what the bound cut from), and the number of updating steps (versions made),
* final reward (mean batch reward over the last third of the steps), its spread, the largest |KL|, and
  held-out pass@1 after training.
Training runs on the preset's RL set (environments SFT never saw).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from common import progress  # also puts the repository root on sys.path

import configs
from envs import make_sandbox
from model import ByteTokenizer, Transformer, load_checkpoint
from stages.env_sets import train_and_held_out
from trainers.loop import RLLoop
from trainers.sft import evaluate


def _actor(cfg, init: str | None):
    if init is None and cfg.base.checkpoint:  # the preset's shipped base: where iteration 1's RL starts
        from stages import resolve_base

        init = str(resolve_base(cfg.base.checkpoint))
    return load_checkpoint(init) if init else Transformer(cfg.model)


def _eval(cfg, model, held, tok, sb) -> dict:
    return evaluate(model, held, tok, sb, cfg.agent, n_slots=cfg.loop.n_slots, concurrency=cfg.loop.batch_in_flight)


def _instrument(trainer) -> dict:
    """Record, at every `select`, each received sample's lag (trainer version − its oldest generated token's
    version) and whether the trainer kept it."""
    rec: dict = {"seen": 0, "lag_all": [], "lag_kept": [], "reward_kept": [], "reward_stale": [], "len_kept": [],
                 "len_stale": []}
    select = trainer.select

    def wrapped(trajs, current_version):
        kept = select(trajs, current_version)
        keep = {id(t) for t in kept}
        rec["seen"] += len(trajs)
        for t in trajs:
            oldest = t.policy_versions()[0]
            if oldest < 0:
                continue  # nothing generated (a crashed episode)
            lag = current_version - oldest
            rec["lag_all"].append(lag)
            if id(t) in keep:
                rec["lag_kept"].append(lag)
            which = "kept" if id(t) in keep else "stale" if lag > (trainer.cfg.staleness or 0) else None
            if which:  # what the bound cut: the outcome and length of the kept and the dropped episodes
                rec[f"reward_{which}"].append(t.reward)
                rec[f"len_{which}"].append(t.n_trainable)
        return kept

    trainer.select = wrapped
    return rec


def run_one(cfg, args, specs, held, method: str, tau: int | None, seed: int, tok, sb, bar=None) -> dict:
    random.seed(seed)
    torch.manual_seed(seed)
    # the same warm start for every seed and method (a random init is drawn from the preset's seed)
    if not args.init:
        torch.manual_seed(cfg.seed)
    actor = _actor(cfg, args.init)
    torch.manual_seed(seed)
    batch = args.batch_size or cfg.loop.batch_size
    in_flight = args.in_flight or 4 * batch
    if method == "sao":
        sao = cfg.sao.model_copy(update={"loss": "sao", "staleness": tau})
        lc = cfg.loop.model_copy(update={"mode": "async", "push_every": 1, "batch_size": batch,
                                         "in_flight": in_flight, "seed": seed, "bound_admission": args.admission})
    elif method == "ppo":
        sao = cfg.sao.model_copy(update={"loss": "ppo", "staleness": None})
        lc = cfg.loop.model_copy(update={"mode": "async", "push_every": 1, "batch_size": batch,
                                         "in_flight": in_flight, "seed": seed})
    elif method == "grpo":
        sao = cfg.sao.model_copy(update={"loss": "grpo", "staleness": None})
        lc = cfg.loop.model_copy(update={"mode": "sync", "push_every": 1, "group_size": 4, "batch_size": batch,
                                         "seed": seed})
    else:
        raise ValueError(f"method {method!r}: expected sao, ppo or grpo")
    # the agent samples with a seed per environment and turn: moving it with the seed makes seeds replicates
    # (with one agent seed, sync GRPO would draw the very same episodes on every seed)
    agent = cfg.agent if cfg.agent.seed is None else cfg.agent.model_copy(update={"seed": cfg.agent.seed + seed})
    loop = RLLoop(actor, specs, tok, sb, agent, sao, lc, version=1)
    rec = _instrument(loop.trainer)
    t = time.perf_counter()
    hist = loop.run(args.steps, on_step=(lambda _h: bar.advance()) if bar else None)
    dt = time.perf_counter() - t
    tail = [h["batch_reward"] for h in hist[-max(1, len(hist) // 3):]]
    ev = _eval(cfg, actor, held, tok, sb) if args.eval else {"pass@1": float("nan")}
    stale = loop.trainer.dropped["stale"]
    return {"method": method, "tau": tau, "seed": seed, "in_flight": in_flight if method != "grpo" else None,
            "final_reward": statistics.mean(tail), "reward_std": statistics.pstdev(tail),
            "max_kl": max((abs(h.get("kl", 0.0)) for h in hist), default=0.0),
            "updates": sum(bool(h.get("updated")) for h in hist), "seen": rec["seen"], "dropped_stale": stale,
            "stale_share": stale / rec["seen"] if rec["seen"] else 0.0,
            "lag_mean": float(statistics.mean(rec["lag_kept"])) if rec["lag_kept"] else 0.0,
            "lag_max": max(rec["lag_kept"], default=0),
            "lag_mean_received": float(statistics.mean(rec["lag_all"])) if rec["lag_all"] else 0.0,
            **{k: float(statistics.mean(rec[k])) if rec[k] else float("nan")
               for k in ("reward_kept", "reward_stale", "len_kept", "len_stale")},
            "pass@1": ev["pass@1"], "seconds": dt, "rewards": [h["batch_reward"] for h in hist]}


def _ms(xs: list[float], fmt: str = ".3f") -> str:
    if any(x != x for x in xs):  # NaN: not measured (--no-eval)
        return "n/a"
    m = statistics.mean(xs)
    s = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{m:{fmt}} ± {s:{fmt}}"


def _table(title: str, header: list[str], rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for h in header:
        t.add_column(h, justify="right", no_wrap=True)
    for r in rows:
        t.add_row(*map(str, r))
    Console(width=max(200, Console().width)).print(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("-o", "--override", action="append", default=[])
    ap.add_argument("--init", default=None,
                    help="warm-start checkpoint; default: the preset's base.checkpoint (tiny: the shipped base), else a "
                         "random init (a smoke run: it rarely earns a reward, so it makes few or no updates)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--taus", "--staleness", dest="taus", default="0,2,4",
                    help="SAO staleness bounds τ, in policy versions (comma-separated)")
    ap.add_argument("--methods", default="sao,ppo,grpo", help="sao runs once per τ; ppo and grpo once")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--batch-size", type=int, default=None, help="default: the preset's loop.batch_size")
    ap.add_argument("--in-flight", type=int, default=None, help="episodes in flight (default 4 × batch size)")
    ap.add_argument("--no-eval", dest="eval", action="store_false", help="skip held-out pass@1")
    ap.add_argument("--no-admission", dest="admission", action="store_false",
                    help="SAO without admission control: every episode in flight, the stale ones dropped")
    ap.add_argument("--out", default="runs/bench-ablation.json")
    args = ap.parse_args()
    cfg = configs.load(args.preset, args.override)
    tok, sb = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    specs, held = train_and_held_out(cfg, rl=True)  # the RL set (environments SFT never saw) and the held-out set
    if args.eval:
        torch.manual_seed(cfg.seed)
        base = _eval(cfg, _actor(cfg, args.init), held, tok, sb)["pass@1"]
    else:
        base = float("nan")
    methods = args.methods.split(",")
    grid: list[tuple[str, int | None]] = []
    if "sao" in methods:
        grid += [("sao", int(s)) for s in args.taus.split(",")]
    grid += [(m, None) for m in methods if m in ("ppo", "grpo")]
    runs, rows = [], []
    with progress("loop steps", len(grid) * len(args.seeds) * args.steps) as bar:
        for method, tau in grid:
            runs += _cell(cfg, args, specs, held, method, tau, tok, sb, bar, rows)
    _report(args, base, runs, rows)


def _cell(cfg, args, specs, held, method, tau, tok, sb, bar, rows) -> list[dict]:
    """One (method, τ) of the grid over every seed; its table row is appended to `rows`."""
    mine = []
    for seed in args.seeds:
        bar.note(f"{method} τ={tau} seed {seed}" if tau is not None else f"{method} seed {seed}")
        r = run_one(cfg, args, specs, held, method, tau, seed, tok, sb, bar)
        mine.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "rewards"}), flush=True)
    col = lambda k: [float(r[k]) for r in mine]  # noqa: E731
    name = {"sao": f"SAO τ={tau}" + ("" if args.admission else ", drop only"), "ppo": "async PPO, no bound",
            "grpo": "sync GRPO"}[method]
    rows.append([name, _ms(col("stale_share")),
                 f"{_ms(col('reward_kept'), '.2f')} / {_ms(col('reward_stale'), '.2f')}",
                 f"{_ms(col('len_kept'), '.0f')} / {_ms(col('len_stale'), '.0f')}",
                 _ms(col("lag_mean"), ".2f"), _ms(col("lag_max"), ".1f"),
                 _ms(col("lag_mean_received"), ".2f"), _ms(col("updates"), ".1f"), _ms(col("final_reward")),
                 _ms(col("reward_std")), _ms(col("max_kl")), _ms(col("pass@1")), f"{sum(col('seconds')):.0f}"])
    return mine


def _report(args, base: float, runs: list[dict], rows: list[list[str]]) -> None:
    _table(f"staleness ablation on {args.preset}: {args.steps} steps, seeds {args.seeds}, push every update, "
           f"τ in policy versions (pass@1 before: {base:.2f}; mean ± std over seeds)",
           ["config", "stale share", "reward kept / dropped", "tokens kept / dropped", "lag mean (trained)",
            "lag max (trained)", "lag mean (received)", "updates",
            "final reward", "reward std", "max |KL|", "pass@1 after", "seconds"], rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(runs, indent=1))

if __name__ == "__main__":
    main()
