"""MLflow tracking: one parent run per pipeline run, one nested run per stage with its params, code and data.

MLflow keeps the active-run stack per thread, and Prefect may run a task in a worker thread, so a stage
finds its parent as: the `parent_run_id` it is given, else this thread's active run, else the pipeline
run this process started with `start_pipeline_run`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import numbers
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import mlflow
from mlflow.data.dataset_source_registry import get_dataset_source_from_json
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from tasks.cache import MISSING, content_digest
from transfer.config import flatten

__all__ = [
    "tracking_uri",
    "ensure_experiment",
    "loggable_params",
    "git_tags",
    "start_pipeline_run",
    "stage_run",
    "log_dataset",
    "log_metrics_history",
    "log_figure_png",
    "metric_key",
    "step_metrics_listener",
    "mark_killed_runs",
    "existing_tracking_uri",
    "sqlite_path",
]

GIT_COMMIT_TAG = "mlflow.source.git.commit"
MAX_DATASET_DIGEST = 36  # MLflow rejects longer dataset digests; the full sha256 goes in an input tag
_BATCH = 1000  # MLflow's limit on metrics per log_batch call

# a key component ending in one of these words is a secret: hf_token, db_password, aws_access_key_id (not max_tokens)
_SECRET = re.compile(r"(^|_)(token|secret|password|passwd|credentials?|(api|access|private|secret|auth)_?key(_id)?)$")

_METRIC_NAME_BAD = re.compile(r"[^A-Za-z0-9_\-. :/]")  # what MLflow refuses in a metric name

_pipeline_run_id: str | None = None  # this process's pipeline run, for stages running in other threads


def metric_key(name: str) -> str:
    """`name` as MLflow accepts it: a variant such as `ulmfit+tfidf` logs as `ulmfit_plus_tfidf`."""
    return _METRIC_NAME_BAD.sub("_", name.replace("+", "_plus_"))


def step_metrics_listener() -> Callable[[dict], None]:
    """A `transfer.progress` listener that logs training progress as step metrics of this process's pipeline run:
    `steps.<stage direction>.loss` and `.<unit>_per_s`, at each global step reported (every few seconds)."""
    run_id, client = _pipeline_run_id, _client()

    def listen(event: dict) -> None:
        if run_id is None:
            return
        base = metric_key(f"steps.{event['name']}")
        now = int(time.time() * 1000)
        try:
            client.log_batch(run_id, metrics=[
                Metric(f"{base}.loss", float(event["loss"]), now, int(event["global_step"])),
                Metric(f"{base}.{event['unit']}_per_s", float(event["rate"]), now, int(event["global_step"]))])
        except Exception:  # noqa: BLE001  progress is best effort: a busy database must not stop training
            pass
    return listen


def tracking_uri() -> str:
    """$MLFLOW_TRACKING_URI, else a SQLite database `mlflow.db` in the working directory."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///` tracking URI; None for other stores and in-memory databases."""
    if not uri.startswith("sqlite:///"):
        return None
    db = uri.removeprefix("sqlite:///").split("?")[0]
    return None if db == ":memory:" else Path(db)


def existing_tracking_uri() -> str:
    """The tracking URI for reading the registry; a SQLite store must exist (a read must not create an empty one)."""
    from transfer.errors import TransferError

    uri = tracking_uri()
    db = sqlite_path(uri)
    if db is not None and not db.is_file():
        raise TransferError(f"{db}: no MLflow tracking database there, so no registered models (`transfer run` "
                            "creates it; or set MLFLOW_TRACKING_URI)")
    return uri


def _client() -> MlflowClient:
    return MlflowClient(tracking_uri=tracking_uri())


