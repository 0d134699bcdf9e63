"""`temper train sft | sao | opd | resume`: the trainers from the command line, with progress bars.

    temper train sft --preset tiny --out runs/sft
    temper train sao --preset tiny --init runs/sft/checkpoint --steps 40 --out runs/sao
    temper train opd --preset tiny --init runs/sft/checkpoint --teacher code=runs/sao-code/checkpoint ... --out runs/opd
    temper train resume --out runs/sao          # continue a killed SAO run from its last checkpoint

Each run writes `run.json` (the resolved config and arguments), training checkpoints under
`state/` (atomic, resumable), the final policy in HF layout under `checkpoint/`, and `report.json`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def _setup(args, rl: bool = False):
    """(config, tokenizer, sandbox, training environments, held-out environments). With `rl`, the
    training environments are the preset's RL set (`envs.n_rl` at `envs.rl_seed`) when it has one."""
    import configs
    from envs import make_sandbox
    from model import ByteTokenizer
    from stages.env_sets import train_and_held_out

    cfg = configs.load(args.preset, args.override)
    tok = ByteTokenizer()
    sandbox = make_sandbox(cfg.envs.sandbox)
    train, held = train_and_held_out(cfg, rl)  # the pipeline's sets: hashed seeds, held out by content
    return cfg, tok, sandbox, train, held


def _progress(con, total: float, label: str):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    prog = Progress(TextColumn(label), BarColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                    console=con, transient=True)
    return prog, prog.add_task("", total=total)


