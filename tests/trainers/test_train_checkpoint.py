"""Resumable training checkpoints: a SIGKILLed run resumes and reproduces the uninterrupted loss curve;
atomicity (temp dirs and incomplete dirs are ignored, `latest` names a complete checkpoint), pruning,
full state round trip, clear errors.

(Named test_train_checkpoint.py: tests/model/test_checkpoint.py already owns the module name
`test_checkpoint` under pytest's rootdir-relative imports.)"""

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import configs
from model import Transformer
from trainers.checkpoint import (
    LATEST,
    complete_checkpoints,
    latest_checkpoint,
    load_training_state,
    restore,
    save_training_state,
)
from trainers.lm import LMTrainer

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]
TOTAL = 25

# Trains the micro model on the generated corpus. Every source of randomness a step uses is restored on
# resume: the data generator (the data cursor), torch's global RNG (the loss mask), Python's `random`
# (the sequence length) and NumPy's (the mask density).
SCRIPT = r"""
import random, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np, torch
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
import configs
from model import ByteTokenizer, Transformer
from trainers.checkpoint import load_training_state, restore, save_training_state
from trainers.data import generated_corpus
from trainers.lm import LMTrainer

ckpt, total, resume, pause = sys.argv[2], int(sys.argv[3]), sys.argv[4] == "resume", float(sys.argv[5])
cfg = configs.load("micro", ["train.warmup_steps=5", "train.lr=1e-2"])
torch.manual_seed(0); random.seed(0); np.random.seed(0)
model = Transformer(cfg.model)
trainer = LMTrainer(model, cfg.train)
data = torch.tensor(ByteTokenizer().encode(generated_corpus(300, seed=0)))
gen = torch.Generator().manual_seed(1)
start = 0
if resume:
    state = restore(load_training_state(ckpt), model, trainer.opt)
    gen.set_state(state.data_cursor)
    start = trainer.step_no = state.step
    print(f"resumed {start}", flush=True)
for step in range(start, total):
    seq = 24 + random.randrange(9)
    starts = torch.randint(0, len(data) - seq, (4,), generator=gen)
    ids = torch.stack([data[s : s + seq] for s in starts.tolist()])
    mask = torch.rand(ids.shape) < 0.6 + 0.3 * float(np.random.rand())
    st = trainer.step(ids, mask, progress=step / total)
    print(f"step {step + 1} {st.loss!r}", flush=True)
    if (step + 1) % 5 == 0:
        save_training_state(ckpt, policy=model, optimizer=trainer.opt, step=step + 1, policy_version=step + 1,
                            data_cursor=gen.get_state(), extra={"tokens": st.tokens})
    time.sleep(pause)
"""


def _start(ckpt: Path, mode: str, pause: float = 0.0) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(ROOT), str(ckpt), str(TOTAL), mode, str(pause)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _losses(lines) -> dict[int, float]:
    out = {}
    for line in lines:
        if line.startswith("step "):
            _, n, loss = line.split()
            out[int(n)] = float(loss)
    return out


