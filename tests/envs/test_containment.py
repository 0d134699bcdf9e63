"""What an environment may touch on the host, and how much it may grow, tried by breaking it (both sandboxes):

* a spec's files are written by the unprivileged user, and a path outside the workspace is refused with the path
  named and nothing written, even when the spec's own validation is bypassed;
* the verifier's copy of the workspace lives in a filesystem as large as the workspace's quota, made inside the
  sandbox, and sparse files stay sparse (12 KiB of them once became 384 MiB of host disk per check);
* nothing in the sandbox names a host path (the checkout, the virtualenv, the host's temp dir);
* a pinned directory replaced by a link fails the pin, at any level.
"""

import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

import pytest

from envs import FAMILIES, Action, Environment, run_script
from envs.environment import WorkspaceError
from envs.sandbox import SANDBOX_UID
from envs.spec import Check, Verifier

ROOT = Path(__file__).resolve().parents[2]
AS_ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def sandbox(each_sandbox):  # bwrap, then Docker (tests/envs/conftest.py)
    return each_sandbox


def _py(code):
    return Action("python", {"code": code}).render()


def _with_check(spec, code):
    """`spec` judged by one generated "python" check (environment code, run in the verifier's sandbox)."""
    v = Verifier(checks=[Check(kind="python", name="probe", code=code)])
    return spec.model_copy(update={"verifier": v}).compute_hashes()


@pytest.mark.parametrize("bad", ["../escape.txt", "/tmp/temper-escape-abs.txt", "a/../../escape.txt", "a//b.txt",
                                 "./a.txt"])
def test_set_up_refuses_a_path_outside_the_workspace(sandbox, bad):
    spec = FAMILIES["fix-bug"].make(0)
    # model_copy does not validate: as if a generated spec had slipped past envs/spec.py's path checks
    evil = spec.model_copy(update={"files": {"ok.txt": "fine", bad: "escaped"}})
    env = Environment(evil, sandbox)
    try:
        with pytest.raises(WorkspaceError, match=bad.replace(".", r"\.")):
            env.reset()
        for where in (env._tmp / "escape.txt", env._tmp.parent / "escape.txt", Path("/tmp/temper-escape-abs.txt")):
            assert not where.exists(), where
    finally:
        env.close()


def test_set_up_runs_as_the_unprivileged_user(sandbox):
    spec = FAMILIES["fix-bug"].make(0)
    with Environment(spec, sandbox) as env:
        env.reset()
        owners = {os.stat(env.workspace / rel).st_uid for rel in spec.files}
        assert owners == ({SANDBOX_UID} if AS_ROOT else {os.geteuid()})
        assert env.workspace.joinpath("tests/test_listx.py").read_text() == spec.files["tests/test_listx.py"]


def test_the_verifier_copy_is_inside_a_sized_filesystem(sandbox):
    assert AS_ROOT, "workspace quotas are tmpfs mounts: run the suite as root (CI does)"
    spec = FAMILIES["set-const"].make(0)
    cap = sandbox.limits.workspace_bytes
    code = (f"import os\nst = os.statvfs('.')\nsize = st.f_blocks * st.f_frsize\n"
            f"emit({{'pass': 0 < size <= {cap}, 'detail': f'size {{size}}'}})")
    r, _, _ = run_script(_with_check(spec, code), sandbox, [])
    assert r.reward == 1.0 and r.status == "ok", r.checks


