"""The `champion` alias moves only on a significant improvement that also beats the champion."""

from store.tracking import Tracker


def test_champion_moves_only_on_a_significant_gain(tmp_path):
    tr = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = tr.start("it")
    r1 = tr.register_student("s", run, "/ckpt/1", 0.40, significant=False, p_value=0.3)
    assert not r1["champion_moved"] and "no significant gain" in r1["reason"]
    r2 = tr.register_student("s", run, "/ckpt/2", 0.45, significant=True, p_value=0.01)
    assert r2["champion_moved"]
    assert str(tr.client.get_model_version_by_alias("s", "champion").version) == str(r2["version"])
    r3 = tr.register_student("s", run, "/ckpt/3", 0.60, significant=False, p_value=0.08)  # higher, not significant
    assert not r3["champion_moved"]
    r4 = tr.register_student("s", run, "/ckpt/4", 0.44, significant=True, p_value=0.02)  # significant, below champion
    assert not r4["champion_moved"] and "does not beat" in r4["reason"]
    assert str(tr.client.get_model_version_by_alias("s", "champion").version) == str(r2["version"])
    assert tr.client.get_model_version("s", str(r3["version"])).tags["significant"] == "False"
