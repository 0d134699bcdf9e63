"""The tables of `bench/iteration_profile.py`: its categories, each stage's tokens and tokens per second, and the
report printed as three tables of seconds (main thread, engine threads, worker threads: only the first adds up to the
steps' wall time, the other two overlap it), one of tokens and one of the trainers' forwards."""

from __future__ import annotations

import sys

from profile_timers import GROUPS, OUTSIDE

CATEGORIES = {  # key: (label, where it is timed)
    "decode": ("engine decode", "Engine._forward(chunked=False), Engine._speculate"),
    "prefill": ("engine prefill", "Engine._forward(chunked=True), Engine._score"),
    "compile": ("engine compile (first runs)", "CompiledDecode.run of a variant its engine has not run yet (torch.compile)"),
    "emit": ("engine sampling / emit", "Engine._emit"),
    "engine_sched": ("engine scheduling", "the rest of Engine.step (admission, retiring)"),
    "weight_sync": ("weight sync", "Engine._update; InProcessBackend/ServerBackend push and load; RLLoop.push_weights"),
    "sandbox": ("sandbox tool calls", "Environment.reset/step/close outside verification"),
    "verify": ("verification", "Environment.verify; envs.gate validate/judge/mine (their sandbox runs included)"),
    "taskgen": ("task generation", "envs.generator generate / generate_disjoint"),
    "sao_policy_fwd": ("SAO policy fwd (+loss)", "rows_logprobs, policy_loss, KL terms inside SAOTrainer"),
    "sao_policy_bwd": ("SAO policy bwd", "Tensor.backward inside SAOTrainer, outside the critic update"),
    "sao_critic_fwd": ("SAO critic fwd", "Critic.forward"),
    "sao_critic_bwd": ("SAO critic bwd", "Tensor.backward inside SAOTrainer._critic_update"),
    "sao_other": ("SAO step, rest", "SAOTrainer.step / value_pretrain not in the rows above"),
    "opd_teacher": ("OPD teacher scoring", "OPDTrainer.teacher_logprobs (teacher loads it waits for included)"),
    "opd_student_fwd": ("OPD student fwd (+loss)", "rows_logprobs, opd_advantage, policy_loss inside OPDTrainer.step"),
    "opd_student_bwd": ("OPD student bwd", "Tensor.backward inside OPDTrainer.step"),
    "opd_other": ("OPD step, rest", "OPDTrainer.step not in the rows above"),
    "optimizer": ("optimizer step + clip", "AdamW.step, ShardedAdamW.step, TrainBackend.clip_grad_norm"),
    "fwd_other": ("model fwd elsewhere", "rows_logprobs / losses outside SAO and OPD steps"),
    "bwd_other": ("backward elsewhere", "Tensor.backward outside SAO and OPD steps"),
    "checkpoint": ("checkpoint I/O + hash", "load/save_checkpoint, save/load_training_state, weights_sha256"),
    "store": ("store (DuckDB)", "TrajectoryStore / queries: open, write, read, stats, export, close"),
    "mlflow": ("MLflow", "store.tracking.Tracker and its MlflowClient"),
    "agent_loop": ("agent loop (awaits)", "asyncio.run on the stage or a rollouts thread: agent Python + awaiting"),
    "wait_threads": ("wait on worker threads", "RLLoop._wait (rollouts ahead), ThreadPoolExecutor.map results"),
    "other": ("other: Dagster, Python", "main thread only: the step's wall time not in any row above"),
}


SHORT = {"env_specs": "env_specs", "verified_envs": "verified", "warm_start": "warm", "rollout_batches": "rollouts",
         "rewards": "rewards", "sao_experts": "sao", "opd_student": "opd", "evaluation": "eval", "scaling": "scaling",
         OUTSIDE: "between"}
SAO_TRAIN = ("sao_policy_fwd", "sao_policy_bwd", "sao_critic_fwd", "sao_critic_bwd", "sao_other")
OPD_TRAIN = ("opd_student_fwd", "opd_student_bwd", "opd_other")
FORWARDS = ("sao_policy_fwd", "sao_critic_fwd", "opd_teacher", "opd_student_fwd", "fwd_other")  # positions counted


def _short(stage: str) -> str:
    return SHORT.get(stage) or stage.replace("verified_envs_", "check:")[:14]