def test_kill_and_resume_reproduces_the_uninterrupted_loss_curve(tmp_path):
    full = _start(tmp_path / "full", "fresh")  # the uninterrupted reference, in parallel
    victim = _start(tmp_path / "run", "fresh", pause=0.05)
    seen = []
    for line in victim.stdout:
        seen.append(line)
        if line.startswith("step 12 "):
            victim.send_signal(signal.SIGKILL)
            break
    victim.wait(30)
    assert victim.returncode == -signal.SIGKILL, "".join(seen) + victim.stderr.read()
    killed_at = max(_losses(seen))
    assert 12 <= killed_at < TOTAL

    resumed = _start(tmp_path / "run", "resume")
    out, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err
    start = int(out.splitlines()[0].split()[1])
    assert start == 5 * (killed_at // 5) and start >= 10  # the last checkpoint before the kill
    after = _losses(out.splitlines())
    assert sorted(after) == list(range(start + 1, TOTAL + 1))

    ref_out, ref_err = full.communicate(timeout=120)
    assert full.returncode == 0, ref_err
    ref = _losses(ref_out.splitlines())
    assert sorted(ref) == list(range(1, TOTAL + 1))
    for step, loss in _losses(seen).items():  # before the kill: same run
        assert loss == pytest.approx(ref[step], abs=1e-5), step
    for step, loss in after.items():  # after the resume: the uninterrupted curve (in fact bit-identical)
        assert loss == pytest.approx(ref[step], abs=1e-5), step
        assert loss == ref[step], step
    assert [s for s, _ in complete_checkpoints(tmp_path / "run")] == [15, 20, 25]  # keep=3
    assert (tmp_path / "run" / LATEST).read_text().strip() == "step-00000025"


# ---- in-process tests ----------------------------------------------------------------------------------
def _trainer(seed=0):
    torch.manual_seed(seed)
    model = Transformer(configs.load("micro").model)
    return model, LMTrainer(model, configs.load("micro", ["train.warmup_steps=2"]).train)


def _train(trainer, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        trainer.step(torch.randint(0, 256, (2, 16), generator=g))


def _save(root, model, trainer, step, **kw):
    return save_training_state(root, policy=model, optimizer=trainer.opt, step=step, policy_version=step,
                               data_cursor={"offset": step}, **kw)


def test_round_trip_restores_weights_optimizer_critic_and_rng(tmp_path):
    model, trainer = _trainer()
    _train(trainer, 3)
    critic = torch.nn.Linear(4, 1)
    critic_opt = torch.optim.SGD(critic.parameters(), lr=0.1, momentum=0.9)
    critic(torch.ones(1, 4)).sum().backward()
    critic_opt.step()
    torch.manual_seed(42), random.seed(42), np.random.seed(42)
    path = _save(tmp_path, model, trainer, 3, critic=critic, critic_optimizer=critic_opt, extra={"note": "x"})
    draws = (torch.rand(3), random.random(), np.random.rand())

    model2, trainer2 = _trainer(seed=7)  # different weights, fresh optimizer
    critic2 = torch.nn.Linear(4, 1)
    critic_opt2 = torch.optim.SGD(critic2.parameters(), lr=0.1, momentum=0.9)
    state = restore(load_training_state(tmp_path), model2, trainer2.opt, critic2, critic_opt2)
    assert state.path == path and (state.step, state.policy_version) == (3, 3)
    assert state.data_cursor == {"offset": 3} and state.extra == {"note": "x"}
    assert json.loads((state.policy_path / "temper.json").read_text())["policy_version"] == 3
    for (n, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), n  # router biases included
    for a, b in zip(critic.state_dict().values(), critic2.state_dict().values()):
        assert torch.equal(a, b)
    assert critic_opt2.state_dict()["state"][0]["momentum_buffer"].equal(critic_opt.state_dict()["state"][0]["momentum_buffer"])
    assert torch.equal(draws[0], torch.rand(3)) and draws[1] == random.random() and draws[2] == np.random.rand()
    # Training continues identically from the restored objects.
    trainer2.step_no = state.step
    _train(trainer, 2, seed=9)
    _train(trainer2, 2, seed=9)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    _save(tmp_path / "no-critic", model, trainer, 1)
    with pytest.raises(ValueError, match="no critic state"):
        restore(load_training_state(tmp_path / "no-critic"), model2, trainer2.opt, critic2)
    # an optimizer over other parameters than the saved one's (a model built another way since): named, not torch's
    # bare "parameter group" error
    other = torch.optim.AdamW(list(model2.parameters())[:3])
    with pytest.raises(ValueError, match=r"optimizer state does not fit .*trainer\.megatron\.experts"):
        restore(load_training_state(tmp_path), model2, other)


def test_a_sharded_state_is_refused_on_another_megatron_layout_and_legacy_layouts_read_as_sequential(tmp_path):
    """Rank files of a Megatron layout saved before the expert module (and the optimizer) were recorded held
    SequentialMLP experts and whole AdamW moments: the grouped module is refused with the keys to change; the
    sequential one passes the layout check (and goes on to read its rank file)."""
    from trainers.checkpoint import TrainingState, _own_part

    legacy = {"world": 2, "tp": 2, "pp": 1, "ep": 1, "etp": 2, "dtype": "float32"}

    class Backend:
        def __init__(self, experts):
            self.layout = {**legacy, "experts": experts, "distributed_optimizer": False}

        def state_layout(self):
            return self.layout

    state = TrainingState(path=tmp_path, step=1, policy_version=1, data_cursor=None, ranks=2, layout=legacy)
    with pytest.raises(ValueError, match=r"saved by 2 ranks .*\(tp, ep, etp, experts, distributed_optimizer\)"):
        _own_part(state, Backend("grouped"))
    # past the layout check it asks for this process's rank (no process group: an error) and reads its rank file
    # (a process group left by another test in this worker: rank 0, whose file this state does not have)
    with pytest.raises((RuntimeError, ValueError, FileNotFoundError)) as e:
        _own_part(state, Backend("sequential"))
    assert "saved by" not in str(e.value)


def test_atomicity_partial_saves_are_ignored(tmp_path, monkeypatch):
    model, trainer = _trainer()
    _save(tmp_path, model, trainer, 10)
    # A crash in the middle of a save: the exception propagates, nothing half-written is visible.
    real_save = torch.save

    def crash(obj, f, *a, **kw):
        real_save(obj, f, *a, **kw)
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, model, trainer, 15)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step-00000010"]
    # Leftovers of a killed writer (temp dir) and a step dir without its completion marker.
    (tmp_path / ".step-00000020.abc.tmp" / "policy").mkdir(parents=True)
    (tmp_path / ".step-00000020.abc.tmp" / "trainer.pt").write_bytes(b"partial")
    (tmp_path / "step-00000030").mkdir()
    (tmp_path / "step-00000030" / "trainer.pt").write_bytes(b"partial")
    assert load_training_state(tmp_path).step == 10
    # A crash between the rename and the `latest` update: the newer complete checkpoint wins.
    _save(tmp_path, model, trainer, 12)
    assert not any(p.name.startswith(".step-") for p in tmp_path.iterdir())  # stale temps cleaned
    (tmp_path / LATEST).write_text("step-00000010\n")
    assert load_training_state(tmp_path).step == 12
    # `latest` always names a complete checkpoint after a save.
    for step in (13, 14):
        _save(tmp_path, model, trainer, step)
        target = tmp_path / (tmp_path / LATEST).read_text().strip()
        assert target == latest_checkpoint(tmp_path) and (target / "meta.json").is_file()
        assert load_training_state(tmp_path).step == step
    # Resuming from an earlier checkpoint and saving abandons the later ones.
    _save(tmp_path, model, trainer, 11)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [11]  # 10 was pruned earlier (keep=3)
    assert load_training_state(tmp_path / "step-00000011").step == 11  # a step dir can be named directly


def test_keep_prunes_old_checkpoints(tmp_path):
    model, trainer = _trainer()
    for step in range(1, 6):
        _save(tmp_path, model, trainer, step, keep=2)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [4, 5]
    _save(tmp_path, model, trainer, 5, keep=2)  # re-saving a step replaces it
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [4, 5]
    with pytest.raises(ValueError, match="keep"):
        _save(tmp_path, model, trainer, 6, keep=0)


def test_nothing_to_resume_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"nothing to resume.*{tmp_path / 'nope'} does not exist"):
        load_training_state(tmp_path / "nope")
    (tmp_path / "empty" / ".step-00000005.x.tmp").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'empty'} holds no complete checkpoint"):
        load_training_state(tmp_path / "empty")


