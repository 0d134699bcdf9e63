"""MLflow tracking, called directly (one run per iteration, nested runs per stage, batched metrics).

Only this room imports mlflow. The tracking URI is the resource's `mlflow_uri`, else $TEMPER_MLFLOW_URI (a
database URI such as `postgresql://temper@db:5432/mlflow` for a shared deployment: MLflow's SQL store), else a
sqlite file under the run root (MLflow 3's default store); telemetry is off.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


@functools.cache
def git_commit(repo: Path | None = None) -> str:
    """The commit of the code that ran (with `+dirty` when the work tree differs), or "unknown"."""
    import subprocess

    repo = repo or Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


SQL_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")  # MLflow's SQL store (`postgresql+psycopg2://` too)


def tracking_uri(run_root: str | Path, configured: str = "", env=None) -> str:
    """The MLflow tracking URI of a run root: `configured` (the `temper` resource's `mlflow_uri`), else
    $TEMPER_MLFLOW_URI, else the sqlite file `<run_root>/mlflow.db` (the embedded default). Keep a database
    password out of the URI (it is recorded in run tags): libpq reads $PGPASSWORD or ~/.pgpass."""
    env = os.environ if env is None else env
    return configured or env.get("TEMPER_MLFLOW_URI") or f"sqlite:///{Path(run_root).resolve() / 'mlflow.db'}"


def is_sql_store(uri: str) -> bool:
    return uri.split(":", 1)[0].split("+", 1)[0] in SQL_SCHEMES


def sql_url_problem(uri: str) -> str | None:
    """Why SQLAlchemy cannot open the database URL `uri` with the drivers installed (None: it can, or `uri` is not a
    database URL). SQLAlchemy 2.1 opens a bare `postgresql://` with psycopg 3; dagster-postgres brings psycopg2, so
    write `postgresql+psycopg2://`. The message names the scheme only, never the URL (it may hold a password)."""
    scheme = uri.split(":", 1)[0]
    if not (is_sql_store(uri) or scheme == "postgres") or scheme == "sqlite":
        return None
    from sqlalchemy.engine.url import make_url

    hint = "write postgresql+psycopg2://USER@HOST:PORT/DB (psycopg2-binary comes with dagster-postgres)"
    try:
        dialect = make_url(uri).get_dialect()
    except Exception:  # noqa: BLE001 - sqlalchemy's ArgumentError / NoSuchModuleError
        return f"SQLAlchemy cannot open a `{scheme}://` URL: {hint}"
    try:
        dialect.import_dbapi()
    except ImportError as e:
        return f"`{scheme}://` needs the driver {e.name!r}, which is not installed: {hint}"
    return None


def artifact_root(tracking_uri: str, default: str | None = None, env=None) -> str | None:
    """Where a new experiment keeps its artifacts: $TEMPER_MLFLOW_ARTIFACTS (a path or a URI) when set, else next
    to a sqlite store (`<db dir>/mlartifacts`), else `default` for another database store (the caller's run root:
    not MLflow's `./mlruns` in whatever directory the process was started from). None: MLflow's choice (a file
    store keeps artifacts inside itself; a server has its own root)."""
    env = os.environ if env is None else env
    if where := env.get("TEMPER_MLFLOW_ARTIFACTS"):
        return Path(where).resolve().as_uri() if "://" not in where else where
    if tracking_uri.startswith("sqlite:///"):
        return (Path(tracking_uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts").as_uri()
    return default if is_sql_store(tracking_uri) else None


class Tracker:
    def __init__(self, tracking_uri: str, experiment: str = "temper", artifacts: str | None = None):
        """`artifacts`: the artifact root of the experiment if this creates it and the store is a database
        other than sqlite (`artifact_root`)."""
        import mlflow
        from mlflow.tracking import MlflowClient

        self.mlflow = mlflow
        mlflow.set_tracking_uri(tracking_uri)
        self.client = MlflowClient(tracking_uri)
        exp = self.client.get_experiment_by_name(experiment)
        self.experiment_id = exp.experiment_id if exp else self.client.create_experiment(
            experiment, artifact_location=artifact_root(tracking_uri, artifacts))
        self.uri = tracking_uri

    def start(self, name: str, parent_run_id: str | None = None, tags: dict | None = None) -> str:
        t = dict(tags or {})
        if parent_run_id:
            t["mlflow.parentRunId"] = parent_run_id
        return self.client.create_run(self.experiment_id, run_name=name, tags=t).info.run_id

    def iteration_run(self, iteration: str, tags: dict | None = None, config: dict | None = None) -> str:
        """The iteration's run (created once, found again on retries). `tags` are set on it every time (the
        latest Dagster run id wins); `config`, the resolved IterationConfig, is logged as `config.json` once."""
        runs = self.client.search_runs([self.experiment_id], f"tags.temper_iteration = '{iteration}' and "
                                                             "tags.temper_kind = 'iteration'", max_results=1)
        if runs:
            run_id = runs[0].info.run_id
            for k, v in (tags or {}).items():
                if runs[0].data.tags.get(k) != str(v):
                    self.client.set_tag(run_id, k, str(v))
        else:
            run_id = self.start(f"iteration-{iteration}", tags={"temper_iteration": iteration,
                                                                "temper_kind": "iteration", **(tags or {})})
        if config is not None and not self.client.list_artifacts(run_id, "config"):
            self.client.log_dict(run_id, config, "config/config.json")
        return run_id

    def log_datasets(self, run_id: str, datasets: dict[str, tuple[str, str, str]]) -> None:
        """Record the run's datasets as MLflow inputs: name → (digest, absolute source path, context)."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        self.client.log_inputs(run_id, [DatasetInput(Dataset(name, digest[:36], "local", Path(src).resolve().as_uri()),
                                                     [InputTag("mlflow.data.context", ctx)])
                                        for name, (digest, src, ctx) in datasets.items()])

    def stage_run(self, iteration_run: str, iteration: str, stage: str, key: str | None = None) -> str:
        """The stage's run nested under the iteration's run. With `key` (the stage's input key), the run of those
        inputs, found again when the step is retried or repaired, and a new run when the stage recomputes on other
        inputs (a run's params cannot change, and the earlier run keeps what its inputs gave); without, the newest."""
        runs = self.client.search_runs([self.experiment_id], f"tags.temper_iteration = '{iteration}' and "
                                                             f"tags.temper_stage = '{stage}'",
                                       order_by=["attributes.start_time DESC"])
        for r in runs:
            if key is None or r.data.tags.get("temper_input_key") == key:
                return r.info.run_id
        tags = {"temper_iteration": iteration, "temper_stage": stage, "temper_kind": "stage"}
        return self.start(stage, parent_run_id=iteration_run, tags={**tags, **({"temper_input_key": key} if key else {})})

    def log_plot(self, run_id: str, name: str, curves: dict[str, list[float]], path: str | Path,
                 bars: dict[str, dict[str, float]] | None = None) -> Path | None:
        """Save `curves` (one line panel each) or `bars` (one bar panel each) as a PNG at `path` and log it as
        an artifact of the run; None when there is nothing to plot."""
        png = bar_png(bars, name, path) if bars else curve_png(curves, name, path)
        if png is not None:
            self.client.log_artifact(run_id, str(png), artifact_path="plots")
        return png

    def log(self, run_id: str, metrics: dict[str, float] | None = None, params: dict | None = None,
            steps: dict[str, list[float]] | None = None) -> None:
        from mlflow.entities import Metric, Param

        now = int(time.time() * 1000)
        ms = [Metric(k, float(v), now, 0) for k, v in (metrics or {}).items()]
        for k, vals in (steps or {}).items():
            ms += [Metric(k, float(v), now, i) for i, v in enumerate(vals)]
        ps = [Param(k, str(v)[:500]) for k, v in (params or {}).items()]
        for i in range(0, max(len(ms), 1), 900):
            self.client.log_batch(run_id, metrics=ms[i : i + 900], params=ps if i == 0 else [])

    def log_step(self, run_id: str, values: dict[str, float], step: int) -> None:
        """One training step's metrics, stamped now: curves that grow while the stage trains."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in values.items()])

    def fail_iteration(self, iteration: str) -> int:
        """Mark every run of `iteration` still RUNNING as FAILED (a failed iteration must not look live)."""
        runs = self.client.search_runs([self.experiment_id], f"tags.temper_iteration = '{iteration}' and "
                                                             "attributes.status = 'RUNNING'")
        for r in runs:
            self.finish(r.info.run_id, "FAILED")
        return len(runs)

    def finish(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status)

    def artifact(self, run_id: str, path: str | Path) -> None:
        self.client.log_artifact(run_id, str(path))

    def log_model(self, name: str, run_id: str, checkpoint: str | Path, *, metrics: dict[str, dict[str, float]] | None = None,
                  datasets: dict[str, tuple[str | Path, str]] | None = None, tags: dict | None = None,
                  params: dict | None = None, copy: bool = True, model_type: str = "glm_moe_dsa") -> str:
        """Log `checkpoint` as an MLflow 3 LoggedModel produced by run `run_id`; return its model id (`models:/<id>`).

        `copy`: the checkpoint directory becomes the model's artifacts; else they reference it (`checkpoint.json`
        and the `checkpoint` param hold its absolute path). `datasets` (name → (directory, context), its digest from
        `dataset_digest`) become the run's inputs, and `metrics` (dataset name, or "" for none → {metric: value})
        the model's metrics, each tied to its dataset by name and digest: the model page lists them under Metrics
        and Datasets used."""
        from mlflow.entities import LoggedModelOutput, Metric

        sets = {k: (dataset_digest(src), str(Path(src).resolve()), ctx) for k, (src, ctx) in (datasets or {}).items()}
        if unknown := {k for k in (metrics or {}) if k and k not in sets}:
            raise ValueError(f"metrics on datasets not given: {sorted(unknown)}")
        lm = self.client.create_logged_model(self.experiment_id, name=name, source_run_id=run_id,
                                             tags={k: str(v) for k, v in (tags or {}).items()} or None,
                                             params={"checkpoint": str(Path(checkpoint).resolve()),
                                                     **{k: str(v) for k, v in (params or {}).items()}},
                                             model_type=model_type)
        if copy:
            self.client.log_model_artifacts(lm.model_id, str(checkpoint))
        else:
            import json
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                (Path(tmp) / "checkpoint.json").write_text(json.dumps({"checkpoint": str(Path(checkpoint).resolve())}))
                self.client.log_model_artifacts(lm.model_id, tmp)
        self.client.finalize_logged_model(lm.model_id, "READY")
        if sets:
            self.log_datasets(run_id, sets)
        self.client.log_outputs(run_id, [LoggedModelOutput(lm.model_id, 0)])
        now = int(time.time() * 1000)
        ms = [Metric(k, float(v), now, 0, model_id=lm.model_id, dataset_name=ds or None,
                     dataset_digest=sets[ds][0][:36] if ds else None)
              for ds, vals in (metrics or {}).items() for k, v in vals.items() if v is not None]
        for i in range(0, len(ms), 900):
            self.client.log_batch(run_id, metrics=ms[i : i + 900])
        return lm.model_id

    def register_student(self, name: str, run_id: str, checkpoint: str, score: float, significant: bool = True,
                         p_value: float | None = None, *, model_run_id: str | None = None,
                         metrics: dict[str, dict[str, float]] | None = None,
                         datasets: dict[str, tuple[str | Path, str]] | None = None) -> dict:
        """Log the student as a LoggedModel (a copy of its checkpoint; `metrics` and `datasets` as in `log_model`,
        plus `champion_score`, the `score` the champion rule reads) produced by `model_run_id` (default `run_id`),
        register it from `models:/<id>` as a version of `name`, and move the `champion` alias only when its
        improvement over its warm start is significant (`significant`, from the paired test) and `score` beats the
        champion's."""
        tags = {"pass_at_1": f"{score:.4f}", "significant": str(bool(significant))}
        if p_value is not None:
            tags["p_value"] = f"{p_value:.4g}"
        metrics = {**(metrics or {})}
        metrics[""] = {**metrics.get("", {}), "champion_score": score}
        model_id = self.log_model(name, model_run_id or run_id, checkpoint, metrics=metrics, datasets=datasets,
                                  tags={**tags, "temper_run": run_id})
        # registering from `models:/<id>` also tags the LoggedModel with its version (the model page's "Model
        # versions"); mlflow's registry reads the logged model through the process-wide tracking URI: this one
        self.mlflow.set_tracking_uri(self.uri)
        mv = self.mlflow.register_model(f"models:/{model_id}", name, tags={**tags, "logged_model_id": model_id})
        try:
            champ = self.client.get_model_version_by_alias(name, "champion")
            best = float(champ.tags.get("pass_at_1", "-1"))
        except Exception:  # noqa: BLE001 - no champion yet
            best = -1.0
        from trainers.stats import moves_champion

        moved = moves_champion(significant, score, best)
        if moved:
            self.client.set_registered_model_alias(name, "champion", mv.version)
        why = ("beats the champion significantly" if moved else "no significant gain over its warm start"
               if not significant else f"pass@1 {score:.4f} does not beat the champion's {best:.4f}")
        return {"version": int(mv.version), "champion_moved": moved, "previous_best": best, "reason": why,
                "model_id": model_id, "model_uri": f"models:/{model_id}",
                "artifact_location": self.client.get_logged_model(model_id).artifact_location}

    def run_link(self, run_id: str) -> str:
        return f"{self.uri} · experiment {self.experiment_id} · run {run_id}"


