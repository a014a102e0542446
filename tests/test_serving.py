"""End to end: `transfer run` in a tiny workspace, then the champion behind `mlflow models serve` and `transfer predict`.

Real processes throughout: each is started in its own session and stopped by its process-group id (the id of the
process we started), terminate first and kill after a timeout, so the uvicorn child that `mlflow models serve`
starts goes with it.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_workspace
from tests.processes import BIN, clean_env, free_port, start, stop, tail

pytestmark = pytest.mark.slow

CLASSES = {"business", "science", "sports", "world"}
STAGES = {"prepare", "tokenize", "pretrain", "finetune_lm", "train_classifier", "evaluate"}
MODEL = "transfer-classifier"
READY_S = 120  # server start-up on a loaded 2-core machine
RUN_S = 600  # the tiny pipeline takes 1-3 minutes here
# the conftest's tiny params, cut further: one direction, one short epoch per stage
FAST = ["model.directions=[fwd]", "evaluate.variants=[ulmfit_fwd]", "pretrain.max_tokens=3000",
        "finetune_lm.max_tokens=2000", "finetune_lm.freeze_epochs=0", "classifier.unfreeze_epochs=[1]"]
TEXTS = ["The striker scored twice as the team won the final.", "Shares fell after the bank cut its forecast."]


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = READY_S) -> None:
    """Poll GET `url` until it answers 200; fail at once if the process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{proc.args[:3]} exited with {proc.returncode} before {url} answered:\n{tail(log)}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"{url} did not answer within {timeout:.0f}s:\n{tail(log)}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    """A tiny workspace after one real `transfer run`: (workspace, env for processes that use its mlflow.db)."""
    ws = make_workspace(tmp_path_factory.mktemp("serve-ws"), FAST)
    env = clean_env(tmp_path_factory.mktemp("prefect-home"), MLFLOW_TRACKING_URI=f"sqlite:///{ws / 'mlflow.db'}")
    log = ws / "run.log"
    proc = start([str(BIN / "transfer"), "run"], env, ws, log)
    try:
        rc = proc.wait(timeout=RUN_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`transfer run` did not finish within {RUN_S}s:\n{tail(log)}")
    finally:
        stop(proc)
    assert rc == 0, f"`transfer run` failed ({rc}):\n{tail(log)}"
    return ws, env


@pytest.fixture(scope="module")
def server(trained, tmp_path_factory) -> str:
    """`mlflow models serve` on the champion, on a free loopback port; yields the base URL."""
    ws, env = trained
    port = free_port()
    log = tmp_path_factory.mktemp("serve-log") / "serve.log"
    proc = start([str(BIN / "mlflow"), "models", "serve", "-m", f"models:/{MODEL}@champion", "--env-manager", "local",
                  "-h", "127.0.0.1", "-p", str(port)], env, ws, log)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/ping", proc, log)
        yield url
    finally:
        stop(proc)


def test_run_is_logged_as_parent_and_stage_runs_and_champion_is_registered(trained):
    from mlflow import MlflowClient

    ws, env = trained
    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("transfer")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1, [r.info.run_name for r in parents]
    parent = parents[0]
    assert parent.info.run_name.startswith("train-awd16x32"), parent.info.run_name
    assert parent.info.status == "FINISHED"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    stages = {r.data.tags.get("stage") for r in children}
    assert STAGES <= stages, stages
    assert all(r.info.status == "FINISHED" for r in children)

    champion = client.get_model_version_by_alias(MODEL, "champion")
    assert champion.run_id in {r.info.run_id for r in children}  # the "register" stage run


def _check_predictions(body: dict, n: int) -> None:
    preds = body["predictions"]
    assert len(preds) == n
    for row in preds:
        probs = {k.removeprefix("prob_"): v for k, v in row.items() if k.startswith("prob_")}
        assert set(probs) == CLASSES
        assert row["label"] in CLASSES
        assert sum(probs.values()) == pytest.approx(1.0, abs=1e-4)
        assert row["probability"] == pytest.approx(probs[row["label"]])
        assert row["probability"] == pytest.approx(max(probs.values()))


GOOD = {
    "dataframe_split": {"dataframe_split": {"columns": ["text"], "data": [[t] for t in TEXTS]}},
    "dataframe_records": {"dataframe_records": [{"text": t} for t in TEXTS]},
    "inputs_columns": {"inputs": {"text": TEXTS}},
    "inputs_list": {"inputs": TEXTS},
    "instances": {"instances": [{"text": t} for t in TEXTS]},
}


@pytest.mark.parametrize("payload", GOOD.values(), ids=GOOD.keys())
def test_invocations_accepts_raw_text(server, payload):
    r = httpx.post(f"{server}/invocations", json=payload, timeout=60)
    assert r.status_code == 200, r.text
    _check_predictions(r.json(), len(TEXTS))


BAD = {  # (body bytes, content type)
    "missing_text_column": (json.dumps({"dataframe_split": {"columns": ["body"], "data": [["x"]]}}), "application/json"),
    "int_values": (json.dumps({"dataframe_split": {"columns": ["text"], "data": [[1], [2]]}}), "application/json"),
    "null_value": (json.dumps({"dataframe_records": [{"text": None}]}), "application/json"),
    "nested_list_value": (json.dumps({"dataframe_split": {"columns": ["text"], "data": [[["a"]]]}}), "application/json"),
    "empty_split": (json.dumps({"dataframe_split": {"columns": ["text"], "data": []}}), "application/json"),
    "empty_inputs": (json.dumps({"inputs": []}), "application/json"),
    "invalid_json": ('{"dataframe_split": {"columns": ["text"], ', "application/json"),
    "json_list": (json.dumps(TEXTS), "application/json"),
    "unknown_key": (json.dumps({"texts": TEXTS}), "application/json"),
    "wrong_content_type": ("hello", "text/plain"),
}


@pytest.mark.parametrize("body,content_type", BAD.values(), ids=BAD.keys())
def test_invocations_rejects_malformed_payloads_and_keeps_serving(server, body, content_type):
    r = httpx.post(f"{server}/invocations", content=body.encode(), headers={"Content-Type": content_type}, timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    good = httpx.post(f"{server}/invocations", json=GOOD["dataframe_split"], timeout=60)
    assert good.status_code == 200, good.text
    _check_predictions(good.json(), len(TEXTS))


def test_predict_cli_prints_label_and_probability(trained):
    ws, env = trained
    r = subprocess.run([str(BIN / "transfer"), "predict", *TEXTS], env=env, cwd=ws, capture_output=True, text=True,
                       timeout=RUN_S)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == len(TEXTS), r.stdout
    for line, text in zip(lines, TEXTS):
        label, prob, echoed = line.split("\t")
        assert label in CLASSES
        assert 0.25 <= float(prob) <= 1.0  # the top of 4 probabilities
        assert text.startswith(echoed)


def test_predict_cli_unknown_model_is_one_paragraph_error(trained):
    ws, env = trained
    r = subprocess.run([str(BIN / "transfer"), "predict", "--model", "models:/nope@champion", "x"], env=env, cwd=ws,
                       capture_output=True, text=True, timeout=RUN_S)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr + r.stdout
    error = r.stderr[r.stderr.index("error:"):].strip()  # warnings from imports may come first
    assert "models:/nope@champion" in error
    assert "\n\n" not in error, error


def test_the_registered_model_is_data_only_and_loads_through_the_installed_package(trained, monkeypatch):
    """Weights, tokenizer and meta.json, no code and no pickle: loading imports tasks.pyfunc_model instead."""
    import mlflow
    import yaml
    from mlflow import MlflowClient

    from tasks.pyfunc_model import load_model

    ws, env = trained
    monkeypatch.setenv("MLFLOW_TRACKING_URI", env["MLFLOW_TRACKING_URI"])
    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    version = client.get_model_version_by_alias(MODEL, "champion")
    local = Path(mlflow.artifacts.download_artifacts(version.source, dst_path=str(ws / "downloaded")))
    files = [f.relative_to(local) for f in local.rglob("*") if f.is_file()]
    assert any(f.name == "meta.json" for f in files) and any(f.name == "spm.model" for f in files), files
    code = [f for f in files if f.suffix in (".py", ".pyc", ".pkl", ".pickle", ".cloudpickle")]
    assert not code, code
    flavour = yaml.safe_load((local / "MLmodel").read_text())["flavors"]["python_function"]
    assert flavour["loader_module"] == "tasks.pyfunc_model" and not flavour.get("code")
    model, classes = load_model(f"models:/{MODEL}@champion")
    assert set(classes) == CLASSES
    assert set(model.predict(__import__("pandas").DataFrame({"text": TEXTS}))["label"]) <= CLASSES


def test_every_training_stage_logs_a_loadable_model_with_its_device(trained):
    """pretrain and finetune_lm log their LMs (state_dicts + tokenizer + architecture), train_classifier its
    bundle; each run says which device and precision trained it."""
    import json as _json

    import mlflow
    import torch
    from mlflow import MlflowClient

    from transfer.evaluate import Predictor
    from transfer.model import LanguageModel, lm_config

    ws, env = trained
    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("transfer").experiment_id], max_results=1000)
    by_stage = {r.data.tags.get("stage"): r for r in runs if r.data.tags.get("cache") == "miss"}
    for stage in ("pretrain", "finetune_lm"):
        run = by_stage[stage]
        assert run.data.tags["device"].startswith(("cpu: ", "cuda: ")) and run.data.tags["precision"] in ("fp32", "bf16")
        local = Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="model",
                                                         dst_path=str(ws / f"dl-{stage}")))
        arch = _json.loads((local / "architecture.json").read_text())
        model = LanguageModel(lm_config(arch["vocab_size"], 0.0, emb_size=arch["emb_size"],
                                        hidden_size=arch["hidden_size"], n_layers=arch["n_layers"]))
        model.load_state_dict(torch.load(local / "lm-fwd.pt", weights_only=True))
        assert (local / "spm.model").is_file()
    run = by_stage["train_classifier"]
    assert run.data.tags["device"].startswith(("cpu: ", "cuda: "))
    local = Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="model",
                                                     dst_path=str(ws / "dl-classifier")))
    assert Predictor.from_dir(local).predict_proba(TEXTS).shape == (len(TEXTS), len(CLASSES))
