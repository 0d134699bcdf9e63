"""`scaling`: post-training as a scaling axis — the held-out curve over iterations and cumulative compute, its fit,
and the forecast of the next iteration checked against what that iteration then measures.

Each iteration N hands a policy to N+1 (`hand_off`: by default its student when it was better on the validation set,
else its warm start).
The curve is that chain: point 0 is iteration 1's warm start (the shipped base), point N the policy iteration N
hands off, each with its held-out pass@1 (overall and per domain, 95% Wilson intervals) and the post-training
compute spent up to it: trained tokens (every token a gradient step of SAO or OPD read) and training FLOPs
(6 × active parameters × trained tokens).

The fit is the sigmoidal compute-performance curve of the RL-scaling literature (ScaleRL, arXiv 2510.13786):

    R(C) = R0 + (A − R0) / (1 + (C_mid / C)^B)

with R0 the base's pass rate, A the asymptote, B the efficiency and C_mid the compute at half the gain. It needs
as many points past the base as free parameters (3). Its uncertainty comes from a parametric bootstrap of the
measurements (each pass rate redrawn from its binomial), refitted; the forecast of the next iteration, at the
compute the iterations have spent on average, carries a 95% prediction interval (the fit's spread plus the next
measurement's own binomial noise), and is checked when the next iteration reports.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

N_PARAMS = 3  # A, B, C_mid (R0 is measured)


def sigmoid_curve(c, r0: float, a: float, b: float, c_mid: float):
    """ScaleRL's R(C); R(0) = R0."""
    c = np.asarray(c, dtype=float)
    with np.errstate(divide="ignore", over="ignore"):
        frac = 1.0 / (1.0 + np.power(c_mid / np.maximum(c, 1e-300), b))
    return r0 + (a - r0) * np.where(c > 0, frac, 0.0)


def fit_curve(c: list[float], r: list[float], r0: float, w: list[float] | None = None,
              x0: dict | None = None) -> dict:
    """Least-squares A, B, C_mid of `sigmoid_curve` through (c, r) with R0 fixed (`w`: the points' weights, e.g.
    1/σ). A is kept in [0, 1], B in [0.05, 20], C_mid in (0, 1000 × max c]; the fit starts from several C_mid
    and keeps the best, or from `x0` (an earlier fit's parameters) alone."""
    from scipy.optimize import least_squares

    c_arr, r_arr = np.asarray(c, float), np.asarray(r, float)
    w_arr = np.ones_like(r_arr) if w is None else np.asarray(w, float)
    if len(c_arr) < N_PARAMS:
        raise ValueError(f"a fit needs {N_PARAMS} points past the base, got {len(c_arr)}")
    scale = float(c_arr.max())
    x = c_arr / scale  # compute in units of the largest, so the parameters are of order 1

    def resid(p):
        a, b, lm = p
        return w_arr * (sigmoid_curve(x, r0, a, b, math.exp(lm)) - r_arr)

    lo, hi = [0.0, 0.05, math.log(1e-6)], [1.0, 20.0, math.log(1000.0)]
    starts = ([[x0["A"], x0["B"], math.log(x0["C_mid"] / scale)]] if x0 else
              [[min(1.0, max(r_arr.max(), r0) + 0.05), b0, lm0]
               for lm0 in (math.log(0.1), math.log(0.5), 0.0, math.log(2.0)) for b0 in (0.7, 1.5)])
    best = None
    for st in starts:
        st = [min(max(v, lo_i + 1e-9), hi_i - 1e-9) for v, lo_i, hi_i in zip(st, lo, hi)]
        res = least_squares(resid, st, bounds=(lo, hi))
        if best is None or res.cost < best.cost:
            best = res
    a, b, lm = best.x
    return {"A": float(a), "B": float(b), "C_mid": float(math.exp(lm) * scale), "R0": r0,
            "rss": float(2 * best.cost)}


