"""Dagster resources of the iteration: the config, the rollout backend, the sandbox and the trainer backend.

The Pipes runner (`pipes`) is Dagster's own `PipesSubprocessClient`, or dagster-docker's `PipesDockerClient` for
stages that run in containers (`StageRunner`); the trajectory store is a DuckDB file
under the run root whose writers share the `duckdb_writer` concurrency pool (limit 1 in dagster.yaml).
"""


import contextlib
import enum
import functools
import json
import os
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import dagster as dg
from pydantic import BaseModel, Field, create_model, model_validator

from .keys import LaunchRefused, iteration_number

# the shipped presets, as an enum: the Launchpad (and `validate_run_config`) refuses any other name
Preset = enum.Enum("Preset", {p.stem: p.stem for p in sorted((Path(__file__).parents[1] / "configs" / "presets")
                                                              .glob("*.yaml"))}, type=str)


def _leaf_type(tp, name: str):
    """The Dagster-config type of one IterationConfig leaf (None: not expressible; set it through `overrides`)."""
    origin = typing.get_origin(tp)
    if tp in (int, float, bool, str):
        return tp
    if origin is typing.Literal:
        vals = typing.get_args(tp)
        if all(isinstance(v, str) for v in vals):
            return enum.Enum(name, {v: v for v in vals}, type=str)
        return int if all(isinstance(v, int) and not isinstance(v, bool) for v in vals) else None
    if origin is list:
        args = typing.get_args(tp)
        inner = _leaf_type(args[0], name) if args else None
        return list[inner] if inner in (int, float, bool, str) or isinstance(inner, enum.EnumMeta) else None
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _leaf_type(args[0], name) if len(args) == 1 else None
    return None


def _settings_schema(model: type[BaseModel], name: str) -> type[dg.Config]:
    """A Dagster Config mirroring `model` (IterationConfig), every leaf optional (unset: the preset's value), typed
    as in the config — ints, floats, bools, strings, enums for literals, lists of those — so the Launchpad checks
    each value's type and each key's spelling before a run exists. Ranges and cross-field rules are checked when
    the resource is built, with the key named."""
    fields: dict = {}
    for fname, f in model.model_fields.items():
        sub_name = name + fname.title().replace("_", "")
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            sub = _settings_schema(f.annotation, sub_name)
            fields[fname] = (sub, sub())
        elif (leaf := _leaf_type(f.annotation, sub_name)) is not None:
            fields[fname] = (leaf | None, Field(default=None, description=f.description))
    return create_model(name, __base__=dg.Config, __doc__=f"typed overrides of {model.__name__}", **fields)


def _flatten(values: dict, prefix: str = "") -> list[str]:
    """`settings` as `key.path=value` overrides (set leaves only)."""
    out = []
    for k, v in values.items():
        if isinstance(v, dict):
            out += _flatten(v, f"{prefix}{k}.")
        elif v is not None:
            v = [x.value if isinstance(x, enum.Enum) else x for x in v] if isinstance(v, list) else v
            out.append(f"{prefix}{k}={json.dumps(v.value if isinstance(v, enum.Enum) else v)}")
    return out


def _iteration_settings():
    from configs import IterationConfig

    return _settings_schema(IterationConfig, "Settings")


Settings = _iteration_settings()