def test_resume_falls_back_to_the_newest_intact_state_loudly(tmp_path, caplog):
    """A truncated newest trainer.pt, or one flipped byte in a newer state's policy, is skipped with a warning naming
    the state (never a raw unpickling error), and the newest intact state is resumed; the restored weights are that
    state's. With no intact state, the error names every one and why."""
    import logging

    from model.checkpoint import ChecksumError
    from trainers.checkpoint import StateUnreadable

    model, trainer = _trainer()
    weights = {}
    for step in (1, 2, 3):
        _train(trainer, 1, seed=step)
        _save(tmp_path, model, trainer, step)
        weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
    newest, middle = tmp_path / "step-00000003", tmp_path / "step-00000002"
    pt = newest / "trainer.pt"
    pt.write_bytes(pt.read_bytes()[: pt.stat().st_size // 2])  # truncated (a full disk, a killed copy)
    data = bytearray((middle / "policy" / "model.safetensors").read_bytes())
    data[-3] ^= 0x10
    (middle / "policy" / "model.safetensors").write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="trainers.checkpoint"):
        state = load_training_state(tmp_path)
    assert state.step == 1 and state.path == tmp_path / "step-00000001"
    assert [p for p, _ in state.skipped] == [newest, middle]
    assert "ChecksumError" in state.skipped[0][1] and "trainer.pt" in state.skipped[0][1]
    assert "ChecksumError" in state.skipped[1][1] and "model.safetensors" in state.skipped[1][1]
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert f"training state {newest} is damaged and skipped" in logged and str(middle) in logged
    model2, trainer2 = _trainer(seed=5)
    restore(state, model2, trainer2.opt)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, weights[1][k]), k
    # a state saved before checksums were recorded: the truncated pickle itself is caught, and skipped the same way
    meta = json.loads((tmp_path / "step-00000001" / "meta.json").read_text())
    (tmp_path / "step-00000001" / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "files"}))
    pt1 = tmp_path / "step-00000001" / "trainer.pt"
    pt1.write_bytes(pt1.read_bytes()[:100])
    with pytest.raises(StateUnreadable, match=r"step-00000003: ChecksumError.*step-00000002: ChecksumError.*"
                                               r"step-00000001: (RuntimeError|EOFError|UnpicklingError)"):
        load_training_state(tmp_path)
    # the policy is verified where the state is restored too, when it was not just verified
    state.verified = False
    with pytest.raises(ChecksumError, match="model.safetensors"):
        restore(state.__class__(**{**state.__dict__, "path": middle}), model2, trainer2.opt)


