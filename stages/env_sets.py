"""The data sets of an iteration, held out by construction.

Every set's seeds come from `envs.generator.data_seed(purpose, seed, pattern, index)`, so no two purposes share a
seed; and every set is checked by content (`task_content`: family, instruction, files):

* the held-out set (`envs.eval_seed`, the same every iteration so iterations compare) holds no task twice and none
  of the base recipe's demonstrations (the shipped base was trained on those);
* the validation, SFT and RL sets (fresh every iteration) hold no held-out task, and the RL set no validation task
  (model selection reads the validation set);
* `check_disjoint` refuses any pair that shares a task, naming the sets and a task; each stage that builds a set
  calls it, so a set made some other way cannot leak into the held-out set unnoticed.
"""

from __future__ import annotations

from functools import lru_cache

from envs.generator import generate, generate_disjoint, task_content

SYNTH, SLOPPY = "synth:", "sloppy:"


class HeldOutLeak(ValueError):
    """Two sets that must be disjoint share a task."""


@lru_cache(maxsize=4)
def _base_contents(patterns: tuple[str, ...], n_per_pattern: int, data_seed: int) -> frozenset[str]:
    out = set()
    for j, p in enumerate(patterns):  # as trainers/base.py's base_data draws them
        if not p.startswith(SYNTH):
            out.update(task_content(s) for s in generate([p.removeprefix(SLOPPY)], n_per_pattern, data_seed + 1000 * j))
    return frozenset(out)


def base_recipe_contents(bc) -> frozenset[str]:
    """The tasks the base recipe (`base` in the preset) demonstrates, by content: every pattern of its curriculum and
    second phase (`BaseConfig.patterns`, whose order gives each pattern its data seed), the careless demonstrator's
    included."""
    return _base_contents(tuple(bc.patterns), bc.n_per_pattern, bc.data_seed)


def check_disjoint(sets: dict[str, list]) -> None:
    """HeldOutLeak if a set holds a task twice or two sets share one (`sets`: name -> specs)."""
    seen: dict[str, str] = {}
    for name, specs in sets.items():
        mine = set()
        for s in specs:
            c = task_content(s)
            if c in mine:
                raise HeldOutLeak(f"the {name} set holds task {s.id} ({s.family}) twice")
            if c in seen:
                raise HeldOutLeak(f"the {name} and {seen[c]} sets share a task ({s.id}, {s.family})")
            mine.add(c)
        seen.update(dict.fromkeys(mine, name))


def held_out(e, bc) -> tuple[list, int]:
    """The held-out set: `e.n_eval` distinct tasks of `e.held_out_patterns` at `e.eval_seed`, none of them the base
    recipe's. Returns (specs, tasks skipped)."""
    return generate_disjoint(e.held_out_patterns, e.n_eval, e.eval_seed, "held-out", base_recipe_contents(bc))


def build_sets(e, bc, rl_mix=None) -> dict:
    """Every set `e` asks for (`e`: the iteration's EnvConfig, its seeds already offset by the iteration), checked
    disjoint. Returns {"eval", "val", "train", "rl": specs or None, "skipped": {set: tasks skipped}}.

    `rl_mix(excluded)`: the curriculum (`stages/curriculum.py`): given the contents no RL task may have (held-out and
    validation), returns ({pattern: tasks}, extra sets to check disjoint from the held-out set, e.g. its probe
    tasks); the RL set then draws that many of each pattern, interleaved. Without it, the RL set cycles
    `e.rl_source_patterns`."""
    held, skipped = held_out(e, bc)
    out: dict = {"eval": held, "val": None, "train": None, "rl": None, "skipped": {"eval": skipped}}
    held_c = {task_content(s) for s in held}
    if e.n_val:
        out["val"], out["skipped"]["val"] = generate_disjoint(e.held_out_patterns, e.n_val, e.val_seed, "validation",
                                                              held_c)
    if e.n_train or not e.n_rl:
        out["train"], out["skipped"]["train"] = generate_disjoint(e.patterns, e.n_train, e.seed, "sft", held_c)
    extra: dict = {}
    if e.n_rl:
        val_c = {task_content(s) for s in out["val"] or []}
        if rl_mix is None:
            out["rl"], out["skipped"]["rl"] = generate_disjoint(e.rl_source_patterns, e.n_rl, e.rl_seed, "rl",
                                                                held_c | val_c)
        else:
            from .curriculum import interleave

            mix, extra = rl_mix(held_c | val_c)
            per, out["skipped"]["rl"] = {}, 0
            for p, n in mix.items():
                per[p], sk = generate_disjoint([p], n, e.rl_seed, "rl", held_c | val_c)
                out["skipped"]["rl"] += sk
            out["rl"] = interleave(per)
    check_disjoint({k: out[k] for k in ("eval", "val", "rl") if out[k] is not None})
    for name, specs in extra.items():
        check_disjoint({"eval": out["eval"], name: specs})
    if out["train"] is not None:
        check_disjoint({"eval": out["eval"], "train": out["train"]})
    return out


def train_and_held_out(cfg, rl: bool = False) -> tuple[list, list]:
    """(the environments training reads, the held-out set) of iteration 1 as the pipeline builds them (`build_sets`):
    what `temper train` and the benches evaluate on. `rl`: the RL set when the preset has one, else the SFT set."""
    sets = build_sets(cfg.envs, cfg.base)
    return (sets["rl"] if rl and sets["rl"] is not None else sets["train"] or []), sets["eval"]