def dataset_digest(path: str | Path) -> str:
    """A dataset directory's sha256: the one its `manifest.json` records (temper's env datasets, envs/dataset.py),
    else one over its files (relative names and bytes, in sorted order)."""
    import hashlib
    import json

    path = Path(path)
    try:
        return str(json.loads((path / "manifest.json").read_text())["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def pass_at_1_metrics(summaries: dict[str, dict]) -> dict[str, float]:
    """Metrics of pass@1 summaries (`trainers.stats.summarize`: pass@1 and its 95% interval) by group:
    `pass_at_1_<group>` and its bounds `pass_at_1_<group>_ci95_lo` / `_hi`; the group `all` is plain `pass_at_1`."""
    out = {}
    for g, s in summaries.items():
        key = "pass_at_1" if g == "all" else f"pass_at_1_{g}"
        out[key] = float(s["pass@1"])
        out[f"{key}_ci95_lo"], out[f"{key}_ci95_hi"] = (float(x) for x in s["ci95"])
    return out


def curve_png(curves: dict[str, list[float]], title: str, path: str | Path) -> Path | None:
    """One line panel per curve (x = step)."""
    def draw(ax, v):
        ax.plot(range(1, len(v) + 1), v, lw=1.2)
        ax.set_xlabel("step", fontsize=8)

    return _panels_png(curves, title, path, draw)


def bar_png(panels: dict[str, dict[str, float]], title: str, path: str | Path) -> Path | None:
    """One bar panel per entry of `panels` (label → value)."""
    def draw(ax, v):
        ax.bar(list(v), [float(x) for x in v.values()])
        ax.tick_params(axis="x", labelrotation=20)

    return _panels_png(panels, title, path, draw)


def _panels_png(panels: dict, title: str, path: str | Path, draw) -> Path | None:
    """A row of panels drawn by `draw(ax, value)`, written with matplotlib's Agg backend; None when all are empty."""
    panels = {k: v for k, v in panels.items() if v}
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 2.6), squeeze=False)
    for ax, (k, v) in zip(axes[0], panels.items()):
        draw(ax, v)
        ax.set_title(k, fontsize=9)
        ax.tick_params(labelsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