class TemperResource(dg.ConfigurableResource):
    """The IterationConfig (a preset plus Launchpad overrides) and where runs, trajectories and tracking live.

    The preset is an enum in the config schema, and `settings` mirrors the whole IterationConfig with typed,
    optional leaves (`settings: {loop: {steps: 40}}`): the Launchpad refuses a misspelt key or a value of the
    wrong type before a run exists. `overrides` (`key.path=value` strings, applied before `settings`) reach the
    few fields the typed schema cannot express. Both are resolved against the preset when the resource is built,
    so a bad key or value stops the run before any asset computes, with the key named (and a "did you mean");
    `temper run` resolves them before it creates a partition."""

    preset: Preset = Preset.tiny
    overrides: list[str] = []
    settings: Settings = Settings()
    run_root: str = "runs/pipeline"
    mlflow_uri: str = ""  # default: $TEMPER_MLFLOW_URI (e.g. postgresql://temper@db/mlflow), else sqlite under run_root
    mlflow_ui: str = ""  # e.g. http://127.0.0.1:5000 (what `make ui` serves): turns run links into URLs

    @model_validator(mode="after")
    def _resolves(self):
        import configs

        configs.load(self.preset_name, self.all_overrides())  # ConfigError (a ValueError) names the bad key
        return self

    def all_overrides(self) -> list[str]:
        """`overrides`, then the set `settings` leaves as `key.path=value` (later ones win)."""
        st = self.settings
        return [*self.overrides, *_flatten(st.model_dump() if isinstance(st, BaseModel) else dict(st or {}))]

    @property
    def preset_name(self) -> str:
        return self.preset.value if isinstance(self.preset, enum.Enum) else str(self.preset)

    def config(self):
        """The resolved IterationConfig. Also puts torch.compile's on-disk cache (the engines' compiled decode step,
        rollout/compiled.py) under the run root, unless TORCHINDUCTOR_CACHE_DIR names one already: a later stage or
        iteration loads the compiled code instead of compiling it again."""
        import configs

        root = Path(self.run_root).expanduser().resolve()  # (not made here: a refused launch leaves no run root)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "compile-cache"))
        return configs.load(self.preset_name, self.all_overrides())

    def root(self) -> Path:
        """The run root, absolute: every path an asset records is absolute."""
        p = Path(self.run_root).expanduser().resolve()
        p.mkdir(parents=True, exist_ok=True)
        return p

    def dir(self, iteration: str) -> Path:
        try:
            n = iteration_number(iteration)
        except LaunchRefused as e:  # a partition added by hand in the UI: fails once, not three times
            raise dg.Failure(str(e), allow_retries=False) from None
        p = self.root() / f"iteration-{n:04d}"
        p.mkdir(parents=True, exist_ok=True)
        return p

    def store_path(self) -> Path:
        return self.root() / "trajectories.duckdb"

    def tracker(self):
        """The MLflow tracker: `mlflow_uri`, else $TEMPER_MLFLOW_URI, else `<run_root>/mlflow.db`; a database store's
        artifacts go to $TEMPER_MLFLOW_ARTIFACTS, else `<run_root>/mlartifacts` (as sqlite's do)."""
        from store.tracking import tracking_uri

        return _tracker(tracking_uri(self.run_root, self.mlflow_uri), (self.root() / "mlartifacts").as_uri())

    def run_url(self, tracker, run_id: str) -> str:
        return f"{self.mlflow_ui.rstrip('/')}/#/experiments/{tracker.experiment_id}/runs/{run_id}"


@functools.cache
def _tracker(uri: str, artifacts: str):
    from store.tracking import Tracker

    return Tracker(uri, artifacts=artifacts)


class RolloutBackend(dg.ConfigurableResource):
    """Where rollouts are generated.

    `embedded`: the resource starts `embedded_servers` temper engine servers on 127.0.0.1 for the step and
    stops them after. `sglang`: `urls` are running SGLang servers (each gets the checkpoint through
    `/update_weights_from_disk`); `router_url`, when set, is an sglang-router in front of them that serves
    `/generate`."""

    kind: Literal["embedded", "sglang"] = "embedded"
    embedded_servers: int = 1
    urls: list[str] = []
    router_url: str = ""
    # kind sglang, launch: start `sglang_servers` SGLang servers on ports base_port, base_port+1, … from the step's
    # checkpoint (rollout/sglang.py builds the flags: deterministic DSA top-k with temper's tie rule, MTP as
    # EAGLE), plus sglang-router on `router_port` when `sglang_router`; all stopped after the step
    launch: bool = False
    sglang_servers: int = 1
    sglang_python: str = "python"
    tp_size: int = 1
    base_port: int = 30000
    sglang_router: bool = False
    router_port: int = 29000
    extra_args: list[str] = []
    # OPD's teachers score on their own servers: embedded ones started for the step, `teacher_urls` (sglang), or
    # with launch `teacher_servers` SGLang servers after the rollout ones' ports; none: teachers in-process
    teacher_urls: list[str] = []
    teacher_servers: int = 1
    # every generating stage (SAO, OPD, evaluation too) drives these servers; off: only rollout_batches does and
    # the training stages use an in-process engine (the CPU default). SGLang servers are always used by all.
    all_stages: bool = False

    def for_stages(self) -> bool:
        return self.all_stages or self.kind == "sglang"

    @contextlib.contextmanager
    def teacher_serving(self, cfg, checkpoint: str | None = None) -> Iterator[list[str] | None]:
        """Servers for OPD's teachers (never the rollout servers: loading a teacher would replace the student)."""
        if not self.for_stages():
            yield None
        elif self.kind == "sglang" and self.launch:
            shifted = self.model_copy(update={"base_port": self.base_port + self.sglang_servers,
                                              "sglang_servers": self.teacher_servers, "sglang_router": False})
            with shifted.serving(cfg, checkpoint) as (urls, _):
                yield urls
        elif self.kind == "sglang":
            yield list(self.teacher_urls) or None
        else:
            with self.serving(cfg, checkpoint) as (urls, _):
                yield urls

    @contextlib.contextmanager
    def stage_serving(self, cfg, checkpoint: str | None = None) -> Iterator[tuple[list[str] | None, str]]:
        """The servers a training/evaluation stage should use, or (None, "") for in-process."""
        if not self.for_stages():
            yield None, ""
            return
        with self.serving(cfg, checkpoint) as got:
            yield got

    @contextlib.contextmanager
    def serving(self, cfg, checkpoint: str | None = None) -> Iterator[tuple[list[str], str]]:
        if self.kind == "sglang" and self.launch:
            from rollout.sglang import Fleet, SGLangLaunch, router_command, server_command

            if not checkpoint:
                raise dg.Failure("rollout backend 'sglang' with `launch` needs the step's checkpoint to start from")
            spec = SGLangLaunch(python=self.sglang_python, tp_size=self.tp_size, extra_args=self.extra_args,
                                context_length=cfg.agent.max_context + 8)
            urls = [f"http://127.0.0.1:{self.base_port + i}" for i in range(self.sglang_servers)]
            cmds = [server_command(checkpoint, self.base_port + i, spec) for i in range(self.sglang_servers)]
            with Fleet(cmds, urls):
                if not self.sglang_router:
                    yield urls, ""
                    return
                router = f"http://127.0.0.1:{self.router_port}"
                with Fleet([(router_command(urls, self.router_port, spec), {})], [router]):
                    yield urls, router
            return
        if self.kind == "sglang":
            if not self.urls:
                raise dg.Failure("rollout backend 'sglang' needs `urls` (the SGLang servers' base URLs)",
                                 allow_retries=False)  # a config error (`assets/launch.py` refuses it at launch)
            yield list(self.urls), self.router_url
            return
        from rollout.backend import embedded_servers

        with embedded_servers(cfg.model, n=self.embedded_servers, n_slots=cfg.loop.n_slots,
                              max_len=cfg.agent.max_context + 8, seed=cfg.seed) as urls:
            yield urls, ""


