"""The rollout backend: two embedded servers behind temper's Router serve the rollout stage exactly as
SGLang URLs would (weights loaded through /update_weights_from_disk, trajectories into DuckDB)."""

import dagster as dg
import httpx
import pytest
import torch
from micro_rollouts import stored_rollouts

import configs
import stages
from assets import RolloutBackend
from model import Transformer, load_checkpoint, save_checkpoint, weights_checksum
from rollout.backend import embedded_servers
from store import TrajectoryStore


def test_rollouts_through_two_servers_by_url(tmp_path):
    cfg = configs.load("micro", ["envs.n_train=6", "envs.n_eval=1", "envs.probes=false"])
    specs = stages.env_specs(cfg, tmp_path / "envs")
    envs = stages.verified_envs(cfg, specs, tmp_path / "verified")
    torch.manual_seed(1)
    save_checkpoint(Transformer(cfg.model), tmp_path / "policy", policy_version=1)
    heard = []  # what `temper run` shows as the stage's k of N (stages/step.py passes a reporter)
    with embedded_servers(cfg.model, n=2, n_slots=4, max_len=cfg.agent.max_context + 8, seed=5) as urls:
        assert len(set(urls)) == 2
        out = stages.rollout_batches(cfg, str(tmp_path / "policy"), envs, tmp_path / "t.duckdb", iteration=7, urls=urls,
                                     progress=lambda k, n, what: heard.append((k, n, what)))
    assert out["trajectories"] == envs["accepted"] > 0 and out["workers"] == urls
    n = out["trajectories"]
    assert heard == [(k, n, "rollouts") for k in range(1, n + 1)]  # one per episode as it finishes
    with TrajectoryStore(tmp_path / "t.duckdb", read_only=True) as st:
        trajs = st.read(iteration=7)
    assert len(trajs) == out["trajectories"]
    versions = {v for t in trajs for s in t.segments for v, m in zip(s.versions, s.loss_mask) if m}
    assert versions == {stages.WARM_VERSION}  # every generated token came from the warm start, served at its version
    assert sorted(out["trajectory_ids"]) == sorted(t.trajectory_id for t in trajs)
    # a rerun with the same policy finds every rollout stored and generates none; another policy gets its own
    with embedded_servers(cfg.model, n=1, n_slots=4, max_len=cfg.agent.max_context + 8, seed=5) as urls:
        again = stages.rollout_batches(cfg, str(tmp_path / "policy"), envs, tmp_path / "t.duckdb", iteration=7,
                                       urls=urls)
        assert again["resumed_with"] == out["trajectories"] and again["trajectory_ids"] == out["trajectory_ids"]
        torch.manual_seed(2)
        save_checkpoint(Transformer(cfg.model), tmp_path / "other", policy_version=1)
        other = stages.rollout_batches(cfg, str(tmp_path / "other"), envs, tmp_path / "t.duckdb", iteration=7,
                                       urls=urls)
    assert other["resumed_with"] == 0 and not set(other["trajectory_ids"]) & set(out["trajectory_ids"])
    with TrajectoryStore(tmp_path / "t.duckdb", read_only=True) as st:
        assert st.count(iteration=7) == 2 * out["trajectories"]