def rates(row: dict) -> dict:
    """A stage's tokens and tokens per second: decode and prefill per second of their own category (every thread),
    SAO / OPD trained tokens per second of the stage's wall time and of their training categories."""
    c = row["counts"]

    def secs(*cats):
        return sum(row[g].get(k, 0.0) for g in GROUPS for k in cats)

    def per(n, s):
        return round(n / s, 1) if s > 0 and n else None

    sao_s = secs(*SAO_TRAIN) + (secs("optimizer") if c.get("sao_tokens") else 0.0)
    opd_s = secs(*OPD_TRAIN) + (secs("optimizer") if c.get("opd_tokens") else 0.0)
    dec, pre, sao, opd = (int(c.get(k, 0)) for k in ("decode_tokens", "prefill_tokens", "sao_tokens", "opd_tokens"))
    return {"decoded": dec, "prefilled": pre, "decode_tok_s": per(dec, secs("decode")),
            "prefill_tok_s": per(pre, secs("prefill")), "decoded_per_wall_s": per(dec, row["wall"]),
            "engine_busy_s": round(sum(row["engine"].values()), 2),
            "sao_tokens": sao, "sao_steps": int(c.get("sao_steps", 0)), "sao_tok_s_wall": per(sao, row["wall"]),
            "sao_tok_s_train": per(sao, sao_s), "opd_tokens": opd, "opd_steps": int(c.get("opd_steps", 0)),
            "opd_tok_s_wall": per(opd, row["wall"]), "opd_tok_s_train": per(opd, opd_s),
            "forwards": {k: {"tokens": int(c[f"{k}_tokens"]), "tok_s": per(c[f"{k}_tokens"], secs(k))}
                         for k in FORWARDS if c.get(f"{k}_tokens")}}


def _table(title: str, stages: list[str], rep: dict, group: str):
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    t.add_column("category")
    for s in [*stages, "total"]:
        t.add_column(_short(s) if s != "total" else "total", justify="right")
    if group == "main":
        t.add_row("wall (step)", *(f"{rep['stages'][s]['wall']:.1f}" for s in stages), f"{rep['wall']:.1f}",
                  style="bold")
    for cat, (label, _where) in CATEGORIES.items():
        vals = [rep["stages"][s][group].get(cat, 0.0) for s in stages]
        if not any(abs(v) >= 0.05 for v in vals):
            continue
        t.add_row(label, *(f"{v:.1f}" if abs(v) >= 0.05 else "·" for v in vals), f"{sum(vals):.1f}")
    return t


def render(rep: dict, meta: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=None if sys.stdout.isatty() else 220)
    stages = [s for s in rep["order"] if rep["stages"][s]["wall"] >= 0.1]  # (asset checks: hundredths; in the JSON)
    con.print(_table("main thread, seconds (exclusive: each column adds up to its step's wall time)", stages, rep, "main"))
    con.print(_table("engine threads, busy seconds (OVERLAP the main thread's time: its agent loop awaits them)",
                     stages, rep, "engine"))
    con.print(_table("worker threads, busy seconds (OVERLAP main and engine; summed over threads running at once)",
                     stages, rep, "workers"))
    t = Table(title="tokens and tokens per second", title_justify="left")
    heads = ["stage", "wall s", "decoded", "decode tok/s", "prefilled", "prefill tok/s", "engine busy s", "SAO tok",
             "SAO tok/s wall", "SAO tok/s train", "OPD tok", "OPD tok/s wall", "OPD tok/s train"]
    for h in heads:
        t.add_column(h, justify="left" if h == "stage" else "right")
    for s in stages:
        r = rep["stages"][s]["rates"]
        cells = [r["decoded"], r["decode_tok_s"], r["prefilled"], r["prefill_tok_s"], r["engine_busy_s"],
                 r["sao_tokens"], r["sao_tok_s_wall"], r["sao_tok_s_train"], r["opd_tokens"], r["opd_tok_s_wall"],
                 r["opd_tok_s_train"]]
        t.add_row(s, f"{rep['stages'][s]['wall']:.1f}", *("·" if x in (None, 0) else f"{x:,}" for x in cells))
    con.print(t)
    f = Table(title="positions through the trainers' forwards (each call's rows; exact rows at their own length), "
                    "per second of that category", title_justify="left")
    f.add_column("stage")
    for k in FORWARDS:
        f.add_column(CATEGORIES[k][0], justify="right")
    for s in stages:
        fw = rep["stages"][s]["rates"]["forwards"]
        if fw:
            f.add_row(s, *(f"{fw[k]['tokens']:,}" + (f" @ {fw[k]['tok_s']:,}/s" if fw[k]["tok_s"] else "") if k in fw
                           else "·" for k in FORWARDS))
    con.print(f)
    legend = ", ".join(f"{_short(s)} = {s}" for s in stages if _short(s) != s)
    con.print(f"columns: {legend}" if legend else "")
    for line in meta["notes"]:
        con.print(f"- {line}", highlight=False)
