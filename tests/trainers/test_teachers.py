"""Teacher pool: LRU residency, pinning, background prefetch accounting, swap-minimising scoring order,
thread safety of background loads next to forward passes, and clear errors."""

import threading

import pytest
import torch

import configs
from model import Transformer, load_checkpoint, save_checkpoint
from trainers.teachers import TeacherPool

DOMAINS = ("code", "math", "reasoning")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """Three micro teachers with different weights, saved HF-layout; returns (paths, reference models)."""
    root = tmp_path_factory.mktemp("teachers")
    cfg = configs.load("micro").model
    paths, refs = {}, {}
    for i, d in enumerate(DOMAINS):
        torch.manual_seed(100 + i)
        m = Transformer(cfg).eval()
        paths[d] = save_checkpoint(m, root / d)
        refs[d] = m
    return paths, refs


class Recorder:
    """A loader that tags each model with its domain and records which thread loaded it."""

    def __init__(self, paths, gate: dict | None = None):
        self.by_path = {str(p): d for d, p in paths.items()}
        self.calls: list[tuple[str, str]] = []
        self.gate = gate or {}

    def __call__(self, path):
        d = self.by_path[str(path)]
        if d in self.gate:
            self.gate[d].wait(10)
        self.calls.append((d, threading.current_thread().name))
        m = load_checkpoint(path)
        m.teacher_domain = d
        return m


def _ids(seed=0, b=2, t=24):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, t), generator=g)


def _logprobs(model, ids):
    with torch.no_grad():
        return model(ids)[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]


def test_lru_residency_swaps_and_right_weights(teachers):
    paths, refs = teachers
    rec = Recorder(paths)
    with TeacherPool(paths, max_resident=2, loader=rec) as pool:
        ids = _ids()
        for d in DOMAINS:
            torch.testing.assert_close(_logprobs(pool.get(d), ids), _logprobs(refs[d], ids), rtol=0, atol=0)
        assert pool.resident() == ["math", "reasoning"]  # code was least recently used
        pool.get("math")  # resident: no load, becomes most recent
        assert pool.resident() == ["reasoning", "math"]
        pool.get("code")  # evicts reasoning, the LRU one
        assert pool.resident() == ["math", "code"]
        s = pool.stats()
        assert (s.swaps, s.loads, s.evictions) == (4, 4, 2)
        assert s.hidden_seconds == 0.0 and s.hidden_fraction == 0.0  # all synchronous
        assert [t for _, t in rec.calls] == ["MainThread"] * 4


def test_use_pins_a_teacher_and_prefetch_waits_staged(teachers):
    paths, _ = teachers
    rec = Recorder(paths)
    with TeacherPool(paths, max_resident=1, loader=rec) as pool:
        with pool.use("code") as t:
            assert t.teacher_domain == "code"
            pool.prefetch("math").result()  # loaded, but the only slot is pinned: stays staged
            assert pool.resident() == ["code"]
            assert pool.prefetch("math") is None  # already staged: no second load
            with pytest.raises(RuntimeError, match="in use.*code"):
                pool.get("reasoning")
        assert pool.get("math").teacher_domain == "math"  # installs the staged one, evicts code
        assert pool.resident() == ["math"]
        s = pool.stats()
        assert (s.swaps, s.loads, s.evictions) == (2, 3, 1)  # the refused reasoning load still counts
        assert [c for c in rec.calls if c[0] == "math"] == [("math", "teacher-prefetch_0")]


def test_prefetch_accounting_hidden_and_waited(teachers):
    paths, _ = teachers
    # Fully hidden: the prefetch finished before anyone asked.
    with TeacherPool(paths, loader=Recorder(paths)) as pool:
        pool.prefetch("code").result()
        pool.get("code")
        s = pool.stats()
        assert s.loads == 1 and s.hidden_seconds == s.load_seconds > 0 and s.hidden_fraction == 1.0
        assert s.wait_seconds == 0.0
    # Not hidden: the caller asked at once and waited for the whole (gated) load.
    gate = {"math": threading.Event()}
    with TeacherPool(paths, loader=Recorder(paths, gate)) as pool:
        pool.prefetch("math")
        threading.Timer(0.3, gate["math"].set).start()
        pool.get("math")
        s = pool.stats()
        assert s.load_seconds >= 0.3 and s.wait_seconds >= 0.3
        assert s.hidden_seconds < 0.5 * s.load_seconds
    # A prefetch evicted before anyone took it is a load, never hidden time.
    with TeacherPool(paths, max_resident=1, loader=Recorder(paths)) as pool:
        pool.prefetch("code").result()
        pool.get("math")  # evicts the untaken code teacher
        pool.get("code")  # synchronous reload
        s = pool.stats()
        assert s.loads == 3 and s.hidden_seconds == 0.0


