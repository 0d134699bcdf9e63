"""`env_specs` and `verified_envs`: the iteration's environments, generated and gated."""

from __future__ import annotations

import json
from pathlib import Path

from .common import (
    ITERATION_SEED_STRIDE,
    _dump,
    _quiet,
)


def env_specs(cfg, out: Path, iteration: int = 1, parent_checkpoint: str | None = None, log=_quiet) -> dict:
    """Generate the iteration's environments: the held-out set (the same every iteration, so iterations compare),
    the RL set and, without a base checkpoint, the SFT set — fresh instances every iteration (seeds offset by
    the iteration), so RL never revisits environments an earlier iteration trained on.

    With `envs.curriculum.enabled`, the RL set's pattern mix is chosen by the frontier curriculum
    (`stages/curriculum.py`) from samples of the policy this iteration starts from: `parent_checkpoint` (what
    iteration N−1 handed off), else the shipped base."""
    from envs.dataset import write_dataset

    from .env_sets import build_sets
    from .warm import check_recipe

    check_recipe(cfg.base)  # the held-out set below is disjoint from the base's recipe only if it is the preset's
    off = ITERATION_SEED_STRIDE * (iteration - 1)
    e = cfg.envs.model_copy(update={"seed": cfg.envs.seed + off, "rl_seed": cfg.envs.rl_seed + off,
                                    "val_seed": cfg.envs.val_seed + off})
    chosen: dict = {}
    rl_mix = None
    if e.curriculum.enabled and e.n_rl:
        from .curriculum import choose_mix, probe
        from .warm import resolve_base

        policy = parent_checkpoint or (str(resolve_base(cfg.base.checkpoint)) if cfg.base.checkpoint else None)
        if policy is None:
            raise ValueError("envs.curriculum.enabled: the curriculum samples the policy it trains, and this iteration "
                             "has none yet (no base.checkpoint and no iteration N−1)")

        def rl_mix(excluded: set[str]):
            figures, probe_specs = probe(cfg, policy, e.rl_source_patterns, e.rl_seed, excluded, log)
            mix, why = choose_mix(figures, e.rl_source_patterns, e.n_rl, e.curriculum)
            chosen.update(policy=policy, figures=figures, choice=why, mix=mix,
                          probe_episodes=len(probe_specs) * e.curriculum.probe_samples)
            log("curriculum: " + ", ".join(f"{p} {n}" for p, n in mix.items()))
            return mix, {"curriculum-probe": probe_specs}

    sets = build_sets(e, cfg.base, rl_mix)  # hashed seeds per purpose; held-out disjoint from the base recipe and all sets
    skipped = sets["skipped"]
    held = write_dataset(sets["eval"], out / "eval", {"seed": e.eval_seed, "purpose": "held-out",
                                                      "skipped_base_or_repeated": skipped["eval"]})
    res = {"train": None, "eval": str(out / "eval"), "n_train": 0, "n_eval": held["n"], "n_rl": 0,
           "families": {}, "eval_families": held["families"], "eval_sha256": held["sha256"], "skipped": skipped}
    if sets["val"] is not None:  # model selection's own tasks: the same patterns as the held-out set, none of its tasks
        val = write_dataset(sets["val"], out / "val", {"seed": e.val_seed, "purpose": "validation",
                                                       "held_out_removed": skipped["val"]})
        res.update(val=str(out / "val"), n_val=val["n"], val_sha256=val["sha256"])
    if sets["train"] is not None:  # the SFT set (RL's too when there is no RL set); empty sets fail the triad check
        train = write_dataset(sets["train"], out / "train", {"seed": e.seed, "purpose": "sft"})
        res.update(train=str(out / "train"), n_train=train["n"], families=train["families"], sha256=train["sha256"])
    if sets["rl"] is not None:
        rl = write_dataset(sets["rl"], out / "rl", {"seed": e.rl_seed, "purpose": "rl"})
        res.update(rl=str(out / "rl"), n_rl=rl["n"], rl_families=rl["families"], rl_sha256=rl["sha256"])
    if chosen:
        res["curriculum"] = chosen
        _dump(out / "curriculum.json", chosen)
    return res


