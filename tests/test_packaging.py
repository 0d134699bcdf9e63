"""Packaging: the wheel builds without a deprecation warning, and installed outside the repository it gives a working
`temper` that loads its presets, finds the shipped base and runs an iteration (`temper run`) on the installed code.

The wheel is built from a copy of the working tree (a stale `build/` of the checkout cannot leak into it) with this
venv's setuptools (`--no-build-isolation`: no registry needed), then installed with `--no-deps` into a fresh venv
that sees this venv's site-packages (the dependencies) through a `.pth` file, but not the checkout: the editable
install's finder lives in a `.pth` of this venv, which a path added by another `.pth` does not run. Every command runs
from a temporary directory, so nothing is imported from the repository.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = shutil.ignore_patterns(".git", ".venv", "runs", "build", "dist", "site", "*.egg-info", "__pycache__",
                              ".pytest_cache", ".ruff_cache", ".gpu-wheels")
WARNINGS = ("Deprecat", "BuildBackendWarning", "SetuptoolsWarning")


def _run(cmd, cwd, **kw):
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=SKIP, symlinks=True)
    r = _run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "--no-index",
              "-w", str(tmp / "dist"), str(src)], cwd=tmp)
    (whl,) = (tmp / "dist").glob("temper-*.whl")
    return {"path": whl, "log": r.stdout + r.stderr, "tmp": tmp}


def test_the_build_warns_of_nothing_deprecated(wheel):
    bad = [ln for ln in wheel["log"].splitlines() if any(w in ln for w in WARNINGS)]
    assert not bad, "\n".join(bad)
    with zipfile.ZipFile(wheel["path"]) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta


def test_the_wheel_ships_the_presets_and_the_base(wheel):
    import configs

    with zipfile.ZipFile(wheel["path"]) as z:
        names = set(z.namelist())
    presets = {f"configs/presets/{p}.yaml" for p in configs.preset_names()}
    base = {f"checkpoints/tiny-base/{f.name}" for f in (ROOT / "checkpoints" / "tiny-base").iterdir() if f.is_file()}
    tools = {f"envs/tools/{f.name}" for f in (ROOT / "envs" / "tools").glob("*.py")}
    assert presets and base and tools
    assert not (presets | base | tools) - names, sorted((presets | base | tools) - names)
    assert not [n for n in names if n.startswith(("tests/", "docs/", "bench/"))]


@pytest.fixture(scope="module")
def installed(wheel):
    venv = wheel["tmp"] / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=wheel["tmp"])
    py = venv / "bin" / "python"
    purelib = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        cwd=wheel["tmp"]).stdout.strip())
    (purelib / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # the dependencies, not temper
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index",
          str(wheel["path"])], cwd=wheel["tmp"])
    work = wheel["tmp"] / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {"venv": venv, "py": py, "purelib": purelib, "cwd": work, "env": env}


def test_installed_temper_runs_outside_the_repository(installed):
    import configs

    temper = installed["venv"] / "bin" / "temper"
    r = _run([str(temper), "--help"], cwd=installed["cwd"], env=installed["env"])
    for cmd in ("run", "train", "serve", "envs", "config"):
        assert cmd in r.stdout
    r = _run([str(temper), "config", "show", "--preset", "tiny", "-o", "loop.steps=3"], cwd=installed["cwd"],
             env=installed["env"])
    assert json.loads(r.stdout) == configs.load("tiny", ["loop.steps=3"]).model_dump(mode="json")

    probe = (
        "import json, configs, stages\n"
        "p = stages.resolve_base(configs.load('tiny').base.checkpoint)\n"
        "card = stages.check_base(p)\n"  # the weights checked against the card's sha256
        "print(json.dumps({'configs': configs.__file__, 'stages': stages.__file__, 'base': str(p),\n"
        "                  'presets': configs.preset_names(), 'card': bool(card)}))\n")
    out = json.loads(_run([str(installed["py"]), "-c", probe], cwd=installed["cwd"], env=installed["env"]).stdout)
    site = str(installed["purelib"])
    assert out["configs"].startswith(site) and out["stages"].startswith(site), out  # the installed copy, not the checkout
    assert out["base"] == str(installed["purelib"] / "checkpoints" / "tiny-base"), out
    assert out["presets"] == configs.preset_names()
    assert out["card"]


# Imported by every interpreter of the test venv (the `temper` process and each stage's `python -m stages.step`); with
# $TEMPER_TEST_IMPORTS set it appends, at exit, the process's argv and the file of every temper module it imported.
RECORDER = """\
import atexit, json, os, sys

_OUT = os.environ.get("TEMPER_TEST_IMPORTS")
_PKGS = set(os.environ.get("TEMPER_TEST_PACKAGES", "").split(","))


