"""The agent loop: one episode of a policy acting in an environment, token-in / token-out.

Per turn: generate an action (stop at <|end|>), parse it, step the environment in the sandbox, append
the observation as loss-masked tokens, until the environment is done, the turn budget or the token
budget runs out. Compaction: when less than `compact_margin` tokens of context remain, the policy writes
a summary from a summary prompt; the next segment is rebuilt as system + goal + summary + the last two
action/observation pairs (their exact tokens), at most `max_compactions` times. All segments are kept
under one trajectory id with their turn boundaries. A crashing environment marks the trajectory
`crashed` and the caller's other episodes go on.
"""

from __future__ import annotations

import asyncio
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Protocol

from envs import Environment, TaskSpec
from envs.sandbox import Sandbox
from model.tokenizer import ChatTemplate, Tokenizer

from .config import AgentConfig
from .types import Segment, Trajectory

SUMMARY_PROMPT = "Context is nearly full. Briefly summarise what you found and what remains to do."


class Policy(Protocol):
    async def generate(self, input_ids: list[int], sampling_params: dict | None = None, **kw) -> dict: ...


@dataclass
class _Seg:
    tokens: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    start_turn: int = 0
    summary: bool = False

    def add(self, ids: list[int], train: bool = False, logprobs: list[float] | None = None,
            versions: list[int] | None = None) -> None:
        self.tokens += ids
        self.mask += [train] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.versions += versions if versions is not None else [-1] * len(ids)

    def freeze(self, end_turn: int) -> Segment:
        return Segment(self.tokens, self.mask, self.logprobs, self.versions, self.start_turn, end_turn, self.summary)


