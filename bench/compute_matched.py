"""The compute-matched control: K iterations against one iteration K times longer, on the same trained tokens.

    temper run --run-root runs/chain --iterations 4                         # K = 4 iterations
    temper run --run-root runs/long -o loop.steps=80 -o opd.steps=64        # one iteration, 4x the SAO and OPD steps
    python bench/compute_matched.py runs/chain runs/long

Each side's policy is the one its last iteration hands off (`hand_off`), and its compute the trained tokens every
SAO expert and OPD student of its iterations read (`stages/scaling.py`). Both policies play the same held-out tasks
greedily, in this process, and the table compares them paired: pass@1 per domain and overall with 95% Wilson
intervals, the tasks that flipped each way, the paired difference with its 95% interval and the exact McNemar
p-value. Iterating is a scaling axis of its own if the K-iteration chain wins on no more compute.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import progress, table

from configs import load
from trainers.stats import compare


def final_policy(run_root: Path, rule: str, student: bool = False) -> tuple[str, int, int]:
    """(the checkpoint the run root's last evaluated iteration hands off, or with `student` its student whatever the
    champion gate decided; cumulative trained tokens; iterations)."""
    from stages.scaling import chain_points
    from stages.warm import hand_off_of

    pts = chain_points(run_root, 10_000, rule)
    if len(pts) < 2:
        raise SystemExit(f"{run_root}: no evaluated iteration")
    last = pts[-1]["iteration"]
    d = run_root / f"iteration-{last:04d}"
    ev = json.loads((d / "evaluation.json").read_text())
    ws = json.loads((d / "warm_start.json").read_text())["checkpoint"]
    ckpt, _ = hand_off_of(rule, ev, ws)
    return (ev["student"] if student else ckpt), pts[-1]["tokens"], last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("chain", type=Path, help="run root of the K-iteration chain")
    ap.add_argument("long", type=Path, help="run root of the one long iteration")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("-o", "--override", action="append", default=[])
    ap.add_argument("--long-student", action="store_true",
                    help="the long iteration's student even when its champion gate kept the warm start")
    a = ap.parse_args()

    from envs.sandbox import make_sandbox
    from model import ByteTokenizer, load_checkpoint
    from stages.env_sets import held_out
    from trainers.sft import evaluate

    cfg = load(a.preset, a.override)
    specs = held_out(cfg.envs, cfg.base)[0]
    tok, sb = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    sides = {}
    with progress("held-out episodes", 2 * len(specs)) as bar:
        for name, root in (("chain", a.chain), ("long", a.long)):
            bar.note(name)
            ckpt, tokens, its = final_policy(root, cfg.hand_off, student=name == "long" and a.long_student)
            ev = evaluate(load_checkpoint(ckpt), specs, tok, sb, cfg.agent, concurrency=cfg.loop.batch_in_flight,
                          on_done=bar)
            by: dict[str, list[float]] = {}
            for s, t in zip(specs, ev["trajectories"]):
                by.setdefault(s.domain, []).append(t.reward)
            sides[name] = {"ckpt": ckpt, "tokens": tokens, "iterations": its, "by": by}
    st = compare(sides["long"]["by"], sides["chain"]["by"])
    rows = []
    for g, v in st.items():
        t = v["test"]
        rows.append([g, t["n"], f"{v['before']['pass@1']:.3f} [{v['before']['ci95'][0]:.2f}, {v['before']['ci95'][1]:.2f}]",
                     f"{v['after']['pass@1']:.3f} [{v['after']['ci95'][0]:.2f}, {v['after']['ci95'][1]:.2f}]",
                     f"{t['delta']:+.3f} [{t['delta_ci95'][0]:+.3f}, {t['delta_ci95'][1]:+.3f}]",
                     f"{t['gained']} / {t['lost']}", f"{t['p_value']:.4f}"])
    c, lg = sides["chain"], sides["long"]
    table(f"compute-matched: {c['iterations']} iterations ({c['tokens']:,} trained tokens) vs 1 long iteration "
          f"({lg['tokens']:,}); tokens ratio {c['tokens'] / max(1, lg['tokens']):.2f}",
          ["group", "n", "long: pass@1 [95% CI]", "chain: pass@1 [95% CI]", "chain − long [95% CI]",
           "chain wins / loses", "p (McNemar)"], rows)
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "by"} for k, v in sides.items()}, indent=1))


if __name__ == "__main__":
    main()