def test_a_newer_state_without_its_meta_is_passed_over_loudly(tmp_path, caplog):
    """The newest step directory lost its meta.json (a save completes by renaming, so this is damage): the resume
    takes the newest complete state, and says which newer one it passed over and why, instead of saying nothing."""
    import logging

    model, trainer = _trainer()
    for step in (1, 2, 3):
        _train(trainer, 1, seed=step)
        _save(tmp_path, model, trainer, step)
    (tmp_path / "step-00000003" / "meta.json").unlink()
    with caplog.at_level(logging.WARNING, logger="trainers.checkpoint"):
        state = load_training_state(tmp_path)
    assert state.step == 2 and state.skipped == [(tmp_path / "step-00000003", "incomplete: no meta.json")]
    assert f"training state {tmp_path / 'step-00000003'} is incomplete" in "\n".join(r.getMessage() for r in caplog.records)


def test_a_state_whose_policy_lost_its_checksums_is_not_resumed_as_verified(tmp_path):
    """The newest state's policy without its temper.json, and a byte of its weights flipped: it cannot be vouched for,
    so it is skipped like a damaged one (it was resumed, reported verified, and restored unchecked)."""
    model, trainer = _trainer()
    for step in (1, 2):
        _train(trainer, 1, seed=step)
        _save(tmp_path, model, trainer, step)
    pol = tmp_path / "step-00000002" / "policy"
    (pol / "temper.json").unlink()
    data = bytearray((pol / "model.safetensors").read_bytes())
    data[-3] ^= 0x10
    (pol / "model.safetensors").write_bytes(bytes(data))
    state = load_training_state(tmp_path)
    assert state.step == 1 and state.skipped[0][0] == tmp_path / "step-00000002"
    assert "no recorded checksums" in state.skipped[0][1]