def test_sparse_files_are_not_expanded(sandbox):
    """24 files of 15 MiB that hold 4 KiB each: next to the real fix, the check still runs and passes (a copy that
    wrote the holes would need 360 MiB, past the 64 MiB of the verifier's filesystem, and fail)."""
    assert AS_ROOT, "workspace quotas are tmpfs mounts: run the suite as root (CI does)"
    spec = FAMILIES["fix-bug"].make(0)
    code = ("for i in range(24):\n    with open(f'sparse{i}.bin', 'wb') as f:\n"
            "        f.write(b'x' * 4096)\n        f.truncate(15 << 20)\nprint('made')")
    r, _, obs = run_script(spec, sandbox, [_py(code)] + spec.reference)
    assert "made" in obs[0], obs
    assert r.reward == 1.0 and r.status == "ok", r.checks
    # and what the verifier's copy holds: the same apparent sizes, 4 KiB of blocks each
    look = ("import os\nfs = [f for f in os.listdir('.') if f.startswith('sparse')]\n"
            "size = sum(os.stat(f).st_size for f in fs)\nused = sum(os.stat(f).st_blocks * 512 for f in fs)\n"
            "emit({'pass': len(fs) == 24 and size == 24 * (15 << 20) and used <= 24 * 8192, "
            "'detail': f'{len(fs)} files, {size} bytes, {used} allocated'})")
    r, _, _ = run_script(_with_check(spec, look), sandbox, [_py(code)])
    assert r.reward == 1.0 and r.status == "ok", r.checks


def _host_names() -> list[str]:
    return [str(ROOT), sysconfig.get_paths()["purelib"], "site-packages", tempfile.gettempdir() + "/temper-",
            "temper-stage", "temper-feeds"]


def test_no_host_path_is_visible_inside(sandbox):
    """Neither a tool run nor the verifier sees the checkout, the virtualenv or temper's temp dirs in its mounts,
    nor packages beyond pytest's."""
    assert AS_ROOT, "the staged tools and site are a tmpfs mount: run the suite as root (CI does)"
    names = _host_names()
    look = (f"import os\nm = open('/proc/self/mountinfo').read()\nleaks = [n for n in {names!r} if n in m]\n"
            "site = sorted(os.listdir('/opt/temper/site'))\n")
    spec = FAMILIES["fix-bug"].make(0)
    _, _, obs = run_script(spec, sandbox, [_py(look + "print('leaks', leaks, 'site', site)")])
    assert "leaks [] site" in obs[0] and "torch" not in obs[0] and "'pytest'" in obs[0], obs
    r, _, _ = run_script(_with_check(spec, look + "emit({'pass': not leaks and 'torch' not in site, "
                                                  "'detail': f'{leaks} {site}'})"), sandbox, [])
    assert r.reward == 1.0 and r.status == "ok", r.checks


def test_the_pytest_tool_runs_with_the_staged_packages(sandbox):
    spec = FAMILIES["fix-bug"].make(0)
    _, _, obs = run_script(spec, sandbox, [Action("pytest", {"argv": []}).render()])
    assert "passed" in obs[0] and "failed" in obs[0] and "ModuleNotFoundError" not in obs[0], obs


def test_a_pinned_directory_replaced_by_a_link_fails_the_pin(sandbox):
    """tests/ swapped for a link to an unchanged copy: the files read the same through it, but the pin is on the
    workspace as the agent left it, no link followed at any level."""
    spec = FAMILIES["fix-bug"].make(0)
    swap = _py("import os, shutil\nshutil.copytree('tests', 'kept')\nshutil.rmtree('tests')\nos.symlink('kept', 'tests')")
    r, _, obs = run_script(spec, sandbox, spec.reference + [swap])
    pin = [c for c in r.checks if c.name == "tests untouched"][0]
    assert r.reward == 0.0 and r.status == "ok" and not pin.passed, (r.checks, obs)
    # the same copy made without the swap leaves the pin intact: it is the link that fails it
    keep = _py("import shutil\nshutil.copytree('tests', 'kept')")
    r, _, _ = run_script(spec, sandbox, spec.reference + [keep])
    assert r.reward == 1.0, r.checks


def test_a_deep_tree_is_removed_with_the_environment(sandbox):
    spec = FAMILIES["fix-bug"].make(0)
    env = Environment(spec, sandbox)
    env.reset()
    env.step(_py("import os\nfor _ in range(1500):\n    os.mkdir('d')\n    os.chdir('d')"))
    tmp = env._tmp
    env.close()
    assert not tmp.exists()
    shutil.rmtree(tmp, ignore_errors=True)
