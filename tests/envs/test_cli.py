import json

from pipelines.cli import main


def test_envs_generate_validate_show(tmp_path, capsys):
    ds = tmp_path / "ds"
    assert main(["envs", "generate", "--pattern", "kv-lookup", "--pattern", "calc-chain", "--n", "4",
                 "--out", str(ds)]) == 0
    assert json.loads((ds / "manifest.json").read_text())["families"] == {"kv-lookup": 2, "calc-chain": 2}
    assert main(["envs", "validate", str(ds)]) == 0
    out = capsys.readouterr().out
    assert "kv-lookup" in out and "4/4 accepted" in out
    report = json.loads((ds / "validation.json").read_text())
    assert len(report) == 4 and all(r["accepted"] for r in report)
    sid = report[0]["id"]
    assert main(["envs", "show", str(ds / "accepted"), sid]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["id"] == sid and "reference" not in shown and "hidden" not in shown
    assert main(["envs", "show", str(ds), sid, "--reveal"]) == 0
    assert "reference" in json.loads(capsys.readouterr().out)
    assert main(["envs", "show", str(ds), "nope"]) == 2
    assert main(["envs", "generate", "--pattern", "nope", "--out", str(tmp_path / "x")]) == 2
    # reports keep the dataset's order whatever the number of workers
    assert [r["id"] for r in report] == [json.loads(line)["id"] for line in (ds / "specs.jsonl").read_text().splitlines()]
    assert main(["envs", "validate", str(ds), "--workers", "1", "--no-probes", "--out", str(tmp_path / "one")]) == 0
    one = json.loads((tmp_path / "one" / "validation.json").read_text())
    assert [(r["id"], r["accepted"]) for r in one] == [(r["id"], r["accepted"]) for r in report]


def test_config_and_path_mistakes_get_an_error_not_a_traceback(tmp_path, capsys):
    out = str(tmp_path / "x")
    assert main(["train", "sft", "--preset", "micro", "-o", "train.lr=fast", "--out", out]) == 2
    assert "train.lr: Input should be a valid number" in capsys.readouterr().err
    assert main(["train", "sft", "--preset", "micro", "-o", "train.lrr=1", "--out", out]) == 2
    assert "did you mean `train.lr`?" in capsys.readouterr().err
    assert main(["train", "sft", "--preset", "micro", "-o", "envs.patterns=[nope]", "--out", out]) == 2
    assert "unknown task family 'nope'" in capsys.readouterr().err
    assert main(["envs", "show", str(tmp_path / "no-such-dataset"), "x"]) == 2
    assert "no-such-dataset" in capsys.readouterr().err
