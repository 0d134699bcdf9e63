import os
import sys
from pathlib import Path

import pytest
import torch

# temper_kernels/: without a GPU the Triton kernels run in Triton's interpreter (numpy), which triton.jit picks when it
# decorates, i.e. at import: set it before anything imports temper_kernels. It changes nothing unless a test asks for
# the Triton backend (TEMPER_KERNELS=triton); on CPU tensors the dispatch picks the torch references.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Under pytest-xdist (`-n 2`, what `make test` runs) each worker takes one core: two workers with two threads each
# would oversubscribe a 2-core machine (OpenMP spin-waits slow small ops by orders of magnitude).
# TEMPER_TEST_THREADS sets the count for every test instead (`make test-threads` runs the tests that compare
# floating-point results across processes, thread counts or batch shapes at 2 threads, so their outcome is shown not
# to depend on the reduction order a thread count gives).
TEST_THREADS = int(os.environ.get("TEMPER_TEST_THREADS") or 0)
torch.set_num_threads(TEST_THREADS or (1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1))))


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread (trainers, the model's training tests): with two, torch oversubscribes a shared 2-core machine (a
    loader or gloo thread next to the compute threads slows small ops by orders of magnitude)."""
    n = torch.get_num_threads()
    torch.set_num_threads(TEST_THREADS or 1)
    yield
    torch.set_num_threads(n)


def make_cfg(**kw):
    from model import ModelConfig

    base = dict(
        vocab_size=300, hidden_size=64, num_hidden_layers=4, first_k_dense_replace=1, intermediate_size=128,
        num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        routed_scaling_factor=2.5, index_topk=8, index_head_dim=16, index_n_heads=16,
        indexer_types=["full", "shared", "full", "shared"], num_nextn_predict_layers=1,
    )
    base.update(kw)
    return ModelConfig(**base)


@pytest.fixture(scope="session")
def wait_for_http():
    """`wait(proc, url, log_path, timeout, what)`: poll `url` until it answers 200; a server that exits or stays silent
    past `timeout` seconds fails with the tail of its log."""
    import time

    import httpx

    def wait(proc, url: str, log_path, timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while True:
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"{what} did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)

    return wait


@pytest.fixture
def cfg_factory():
    return make_cfg


def pytest_collection_modifyitems(config, items):
    """Files holding a `slow` test first. `make test` runs two xdist workers with `--dist loadfile
    --no-loadscope-reorder`, which hands out files in collection order (xdist's default order is by test count,
    which put the one-test fault sweep last): a long file started last leaves one worker running it alone."""
    slow = {it.path for it in items if it.get_closest_marker("slow")}
    items.sort(key=lambda it: it.path not in slow)  # stable: the order within each group is kept