def test_sao_reads_the_scored_rollouts_back_from_the_store(tmp_path):
    """rollout_batches → rewards → sao_expert is a real data flow: `rewards` scores the stored rollouts per domain,
    and SAO's critic pre-trains on that domain's rollouts, read back from the store, then takes its first step on them."""
    cfg = configs.load("micro", ["envs.n_train=8", "envs.n_eval=1", "envs.probes=false", "loop.steps=2",
                                 "sao.value_pretrain_steps=1", "loop.warm_rollouts=train"])
    envs, store, ro = stored_rollouts(cfg, tmp_path, iteration=2)
    # an unrelated trajectory of the same iteration in the store: `rewards` scores only rollout_batches' own
    with TrajectoryStore(store) as st:
        extra = st.read(2, limit=1)[0]
        extra.trajectory_id, extra.reward = "not-a-rollout", 1.0
        st.write([extra])
    scored = stages.rewards(store, 2, ro["trajectory_ids"])
    with TrajectoryStore(store, read_only=True) as st:
        trajs = st.read(2, ids=ro["trajectory_ids"])
    assert scored["trajectories"] == len(trajs) == ro["trajectories"]
    for dom, d in scored["domains"].items():
        mine = [t for t in trajs if t.domain == dom]
        assert sorted(d["ids"]) == sorted(t.trajectory_id for t in mine)
        assert d["mean_reward"] == pytest.approx(sum(t.reward for t in mine) / len(mine))
        assert scored["domain_reward"][dom] == d["mean_reward"]
    dom = max(scored["domains"], key=lambda k: scored["domains"][k]["trajectories"])
    warm = scored["domains"][dom]["ids"]
    out = stages.sao_expert(cfg, str(tmp_path / "policy"), envs, dom, tmp_path / "expert", store_path=store,
                            iteration=2, warm_rollouts=warm)
    assert out["warm_rollouts"] == len(warm) and out["warm_rollouts_use"] == "train"
    with TrajectoryStore(store, read_only=True) as st:
        rows = st.consumption("sao")
    assert sorted(r["trajectory_id"] for r in rows if r["outcome"] == "value_pretrain") == sorted(warm)
    first = [r for r in rows if r["step"] == 1]
    assert sorted(r["trajectory_id"] for r in first) == sorted(warm) and all(r["staleness"] == 0 for r in first)
    # ids that are not this domain's warm-start rollouts are refused, not silently skipped
    other = next((d for d in scored["domains"] if d != dom), None)
    with pytest.raises(ValueError, match="not in"):
        stages.sao_expert(cfg, str(tmp_path / "policy"), envs, dom, tmp_path / "x1", store_path=store, iteration=2,
                          warm_rollouts=warm + ["no-such-id"])
    if other is not None:
        with pytest.raises(ValueError, match=f"not {dom} trajectories"):
            stages.sao_expert(cfg, str(tmp_path / "policy"), envs, dom, tmp_path / "x2", store_path=store,
                              iteration=2, warm_rollouts=scored["domains"][other]["ids"])
    # the replay anchor: the other domains' warm rollouts (read back, any domain) are its rows
    others = stages.replay_ids(scored["domains"], dom)
    assert others, "the micro RL set has a single domain: nothing to replay"
    replay = cfg.model_copy(update={"sao": cfg.sao.model_copy(update={"replay_coef": 1.0})})
    curves = []
    out = stages.sao_expert(replay, str(tmp_path / "policy"), envs, dom, tmp_path / "r1", store_path=store,
                            iteration=2, warm_rollouts=warm, replay_rollouts=others,
                            metrics=lambda values, step: curves.append(values))
    with TrajectoryStore(store, read_only=True) as st:
        tokens = sum(max(0, sum(s.loss_mask[1:])) for t in st.read(2, ids=others)
                     if t.status not in ("crashed", "aborted") for s in t.segments if s.tokens)
    assert out["replay_rollouts"] == len(others) and out["replay_tokens"] == tokens > 0
    # every step reports the anchor's KL (to MLflow), and the first, taken at the reference, is 0
    assert len(curves) == 2 and all("replay_kl" in c for c in curves)
    assert curves[0]["replay_kl"] == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="sao.replay_coef"):
        stages.sao_expert(replay, str(tmp_path / "policy"), envs, dom, tmp_path / "r2", store_path=store,
                          iteration=2, warm_rollouts=warm)
    # a pattern of its own left out of training (nearly constant reward): its warm rollouts join the replay rows,
    # and the expert replays them without other domains' rows given
    from envs.dataset import read_dataset
    from trainers.sft import pattern_key

    specs = {s.id: pattern_key(s) for s in read_dataset(stages.rl_set(envs)) if s.domain == dom}
    with TrajectoryStore(store, read_only=True) as st:
        mine = [t for t in st.read(2, ids=warm) if t.status not in ("crashed", "aborted") and t.n_trainable]
    left = specs[mine[0].env_id]
    assert set(specs.values()) - {left}, "the micro domain has a single pattern: nothing would be left to train on"
    own = [t for t in mine if specs[t.env_id] == left]
    out = stages.sao_expert(replay, str(tmp_path / "policy"), envs, dom, tmp_path / "r3", store_path=store,
                            iteration=2, warm_rollouts=warm, constant={left: 0.0})
    assert out["replay_rollouts"] == len(own) > 0
    assert out["replay_tokens"] == sum(max(0, sum(s.loss_mask[1:])) for t in own for s in t.segments if s.tokens)


def test_sglang_backend_needs_urls():
    cfg = configs.load("micro")
    with pytest.raises(dg.Failure, match="needs `urls`"), RolloutBackend(kind="sglang").serving(cfg):
        pass
    with RolloutBackend(kind="sglang", urls=["http://10.0.0.1:30000"], router_url="http://10.0.0.1:30001").serving(cfg) as (u, r):
        assert u == ["http://10.0.0.1:30000"] and r == "http://10.0.0.1:30001"


