"""Knobs of the trainers: LM/SFT, SAO (and its baselines), OPD, and the RL loop."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SYNTH = "synth:"  # base curriculum patterns drawn from trainers/synthetic.py instead of environments
SLOPPY = "sloppy:"  # `sloppy:PATTERN`: PATTERN's tasks demonstrated by its family's careless demonstrator


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seq_len: int = Field(default=128, gt=1)
    batch_size: int = Field(default=16, gt=0)
    lr: float = Field(default=3e-3, gt=0)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    warmup_steps: int = Field(default=20, ge=0)
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = Field(default=1.0, gt=0)
    mtp_loss_weight: float = Field(default=0.3, ge=0)
    mtp_train_steps: int | None = Field(default=None, gt=0)  # chained MTP draft steps in the loss (None: all)
    router_bias_rate: float = Field(default=1e-3, ge=0)
    max_steps: int = Field(default=600, gt=0)  # the SFT budget, in optimizer steps
    max_seconds: float = Field(default=3600.0, gt=0)  # a safety cap: reaching it is an error, not a budget


class SAOConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    loss: Literal["sao", "ppo", "tis", "grpo"] = "sao"
    eps_low: float = Field(default=0.2, ge=0, le=1)
    eps_high: float = Field(default=4.0, ge=0)
    clip: float = Field(default=0.2, gt=0)
    tis_cap: float = Field(default=2.0, gt=0)
    gamma: float = Field(default=1.0, gt=0, le=1)
    alpha: float = Field(default=1.0, gt=0)  # λ_policy = 1 − 1/(α·l)
    staleness: int | None = Field(default=2, ge=0)  # τ; None: no bound (naive async)
    critic_updates: int = Field(default=2, ge=0)
    epochs: int = Field(default=1, ge=1)  # actor updates per batch (PPO epochs); one policy version per batch
    freeze_critic_attention: bool = True
    lr: float = Field(default=1e-4, gt=0)
    warmup_steps: int = Field(default=0, ge=0)  # linear actor-lr warmup: Adam's first steps are full-size
    critic_lr: float = Field(default=5e-4, gt=0)
    grad_clip: float = Field(default=1.0, gt=0)
    micro_rows: int = Field(default=8, gt=0)
    # each row forwarded alone at its own length, as the engine rescores a finished segment: the log-probs the
    # rollout recorded and the trainer's are then the same bits (mismatch exactly 0 on the embedded path).
    # False: one padded forward per micro-batch (faster on GPUs; ~1e-6 of numerics between the two sides)
    exact_rows: bool = True
    value_pretrain_steps: int = Field(default=50, ge=0)
    # β of a KL penalty toward the policy the trainer started from (the iteration's warm start, kept frozen):
    # β·k3 per trainable token, k3 = π_ref/π − log(π_ref/π) − 1 on the sampled tokens (DeepSeekMath's GRPO
    # estimator), token-averaged like the policy loss. It holds the skills the reward does not watch (copying a
    # number, a well-formed tool call) where one-rollout advantages on a sharp policy would wear them down. 0: off
    kl_coef: float = Field(default=0.0, ge=0)
    # parameters the actor update leaves as they are: shell-style patterns over parameter names, e.g.
    # ["embed_tokens.*", "lm_head.*"] or ["layers.*.self_attn.*"]; every pattern must match some parameter
    frozen: list[str] = Field(default_factory=list)
    # β of a replay anchor (learning without forgetting): each step the actor is also pulled toward the warm start's
    # whole next-token distribution, KL(π_warm ‖ π) summed over the vocabulary at the policy's own tokens, on
    # `replay_rows` rows of warm-start rollouts the expert does not train on (the other domains', and this domain's
    # left-out patterns), taken in turn. It holds what the reward does not watch on the inputs where it lives,
    # and leaves the update free on this domain's. 0: off
    replay_coef: float = Field(default=0.0, ge=0)
    replay_rows: int = Field(default=8, gt=0)
    # a domain whose rollout reward is outside [min, max] is skipped with a reason: with (nearly) every reward
    # equal there is no outcome signal to learn from, only the critic's noise
    min_domain_reward: float = Field(default=0.02, ge=0, le=1)
    max_domain_reward: float = Field(default=0.98, ge=0, le=1)
    # the same within a domain, per task pattern (DAPO's dynamic-sampling filter, with the pattern as the group): a
    # pattern whose warm-start rollouts (at least this many) all earned one reward is left out of the expert's
    # training, since the critic can read its outcome off the prompt; a domain left with no pattern gets no expert.
    # 0: off
    constant_pattern_min: int = Field(default=8, ge=0)
    # ... and one whose warm rollouts earned one reward at least this often (1.0: all of them; 0.95: 38 of 40), since
    # a pattern solved 39 times in 40 gives one advantage of signal and 39 of critic noise
    constant_pattern_share: float = Field(default=1.0, gt=0.5, le=1.0)


class OPDConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lr: float = Field(default=1e-4, gt=0)
    band_low: float = Field(default=0.1, gt=0, lt=1)
    band_high: float = Field(default=10.0, gt=1)
    outcome_alpha: float = Field(default=0.0, ge=0)
    grad_clip: float = Field(default=1.0, gt=0)
    micro_rows: int = Field(default=8, gt=0)
    exact_rows: bool = True  # as SAOConfig.exact_rows
    steps: int = Field(default=10, ge=0)  # OPD steps in one iteration
    epochs: int = Field(default=1, ge=1)  # student updates per batch (the teachers score it once)
    # where the student starts: "warm_start" (the iteration's warm start), or "merged": the warm start plus
    # `merge_scale` × the sum of every expert's weight delta from it (task arithmetic). The experts are short
    # fine-tunes of the same warm start on disjoint domains, so their deltas add with little interference and
    # distillation starts near every teacher at once instead of having to rebuild each one's gain
    init: Literal["warm_start", "merged"] = "warm_start"
    merge_scale: float = Field(default=1.0, gt=0, le=1)
    # with a validation set (`envs.n_val`), an expert teaches (and joins the merge) only if, greedy on its domain's
    # validation tasks, it solves more of those the warm start fails than the reverse; a domain whose expert does
    # not is left out of distillation (the student keeps the warm start there), with the counts in the result
    gate_teachers: bool = True
    # a domain of the RL set with no teaching expert (skipped, or left out by the gate): "warm_start": the warm start
    # teaches it, so the student's own samples there are pulled back toward where the iteration began (the merged
    # student carries every other expert's delta into it, and an expert trained on one domain moves the others too);
    # "none": the student never samples it and it drifts with the rest of the network
    untaught: Literal["warm_start", "none"] = "warm_start"


class LoopConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # async: free-running rollouts, trained in the order they finish; pipelined: deterministic one-step-off (the
    # next batch generated on the current weights while the trainer steps); sync: generate, then train (GRPO)
    mode: Literal["async", "pipelined", "sync"] = "async"
    steps: int = Field(default=20, ge=0)  # SAO steps per expert in one iteration
    batch_size: int = Field(default=8, gt=0)
    push_every: int = Field(default=1, gt=0)
    in_flight: int = Field(default=8, gt=0)
    # async SAO with a staleness bound τ: the rollout side starts an episode only if, trained in its turn, it would
    # be at most τ policy versions old (AReaL's admission control: at most τ·push_every + 1 batches started beyond
    # the ones the trainer has finished), so `in_flight` is a ceiling and few samples are generated only to be
    # dropped. The drop stays, exact, for the episodes that finish late. False: free-running rollouts, drop only
    bound_admission: bool = True
    group_size: int = Field(default=1, gt=0)  # sync GRPO: rollouts per prompt
    n_slots: int = Field(default=8, gt=0)  # engine slots (sequences decoded together) of each rollout worker
    # the in-process engines' decode step compiled by torch.compile (rollout/compiled.py): fused C++ loops instead of
    # a few hundred small ops a step on a CPU; two compiles a process (cached on disk under the run root), the
    # recorded log-probs unchanged (they come from the engine's rescoring forward). Off: eager decode
    compile_decode: bool = False
    # episodes in flight in the one-shot batches: the warm start's rollouts and the held-out evaluation. Nothing
    # trains while they run, so no staleness to bound: as many as the engine has slots (its batched decode
    # amortises the weights, and the agents' sandbox calls overlap it). The RL loop keeps `in_flight`
    batch_in_flight: int = Field(default=8, gt=0)
    save_every: int = Field(default=5, gt=0)  # training-state checkpoint interval of the pipeline's RL stages
    # the most of a family's episodes a stage may lose to a crashed environment (status crashed: the sandbox could
    # not run; every trainer drops them) before it fails, naming the family and the causes, instead of training on
    # (or scoring) what is left (rollout/crashes.py; aborted episodes, the engine's, are reported beside it, not held
    # to it). Every stage that runs episodes checks it: the gate, the warm start's rollouts, SAO, OPD's teacher gate
    # and student, evaluation. 0: any crash fails; 1: never
    max_crashed_share: float = Field(default=0.05, ge=0, le=1)
    # what SAO does with the iteration's stored rollouts of the warm start (`rollout_batches`, one per RL env):
    # "critic": the value pre-training cycles through them a batch at a time (instead of fitting one fresh batch);
    # "train": also the first actor step, on all of them at once (on-policy: the actor has not moved yet; one
    # step as costly as len/batch_size steps); "off": ignore them
    warm_rollouts: Literal["critic", "train", "off"] = "critic"
    seed: int = 0


class CurriculumStage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    from_step: int = Field(ge=0)  # this stage's pattern mix applies from this optimizer step on
    patterns: list[str] = Field(min_length=1)


class MegatronConfig(BaseModel):
    """The Megatron-core layout of `trainer.kind: megatron` (trainers/megatron): tensor parallel `tp` (sequence
    parallel when > 1), expert parallel `ep`, expert tensor parallel `etp` (None: tp). The data-parallel size is
    world_size / tp. Pipeline parallelism is not built (pp = 1)."""

    model_config = ConfigDict(extra="forbid")

    tp: int = Field(default=1, ge=1)
    ep: int = Field(default=1, ge=1)
    etp: int | None = Field(default=None, ge=1)
    # bfloat16: bf16 weights, updated through fp32 main weights (trainers/optim.py)
    dtype: Literal["float32", "bfloat16"] = "float32"
    # the routed experts: temper's grouped GEMMs (GroupedExperts) or Megatron's SequentialMLP (a loop over experts)
    experts: Literal["grouped", "sequential"] = "grouped"
    # ZeRO-1: fp32 main weights and Adam's moments split element-exactly over the data-parallel ranks (dense) and the
    # expert-data-parallel ranks (experts)
    distributed_optimizer: bool = False


class TrainerConfig(BaseModel):
    """The trainer's process layout in the pipeline. `world_size > 1`: a training stage re-launches itself under
    `torchrun` with that many ranks (data parallel through `DDPBackend`: gloo on CPU, nccl on GPU); rank 0 drives
    the rollout backend and hands every batch to the others, and all ranks end each step with the same weights.
    `kind: megatron`: the same trainers on a Megatron-core model (`MegatronBackend`, layout in `megatron`); the
    engines still get temper's model, gathered from the shards at every weight push. With `world_size > 1` the SFT,
    SAO and OPD stages run as that many torchrun ranks holding shards, and every rank saves its part of the training
    state (trainers/checkpoint.py)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["torch", "megatron"] = "torch"
    world_size: int = Field(default=1, ge=1)
    # where the torch backends train: auto = CUDA when there is one (each rank on its own GPU under nccl); Megatron
    # places its model itself
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl when CUDA is available, else gloo
    timeout_s: float = Field(default=600.0, gt=0)  # a collective that waits longer fails the stage loudly
    # keep each layer's input only and recompute the layer in backward: activation memory of one layer, for about
    # one more forward (torch backends; Megatron has its own recompute settings, not wired here)
    activation_checkpointing: bool = False
    # ZeRO-1 on the torch data-parallel backend (world_size > 1): fp32 main weights and Adam's moments split over the
    # ranks, each rank saving its part of the training state (trainers/optim.py); Megatron: trainer.megatron's own
    distributed_optimizer: bool = False
    # weights below fp32 (a bf16 checkpoint) step through fp32 main weights and sum their gradients in fp32: 18 bytes
    # per parameter (bf16 weight, fp32 gradient, fp32 copy, two fp32 moments) against a bf16 AdamW's 8, which rounds
    # away every update under half a bf16 ulp. false: that bf16 AdamW (a distributed optimizer keeps them anyway)
    fp32_main_weights: bool = True
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)

    @model_validator(mode="after")
    def _layout(self) -> TrainerConfig:
        if self.kind == "megatron" and self.device != "auto":
            raise ValueError(f"trainer.device: {self.device} with trainer.kind=megatron (the Megatron backend places "
                             "its model itself: CUDA when there is one); leave it at auto")
        if self.kind == "megatron" and self.distributed_optimizer:
            raise ValueError("trainer.distributed_optimizer: the torch backends' switch; with trainer.kind=megatron "
                             "set trainer.megatron.distributed_optimizer")
        if self.kind == "megatron" and self.activation_checkpointing:
            raise ValueError("trainer.activation_checkpointing: not available with trainer.kind=megatron (the "
                             "Megatron model runs its own layer loop)")
        if self.kind != "megatron":
            return self
        m, w = self.megatron, self.world_size
        etp = m.etp or m.tp
        if w % m.tp:
            raise ValueError(f"trainer.megatron.tp: {m.tp} does not divide trainer.world_size={w}")
        if w % (m.ep * etp):
            raise ValueError(f"trainer.megatron.ep: ep·etp = {m.ep * etp} does not divide trainer.world_size={w}")
        return self


