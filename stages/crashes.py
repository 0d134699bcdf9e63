"""Crash accounting of the stages that do not run agent episodes: the gate's verdicts (`verified_envs`). The rule and
the tally are `rollout/crashes.py`'s."""

from __future__ import annotations

from rollout.crashes import CrashTally


def gate_crash(report: dict) -> str | None:
    """Why the gate's judging of one environment crashed (a leg or a probe whose verifier ended `crashed`: its
    sandbox could not start the check), or None. `report`: a `GateReport.to_dict()`."""
    runs = {**report.get("legs", {}), **{f"probe {k}": v for k, v in report.get("probes", {}).items()}}
    crashed = [k for k, v in runs.items() if isinstance(v, dict) and v.get("status") == "crashed"]
    if not crashed:
        return None
    said = [r for r in report.get("reasons", []) if "crashed" in r]
    return said[0] if said else f"{crashed[0]}: verifier crashed"


def gate_tally(reports: list[dict]) -> CrashTally:
    """Per family: the environments judged, and those whose judging crashed (as `crashed`, with the cause)."""
    tally = CrashTally()
    for r in reports:
        why = gate_crash(r)
        tally.count(r["family"], "crashed" if why else "completed", why)
    return tally
