"""`temper train sft | sao | resume | opd` end to end on the micro preset (seconds, not learning)."""

import json

from pipelines.cli import main


def test_sft_then_sao_then_resume_then_opd(tmp_path):
    o = ["-o", "train.max_steps=6", "-o", "train.batch_size=4"]
    assert main(["train", "sft", "--preset", "micro", *o, "--out", str(tmp_path / "sft")]) == 0
    rep = json.loads((tmp_path / "sft" / "report.json").read_text())
    assert rep["steps"] > 0 and 0 <= rep["pass@1_after"] <= 1
    ck = str(tmp_path / "sft" / "checkpoint")
    assert main(["train", "sao", "--preset", "micro", "--init", ck, "--steps", "2", "--save-every", "1",
                 "--out", str(tmp_path / "sao")]) == 0
    run = json.loads((tmp_path / "sao" / "run.json").read_text())
    run["args"]["steps"] = 3
    (tmp_path / "sao" / "run.json").write_text(json.dumps(run))
    assert main(["train", "resume", "--out", str(tmp_path / "sao")]) == 0
    rep = json.loads((tmp_path / "sao" / "report.json").read_text())
    assert rep["steps"] == 3 and len(rep["reward_curve"]) == 1  # only the one missing step ran
    assert main(["train", "opd", "--preset", "micro", "--init", ck, "--teacher", f"reasoning={ck}",
                 "--teacher", f"math={tmp_path / 'sao' / 'checkpoint'}", "--steps", "2",
                 "--out", str(tmp_path / "opd")]) == 0
    rep = json.loads((tmp_path / "opd" / "report.json").read_text())
    assert rep["steps"] == 2 and rep["teacher_pool"]["loads"] >= 2


def test_sao_with_two_trainer_ranks_under_torchrun(tmp_path):
    """`--world-size 2` re-launches under torchrun: rank 0 drives the engine and hands batches to rank 1; both
    end with the same weights, and rank 0 writes the report and the checkpoint."""
    import subprocess
    import sys

    import torch

    import configs
    from model import Transformer, save_checkpoint

    torch.manual_seed(0)
    save_checkpoint(Transformer(configs.load("micro").model), tmp_path / "init")
    out = tmp_path / "sao"
    subprocess.run([sys.executable, "-m", "pipelines.cli", "train", "sao", "--preset", "micro", "--init",
                    str(tmp_path / "init"), "--steps", "2", "--save-every", "2", "--world-size", "2", "--out", str(out),
                    "-o", "sao.value_pretrain_steps=0"], check=True, timeout=900)
    rep = json.loads((out / "report.json").read_text())
    assert rep["steps"] == 2 and (out / "checkpoint" / "config.json").exists()
    assert (out / "rank0.weights").read_text() == (out / "rank1.weights").read_text()


def test_torchrun_relaunch_tries_another_port_when_its_port_was_taken(squatted_port, capsys):
    """`temper train --world-size N` re-runs itself under torchrun on a port from `free_port`; another process can
    bind it first. torchrun then fails on EADDRINUSE and the command runs again on a new port; a port taken every
    time ends with torchrun's status and its error in the output."""
    import trainers.backends as tb
    from pipelines.train_cli import _torchrun

    assert _torchrun(2, ["--help"]) == 0
    assert squatted_port.handed[0] == squatted_port.taken and len(squatted_port.handed) == 2
    squatted_port.always()
    assert _torchrun(2, ["--help"]) != 0
    assert tb.port_taken(capsys.readouterr().out)