class SandboxResource(dg.ConfigurableResource):
    """Where untrusted code runs: the preset's choice (empty), or `bwrap` / `docker` explicitly."""

    kind: Literal["", "bwrap", "docker"] = ""

    def overrides(self) -> list[str]:
        return [f"envs.sandbox={self.kind}"] if self.kind else []


class StageRunner(dg.ConfigurableResource):
    """Where the long stages run, through Dagster Pipes.

    `subprocess` (default): Dagster's `PipesSubprocessClient`, a child process on this machine. `docker`:
    dagster-docker's `PipesDockerClient`, one container per stage (`stages`: which ones; empty: all). The image
    defaults to temper's local skeleton image with this machine's interpreter, virtualenv and repository bound
    read-only and the run root read-write at the same paths; `image` names another (one with temper installed).
    The container shares the host network by default (`network`), so it reaches the rollout servers. A stage that
    runs agent code needs a sandbox inside the container; give the container one (e.g. the engine's socket) or keep
    those stages on `subprocess`."""

    kind: Literal["subprocess", "docker", "k8s"] = "subprocess"
    stages: list[str] = []
    image: str = ""
    network: str = "host"
    # k8s: one pod per stage in `namespace`, from `image` (temper installed, the repository at `workdir`); GPU
    # stages request `gpus` nvidia.com/gpu each; the run root is a shared volume (`run_root_claim`, a PVC) mounted
    # at the same path; `node_selector` and `tolerations` place the pods
    namespace: str = "default"
    workdir: str = "/opt/temper"
    gpu_stages: list[str] = ["warm_start", "rollout_batches", "sao_expert", "opd_student", "evaluation"]
    gpus: int = 1
    cpu: str = "8"
    memory: str = "64Gi"
    run_root_claim: str = ""
    node_selector: dict[str, str] = {}
    tolerations: list[dict[str, str]] = []
    # k8s: a Secret whose keys become the stage pods' environment (e.g. PGPASSWORD, so a stage logs its curves into
    # a PostgreSQL MLflow store without the password in the URI or the pod spec)
    env_secret: str = ""

    def containerized(self, stage: str) -> bool:
        return self.kind != "subprocess" and (not self.stages or stage in self.stages)

    def pod_spec(self, stage: str, run_root: Path) -> dict:
        """The base pod spec of `stage` for `PipesK8sClient` (k8s)."""
        res = {"cpu": self.cpu, "memory": self.memory}
        if stage in self.gpu_stages and self.gpus:
            res["nvidia.com/gpu"] = str(self.gpus)
        container = {"name": "stage", "working_dir": self.workdir, "resources": {"limits": res, "requests": res},
                     "security_context": {"allow_privilege_escalation": False}}
        if self.env_secret:
            container["env_from"] = [{"secret_ref": {"name": self.env_secret}}]
        spec: dict = {"restart_policy": "Never", "containers": [container]}
        if self.run_root_claim:
            container["volume_mounts"] = [{"name": "run-root", "mount_path": str(run_root)}]
            spec["volumes"] = [{"name": "run-root", "persistent_volume_claim": {"claim_name": self.run_root_claim}}]
        if self.node_selector:
            spec["node_selector"] = dict(self.node_selector)
        if self.tolerations:
            spec["tolerations"] = [dict(t) for t in self.tolerations]
        return spec

    def pod(self, stage: str, command: list[str], env: dict[str, str], run_root: Path):
        """The pod `PipesK8sClient` would create, built with dagster-k8s's own builder: a `V1Pod`, so a bad field
        in the configuration fails here, before anything is submitted."""
        from dagster_k8s.pipes import build_pod_body

        if not self.image:
            raise dg.Failure("pipes kind 'k8s' needs `image`: an image with temper installed",
                             allow_retries=False)  # a config error (`assets/launch.py` refuses it at launch)
        return build_pod_body(f"temper-{stage.replace('_', '-')}", self.image, ["python", *command[1:]], env,
                              {"labels": {"app.kubernetes.io/name": "temper", "temper/stage": stage.replace("_", "-")}},
                              self.pod_spec(stage, run_root))

    def run(self, context, stage: str, command: list[str], env: dict[str, str], extras: dict, run_root: Path):
        if not self.containerized(stage):
            return dg.PipesSubprocessClient().run(context=context, command=command, env=env, extras=extras)
        if self.kind == "k8s":
            from dagster_k8s import PipesK8sClient

            self.pod(stage, command, env, run_root)  # validated first
            return PipesK8sClient().run(context=context, extras=extras, image=self.image,
                                        command=["python", *command[1:]], namespace=self.namespace, env=env,
                                        base_pod_meta={"labels": {"app.kubernetes.io/name": "temper"}},
                                        base_pod_spec=self.pod_spec(stage, run_root))
        import sys

        import docker
        from dagster_docker import PipesDockerClient

        from envs.sandbox_docker import ensure_image

        client = docker.from_env()
        image = self.image or ensure_image(client)
        repo = Path(__file__).resolve().parents[1]
        ro = {str(p) for p in (Path(sys.prefix), Path(sys.base_prefix), repo)}
        vols = {"/usr": {"bind": "/usr", "mode": "ro"}}
        for link in ("bin", "lib", "lib64", "sbin"):
            if Path("/" + link).is_dir() and not Path("/" + link).is_symlink():
                vols["/" + link] = {"bind": "/" + link, "mode": "ro"}
        for f in ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "nsswitch.conf", "passwd", "group",
                  "hosts", "resolv.conf"):
            if Path("/etc", f).exists():
                vols[f"/etc/{f}"] = {"bind": f"/etc/{f}", "mode": "ro"}
        vols.update({p: {"bind": p, "mode": "ro"} for p in sorted(ro)})
        vols[str(run_root)] = {"bind": str(run_root), "mode": "rw"}
        label = {"temper.stage": stage, "temper.dagster_run": context.run.run_id}
        try:
            return PipesDockerClient().run(
                context=context, image=image, command=[sys.executable, *command[1:]], extras=extras,
                env={"HOME": "/tmp", "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", **_libpq_env(), **env},
                container_kwargs={"volumes": vols, "working_dir": str(repo), "network_mode": self.network,
                                  "tmpfs": {"/tmp": "size=1g"}, "labels": label, "read_only": True})
        finally:  # the client stops its container; remove it too
            for c in client.containers.list(all=True, filters={"label": [f"{k}={v}" for k, v in label.items()]}):
                c.remove(force=True)


def _libpq_env() -> dict[str, str]:
    """This process's libpq settings (PGPASSWORD, …): a stage container on this machine reaches a PostgreSQL MLflow
    store as its parent does (a subprocess inherits them)."""
    import os

    return {k: v for k, v in os.environ.items() if k in ("PGPASSWORD", "PGUSER", "PGSSLMODE", "PGSSLROOTCERT")}


class TrainerBackend(dg.ConfigurableResource):
    """How the training stages run: the torch backend on this machine's CPUs (`threads` 0 = torch's default).
    A Megatron-core backend plugs in here once it exists."""

    kind: Literal["torch"] = "torch"
    threads: int = 0

    def env(self) -> dict[str, str]:
        return {"OMP_NUM_THREADS": str(self.threads)} if self.threads else {}