class Agent:
    def __init__(self, policy: Policy, tokenizer: Tokenizer, sandbox: Sandbox, cfg: AgentConfig | None = None,
                 engine_name: str = "embedded"):
        self.policy, self.tok, self.sandbox = policy, tokenizer, sandbox
        self.cfg = cfg or AgentConfig()
        self.tpl = ChatTemplate(tokenizer)
        self.engine_name = engine_name
        self._exact: bool | None = None  # does the policy's engine score exactly? (unknown until it answers)

    def _msg(self, role: str, text: str) -> list[int]:
        return self.tpl.render([{"role": role, "content": text}]).ids

    def _obs_ids(self, text: str, room: int) -> list[int]:
        body = self.tok.encode(text)[: max(0, min(self.cfg.max_obs_tokens, room - 3))]
        return [self.tpl.role_ids["observation"], *body, self.tpl.end_id, self.tpl.role_ids["assistant"]]

    async def _gen(self, seg: _Seg, max_new: int, sid: str, seed: int | None = None
                   ) -> tuple[list[int], list[float], list[int], str]:
        sp = {"max_new_tokens": max_new, "temperature": self.cfg.temperature, "top_p": self.cfg.top_p,
              "stop_token_ids": self.tpl.stop_ids}
        if seed is not None:  # per episode and turn: the same environment, seed and weights sample the same tokens
            sp["sampling_seed"] = (seed + len(seg.tokens)) % 2**63
        out = await self.policy.generate(seg.tokens, sp, return_logprob=True, session_id=sid)
        ids = list(out["output_ids"])
        meta = out.get("meta_info", {})
        fin = meta.get("finish_reason")
        if (fin.get("type") if isinstance(fin, dict) else fin) == "abort":
            why = fin.get("error") or fin.get("message") if isinstance(fin, dict) else None
            raise EngineFault(f"the engine aborted the request{f': {why}' if why else ''}")
        raw = meta.get("output_token_logprobs") or []
        if len(raw) != len(ids) or any(x is None or x[0] is None for x in raw):
            # never train on made-up log-probs: the episode is the engine's fault, not the policy's
            raise EngineFault(f"the engine returned {len(ids)} tokens with {len(raw)} log-probs")
        lps = [float(x[0]) for x in raw]
        vers = meta.get("output_token_versions") or [_version(meta.get("weight_version"), self.policy)] * len(ids)
        return ids, lps, [int(v) for v in vers], meta.get("worker", self.engine_name)

    async def _close(self, seg: _Seg, end_turn: int, sid: str) -> Segment:
        """Freeze a finished segment. With `rescore` (on by default), the engine first scores the whole segment in
        one forward of the trainers' own function (`token_logprobs`), and those log-probs replace the decoded ones
        on the tokens the scoring version generated: the trainer, forwarding the same row on the same weights,
        then computes the same bits — the training/inference mismatch is exactly 0 ("true on-policy"). Tokens of
        an older version (a push landed mid-segment) keep their decoded log-probs. Policies opt in (`scores = True`:
        `EnginePolicy`, `EngineClient`, `Router`); an engine that does not score exactly (SGLang) is detected on its
        first reply and not asked again."""
        gen = [i for i, m in enumerate(seg.mask) if m]
        if (self.cfg.rescore and gen and self._exact is not False and len(seg.tokens) > 1
                and getattr(self.policy, "scores", False)):
            out = await self.policy.generate(seg.tokens, {"max_new_tokens": 0}, return_logprob=True,
                                             logprob_start_len=0, session_id=sid)
            meta = out.get("meta_info", {})
            fin = meta.get("finish_reason")
            if (fin.get("type") if isinstance(fin, dict) else fin) == "abort":
                raise EngineFault("the engine aborted the scoring of a finished segment")
            self._exact = bool(meta.get("exact_scoring"))
            lps = meta.get("input_token_logprobs") or []
            if self._exact:
                if len(lps) != len(seg.tokens) or any(lps[i][0] is None for i in gen):
                    raise EngineFault(f"the engine scored {len(lps)} of the segment's {len(seg.tokens)} tokens")
                v = _version(meta.get("weight_version"), self.policy)
                for i in gen:
                    if seg.versions[i] == v:
                        seg.logprobs[i] = float(lps[i][0])
        return seg.freeze(end_turn)

    async def run(self, spec: TaskSpec, iteration: int = 0, trajectory_id: str | None = None, sample: int = 0
                  ) -> Trajectory:
        """One episode. With a sampling seed (`cfg.seed`), the episode's sampling stream is fixed by the seed, the
        environment, the iteration and `sample` — the index of this rollout among the ones of the same environment
        (GRPO's group members, a loop's later visits), which would otherwise sample the very same tokens."""
        cfg, t0 = self.cfg, time.perf_counter()
        tid = trajectory_id or f"{spec.id}-{uuid.uuid4().hex[:10]}"
        timings = {"generate": 0.0, "env": 0.0, "verify": 0.0}
        segments: list[Segment] = []
        # the engine is whichever one answered a generation: an episode that crashed before its first has none
        status, error, reward, details, engine = "truncated", None, 0.0, {}, ""
        env = Environment(spec, self.sandbox)
        key = f"{cfg.seed}:{spec.id}:{iteration}" + (f":{sample}" if sample else "")
        seed = None if cfg.seed is None else zlib.crc32(key.encode())
        try:
            goal = await asyncio.to_thread(env.reset)
            head = self._msg("system", cfg.system_prompt) + self._msg("user", goal)
            seg = _Seg()
            seg.add(head + [self.tpl.role_ids["assistant"]])
            pairs: list[tuple[list[int], list[float], list[int], list[int]]] = []  # (action, lps, vers, obs)
            generated, compactions, turn = 0, 0, 0
            ask = self._msg("user", SUMMARY_PROMPT) + [self.tpl.role_ids["assistant"]]
            summary_cost = len(ask) + cfg.summary_tokens + 1  # what writing a summary needs
            while not env.done and turn < spec.max_turns and generated < cfg.max_total_tokens:
                room = cfg.max_context - len(seg.tokens)
                reserve = summary_cost if compactions < cfg.max_compactions else 0
                if room < max(cfg.compact_margin, reserve) + cfg.max_action_tokens and reserve:
                    budget = min(cfg.summary_tokens, room - len(ask) - 1)
                    if budget < 4:
                        break  # not even room to write a summary
                    seg.add(ask)
                    g0 = time.perf_counter()
                    ids, lps, vers, engine = await self._gen(seg, budget, tid, seed)
                    timings["generate"] += time.perf_counter() - g0
                    generated += len(ids)
                    seg.add(ids, True, lps, vers)
                    segments.append(await self._close(seg, turn, tid))
                    summary = [t for t in ids if t not in self.tpl.stop_ids]
                    seg = _Seg(start_turn=turn, summary=True)
                    seg.add(head)
                    seg.add([self.tpl.role_ids["user"], *self.tok.encode("Summary of earlier work: "), *summary,
                             self.tpl.end_id])
                    seg.add([self.tpl.role_ids["assistant"]])
                    compactions += 1
                    keep = pairs[-2:]  # the last two pairs, whole, as context — as many as leave room to act
                    nxt = summary_cost if compactions < cfg.max_compactions else 0
                    while keep and (len(seg.tokens) + sum(len(a) + len(o) for a, _l, _v, o in keep)
                                    + max(cfg.compact_margin, nxt) + cfg.max_action_tokens > cfg.max_context):
                        keep = keep[1:]
                    for act, _lp, _v, obs in keep:
                        seg.add(act + obs)
                    continue
                if room - reserve <= 8:
                    break  # out of context and out of compactions
                g0 = time.perf_counter()
                ids, lps, vers, engine = await self._gen(seg, min(cfg.max_action_tokens, room - reserve - 4), tid, seed)
                timings["generate"] += time.perf_counter() - g0
                generated += len(ids)
                seg.add(ids, True, lps, vers)
                if not ids or ids[-1] not in self.tpl.stop_ids:
                    seg.add([self.tpl.end_id])  # close a cut-off turn (not trained: the policy did not emit it)
                    ids = ids + [self.tpl.end_id]
                text = self.tok.decode([t for t in ids if t not in self.tpl.stop_ids])
                e0 = time.perf_counter()
                step = await asyncio.to_thread(env.step, text)
                timings["env"] += time.perf_counter() - e0
                turn += 1
                if env.done:
                    break
                obs = self._obs_ids(step.observation, cfg.max_context - len(seg.tokens) - reserve - 8)
                seg.add(obs)
                pairs.append((ids, lps, vers, obs))
            status = "completed" if env.done and env.log and env.log[-1].tool in ("submit", "done") else "truncated"
            segments.append(await self._close(seg, turn, tid))
            v0 = time.perf_counter()
            r = await asyncio.to_thread(env.verify)
            timings["verify"] = time.perf_counter() - v0
            reward, details = r.reward, r.to_dict()
            if r.status == "crashed":
                status, error = "crashed", "verifier crashed"
        except Exception as e:  # noqa: BLE001 - a broken environment or engine marks this episode only
            from .client import EngineUnavailable  # (a stale reply refused by the router is one too)

            engine_fault = isinstance(e, EngineFault | EngineUnavailable) or "Unavailable" in type(e).__name__
            status, error = ("aborted" if engine_fault else "crashed"), f"{type(e).__name__}: {e}"
            reward = 0.0
            if not segments:
                segments = [Segment([], [], [], [])]
        finally:
            await asyncio.to_thread(env.close)
        timings["total"] = time.perf_counter() - t0
        return Trajectory(tid, spec.id, spec.family, spec.domain, spec.spec_hash, spec.verifier_hash, iteration,
                          segments, reward, status, details, engine, timings, time.time(), error)