def _record():
    mods = {n: getattr(m, "__file__", None) for n, m in list(sys.modules.items()) if n.split(".")[0] in _PKGS}
    line = json.dumps({"argv": sys.argv, "modules": mods}) + "\\n"
    fd = os.open(_OUT, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


if _OUT:
    atexit.register(_record)
"""
PACKAGES = ("temper_kernels", "model", "configs", "trainers", "pipelines", "envs", "rollout", "store", "assets", "stages")
# the stages the assets run as `python -m stages.step <stage>` (assets/iteration.py; rewards and scaling run in-process)
STAGE_PROCS = {"env_specs", "verified_envs", "warm_start", "rollout_batches", "sao_expert", "opd_student", "evaluation"}
FAST = ["train.max_steps=6", "train.batch_size=4", "envs.n_train=4", "envs.n_eval=2", "envs.probes=false", "loop.steps=1",
        "opd.steps=1", "sao.value_pretrain_steps=1", "sao.min_domain_reward=0"]


def _clean_env(installed, **extra):
    drop = ("TEMPER_DAGSTER_PG_URL", "TEMPER_MLFLOW_URI", "DAGSTER_HOME", "TEMPER_UNSAFE_NO_SANDBOX")
    return {**{k: v for k, v in installed["env"].items() if k not in drop}, **extra}


def test_installed_temper_runs_an_iteration_outside_the_repository(installed, tmp_path):
    """`temper run` from the wheel, in a directory outside the checkout: the Dagster instance's config (the wheel
    ships no dagster.yaml), the job's `pipelines/defs` (no pyproject.toml beside site-packages), the stages'
    `python -m stages.step` subprocesses and the sandbox's tools all come from the installed copy."""
    import yaml

    (installed["purelib"] / "sitecustomize.py").write_text(RECORDER)
    imports = tmp_path / "imports.jsonl"
    env = _clean_env(installed, TEMPER_TEST_IMPORTS=str(imports), TEMPER_TEST_PACKAGES=",".join(PACKAGES))
    temper = installed["venv"] / "bin" / "temper"
    r = _run([str(temper), "run", "--preset", "micro", "--run-root", str(tmp_path / "runs"),
              *(x for o in FAST for x in ("-o", o))], cwd=tmp_path, env=env)
    it = tmp_path / "runs" / "iteration-0001"
    assert (it / "evaluation.json").is_file(), r.stdout[-3000:]
    assert json.loads((it / "summary.json").read_text())["success"] is True
    # the instance `temper run` made under the cwd has the checkout's dagster.yaml settings
    home = yaml.safe_load((tmp_path / "runs" / "dagster_home" / "dagster.yaml").read_text())
    assert home == yaml.safe_load((ROOT / "dagster.yaml").read_text())

    site, step = str(installed["purelib"]), str(installed["purelib"] / "stages" / "step.py")
    records = [json.loads(line) for line in imports.read_text().splitlines()]
    (main,) = [x for x in records if x["argv"][0] == str(temper)]
    for mod in ("pipelines.run_cli", "pipelines.definitions", "pipelines.defs.iteration", "assets.iteration"):
        assert main["modules"].get(mod, "").startswith(site), (mod, main["modules"].get(mod))
    stage_procs = [x for x in records if x["argv"][1:2] and x["argv"][1] in STAGE_PROCS]
    assert {x["argv"][1] for x in stage_procs} == STAGE_PROCS, [x["argv"] for x in records]
    assert all(x["argv"][0] == step for x in stage_procs), [x["argv"] for x in stage_procs]  # the installed step.py
    files = {f for x in records for f in x["modules"].values() if f}
    assert files and not [f for f in files if not f.startswith(site)], sorted(f for f in files if not f.startswith(site))


def test_installed_temper_run_says_when_there_is_no_sandbox(installed, tmp_path):
    """Without `make` (which installs bubblewrap or says how), `temper run` with no bubblewrap on PATH and no Docker
    engine refuses before anything runs, naming what to install."""
    env = _clean_env(installed, PATH=str(installed["venv"] / "bin"), DOCKER_HOST="unix:///nonexistent/docker.sock")
    r = subprocess.run([str(installed["venv"] / "bin" / "temper"), "run", "--preset", "micro", "--run-root",
                        str(tmp_path / "runs")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "bubblewrap (bwrap) not found: apt-get install bubblewrap" in r.stdout, r.stdout
    assert not (tmp_path / "runs").exists()  # refused before any run, partition or instance


def test_installed_temper_writes_the_checkouts_instance_config(installed):
    """The wheel ships neither dagster.yaml; an installed temper writes the same settings (and with
    $TEMPER_DAGSTER_PG_URL the deployment's PostgreSQL storage)."""
    import yaml

    probe = ("import sys; from pipelines.ui import instance_text\n"
             "print(instance_text({'TEMPER_DAGSTER_PG_URL': sys.argv[1]} if sys.argv[1:] else {}))\n")
    for args, path in (([], ROOT / "dagster.yaml"),
                       (["postgresql+psycopg2://temper@db:5432/dagster"], ROOT / "deploy" / "dagster.yaml")):
        out = _run([str(installed["py"]), "-c", probe, *args], cwd=installed["cwd"], env=_clean_env(installed)).stdout
        assert out.startswith("# written by temper"), out  # not a file of the checkout
        assert yaml.safe_load(out) == yaml.safe_load(path.read_text())