def bootstrap(c: list[float], k: list[int], n: list[int], k0: int, n0: int, c_next: float, draws: int = 300,
              seed: int = 0) -> dict:
    """The fit of (c, k/n) with R0 = k0/n0, its 95% intervals by parametric bootstrap (every pass rate redrawn from
    its binomial, refitted `draws` times), and the forecast at `c_next` with a 95% interval for the fitted value and
    a 95% prediction interval for a measurement on the next iteration's n."""
    rng = np.random.default_rng(seed)
    r = [ki / ni for ki, ni in zip(k, n)]
    r0 = k0 / n0
    fit = fit_curve(c, r, r0)
    n_next = n[-1]
    fs, preds = [], []
    for _ in range(draws):
        rb = [rng.binomial(ni, min(max(ri, 0.0), 1.0)) / ni for ri, ni in zip(r, n)]
        r0b = rng.binomial(n0, r0) / n0
        try:
            fb = fit_curve(c, rb, r0b, x0=fit)
        except ValueError:
            continue
        y = float(sigmoid_curve([c_next], r0b, fb["A"], fb["B"], fb["C_mid"])[0])
        fs.append(fb)
        preds.append((y, rng.binomial(n_next, min(max(y, 0.0), 1.0)) / n_next))

    def ci(v):
        return [float(np.percentile(v, 2.5)), float(np.percentile(v, 97.5))]

    y0 = float(sigmoid_curve([c_next], r0, fit["A"], fit["B"], fit["C_mid"])[0])
    return {**fit, "A_ci95": ci([f["A"] for f in fs]), "B_ci95": ci([f["B"] for f in fs]),
            "C_mid_ci95": ci([f["C_mid"] for f in fs]), "draws": len(fs),
            "forecast": {"compute": c_next, "pass@1": y0, "ci95": ci([p[0] for p in preds]),
                         "prediction_ci95": ci([p[1] for p in preds]), "n": n_next}}


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def trained_tokens(run_dir: Path) -> int:
    """Tokens every SAO expert and the OPD student trained on in one iteration (their `trained_tokens`)."""
    sao = _read(run_dir / "sao_experts.json") or {}
    opd = _read(run_dir / "opd_student.json") or {}
    return int(sum(v.get("trained_tokens", 0) for v in sao.values() if isinstance(v, dict))
               + opd.get("trained_tokens", 0))


def chain_points(run_root: Path, upto: int, rule: str = "better") -> list[dict]:
    """The curve's points from the run root's iteration directories 1..`upto` (each with `evaluation.json`): point 0
    the base, point N the policy iteration N hands off. Stops at the first iteration without an evaluation."""
    from .warm import hand_off_of

    pts: list[dict] = []
    cum = 0
    for it in range(1, upto + 1):
        d = Path(run_root) / f"iteration-{it:04d}"
        ev = _read(d / "evaluation.json")
        if ev is None:
            break
        st = ev["stats"]
        if not pts:
            pts.append({"iteration": 0, "policy": "base", "tokens": 0,
                        "pass@1": st["all"]["before"]["pass@1"], "k": st["all"]["before"]["k"],
                        "n": st["all"]["before"]["n"], "ci95": st["all"]["before"]["ci95"],
                        "domain": {g: v["before"] for g, v in st.items() if g != "all"}})
        cum += trained_tokens(d)
        chosen, _ = hand_off_of(rule, ev, "warm_start", student="student")
        side = "after" if chosen == "student" else "before"
        pts.append({"iteration": it, "policy": chosen, "tokens": cum, "pass@1": st["all"][side]["pass@1"],
                    "k": st["all"][side]["k"], "n": st["all"][side]["n"], "ci95": st["all"][side]["ci95"],
                    "domain": {g: v[side] for g, v in st.items() if g != "all"}})
    return pts


def scaling(run_root: Path, iteration: int, active_params: int, rule: str = "better", draws: int = 300) -> dict:
    """The curve up to `iteration`, the fit on every point so far (when there are enough), its forecast of the next
    iteration, and the check of the forecast made one iteration earlier (the fit on points 0..N−1) against point N."""
    pts = chain_points(run_root, iteration, rule)
    for p in pts:
        p["flops"] = 6.0 * active_params * p["tokens"]
    out: dict = {"points": pts, "active_params": active_params, "fit": None, "check": None,
                 "flops_per_token": 6.0 * active_params}

    def fit_upto(m: int, at: float | None = None) -> dict | None:
        """The fit on points 0..m (m past the base), forecasting at `at` (default: one more iteration's mean
        compute)."""
        past = pts[1:m + 1]
        if len(past) < N_PARAMS or past[-1]["tokens"] <= 0:
            return None
        at = at if at is not None else past[-1]["tokens"] * (1 + 1 / len(past))
        return bootstrap([p["tokens"] for p in past], [p["k"] for p in past], [p["n"] for p in past],
                         pts[0]["k"], pts[0]["n"], at, draws=draws)

    if len(pts) > 1:
        out["fit"] = fit_upto(len(pts) - 1)
        prev = fit_upto(len(pts) - 2, at=pts[-1]["tokens"])  # what the fit before this point said of it
        if prev is not None:
            got = pts[-1]
            lo, hi = prev["forecast"]["prediction_ci95"]
            out["check"] = {"iteration": got["iteration"], "forecast": prev["forecast"]["pass@1"],
                            "prediction_ci95": [lo, hi], "measured": got["pass@1"],
                            "within": lo <= got["pass@1"] <= hi,
                            "forecast_compute": prev["forecast"]["compute"], "measured_compute": got["tokens"]}
    return out


