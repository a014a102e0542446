"""MLflow tracking helpers against a real SQLite tracking store in a temp folder."""

import hashlib
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from tasks.tracking import (
    GIT_COMMIT_TAG,
    ensure_experiment,
    git_tags,
    log_figure_png,
    log_metrics_history,
    loggable_params,
    metric_key,
    start_pipeline_run,
    stage_run,
    tracking_uri,
)

# MLflow's own SQLAlchemy usage, not ours
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")


def migrated_sqlite_uri(config: pytest.Config, dest: Path) -> str:
    """An MLflow SQLite store at `dest`, copied from a migrated template in pytest's cache (migrating takes seconds)."""
    cache = getattr(config, "cache", None)  # absent under -p no:cacheprovider
    if cache is None:
        return f"sqlite:///{dest}"
    template = cache.mkdir(f"mlflow-{mlflow.__version__}-sqlite") / "mlflow.db"
    if not template.exists():
        tmp = template.with_name(f".mlflow.db.tmp-{os.getpid()}")
        MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments()  # runs the migrations
        os.replace(tmp, template)
    shutil.copyfile(template, dest)
    return f"sqlite:///{dest}"


@pytest.fixture(scope="module")
def store(tmp_path_factory, pytestconfig):
    """One SQLite tracking store for this module; each test has its own experiment."""
    root = tmp_path_factory.mktemp("tracking")
    previous = mlflow.get_tracking_uri()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", migrated_sqlite_uri(pytestconfig, root / "mlflow.db"))
        yield root
    mlflow.set_tracking_uri(previous)  # the helpers set MLflow's process-wide URI


@pytest.fixture
def experiment(store, tmp_path, request):
    return ensure_experiment(request.node.name, tmp_path / "artifacts")