class BasePhase2(BaseModel):
    """A second phase of the base recipe: `steps` more steps from the first phase's final weights, with a fresh
    AdamW at a constant `lr` (after a linear warmup), on the last curriculum stage's mix plus `add_patterns`
    (a batch row draws a pattern uniformly from that list, so a pattern listed k times is drawn k times as often).
    It teaches a skill late and briefly, so the base holds it only in part: headroom that RL can close."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(gt=0)
    lr: float = Field(gt=0)
    warmup_steps: int = Field(default=10, ge=0)
    add_patterns: list[str] = Field(default_factory=list)


class BaseConfig(BaseModel):
    """The recipe of the shipped base checkpoint (`temper train base`) and where iteration 1 finds it.

    The base is SFT on oracle trajectories of the task distribution with a pattern curriculum, bounded in
    steps. The lr schedule is warmup-stable-decay: the stable phase of every run with the same recipe is the
    same, so a longer run can branch off any stable-phase snapshot (`--steps` resumes from `out/state`)."""

    model_config = ConfigDict(extra="forbid")

    # HF-layout checkpoint (relative to the repository root, or absolute) that iteration 1 starts from;
    # None: iteration 1 runs SFT from scratch for `train.max_steps` steps (the micro preset's tests do)
    checkpoint: str | None = None
    steps: int = Field(default=2000, gt=0)
    batch_size: int = Field(default=16, gt=0)
    lr: float = Field(default=2e-3, gt=0)
    warmup_steps: int = Field(default=50, ge=0)
    # warmup-stable-decay: constant lr, then a cosine to final_lr_ratio·lr over the last decay_steps steps
    decay_steps: int = Field(default=400, ge=0)
    # DSA's dense stage: the first dense_steps steps attend densely (the indexer learns to match that attention),
    # then sparse over the indexer's top-k; from scratch, a random indexer hides most of the context
    dense_steps: int = Field(default=0, ge=0)
    final_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    curriculum: list[CurriculumStage] = Field(default_factory=lambda: [
        CurriculumStage(from_step=0, patterns=["kv-lookup?horizon=1", "calc-chain?horizon=1", "set-const?horizon=1"])])
    n_per_pattern: int = Field(default=200, gt=0)  # oracle trajectories per pattern
    n_synthetic: int = Field(default=4000, gt=0)  # sequences per `synth:` pattern (trainers/synthetic.py)
    data_seed: int = 7
    n_eval_per_pattern: int = Field(default=40, gt=0)  # the card's held-out pass@1 per pattern
    eval_seed: int = 30_011
    sample_size: int = Field(default=24, ge=0)  # tasks whose greedy outcomes the card pins (checked by a test)
    snapshot_every: int = Field(default=250, gt=0)
    # chained MTP steps in the loss: each costs a block forward + backward over the batch (1: the first draft
    # step, ~25% of a step's time instead of ~45% for 3)
    mtp_train_steps: int = Field(default=1, gt=0)
    max_seconds: float = Field(default=4 * 3600.0, gt=0)  # a safety cap: hitting it is an error, not a budget
    # after `steps`: phase2.steps more from those weights (None: one phase); `temper train base --phase1 CKPT`
    # runs only this phase, from given first-phase weights
    phase2: BasePhase2 | None = None

    @property
    def patterns(self) -> list[str]:
        """Every pattern of the recipe, in first-use order (a pattern's data seed is its index here)."""
        seen: dict[str, None] = {}
        for st in self.curriculum:
            seen.update(dict.fromkeys(st.patterns))
        if self.phase2:
            seen.update(dict.fromkeys(self.phase2.add_patterns))
        return list(seen)

    def with_phase2(self, phase1_steps: int) -> BaseConfig:
        """This recipe with the second phase's mix as a curriculum stage from `phase1_steps` on."""
        if not self.phase2:
            return self
        last = self.stage_at(phase1_steps - 1).patterns
        mix = [*last, *self.phase2.add_patterns]  # a pattern listed k times is drawn k times as often
        kept = [s for s in self.curriculum if s.from_step < phase1_steps]
        return self.model_copy(update={"curriculum": [*kept, CurriculumStage(from_step=phase1_steps, patterns=mix)]})

    @property
    def task_patterns(self) -> list[str]:
        """The curriculum's environment patterns (what the card evaluates), without the `synth:` drills; a
        `sloppy:PATTERN` (PATTERN demonstrated by its family's careless demonstrator) counts as PATTERN."""
        return list(dict.fromkeys(p.removeprefix(SLOPPY) for p in self.patterns if not p.startswith(SYNTH)))

    def stage_at(self, step: int) -> CurriculumStage:
        stages = sorted(self.curriculum, key=lambda s: s.from_step)
        if stages[0].from_step != 0:
            raise ValueError("base.curriculum: the first stage must start at from_step 0")
        return [s for s in stages if s.from_step <= step][-1]
