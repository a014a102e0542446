"""Two `transfer` processes on one workspace: the second refuses, or queues with --lock-timeout; one champion."""

from __future__ import annotations

import subprocess
import time

import pytest
from filelock import FileLock
from mlflow import MlflowClient

from tests.conftest import make_workspace
from tests.test_crash_resume import FAST, TRANSFER, _env

pytestmark = pytest.mark.slow


def test_a_second_run_refuses_or_waits_for_the_workspace_lock(tmp_path, prefect_api):
    ws = make_workspace(tmp_path / "ws", FAST)
    env = _env(ws, prefect_api)
    first = subprocess.Popen([TRANSFER, "run"], cwd=ws, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.time() + 120
        while not (ws / "metrics").exists() and time.time() < deadline:  # the first run is past the lock
            time.sleep(0.5)
        refused = subprocess.run([TRANSFER, "run"], cwd=ws, env=_env(ws), capture_output=True, text=True, timeout=120)
        assert refused.returncode != 0
        assert ".transfer.lock" in refused.stderr and "Traceback" not in refused.stderr
        queued = subprocess.run([TRANSFER, "run", "--lock-timeout", "900"], cwd=ws, env=env, capture_output=True,
                                text=True, timeout=960)
        assert first.wait(timeout=60) == 0, first.stderr.read()
        assert queued.returncode == 0, queued.stderr
        assert queued.stdout.count("Cached") >= 6, "the queued run found every stage done"
    finally:
        first.kill()
    client = MlflowClient(tracking_uri=f"sqlite:///{ws / 'mlflow.db'}")
    model = client.get_registered_model("transfer-classifier")
    assert set(model.aliases) == {"champion", "challenger"}
    assert len(client.search_model_versions("name='transfer-classifier'")) == 1, "a cached rerun registers nothing"


def test_sample_efficiency_refuses_while_another_process_holds_the_workspace(tmp_path):
    ws = make_workspace(tmp_path / "ws", FAST)
    with FileLock(ws / ".transfer.lock"):
        out = subprocess.run([TRANSFER, "experiment", "sample-efficiency", "--budgets", "all", "--seeds", "0"],
                             cwd=ws, env=_env(ws), capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and ".transfer.lock" in out.stderr and "Traceback" not in out.stderr
    assert not (ws / "plots" / "sample_efficiency.csv").exists()
