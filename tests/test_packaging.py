"""Packaging: the wheel builds without a deprecation warning, and installed outside the repository it gives a working
`temper` that loads its presets and finds the shipped base.

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