def cmd_sft(args) -> int:
    import torch
    from rich.console import Console

    from model import Transformer, load_checkpoint, save_checkpoint
    from trainers.lm import train_lm
    from trainers.sft import evaluate, oracle_trajectories, sft_batches

    con = Console()
    cfg, tok, sandbox, train, held = _setup(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text(json.dumps({"command": "sft", "args": vars(args), "config": cfg.model_dump(mode="json")},
                                             indent=1, default=str))
    torch.manual_seed(cfg.seed)
    model = load_checkpoint(args.init) if args.init else Transformer(cfg.model)
    trajs = oracle_trajectories(train, tok, sandbox, cfg.agent)
    con.print(f"SFT data: {len(trajs)} oracle trajectories ({sum(t.n_trainable for t in trajs):,} trainable tokens)")
    before = evaluate(model, held, tok, sandbox, cfg.agent)
    prog, task = _progress(con, cfg.train.max_seconds, "sft")
    t0 = time.perf_counter()
    with prog:
        hist = train_lm(model, sft_batches(trajs, cfg.train.batch_size, tok.pad_id, cfg.seed), cfg.train,
                        lambda s: prog.update(task, completed=time.perf_counter() - t0, description=f"loss {s.loss:.3f}"))
    after = evaluate(model, held, tok, sandbox, cfg.agent)
    save_checkpoint(model, out / "checkpoint", policy_version=1)
    rep = {"steps": len(hist), "loss": [hist[0].loss, hist[-1].loss], "pass@1_before": before["pass@1"],
           "pass@1_after": after["pass@1"], "domain_after": after["domain"], "family_after": after["family"]}
    (out / "report.json").write_text(json.dumps(rep, indent=1))
    con.print(f"SFT {len(hist)} steps, loss {hist[0].loss:.3f} → {hist[-1].loss:.3f}; held-out pass@1 "
              f"{before['pass@1']:.2f} → {after['pass@1']:.2f} {after['domain']}; policy → {out / 'checkpoint'}")
    return 0


def _torchrun(world_size: int, argv: list[str]) -> int:
    """Re-run this command under torchrun with `world_size` ranks (gloo on CPU, nccl on GPU); returns its status.
    Its output is passed through as it comes; when the rendezvous port was taken between `free_port` and torchrun's
    bind (EADDRINUSE), it runs again on another port, up to `PORT_TRIES` times."""
    import sys

    from trainers.backends import run_torchrun

    def echo(line: str) -> bool:  # passed through as it comes, and kept for the port check
        sys.stdout.write(line)
        sys.stdout.flush()
        return True

    return run_torchrun(world_size, ["pipelines.cli", *argv], echo, lambda: print(
        "torchrun: its rendezvous port was taken before it bound it; again on another", file=sys.stderr))[0]


def _dist_backend(cfg):
    """The training runtime of this process from `cfg.trainer` (device, activation checkpointing, dist backend):
    data parallel over torchrun's ranks when torchrun started it, else one process."""
    import os

    from trainers.runtime import make_train_backend

    if "RANK" not in os.environ:
        return make_train_backend(cfg.trainer)
    return make_train_backend(cfg.trainer, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


def _sao_run(args, resume: bool) -> int:
    import os

    import torch
    from rich.console import Console

    from model import Transformer, load_checkpoint, save_checkpoint
    from trainers.checkpoint import load_training_state
    from trainers.loop import RLLoop
    from trainers.sft import evaluate

    world = getattr(args, "world_size", 1)
    if world > 1 and "RANK" not in os.environ:
        return _torchrun(world, args.argv)
    cfg, tok, sandbox, train, held = _setup(args, rl=True)
    dp = _dist_backend(cfg)
    con = Console(quiet=not dp.is_main)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    model = dp.wrap(load_checkpoint(args.init) if args.init else Transformer(cfg.model))
    start = 0
    state = load_training_state(out / "state") if resume else None
    loop = RLLoop(model, train, tok, sandbox, cfg.agent, cfg.sao, cfg.loop, version=1, train_backend=dp,
                  max_crashed_share=cfg.loop.max_crashed_share)
    if state is not None:
        loop.resume(state)
        start = state.step
        con.print(f"resumed from {state.path} (step {start}, policy v{loop.version})")
    elif dp.is_main:
        (out / "run.json").write_text(json.dumps({"command": "sao", "args": vars(args),
                                                  "config": cfg.model_dump(mode="json")}, indent=1, default=str))
    before = None
    if start == 0:
        first = dp.export(model)  # temper's model (every rank: a collective where ranks hold shards)
        before = evaluate(first, held, tok, sandbox, cfg.agent) if dp.is_main else None
    hist: list[dict] = []
    prog, task = _progress(con, args.steps, "sao")
    with prog:
        prog.update(task, completed=start)

        def on_step(st):
            step = start + len(hist) + 1
            hist.append(st)
            prog.update(task, completed=step, description=f"reward {st['batch_reward']:.2f} v{st['version']}")
            if (step % args.save_every == 0 or step == args.steps) and (dp.is_main or dp.sharded_state):
                loop.save_state(out / "state", step)  # sharded (Megatron): every rank saves its part

        loop.run(max(0, args.steps - start), on_step)
    final = dp.export(model)
    if dp.world_size > 1:  # every rank records what it holds (they must agree)
        from model import weights_checksum

        (out / f"rank{dp.rank}.weights").write_text(weights_checksum(final))
    if not dp.is_main:  # rank 0 evaluates and writes; the others hold the same weights
        dp.close()
        return 0
    after = evaluate(final, held, tok, sandbox, cfg.agent)
    save_checkpoint(final, out / "checkpoint", policy_version=loop.version)
    rep = {"steps": start + len(hist), "pass@1_before": before["pass@1"] if before else None,
           "pass@1_after": after["pass@1"], "domain_after": after["domain"],
           "reward_curve": [h["batch_reward"] for h in hist], "dropped_stale": loop.trainer.dropped["stale"]}
    (out / "report.json").write_text(json.dumps(rep, indent=1))
    con.print(f"SAO → step {rep['steps']}, held-out pass@1 {after['pass@1']:.2f} {after['domain']}; "
              f"policy v{loop.version} → {out / 'checkpoint'}"
              + (f" ({dp.world_size} trainer ranks)" if dp.world_size > 1 else ""))
    if dp.world_size > 1:
        dp.close()
    return 0


def cmd_sao(args) -> int:
    return _sao_run(args, resume=False)


def cmd_resume(args) -> int:
    run = json.loads((Path(args.out) / "run.json").read_text())
    if run["command"] != "sao":
        print(f"error: resume supports SAO runs; {args.out} holds a {run['command']} run")
        return 2
    saved = argparse.Namespace(**{**run["args"], "out": args.out, "argv": args.argv})
    return _sao_run(saved, resume=True)


def cmd_opd(args) -> int:
    import asyncio

    import torch
    from rich.console import Console

    from model import load_checkpoint, save_checkpoint
    from rollout.agent import Agent, EnginePolicy, run_episodes
    from rollout.engine import Engine
    from trainers.opd import OPDTrainer
    from trainers.sft import evaluate
    from trainers.teachers import TeacherPool

    con = Console()
    cfg, tok, sandbox, train, held = _setup(args, rl=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    teachers = dict(t.split("=", 1) for t in args.teacher)
    torch.manual_seed(cfg.seed)
    student = load_checkpoint(args.init)
    pool = TeacherPool(teachers, max_resident=args.resident)
    trainer = OPDTrainer(student, pool, cfg.opd)
    engine = Engine(load_checkpoint(args.init), tok, n_slots=cfg.loop.n_slots, max_len=cfg.agent.max_context + 8,
                    policy_version=1)
    specs = [s for s in train if s.domain in teachers]
    version, cursor, hist = 1, 0, []
    try:
        prog, task = _progress(con, args.steps, "opd")
        with prog:
            for _ in range(args.steps):
                batch = [specs[(cursor + i) % len(specs)] for i in range(cfg.loop.batch_size)]
                cursor += cfg.loop.batch_size
                agent = Agent(EnginePolicy(engine), tok, sandbox, cfg.agent)
                trajs = asyncio.run(run_episodes(agent, batch, concurrency=cfg.loop.in_flight))
                st = trainer.step(trajs)
                version += 1
                engine.update_weights(state_dict={k: v.detach().clone() for k, v in student.state_dict().items()},
                                      version=version)
                hist.append(st)
                prog.update(task, advance=1, description=f"reverse KL {st.get('reverse_kl', 0):.3f}")
    finally:
        engine.shutdown()
        pool.close()
    after = evaluate(student, held, tok, sandbox, cfg.agent)
    save_checkpoint(student, out / "checkpoint", policy_version=version)
    rep = {"steps": len(hist), "pass@1_after": after["pass@1"], "domain_after": after["domain"],
           "reverse_kl": [h.get("reverse_kl") for h in hist], "teacher_pool": pool.stats().as_dict()}
    (out / "report.json").write_text(json.dumps(rep, indent=1))
    con.print(f"OPD {len(hist)} steps, held-out pass@1 {after['pass@1']:.2f} {after['domain']}; "
              f"teacher swaps {rep['teacher_pool'].get('swaps')}; policy → {out / 'checkpoint'}")
    return 0


def add_parser(sub) -> None:
    t = sub.add_parser("train", help="SFT warm start, SAO, multi-teacher OPD, resume")
    tsub = t.add_subparsers(dest="sub", required=True)

    def common(p, init_required=False):
        p.add_argument("--preset", default="tiny")
        p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE")
        p.add_argument("--out", required=True)
        p.add_argument("--init", required=init_required, default=None, help="HF-layout checkpoint to start from")

    s = tsub.add_parser("sft", help="warm start on oracle trajectories of verified environments")
    common(s)
    s.set_defaults(fn=cmd_sft)
    r = tsub.add_parser("sao", help="asynchronous SAO with the embedded engine")
    common(r)
    r.add_argument("--steps", type=int, default=40)
    r.add_argument("--save-every", type=int, default=5)
    r.add_argument("--world-size", type=int, default=1,
                   help="trainer ranks: >1 runs the trainer under torchrun (gloo on CPU, nccl on GPU); rank 0 drives "
                        "the engines and hands each batch to every rank")
    r.set_defaults(fn=cmd_sao)
    o = tsub.add_parser("opd", help="multi-teacher on-policy distillation")
    common(o, init_required=True)
    o.add_argument("--teacher", action="append", required=True, metavar="DOMAIN=CHECKPOINT")
    o.add_argument("--resident", type=int, default=1, help="teachers kept in memory")
    o.add_argument("--steps", type=int, default=20)
    o.set_defaults(fn=cmd_opd)
    z = tsub.add_parser("resume", help="continue a killed SAO run from its last checkpoint")
    z.add_argument("--out", required=True)
    z.set_defaults(fn=cmd_resume)
    add_base_parser(tsub)


def cmd_base(args) -> int:
    import shlex
    import sys

    from rich.console import Console

    import configs
    from envs import make_sandbox
    from model import ByteTokenizer, save_checkpoint
    from trainers.base import card_eval, eval_specs, train_base, write_card

    con = Console()
    cfg = configs.load(args.preset, args.override)
    tok, sandbox = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "temper " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    (out / "run.json").write_text(json.dumps({"command": command, "args": vars(args),
                                              "config": cfg.model_dump(mode="json")}, indent=1, default=str))
    from .progress import step_log

    with step_log(con, "base") as log:  # its "base step k/N" lines move a bar (elapsed, time left)
        model, record = train_base(cfg, out, tok, sandbox, steps=args.steps, log=log, phase1=args.phase1)
    ckpt = out / "checkpoint"
    save_checkpoint(model, ckpt, policy_version=0)
    specs = eval_specs(cfg.base)
    con.print(f"evaluating on {len(specs)} held-out tasks")
    ev = card_eval(model, specs, tok, sandbox, cfg.agent)
    card = write_card(ckpt, cfg, record, ev, specs, command)
    for k, v in [*ev["pattern"].items(), *ev["domain"].items(), ("all", ev["all"])]:
        con.print(f"  {k:32s} {v['pass@1']:.2f}  [{v['ci95'][0]:.2f}, {v['ci95'][1]:.2f}]  n={v['n']}")
    con.print(f"base → {ckpt} (weights sha256 {card['weights_sha256'][:12]}…; card: {ckpt / 'CARD.md'})")
    return 0


def add_base_parser(tsub) -> None:
    b = tsub.add_parser("base", help="the base policy recipe: curriculum SFT on oracle trajectories, then a card")
    b.add_argument("--preset", default="tiny")
    b.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE")
    b.add_argument("--out", required=True)
    b.add_argument("--steps", type=int, default=None,
                   help="the first phase's optimizer steps (default: base.steps of the preset)")
    b.add_argument("--phase1", default=None, metavar="CKPT",
                   help="run only base.phase2, from these first-phase weights (their sha256 goes on the card)")
    b.set_defaults(fn=cmd_base)