def init_store() -> None:
    """Create a missing SQLite tracking store atomically: migrate a temp file, then rename it into place.

    MLflow migrates a new database in many steps; a process killed midway would leave a store that every
    later run fails to open ("table ... already exists").
    """
    db = sqlite_path(tracking_uri())
    if db is None or db.exists():
        return
    tmp = db.with_name(f".{db.name}.tmp-{os.getpid()}")
    try:
        MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments(max_results=1)
        os.replace(tmp, db)
    finally:
        tmp.unlink(missing_ok=True)


def ensure_experiment(name: str, artifact_location: str | Path) -> str:
    """The id of experiment `name`, created (artifacts under `artifact_location`) or restored if needed."""
    init_store()
    client = _client()
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        location = str(artifact_location)
        if "://" not in location:  # a local folder: MLflow wants an absolute file URI
            location = Path(location).resolve().as_uri()
        return client.create_experiment(name, artifact_location=location)
    if experiment.lifecycle_stage == "deleted":
        client.restore_experiment(experiment.experiment_id)
    return experiment.experiment_id


def workspace_tags() -> dict[str, str]:
    """Which workspace (folder, machine) a run belongs to: `mark_killed_runs` finds this workspace's runs by them."""
    return {"transfer.workspace": str(Path.cwd().resolve()), "transfer.host": socket.gethostname()}


def mark_killed_runs() -> int:
    """Runs of this workspace left RUNNING by a killed process become KILLED; returns how many.

    Call it holding the workspace lock: then no live process of this workspace is logging."""
    tags = workspace_tags()
    if any("'" in v for v in tags.values()):  # cannot be quoted in a filter string; leave them
        return 0
    init_store()
    client = _client()
    experiments = [e.experiment_id for e in client.search_experiments()]
    if not experiments:
        return 0
    where = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
    stale = client.search_runs(experiments, f"attributes.status = 'RUNNING' and {where}", max_results=10_000)
    for run in stale:
        client.set_terminated(run.info.run_id, status="KILLED")
    return len(stale)


def loggable_params(params: Mapping[str, Any] | Any) -> dict[str, Any]:
    """`params` (dict or dataclass) flattened to dotted keys, without secrets: any key with a secret-like component."""
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        params = dataclasses.asdict(params)
    flat = flatten(params)
    return {k: v for k, v in flat.items() if not any(_SECRET.search(part.lower()) for part in k.split("."))}


def _git(cwd: str | Path | None, *args: str) -> str | None:
    """git's output at `cwd`, or None outside a repo (or without git)."""
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def git_tags(cwd: str | Path | None = None) -> dict[str, str]:
    """{"mlflow.source.git.commit": HEAD, "git.dirty": "true"/"false"} for the repo at `cwd`; {} outside one."""
    commit, status = _git(cwd, "rev-parse", "HEAD"), _git(cwd, "status", "--porcelain", "--untracked-files=no")
    if commit is None or status is None:
        return {}
    return {GIT_COMMIT_TAG: commit, "git.dirty": str(status != "").lower()}


CODE = ("transfer", "tasks", "flows", "pyproject.toml", "constraints.txt")  # what `code_version` calls dirty


def code_version() -> str:
    """The commit of the code that runs ("+dirty" with changed or new files under CODE; data, docs and params
    do not count); "" outside git. Result rows carry it: `--resume` keeps a row whose params, data and LM
    match, whatever code made it."""
    root = Path(__file__).resolve().parents[1]
    commit, status = _git(root, "rev-parse", "HEAD"), _git(root, "status", "--porcelain", "--", *CODE)
    if commit is None or status is None:
        return ""
    return commit[:12] + ("+dirty" if status else "")


def _log_params(run_id: str, params: Mapping[str, Any] | Any) -> None:
    flat = loggable_params(params)
    if flat:
        mlflow.log_params({k: "null" if v is None else v for k, v in flat.items()}, run_id=run_id)


