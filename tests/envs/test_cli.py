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