def rl_set(envs: dict) -> str:
    """The environments RL trains in: the separate RL set when the preset has one, else the SFT set."""
    return envs.get("rl") or envs["train"]


def verified_envs(cfg, specs: dict, out: Path, log=_quiet, progress=None) -> dict:
    """Gate every environment of the SFT and RL sets (`progress(k, n, what)`, when given, hears how many are
    judged)."""
    from concurrent.futures import ThreadPoolExecutor

    from envs import make_sandbox
    from envs.dataset import read_dataset, write_dataset
    from envs.gate import GateReport, acceptance, validate

    from .crashes import gate_crash, gate_tally

    sb = make_sandbox(cfg.envs.sandbox)
    sets = [k for k in ("train", "rl") if specs.get(k)]
    every = [(k, s) for k in sets for s in read_dataset(specs[k])]
    # each verdict is kept as it comes, under the spec's content hash and the legs asked: a rerun after a kill
    # (or with the same environments) judges only what is not judged yet
    cache = out / "reports"
    cache.mkdir(parents=True, exist_ok=True)

    def judge(i: int) -> tuple[GateReport, bool]:
        """(the verdict, whether it was kept from an earlier attempt)"""
        spec, probes = every[i][1], cfg.envs.probes and i % cfg.envs.probe_every == 0
        path = cache / f"{spec.spec_hash}-{'probes' if probes else 'triad'}-{sb.name}.json"
        if path.exists():
            try:
                return GateReport(**json.loads(path.read_text())), True
            except (ValueError, TypeError):  # a torn write: judge again
                pass
        rep = validate(spec, sb, probes=probes)
        if gate_crash(rep.to_dict()) is None:  # a crash is the sandbox's, not the spec's: a rerun judges it again
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(rep.to_dict(), default=str))
            tmp.replace(path)
        return rep, False

    import threading

    lock, done = threading.Lock(), [0]

    def judged_one(i: int) -> tuple[GateReport, bool]:
        r = judge(i)
        with lock:
            done[0] += 1
            if progress is not None:
                progress(done[0], len(every), "gate")
        return r

    with ThreadPoolExecutor(cfg.envs.validate_workers) as pool:  # each validation is sandboxed subprocesses
        judged = list(pool.map(judged_one, range(len(every))))
    reports, reused = [r for r, _ in judged], sum(kept for _, kept in judged)
    log(f"validated {len(every)} environments: {sum(r.accepted for r in reports)} accepted"
        + (f" ({reused} verdicts kept from an earlier attempt)" if reused else ""))
    res: dict = {"eval": specs["eval"], **({"val": specs["val"]} if specs.get("val") else {})}
    for k in sets:  # the last one is the set RL trains in: its domains get experts
        ok = [s for (kk, s), r in zip(every, reports) if kk == k and r.accepted]
        write_dataset(ok, out / k, {"validated_from": specs[k]})
        res.update({k: str(out / k), f"accepted_{k}": len(ok)})
    _dump(out / "validation.json", [r.to_dict() for r in reports])  # (read it when the crash check below fails)
    crashes = gate_tally([r.to_dict() for r in reports]).check(cfg.loop.max_crashed_share, "verified_envs")
    accepted = sum(r.accepted for r in reports)
    probe_hits = sum(1 for r in reports if r.accepted for p in r.probes.values() if p.get("reward", 0) > 0)
    return {**res, "accepted": accepted, "total": len(every), "sandbox": sb.name, "verdicts_reused": reused,
            "acceptance": acceptance(reports), "triad_pass_rate": accepted / max(1, len(every)),
            "accepted_probe_hits": probe_hits, "probed": sum(1 for r in reports if r.probes),
            "domains": sorted({s.domain for s in ok}), "crashes": crashes, "crashed_share": crashes["share"]}