@pytest.fixture
def git_repo(tmp_path, monkeypatch):
    """The working directory is a fresh git repo with one commit; yields its HEAD."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README").write_text("x\n")
    commit = ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]
    for args in (["init", "-q"], ["add", "README"], commit):
        subprocess.run(["git", *args], cwd=repo, check=True)
    monkeypatch.chdir(repo)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()


def test_tracking_uri_defaults_to_sqlite_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert tracking_uri() == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert tracking_uri() == "http://mlflow:5000"


def test_ensure_experiment_creates_once_with_a_local_artifact_folder(store, tmp_path):
    exp_id = ensure_experiment("artifacts-here", tmp_path / "art")
    assert ensure_experiment("artifacts-here", tmp_path / "elsewhere") == exp_id
    assert MlflowClient(tracking_uri()).get_experiment(exp_id).artifact_location == (tmp_path / "art").as_uri()


def test_secret_looking_keys_are_dropped_and_the_rest_flattened():
    params = {
        "data": {"label_col": "label", "text_cols": ["text"], "hf_token": "t", "auth": {"password": "p"}},
        "pretrain": {"max_tokens": 100, "lr": 0.01, "pad_token_id": 0},
        "api_key": "k", "AWS_ACCESS_KEY_ID": "a", "client_secret": "s", "credentials": {"user": "u"},
        "sort_key": "len",
    }
    assert loggable_params(params) == {
        "data.label_col": "label",
        "data.text_cols": '["text"]',
        "pretrain.max_tokens": 100,
        "pretrain.lr": 0.01,
        "pretrain.pad_token_id": 0,
        "sort_key": "len",
    }


def test_stage_runs_nest_under_the_pipeline_run_with_params_commit_and_data_digest(experiment, tmp_path, git_repo):
    train = tmp_path / "train.csv"
    train.write_text("text,label\ngood,pos\nbad,neg\n")
    sha = hashlib.sha256(train.read_bytes()).hexdigest()
    params = {"classifier": {"lr": 0.01, "hf_token": "secret"}, "mlflow": {"experiment": "x"}}

    with start_pipeline_run("nightly", params, experiment_id=experiment) as parent:
        section = {"lr": 0.01, "betas": [0.7, 0.99], "db_password": "pw"}
        with stage_run("classifier", section, inputs={"train": train}) as child:
            pass

    client = MlflowClient(tracking_uri())
    parent, child = client.get_run(parent.info.run_id), client.get_run(child.info.run_id)
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert parent.data.params == {"classifier.lr": "0.01", "mlflow.experiment": "x"}
    assert child.data.params == {"lr": "0.01", "betas": "[0.7, 0.99]"}
    assert parent.data.tags[GIT_COMMIT_TAG] == child.data.tags[GIT_COMMIT_TAG] == git_repo
    (dataset_input,) = child.inputs.dataset_inputs
    assert dataset_input.dataset.name == "train.csv"
    assert dataset_input.dataset.digest == sha[:36]  # MLflow's limit; the full digest is an input tag
    assert {t.key: t.value for t in dataset_input.tags} == {"mlflow.data.context": "train", "sha256": sha}


def test_a_stage_in_a_worker_thread_finds_the_pipeline_run(experiment):
    def stage():
        with stage_run("tokenizer", {"vocab_size": 800}) as run:
            return run.info.run_id

    with start_pipeline_run("threads", {}, experiment_id=experiment) as parent:
        with ThreadPoolExecutor(1) as pool:  # like a Prefect task runner thread: no active MLflow run there
            child_id = pool.submit(stage).result()
    assert MlflowClient(tracking_uri()).get_run(child_id).data.tags["mlflow.parentRunId"] == parent.info.run_id


def test_no_git_repo_means_no_commit_tag(tmp_path):
    assert git_tags(tmp_path) == {}


def test_metrics_history_logs_every_numeric_column_at_its_epoch(experiment):
    history = [{"epoch": e, "train_loss": 1.0 / e, "valid_acc": 0.5 + e / 10, "phase": "unfreeze"} for e in (1, 2, 3)]
    with start_pipeline_run("history", {}, experiment_id=experiment) as run:
        log_metrics_history(history)
    client = MlflowClient(tracking_uri())
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train_loss")] == [
        (1, 1.0), (2, 0.5), (3, 1.0 / 3)
    ]
    assert set(client.get_run(run.info.run_id).data.metrics) == {"train_loss", "valid_acc"}


def test_every_variant_name_logs_as_a_valid_and_distinct_metric(experiment):
    from transfer.config import VARIANTS

    keys = {metric_key(f"variants.{v}.accuracy") for v in VARIANTS}
    assert len(keys) == len(VARIANTS) and "variants.ulmfit_plus_tfidf.accuracy" in keys
    with start_pipeline_run("names", {}, experiment_id=experiment) as run:
        mlflow.log_metrics({k: 0.5 for k in keys})  # MLflow refuses '+' in a metric name
    assert set(MlflowClient(tracking_uri()).get_run(run.info.run_id).data.metrics) == keys


def test_figures_and_png_files_are_logged_as_named_artifacts(experiment, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    png = tmp_path / "whatever.png"
    fig.savefig(png)
    with start_pipeline_run("plots", {}, experiment_id=experiment) as run:
        log_figure_png(fig, "plots/lr_find")
        log_figure_png(png, "plots/confusion.png")
    plt.close(fig)
    listed = MlflowClient(tracking_uri()).list_artifacts(run.info.run_id, "plots")
    assert sorted(a.path for a in listed) == ["plots/confusion.png", "plots/lr_find.png"]


def test_runs_a_dead_process_of_this_workspace_left_running_become_killed(experiment, tmp_path, monkeypatch):
    from tasks.tracking import mark_killed_runs, workspace_tags

    client = MlflowClient(tracking_uri=tracking_uri())
    mine, other = tmp_path / "mine", tmp_path / "other"
    ids = {}
    for name, ws in (("mine", mine), ("other", other)):
        ws.mkdir()
        monkeypatch.chdir(ws)
        with start_pipeline_run(f"pipeline-{name}", {}, experiment_id=experiment) as run:
            with stage_run("prepare", {}):
                pass
        ids[name] = run.info.run_id
        client.update_run(run.info.run_id, status="RUNNING")  # as a process killed mid-run leaves it
        assert client.get_run(run.info.run_id).data.tags["transfer.workspace"] == workspace_tags()["transfer.workspace"]
    monkeypatch.chdir(mine)
    assert mark_killed_runs() == 1
    assert client.get_run(ids["mine"]).info.status == "KILLED"
    assert client.get_run(ids["other"]).info.status == "RUNNING"  # another workspace's run may be alive
    assert mark_killed_runs() == 0