@contextlib.contextmanager
def start_pipeline_run(
    name: str, params: Mapping[str, Any] | Any, experiment_id: str | None = None, tags: Mapping[str, str] | None = None
) -> Iterator[mlflow.ActiveRun]:
    """The parent run of one pipeline run: all params, the git commit; stages nest under it."""
    global _pipeline_run_id
    mlflow.set_tracking_uri(tracking_uri())
    all_tags = {**git_tags(), **workspace_tags(), "pipeline": name, **(tags or {})}
    with mlflow.start_run(run_name=name, experiment_id=experiment_id, tags=all_tags) as run:
        _log_params(run.info.run_id, params)
        previous, _pipeline_run_id = _pipeline_run_id, run.info.run_id
        try:
            yield run
        finally:
            _pipeline_run_id = previous


@contextlib.contextmanager
def stage_run(
    stage: str,
    params_section: Mapping[str, Any] | Any,
    inputs: Mapping[str, str | Path] | None = None,
    parent_run_id: str | None = None,
) -> Iterator[mlflow.ActiveRun]:
    """A run for one stage, nested under the pipeline run: its params section, git commit and input digests."""
    mlflow.set_tracking_uri(tracking_uri())
    active = mlflow.active_run()
    parent = parent_run_id or (active.info.run_id if active else None) or _pipeline_run_id
    experiment_id = _client().get_run(parent).info.experiment_id if parent else None
    tags = {**git_tags(), **workspace_tags(), "stage": stage}
    with mlflow.start_run(
        run_name=stage, experiment_id=experiment_id, nested=active is not None, parent_run_id=parent, tags=tags
    ) as run:
        _log_params(run.info.run_id, params_section)
        for role, path in (inputs or {}).items():
            log_dataset(path, context=role)
        yield run


def log_dataset(path: str | Path, context: str | None = None, name: str | None = None) -> str:
    """Record file or folder `path` as an input of the active run, digested by content; returns the sha256.

    Only the digest is logged (a MetaDataset), so a 40 MB corpus is hashed once and never parsed.
    """
    path = Path(path).resolve()
    sha256 = content_digest(path)
    if sha256 == MISSING:
        raise FileNotFoundError(f"{path}: dataset to log does not exist")
    source = get_dataset_source_from_json(json.dumps({"uri": path.as_uri()}), source_type="local")
    digest = sha256.removeprefix("dir:")[:MAX_DATASET_DIGEST]
    dataset = MetaDataset(source=source, name=name or path.name, digest=digest)
    mlflow.log_input(dataset, context=context, tags={"sha256": sha256})
    return sha256


def log_metrics_history(history: list[Mapping[str, Any]], step_key: str = "epoch", run_id: str | None = None) -> None:
    """Log every numeric column of `history` (one dict per epoch/step) at step `row[step_key]`."""
    if run_id is None:
        active = mlflow.active_run()
        if active is None:
            raise RuntimeError("log_metrics_history needs a run_id or an active MLflow run")
        run_id = active.info.run_id
    now = int(time.time() * 1000)
    metrics = [
        Metric(key=key, value=float(value), timestamp=now, step=int(row[step_key]))
        for row in history
        for key, value in row.items()
        if key != step_key and isinstance(value, numbers.Real) and not isinstance(value, bool)
    ]
    client = _client()
    for i in range(0, len(metrics), _BATCH):
        client.log_batch(run_id, metrics=metrics[i : i + _BATCH])


def log_figure_png(fig_or_path: Any, name: str) -> str:
    """Log a matplotlib figure or an existing PNG file as artifact `name` (".png" added); returns the name."""
    name = name if name.endswith(".png") else f"{name}.png"
    if not isinstance(fig_or_path, (str, Path)):
        mlflow.log_figure(fig_or_path, name)
        return name
    folder, _, file_name = name.rpartition("/")
    with tempfile.TemporaryDirectory() as tmp:  # log_artifact keeps the file's own name: copy it to `name`
        target = Path(tmp, file_name)
        shutil.copyfile(fig_or_path, target)
        mlflow.log_artifact(str(target), artifact_path=folder or None)
    return name