def curve_table(res: dict) -> str:
    """The curve so far as a markdown table, with the fit and the forecast check when there are."""
    doms = sorted({d for p in res["points"] for d in p["domain"]})
    lines = ["| iteration | policy | trained tokens | FLOPs | pass@1 [95% CI] | " + " | ".join(doms) + " |",
             "|---|---|---|---|---|" + "---|" * len(doms)]
    for p in res["points"]:
        lines.append(f"| {p['iteration']} | {p['policy']} | {p['tokens']:,} | {p['flops']:.2e} | {p['pass@1']:.3f} "
                     f"[{p['ci95'][0]:.2f}, {p['ci95'][1]:.2f}] | "
                     + " | ".join(f"{p['domain'][d]['pass@1']:.2f}" if d in p["domain"] else "–" for d in doms) + " |")
    f = res.get("fit")
    if f:
        fc = f["forecast"]
        lines.append(f"\nfit R(C) = R0 + (A − R0)/(1 + (C_mid/C)^B): A {f['A']:.3f} [{f['A_ci95'][0]:.3f}, "
                     f"{f['A_ci95'][1]:.3f}], B {f['B']:.2f} [{f['B_ci95'][0]:.2f}, {f['B_ci95'][1]:.2f}], C_mid "
                     f"{f['C_mid']:.3g} tokens; next iteration at {fc['compute']:.3g} tokens: {fc['pass@1']:.3f} "
                     f"(95% prediction [{fc['prediction_ci95'][0]:.3f}, {fc['prediction_ci95'][1]:.3f}])")
    else:
        lines.append(f"\nno fit yet: it needs {N_PARAMS} iterations past the base")
    if res.get("check"):
        ch = res["check"]
        lines.append(f"forecast of iteration {ch['iteration']}: {ch['forecast']:.3f} [{ch['prediction_ci95'][0]:.3f}, "
                     f"{ch['prediction_ci95'][1]:.3f}], measured {ch['measured']:.3f}: "
                     + ("within" if ch["within"] else "outside") + " its 95% prediction interval")
    return "\n".join(lines)


def scaling_png(res: dict, path: str | Path) -> Path | None:
    """Held-out pass@1 against cumulative trained tokens (overall with its 95% intervals, and per domain), with the
    fitted curve and its forecast when there is one."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    pts = res["points"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, xkey, xlabel in ((axes[0], "iteration", "iteration"), (axes[1], "tokens", "cumulative trained tokens")):
        x = [p[xkey] for p in pts]
        y = [p["pass@1"] for p in pts]
        err = [[p["pass@1"] - p["ci95"][0] for p in pts], [p["ci95"][1] - p["pass@1"] for p in pts]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label="all (95% CI)", color="black")
        for d in sorted({d for p in pts for d in p["domain"]}):
            ax.plot(x, [p["domain"].get(d, {}).get("pass@1", float("nan")) for p in pts], marker=".", alpha=0.7,
                    label=d)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out pass@1")
        ax.grid(alpha=0.3)
    f = res.get("fit")
    if f:
        cmax = f["forecast"]["compute"]
        xs = np.linspace(0, cmax, 100)
        axes[1].plot(xs, sigmoid_curve(xs, f["R0"], f["A"], f["B"], f["C_mid"]), "--", color="gray",
                     label=f"fit: A {f['A']:.2f}, B {f['B']:.2f}")
        fc = f["forecast"]
        axes[1].errorbar([fc["compute"]], [fc["pass@1"]],
                         yerr=[[fc["pass@1"] - fc["prediction_ci95"][0]], [fc["prediction_ci95"][1] - fc["pass@1"]]],
                         marker="x", color="gray", capsize=3, label="forecast (95% prediction)")
    axes[1].legend(fontsize=7)
    fig.suptitle("post-training as a scaling axis")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