class EngineFault(RuntimeError):
    """The engine, not the policy, ended a generation: aborted, or no log-probs for its tokens. The episode is
    marked `aborted` (infrastructure), never trained on as if the policy had chosen to stop."""


def _version(v, policy) -> int:
    """A reply's weight version: temper's servers send an integer (as a string); SGLang sends "default" until a
    version is set, and then the one the policy's WeightSync pushed is the right one."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return int(getattr(policy, "version", 0) or 0)


async def run_episodes(agent: Agent, specs: list[TaskSpec], iteration: int = 0, concurrency: int = 8,
                       on_done=None, trajectory_ids: list[str] | None = None) -> list[Trajectory]:
    """Run many episodes concurrently (bounded); each finished trajectory is handed to `on_done` at once.
    `trajectory_ids`: one per spec (default: a fresh id each)."""
    sem = asyncio.Semaphore(concurrency)
    seen: dict[str, int] = {}
    samples = []
    for s in specs:  # the k-th rollout of an environment in this call samples its own stream (GRPO groups)
        samples.append(seen.get(s.id, 0))
        seen[s.id] = samples[-1] + 1

    async def one(spec: TaskSpec, sample: int, tid: str | None) -> Trajectory:
        async with sem:
            t = await agent.run(spec, iteration, trajectory_id=tid, sample=sample)
        if on_done is not None:
            on_done(t)
        return t

    ids = trajectory_ids if trajectory_ids is not None else [None] * len(specs)
    if len(ids) != len(specs):
        raise ValueError(f"{len(ids)} trajectory ids for {len(specs)} specs")
    return list(await asyncio.gather(*(one(s, k, i) for s, k, i in zip(specs, samples, ids))))


class ScriptedPolicy:
    """A policy that replays fixed tool calls (oracles for SFT data, probes, tests); log-probs are 0."""

    scores = False  # its log-probs are placeholders: nothing to rescore

    def __init__(self, tokenizer: Tokenizer, actions: list[str], version: int = 0, summary: str = "progress noted"):
        self.tok, self.actions, self.version, self.summary = tokenizer, list(actions), version, summary
        tpl = ChatTemplate(tokenizer)
        self.end = tpl.end_id
        self.ask = tpl.render([{"role": "user", "content": SUMMARY_PROMPT}]).ids + [tpl.role_ids["assistant"]]

    async def generate(self, input_ids, sampling_params=None, **kw) -> dict:
        if list(input_ids[-len(self.ask):]) == self.ask:  # asked to compact: answer without using up an action
            text = self.summary
        else:
            text = self.actions.pop(0) if self.actions else "<tool_call>done</tool_call>"
        ids = self.tok.encode(text, allow_special=True) + [self.end]
        return {"output_ids": ids, "meta_info": {"output_token_logprobs": [[0.0, t, None] for t in ids],
                                                 "output_token_versions": [self.version] * len(ids)}}


class EnginePolicy:
    """The in-process engine behind the same `generate` interface as `EngineClient` (no HTTP hop)."""

    scores = True  # answers pure-scoring requests (the agent's rescoring of finished segments)

    def __init__(self, engine):
        self.engine = engine

    async def generate(self, input_ids, sampling_params=None, *, return_logprob=True, session_id=None,
                       logprob_start_len: int = -1, **kw) -> dict:
        from .engine import GenRequest
        from .sampling import SamplingParams

        req = GenRequest(list(input_ids), SamplingParams(**(sampling_params or {})), session_id=session_id,
                         return_logprob=return_logprob, logprob_start_len=logprob_start_len)
        self.engine.submit(req)
        r = await asyncio.wrap_future(req.future)
        meta = {"output_token_logprobs": [[lp, t, None] for lp, t in zip(r.output_logprobs, r.output_ids)],
                "output_token_versions": r.output_versions, "finish_reason": r.finish, "worker": self.engine.name,
                "weight_version": str(next((v for v in (r.scored_version, r.finish_version) if v is not None),
                                           self.engine.version))}
        if return_logprob and logprob_start_len >= 0:
            start = logprob_start_len
            meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.input_logprobs[start:], r.input_ids[start:])]
            if r.scored_version is not None:
                meta["exact_scoring"] = True
        return {"output_ids": r.output_ids, "meta_info": meta}
