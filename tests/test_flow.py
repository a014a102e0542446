"""The Prefect flow caches on content: unchanged reruns train nothing, a param reruns only what depends on it."""

from __future__ import annotations

import json
import os

import pytest
import torch
from mlflow import MlflowClient
from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings
from prefect.testing.utilities import prefect_test_harness

from flows.ulmfit import run_pipeline
from tasks.tracking import code_version
from tests.conftest import make_workspace

pytestmark = pytest.mark.slow
STAGES = ["prepare", "tokenize", "pretrain", "finetune_lm", "train_classifier", "evaluate"]


@pytest.fixture(scope="module")
def prefect_server():
    with temporary_settings({PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 180}):
        with prefect_test_harness(server_startup_timeout=180):
            yield


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, prefect_server):
    ws = make_workspace(tmp_path_factory.mktemp("flow") / "ws")
    old = os.getcwd()
    os.chdir(ws)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{ws / 'mlflow.db'}"
    try:
        yield ws, run_pipeline()
    finally:
        os.chdir(old)
        os.environ.pop("MLFLOW_TRACKING_URI", None)


def states(summary: dict) -> dict[str, str]:
    return {s: v["state"] for s, v in summary["stages"].items()}


def test_first_run_completes_every_stage_and_registers_a_champion(first_run):
    ws, summary = first_run
    assert states(summary) == {s: "Completed" for s in STAGES}
    assert summary["run_name"].startswith("train-awd16x32-v200-fwd+bwd")
    evaluation = json.loads((ws / "metrics" / "evaluate.json").read_text())
    assert set(evaluation) == {"tfidf", "ulmfit_fwd", "ulmfit_bwd", "ulmfit_ensemble", "ulmfit+tfidf"}
    assert summary["promotion"]["promoted"] and summary["registered_version"] == "1"
    client = MlflowClient(tracking_uri=f"sqlite:///{ws / 'mlflow.db'}")
    assert client.get_registered_model("transfer-classifier").aliases["champion"] == 1
    parent = client.get_run(summary["mlflow_run_id"])
    children = client.search_runs([parent.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert {r.data.tags["stage"] for r in children} >= set(STAGES) | {"register"}
    pretrain = next(r for r in children if r.data.tags["stage"] == "pretrain")
    assert "fwd.valid_ppl" in pretrain.data.metrics and pretrain.data.params["pretrain.bptt"] == "20"


def test_an_unchanged_rerun_is_fully_cached(first_run):
    ws, _ = first_run
    summary = run_pipeline(promote=False)
    assert states(summary) == {s: "Cached" for s in STAGES}


def test_a_classifier_param_reruns_only_the_classifier_and_evaluation(first_run):
    summary = run_pipeline(overrides=["classifier.lr=0.03"], promote=False)
    assert states(summary) == {**{s: "Cached" for s in STAGES[:4]},
                               "train_classifier": "Completed", "evaluate": "Completed"}


def test_a_deleted_artifact_is_recomputed_not_loaded(first_run):
    ws, _ = first_run
    lm = ws / "artifacts" / "pretrain" / "lm-bwd.pt"
    before = lm.read_bytes()
    lm.unlink()
    summary = run_pipeline(promote=False)
    assert states(summary)["pretrain"] == "Completed"
    assert lm.read_bytes() == before, "deterministic on CPU: the recomputed LM is bit-identical"
    # identical bytes downstream, so the later stages are cache hits again
    assert states(summary)["finetune_lm"] == "Cached"


def test_sample_efficiency_reuses_the_cached_lms_and_writes_curve(first_run):
    from flows.experiments import run_sample_efficiency

    ws, _ = first_run
    rows = run_sample_efficiency(["40", "all"], [0, 1])
    assert {(r["budget"], r["seed"]) for r in rows} == {("40", 0), ("40", 1), ("all", 0), ("all", 1)}
    assert {r["variant"] for r in rows} == {"tfidf", "ulmfit_fwd", "ulmfit_bwd", "ulmfit_ensemble", "ulmfit+tfidf"}
    assert all(r["n_labels"] == 40 for r in rows if r["budget"] == "40")
    assert all(r["lm_texts"] == "train" for r in rows), "no test text tunes the LM unless the flag says so"
    assert all(r["lm_cache"] == "tokenize=Cached,pretrain=Cached,finetune_lm=Cached" for r in rows), \
        "label budgets never retrain the tokenizer or the language models"
    assert (ws / "plots" / "sample_efficiency.png").read_bytes()[:4] == b"\x89PNG"
    assert len((ws / "plots" / "sample_efficiency.csv").read_text().splitlines()) == 1 + len(rows)
    progress = json.loads((ws / "metrics" / "sample_efficiency_progress.json").read_text())
    assert [(c["budget"], c["seed"]) for c in progress["done"]] == [("40", 0), ("40", 1), ("all", 0), ("all", 1)]
    assert progress["kept"] == [] and progress["current"] is None and progress["finished"] >= progress["started"]


def test_sample_efficiency_resume_keeps_matching_cells_and_reruns_stale_ones(first_run):
    import csv

    from flows.experiments import run_sample_efficiency

    ws, _ = first_run
    path = ws / "plots" / "sample_efficiency.csv"
    if not path.exists():  # run on its own: make the earlier sweep's CSV
        run_sample_efficiency(["40", "all"], [0, 1])
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    # mark two cells so the resumed CSV shows what happened to each: (40, 0) keeps its digest, (40, 1) does not;
    # and drop the threads and commit columns, as a CSV written before them had none
    for r in rows:
        del r["threads"], r["commit"]
        if r["budget"] == "40":
            r["error"] = "0.987"
            if r["seed"] == "1":
                r["params_digest"] = "stale"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)

    resumed = run_sample_efficiency(["40"], [0, 1], resume=True)
    cells = {(r["budget"], r["seed"]): r["error"] for r in resumed}
    assert set(cells) == {("40", 0), ("40", 1), ("all", 0), ("all", 1)}, "other budgets' matching rows are kept"
    assert cells["40", 0] == 0.987, "a cell with the same params and data is not rerun"
    assert cells["40", 1] != 0.987, "a cell whose params digest changed is rerun"
    assert len(path.read_text().splitlines()) == 1 + len(resumed)
    with open(path, newline="") as f:
        now = {(r["budget"], r["seed"]): r for r in csv.DictReader(f)}
    assert now["40", "0"]["threads"] == "" and now["40", "1"]["threads"] == ("0" if torch.cuda.is_available() else "1")
    # a rerun row names the code that made it (the commit; "" outside git); a kept row from before the column
    # stays blank
    assert now["40", "0"]["commit"] == "" and now["40", "1"]["commit"].split("+")[0] == code_version().split("+")[0]
    progress = json.loads((ws / "metrics" / "sample_efficiency_progress.json").read_text())
    assert progress["kept"] == [["40", 0]] and [(c["budget"], c["seed"]) for c in progress["done"]] == [("40", 1)]

    # another param: no earlier cell matches, so nothing is kept
    fresh = run_sample_efficiency(["40"], [0], overrides=["classifier.lr=0.03"], resume=True)
    assert {(r["budget"], r["seed"]) for r in fresh} == {("40", 0)} and fresh[0]["error"] != 0.987
