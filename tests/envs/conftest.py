import shutil

import pytest

from envs.sandbox import make_sandbox


@pytest.fixture(scope="session")
def sandbox():
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is required for the environment tests: apt-get install bubblewrap (make test does)")
    return make_sandbox("bwrap")
