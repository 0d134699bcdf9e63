import shutil
import tempfile
from pathlib import Path

import pytest

from envs.sandbox import SandboxUnavailable, make_sandbox


@pytest.fixture(scope="session")
def sandbox():
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is required for the environment tests: apt-get install bubblewrap (make test does)")
    return make_sandbox("bwrap")


@pytest.fixture(scope="module", params=["bwrap", "docker"])
def each_sandbox(request):
    """Both isolated sandboxes, one after the other (a test that takes it runs in each)."""
    try:
        return make_sandbox(request.param)
    except SandboxUnavailable as e:
        pytest.fail(f"the {request.param} sandbox is required here ({e}); `make test` installs bubblewrap and "
                    "docker.io and starts dockerd")


@pytest.fixture
def tmp_path():
    """A temporary directory the sandbox user can reach (pytest's own sit under a root-only directory): the bwrap
    sandbox runs as an unprivileged host user when the tests run as root."""
    d = Path(tempfile.mkdtemp(prefix="temper-test-"))
    d.chmod(0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)
