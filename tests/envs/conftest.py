import shutil
import tempfile
from pathlib import Path

import pytest

from envs.sandbox import make_sandbox


@pytest.fixture(scope="session")
def sandbox():
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is required for the environment tests: apt-get install bubblewrap (make test does)")
    return make_sandbox("bwrap")


@pytest.fixture
def tmp_path():
    """A temporary directory the sandbox user can reach (pytest's own sit under a root-only directory): the bwrap
    sandbox runs as an unprivileged host user when the tests run as root."""
    d = Path(tempfile.mkdtemp(prefix="temper-test-"))
    d.chmod(0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)
