"""The Policy / WeightSync backends: in-process and servers by URL (two embedded servers behind the Router)."""

import asyncio
import copy

import httpx
import pytest
import torch

import configs
from model import ByteTokenizer, Transformer, weights_checksum
from rollout.backend import InProcessBackend, ServerBackend, WeightSyncError, embedded_servers

TOK = ByteTokenizer()
PROMPT = TOK.encode("read notes.txt and submit")


def _generate(backend, ids, n=6):
    async def go():
        async with backend.session() as policy:
            return await policy.generate(ids, {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
                                         return_logprob=True)

    return asyncio.run(go())


def _perturbed(model, seed):
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return m


def test_server_push_reaches_every_worker_with_version_and_checksum(micro_model, tmp_path):
    new = _perturbed(micro_model, 1)
    with embedded_servers(micro_model.config, n=2, n_slots=4, max_len=256) as urls:
        b = ServerBackend(urls, tmp_path / "sync")
        rec = b.push(new, 7)
        assert rec["workers"] == 2 and rec["down"] == 0 and rec["checksum_checked"]
        for u in urls:
            info = httpx.get(u + "/get_model_info").json()
            assert info["weight_version"] == "7" and info["weights_checksum"] == weights_checksum(new)
        # generation through the router carries the pushed version on every token, and its log-probs are the
        # in-process engine's on the same weights (same engine code: bit for bit)
        out = _generate(b, PROMPT)
        assert out["meta_info"]["output_token_versions"] == [7] * 6
        local = InProcessBackend(new, TOK, n_slots=2, max_len=256, version=7)
        try:
            ref = _generate(local, PROMPT)
        finally:
            local.close()
        assert out["output_ids"] == ref["output_ids"]
        assert [x[0] for x in out["meta_info"]["output_token_logprobs"]] == \
            [x[0] for x in ref["meta_info"]["output_token_logprobs"]]
        # three pushes: only the newest `keep` (2) checkpoints stay on disk
        b.push(_perturbed(micro_model, 2), 8)
        b.push(_perturbed(micro_model, 3), 9)
        assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["v000008", "v000009"]


def test_server_push_of_wrong_shapes_is_refused_and_names_the_worker(micro_model, tmp_path):
    other = Transformer(configs.load("micro", ["model.hidden_size=48"]).model)
    with embedded_servers(micro_model.config, n=2, n_slots=2, max_len=128) as urls:
        b = ServerBackend(urls, tmp_path / "sync")
        with pytest.raises(WeightSyncError, match=r"127\.0\.0\.1.*weights do not match the model"):
            b.push(other, 3)
        # nothing half-done is reported as current: the servers still serve what they had
        assert b.current is None
        for u in urls:
            assert httpx.get(u + "/get_model_info").json()["weight_version"] == "0"


def test_in_process_push_detects_a_diverged_engine(micro_model):
    b = InProcessBackend(micro_model, TOK, n_slots=2, max_len=128)
    try:
        rec = b.push(micro_model, 1)
        assert rec["checksum"] == weights_checksum(b.engine.model) and b.engine.version == 1
        # an engine whose weights differ from what was sent (here: a hook that corrupts the copy) is caught
        orig = b.engine.update_weights

        def corrupting(**kw):
            kw["state_dict"] = {k: v + 1 if v.is_floating_point() else v for k, v in kw["state_dict"].items()}
            return orig(**kw)

        b.engine.update_weights = corrupting
        with pytest.raises(WeightSyncError, match="checksum"):
            b.push(micro_model, 2)
    finally:
        b.close()


def test_server_teacher_pool_scores_like_the_teachers_themselves(micro_model, tmp_path):
    """OPD's teacher scoring on servers: `/generate` input log-probs equal each teacher's own log-probs of the
    student's tokens; with one server per teacher nothing reloads, with one server for two teachers they swap."""
    from rollout.backend import ServerTeacherPool
    from rollout.types import Segment, Trajectory
    from trainers.sao import layout, token_logprobs

    teachers = {"math": _perturbed(micro_model, 4), "code": _perturbed(micro_model, 5)}
    paths = {}
    for d, m in teachers.items():
        from model import save_checkpoint

        save_checkpoint(m, tmp_path / d)
        paths[d] = tmp_path / d
    g = torch.Generator().manual_seed(0)

    def traj(n):
        toks = torch.randint(0, 256, (n,), generator=g).tolist()
        return Trajectory("t", "e", "f", "math", "h", "v", 0, [Segment(toks, [True] * n, [0.0] * n, [0] * n)])

    batches = [("math", layout([traj(20)])), ("code", layout([traj(13)])), ("math", layout([traj(17)]))]
    with embedded_servers(micro_model.config, n=2, n_slots=4, max_len=256) as urls:
        for servers in (urls, urls[:1]):
            pool = ServerTeacherPool(paths, servers)
            got = pool.score_batches(batches)
            for (d, rows), lp in zip(batches, got):
                ref = token_logprobs(teachers[d].eval(), rows.ids)[0]
                n = rows.lengths[0]
                torch.testing.assert_close(lp[:, :n], ref[:, :n], rtol=0, atol=2e-5)
                assert lp.shape == ref.shape and not lp[:, n:].any()
            first = pool.loads
            pool.score_batches(batches)
            assert first == 2 and pool.loads == (2 if len(servers) == 2 else 3)


def test_server_teacher_pool_refuses_scores_from_the_wrong_weights(micro_model, tmp_path):
    """A teacher server that no longer serves its teacher (restarted on another checkpoint) is caught by the version
    its reply carries: the scores are refused, naming the server, and the next call loads the teacher again."""
    from model import save_checkpoint
    from rollout.backend import ServerTeacherPool
    from rollout.types import Segment, Trajectory
    from trainers.sao import layout, token_logprobs

    teacher = _perturbed(micro_model, 6)
    save_checkpoint(teacher, tmp_path / "math")
    save_checkpoint(micro_model, tmp_path / "other", policy_version=0)
    toks = list(range(3, 20))
    rows = layout([Trajectory("t", "e", "f", "math", "h", "v", 0, [Segment(toks, [True] * 17, [0.0] * 17, [0] * 17)])])
    with embedded_servers(micro_model.config, n=1, n_slots=2, max_len=128) as urls:
        pool = ServerTeacherPool({"math": tmp_path / "math"}, urls)
        ref = token_logprobs(teacher.eval(), rows.ids)[0]
        torch.testing.assert_close(pool.score_batches([("math", rows)])[0], ref, rtol=0, atol=2e-5)
        httpx.post(urls[0] + "/update_weights_from_disk", json={"model_path": str(tmp_path / "other")}, timeout=60)
        with pytest.raises(WeightSyncError, match=rf"{urls[0]}: scored with weight version 0, not teacher 'math'"):
            pool.score_batches([("math", rows)])
        torch.testing.assert_close(pool.score_batches([("math", rows)])[0], ref, rtol=0, atol=2e-5)
        assert pool.loads == 2


def test_a_session_admits_a_worker_only_on_the_current_version_and_checksum(micro_model, tmp_path):
    """A worker left serving another policy is not taken for current: the session's router loads the current one into
    it before it gets work, and every reply is stamped with it. Another policy under a higher version number (a later
    stage's: evaluation numbers each policy it loads from 1 again, without a checksum), and another policy under the
    same version number (caught by the checksum)."""
    from model import save_checkpoint

    save_checkpoint(micro_model, tmp_path / "policy", policy_version=1)
    save_checkpoint(_perturbed(micro_model, 9), tmp_path / "other", policy_version=7)
    with embedded_servers(micro_model.config, n=2, n_slots=4, max_len=256) as urls:
        for checksum, squatter in ((None, None), (weights_checksum(micro_model), 1)):
            b = ServerBackend(urls, tmp_path / "sync")
            assert b.load(tmp_path / "policy", 1, checksum)["workers"] == 2
            httpx.post(urls[0] + "/update_weights_from_disk", timeout=60,
                       json={"model_path": str(tmp_path / "other"), "weight_version": squatter})

            async def go(b=b):
                async with b.session() as policy:
                    infos = [httpx.get(u + "/get_model_info").json() for u in urls]  # admitted by now
                    outs = await asyncio.gather(*(policy.generate(PROMPT + [i], {"max_new_tokens": 3})
                                                  for i in range(8)))
                    return infos, outs

            infos, outs = asyncio.run(go())
            assert [i["weight_version"] for i in infos] == ["1", "1"], checksum
            assert {i["weights_checksum"] for i in infos} == {weights_checksum(micro_model)}, checksum
            assert all(set(o["meta_info"]["output_token_versions"]) == {1} for o in outs)