def test_sao_opd_and_evaluation_run_on_two_servers_and_store_every_trajectory(tmp_path):
    """Each generating stage given URLs drives the servers (weights pushed by /update_weights_from_disk), and
    every trajectory it generated is in the store with what the stage did with it."""
    cfg = configs.load("micro", ["envs.n_train=6", "envs.n_eval=4", "envs.probes=false", "loop.steps=2",
                                 "loop.save_every=1", "opd.steps=2", "sao.value_pretrain_steps=0"])
    specs = stages.env_specs(cfg, tmp_path / "envs")
    envs = stages.verified_envs(cfg, specs, tmp_path / "verified")
    torch.manual_seed(1)
    save_checkpoint(Transformer(cfg.model), tmp_path / "policy", policy_version=1)
    store = tmp_path / "t.duckdb"
    dom = envs["domains"][0]
    with embedded_servers(cfg.model, n=2, n_slots=4, max_len=cfg.agent.max_context + 8) as urls, \
            embedded_servers(cfg.model, n=2, n_slots=4, max_len=cfg.agent.max_context + 8) as teacher_urls:
        sao = stages.sao_expert(cfg, str(tmp_path / "policy"), envs, dom, tmp_path / "expert", urls=urls,
                                store_path=store, iteration=3)
        # the random policy earns nothing, so SAO leaves its expert equal to the warm start: OPD gets a perturbed
        # copy as the expert instead, so the two teacher servers can be told apart by their weights
        teacher = load_checkpoint(sao["checkpoint"])
        with torch.no_grad():
            for t in teacher.parameters():
                t.add_(0.01 * torch.randn_like(t))
        save_checkpoint(teacher, tmp_path / "teacher", policy_version=1)
        opd = stages.opd_student(cfg, str(tmp_path / "policy"), {dom: str(tmp_path / "teacher")}, envs,
                                 tmp_path / "student", urls=urls, store_path=store, iteration=3,
                                 teacher_urls=teacher_urls)
        teacher_info = {(i := httpx.get(u + "/get_model_info").json())["weight_version"]: i["weights_checksum"]
                        for u in teacher_urls}
        ev = stages.evaluation(cfg, opd["checkpoint"], str(tmp_path / "policy"), envs, {dom: sao["checkpoint"]},
                               urls=urls, store_path=store, out=tmp_path / "eval", iteration=3)
        served = {u: httpx.get(u + "/get_model_info").json() for u in urls}
    assert sao["backend"] == opd["backend"] == "servers" and sao["steps"] == 2 and opd["steps"] == 2
    # a random micro policy earns no reward: SAO's advantages are all zero, so it makes no update and no version
    # (test_disaggregated.py sets rewards and checks the pushes); OPD's reverse KL moves the student every step
    assert sao["pushes"] == sao["updates"] and "mismatch_fresh_mean" in sao and "mismatch_fresh_mean" in opd
    # the teachers scored on their own servers, each loaded once (named by its teacher id), never on the rollout
    # ones: the expert for `dom`, and the warm start for the other domain (opd.untaught=warm_start)
    assert opd["anchored"] == [d for d in envs["domains"] if d != dom] and len(opd["anchored"]) == 1
    assert opd["pool"]["loads"] == 2 and set(teacher_info) == {"10000", "10001"}
    assert teacher_info["10000"] == weights_checksum(load_checkpoint(tmp_path / "teacher"))  # the expert's own weights
    assert teacher_info["10001"] == weights_checksum(load_checkpoint(tmp_path / "policy"))  # the warm start's
    with TrajectoryStore(store, read_only=True) as st:
        ids = {r[0]: r[1] for r in st.cursor().execute("SELECT trajectory_id, iteration FROM trajectories").fetchall()}
        rows = {s: st.consumption(s) for s in ("sao", "opd", "eval")}
    assert set(ids.values()) == {3}
    assert sao["stored_trajectories"] + opd["stored_trajectories"] + ev["stored_trajectories"] == len(ids)
    # SAO: the batches of steps 1 and 2, four each, all consumed by sao:<domain>
    assert [r["step"] for r in rows["sao"]] == [1] * 4 + [2] * 4 and {r["consumer"] for r in rows["sao"]} == {f"sao:{dom}"}
    assert [r["step"] for r in rows["opd"]] == [1] * 4 + [2] * 4
    # evaluation: the student and the warm start on every held-out task, the expert on its domain's tasks
    n_eval = ev["n_eval"]
    by = {}
    for r in rows["eval"]:
        by[r["consumer"]] = by.get(r["consumer"], 0) + 1
    assert by["eval:student"] == by["eval:warm_start"] == n_eval and f"eval:teacher:{dom}" in by
    assert all(r["trajectory_id"] in ids for rs in rows.values() for r in rs)
    # the last policy the servers were given is the expert (evaluation loads each policy in turn)
    assert len({v["weights_checksum"] for v in served.values()}) == 1


def test_rollout_resource_serves_stages_and_teachers_on_separate_servers():
    cfg = configs.load("micro")
    off = RolloutBackend()
    with off.stage_serving(cfg) as (urls, router), off.teacher_serving(cfg) as teachers:
        assert urls is None and router == "" and teachers is None  # the CPU default: training stages in-process
    on = RolloutBackend(all_stages=True, embedded_servers=2)
    with on.stage_serving(cfg) as (urls, _), on.teacher_serving(cfg) as teachers:
        assert len(urls) == 2 and len(teachers) == 2 and not set(urls) & set(teachers)
        assert all(httpx.get(u + "/health").status_code == 200 for u in urls + teachers)
    sg = RolloutBackend(kind="sglang", urls=["http://a:1"], teacher_urls=["http://t:2"])
    with sg.stage_serving(cfg) as (urls, _), sg.teacher_serving(cfg) as teachers:
        assert urls == ["http://a:1"] and teachers == ["http://t:2"]
