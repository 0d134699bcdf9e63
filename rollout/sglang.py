"""SGLang for real deployments: the launch of a temper checkpoint on SGLang servers, and the router in front.

temper writes HF-layout `glm_moe_dsa` checkpoints (`GlmMoeDsaForCausalLM`), which SGLang serves natively. A
rollout fleet is N servers (each one `python -m sglang.launch_server`, tensor-parallel over `tp_size` GPUs)
behind `python -m sglang_router.launch_router`; the trainer pushes weights to every server with
`/update_weights_from_disk` (rollout/backend.py `ServerBackend`), generation goes through the router.

What the flags are for:

* DSA top-k. SGLang's default sparse-attention top-k (`--dsa-topk-backend sgl-kernel`, a radix select with
  atomics) is not deterministic when indexer scores tie — frequent with few indexer heads, ReLU zeros and
  bf16 — so the rollout engine and the trainer can select different keys and their log-probs drift apart.
  temper's rule is "score descending, ties to the earlier position". The deterministic FlashInfer top-k with
  `SGLANG_DSA_TOPK_FLASHINFER_TIE_BREAK=small` (lower index wins) is that rule.
* MTP. GLM-5's next-token-prediction layer is served as EAGLE speculative decoding (`--speculative-algorithm
  EAGLE`, topk 1): `speculative_num_steps` draft steps, `steps + 1` tokens verified per step.
* Weight versions. `--weight-version` names the version the server starts with; pushes set the next ones.

Residual mismatch to expect on GPUs: bf16 kernels differ between SGLang and the trainer (attention, MoE
grouped GEMMs, reductions), so |log π_train − log π_rollout| is not 0 there even with deterministic top-k;
published unaligned stacks sit near 1e-2, aligned ones below 1e-6. temper logs the measured gap per step
(`mismatch_fresh_*` in the SAO/OPD stats). On the CPU default (temper's own engine in-process or behind
`temper serve`) the engine and trainer run the same code.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

# what SGLang's loader reads from config.json for GlmMoeDsaForCausalLM (MLA, MoE, DSA indexer, MTP)
SGLANG_CONFIG_KEYS = (
    "architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", ("rope_parameters", "rope_theta"),
    "max_position_embeddings", "intermediate_size", "moe_intermediate_size", "n_routed_experts", "n_shared_experts",
    "num_experts_per_tok", "first_k_dense_replace", "routed_scaling_factor", "n_group", "topk_group",
    "norm_topk_prob", "index_topk", "index_head_dim", "index_n_heads", "num_nextn_predict_layers", "rms_norm_eps",
    ("dtype", "torch_dtype"),
)  # a tuple: either name (transformers 5 writes rope_parameters and dtype; 4.x wrote rope_theta and torch_dtype)
ARCHITECTURE = "GlmMoeDsaForCausalLM"


class SGLangLaunch(BaseModel):
    """How each SGLang server of the rollout fleet is launched."""

    model_config = ConfigDict(extra="forbid")

    python: str = "python"  # the interpreter that has sglang installed
    tp_size: int = Field(default=1, gt=0)
    dtype: str = "bfloat16"
    mem_fraction_static: float = Field(default=0.85, gt=0, le=1)
    max_running_requests: int | None = Field(default=None, gt=0)
    context_length: int | None = Field(default=None, gt=0)
    deterministic_topk: bool = True  # FlashInfer's deterministic DSA top-k with temper's tie rule
    mtp: bool = True  # serve the MTP layer as EAGLE speculative decoding (when the checkpoint has one)
    mtp_steps: int = Field(default=3, gt=0)
    router_policy: str = "cache_aware"
    extra_args: list[str] = []


def check_checkpoint(path: str | Path) -> dict:
    """The checkpoint's config.json, after checking it holds what SGLang's GlmMoeDsa loader reads."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{path}: no config.json (not an HF-layout checkpoint)")
    cfg = json.loads(cfg_path.read_text())
    missing = [k if isinstance(k, str) else "/".join(k) for k in SGLANG_CONFIG_KEYS
               if not any(a in cfg for a in ((k,) if isinstance(k, str) else k))]
    if missing:
        raise ValueError(f"{cfg_path}: SGLang's {ARCHITECTURE} loader needs {', '.join(missing)}")
    if ARCHITECTURE not in cfg["architectures"]:
        raise ValueError(f"{cfg_path}: architectures {cfg['architectures']} do not name {ARCHITECTURE}")
    if not list(Path(path).glob("*.safetensors")):
        raise FileNotFoundError(f"{path}: no *.safetensors weights")
    return cfg


def server_command(checkpoint: str | Path, port: int, launch: SGLangLaunch | None = None, host: str = "127.0.0.1",
                   weight_version: int | str = 0) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) of one SGLang server for `checkpoint`."""
    launch = launch or SGLangLaunch()
    cfg = check_checkpoint(checkpoint)
    argv = [launch.python, "-m", "sglang.launch_server", "--model-path", str(checkpoint), "--host", host,
            "--port", str(port), "--tp-size", str(launch.tp_size), "--dtype", launch.dtype,
            "--mem-fraction-static", str(launch.mem_fraction_static), "--weight-version", str(weight_version),
            "--skip-tokenizer-init"]  # token ids in, token ids out: temper tokenizes
    if launch.max_running_requests:
        argv += ["--max-running-requests", str(launch.max_running_requests)]
    if launch.context_length:
        argv += ["--context-length", str(launch.context_length)]
    env: dict[str, str] = {}
    if launch.deterministic_topk:
        argv += ["--dsa-topk-backend", "flashinfer"]
        env.update(SGLANG_DSA_TOPK_FLASHINFER_DETERMINISTIC="1", SGLANG_DSA_TOPK_FLASHINFER_TIE_BREAK="small")
    if launch.mtp and cfg.get("num_nextn_predict_layers", 0) > 0:
        argv += ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(launch.mtp_steps),
                 "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(launch.mtp_steps + 1)]
    return argv + list(launch.extra_args), env


def router_command(worker_urls: list[str], port: int, launch: SGLangLaunch | None = None,
                   host: str = "127.0.0.1") -> list[str]:
    """argv of sglang-router in front of `worker_urls`."""
    launch = launch or SGLangLaunch()
    if not worker_urls:
        raise ValueError("sglang-router needs at least one worker URL")
    return [launch.python, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls, "--policy",
            launch.router_policy, "--host", host, "--port", str(port)]


class Fleet:
    """Start server processes (each in its own process group), wait until they answer /health, stop them all.

    `commands` are (argv, env) pairs; `urls` their base URLs, in the same order."""

    def __init__(self, commands: list[tuple[list[str], dict[str, str]]], urls: list[str], start_timeout: float = 900.0):
        if len(commands) != len(urls):
            raise ValueError("Fleet: one URL per command")
        self.commands, self.urls, self.start_timeout = commands, urls, start_timeout
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Fleet:
        from .backend import wait_healthy

        try:
            for argv, env in self.commands:
                self.procs.append(subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True,
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            for url, p in zip(self.urls, self.procs):
                try:
                    wait_healthy(url, p, self.start_timeout)
                except RuntimeError as e:
                    err = (p.stderr.read() or b"").decode(errors="replace")[-2000:] if p.stderr else ""
                    raise RuntimeError(f"{e}: {err}") from None
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                    p.wait(timeout=20)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            if p.stderr:
                p.stderr.close()

    def __exit__(self, *exc) -> None:
        self.stop()