def test_score_batches_order_results_and_background_loads(teachers):
    paths, refs = teachers
    rec = Recorder(paths)
    batches = [("math", _ids(0)), ("code", _ids(1)), ("math", _ids(2)), ("reasoning", _ids(3)), ("code", _ids(4))]
    visited = []

    def score(teacher, ids):
        if not visited or visited[-1] != teacher.teacher_domain:
            visited.append(teacher.teacher_domain)
        return _logprobs(teacher, ids)

    with TeacherPool(paths, max_resident=1, loader=rec) as pool:
        out = pool.score_batches(batches, score)
        for (d, ids), got in zip(batches, out):
            torch.testing.assert_close(got, _logprobs(refs[d], ids), rtol=0, atol=0)
        assert visited == ["math", "code", "reasoning"]  # first appearance, each domain once
        # The first teacher is loaded on demand, the next two in the background while scoring.
        assert rec.calls == [("math", "MainThread"), ("code", "teacher-prefetch_0"), ("reasoning", "teacher-prefetch_0")]
        s = pool.stats()
        assert (s.swaps, s.loads) == (3, 3)
        # Second call: the resident teacher (reasoning) goes first, so only two more swaps.
        visited.clear()
        out = pool.score_batches(batches, score)
        assert visited == ["reasoning", "math", "code"]
        assert pool.stats().swaps == 5
        # Without prefetch every load is synchronous.
        rec.calls.clear()
        pool.score_batches(batches, score, prefetch=False)
        assert {t for _, t in rec.calls} == {"MainThread"}
        assert pool.score_batches([], score) == []


def test_background_loads_while_forward_passes_run(teachers):
    """Loads (meta-device construction, safetensors reads) in the background thread do not disturb
    forward passes in this thread, and the loaded teachers are exact."""
    paths, refs = teachers
    ids = _ids(7, b=4, t=48)
    want = _logprobs(refs["code"], ids)
    with TeacherPool(paths, max_resident=2, loader=Recorder(paths)) as pool:
        with pool.use("code") as t:
            for _ in range(3):
                for d in ("math", "reasoning"):
                    fut = pool.prefetch(d)
                    assert fut is not None  # the other one was evicted, so this is a real load
                    forwards = 0
                    while not fut.done() or forwards == 0:
                        torch.testing.assert_close(_logprobs(t, ids), want, rtol=0, atol=0)
                        forwards += 1
                    fut.result()
                    torch.testing.assert_close(_logprobs(pool.get(d), ids), _logprobs(refs[d], ids), rtol=0, atol=0)
            assert pool.resident() == ["code", "reasoning"]
        s = pool.stats()
        assert s.loads == 7 and s.evictions == 5


def test_unknown_domain_and_load_errors(teachers, tmp_path):
    paths, _ = teachers
    with TeacherPool({**paths, "broken": tmp_path / "missing"}) as pool:
        for call in (lambda: pool.get("poetry"), lambda: pool.prefetch("poetry"),
                     lambda: pool.score_batches([("poetry", None)], lambda t, b: b)):
            with pytest.raises(KeyError, match="unknown teacher domain 'poetry'; known domains: code, math, reasoning, broken"):
                call()
        with pytest.raises(KeyError, match="poetry"), pool.use("poetry"):
            pass
        pool.prefetch("broken")
        with pytest.raises(FileNotFoundError, match="no config.json"):
            pool.get("broken")  # the background error surfaces here
        with pytest.raises(FileNotFoundError):
            pool.get("broken")  # and a retry loads again rather than hanging
        assert pool.get("code") is not None  # the pool still works
    with pytest.raises(ValueError, match="max_resident"):
        TeacherPool(paths, max_resident=0)
    with pytest.raises(RuntimeError, match="closed"):
        pool.get("code")


def test_a_corrupt_teacher_is_refused_naming_the_file(teachers, tmp_path):
    """OPD's teachers are read with their checksums verified: one flipped byte in a teacher's weights is refused
    (in the background prefetch too, surfacing at `get`), naming the file; the other teachers serve on."""
    import shutil

    from model.checkpoint import ChecksumError

    paths, refs = teachers
    bad = tmp_path / "math"
    shutil.copytree(paths["math"], bad)
    data = bytearray((bad / "model.safetensors").read_bytes())
    data[-2] ^= 0x01
    (bad / "model.safetensors").write_bytes(bytes(data))
    with TeacherPool({"code": paths["code"], "math": bad}) as pool:
        pool.prefetch("math")
        with pytest.raises(ChecksumError, match=f"{bad / 'model.safetensors'}: its bytes do not match"):
            pool.get("math")
        ids = _ids()
        torch.testing.assert_close(_logprobs(pool.get("code"), ids), _logprobs(refs["code"], ids), rtol=0, atol=0)
