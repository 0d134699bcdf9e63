import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for in-process steps: with two, torch oversubscribes a shared 2-core machine (a
    loader or gloo thread next to the compute threads slows small ops by orders of magnitude)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
