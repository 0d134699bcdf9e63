"""`evaluation`: held-out pass@1 of the student and the warm start, paired, and the champion decision (on the
validation set, `stages/decision.py`)."""

from __future__ import annotations

from pathlib import Path

from rollout.crashes import CrashedShareExceeded, CrashTally

from .common import (
    _quiet,
)
from .recorder import Recorder


def evaluation(cfg, student: str, baseline: str, envs: dict, experts: dict[str, str] | None = None, log=_quiet,
               urls: list[str] | None = None, router_url: str = "", store_path: Path | None = None,
               out: Path | None = None, iteration: int = 0, taught: list[str] | None = None,
               warm_val: dict[str, float] | None = None, progress=None) -> dict:
    """Held-out greedy pass@1 of the student and of the warm start on the same tasks, per domain and overall,
    with 95% Wilson intervals and an exact McNemar test of the paired outcomes (tasks that flipped each way);
    and each domain expert on its own domain (the teacher the student is measured against). `taught`: the
    domains whose expert taught the student (OPD's gate); the others' experts are still scored, and marked
    `teaching: false` so no report reads them as the student's teacher. Episodes run on
    the servers at `urls` when given (each policy loaded in turn), else in-process; every trajectory goes to the
    store as `evaluated` by `eval:student`, `eval:warm_start` or `eval:teacher:<domain>`.

    The decision (`decision`: whether the student is a significant gain, which moves the `champion`, and whether it is
    better, which with the champion decides the hand-off) reads the validation set, never the held-out one: the student
    and the warm start on `envs["val"]`, paired (the warm start's greedy outcomes reused from OPD's teacher gate where
    it ran the same checkpoint on the same tasks: `warm_val`, spec id -> reward). Without a validation set there is no
    decision: the champion and the warm start stay.
    `progress(k, n, what)`, when given, hears how many policies of the stage have played."""
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

    n_runs = 2 + (1 if envs.get("val") else 0) * 2 + len(experts or {})
    played = itertools.count(1)

    def run(ckpt: str, specs, who: str) -> dict:
        from rollout.backend import ServerBackend

        backend = None
        if urls:  # the servers load the checkpoint as it is on disk: no second copy
            backend = ServerBackend(urls, work / "sync", router_url=router_url)
            backend.load(ckpt, next(loads))
        ev = evaluate(None if backend else load_checkpoint(ckpt), specs, tok, sb, cfg.agent, backend=backend,
                      n_slots=cfg.loop.n_slots, concurrency=cfg.loop.batch_in_flight,
                      compile_decode=cfg.loop.compile_decode)
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
        if progress is not None:  # (an upper bound of the policies to play: reused outcomes skip some)
            progress(min(next(played), n_runs), n_runs, "policies")
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

    decision = {"set": None, "significant": False, "better": False, "p_value": None,
                "reason": "no validation set (envs.n_val = 0): no decision, the champion and the warm start stay"}
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
