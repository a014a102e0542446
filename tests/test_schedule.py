"""End to end: a real Prefect server, `transfer schedule` serving the cron deployment, and one triggered run.

Processes are started in their own sessions and stopped by their process-group id (the id of the process we
started): terminate, then kill after a timeout.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_workspace
from tests.processes import BIN, READY_S, clean_env, free_port, poll, start, start_server, stop, tail

pytestmark = pytest.mark.slow

CRON = "0 3 * * *"
RUN_S = 480  # the tiny pipeline takes 1-3 minutes here, plus the runner's polling
# the conftest's tiny params, cut further: one direction, one short epoch per stage
FAST = ["model.directions=[fwd]", "evaluate.variants=[ulmfit_fwd]", "pretrain.max_tokens=3000",
        "finetune_lm.max_tokens=2000", "finetune_lm.freeze_epochs=0", "classifier.unfreeze_epochs=[1]"]
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def test_schedule_without_server_fails_with_a_clear_message(tmp_path):
    env = clean_env(tmp_path / "prefect-home")
    r = subprocess.run([str(BIN / "transfer"), "schedule", "--cron", CRON], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=READY_S)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr + r.stdout
    assert "Prefect server" in r.stderr and "PREFECT_API_URL" in r.stderr, r.stderr


def test_scheduled_deployment_is_registered_and_a_triggered_run_completes(tmp_path):
    ws = make_workspace(tmp_path / "ws", FAST)
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = clean_env(tmp_path / "prefect-home", MLFLOW_TRACKING_URI=f"sqlite:///{ws / 'mlflow.db'}")
    client_env = {**env, "PREFECT_API_URL": api}
    procs: dict[str, tuple[subprocess.Popen, Path]] = {}
    try:
        start_server(tmp_path, env, port, procs)

        log = tmp_path / "schedule.log"
        procs["transfer schedule"] = (start([str(BIN / "transfer"), "schedule", "--cron", CRON], client_env, ws, log),
                                      log)

        def deployment():
            r = httpx.post(f"{api}/deployments/filter", timeout=10,
                           json={"flows": {"name": {"any_": ["ulmfit"]}},
                                 "deployments": {"name": {"any_": ["nightly"]}}})
            return next(iter(r.json()), None) if r.status_code == 200 else None

        dep = poll("deployment ulmfit/nightly", deployment, READY_S, procs)
        crons = [s["schedule"].get("cron") for s in dep["schedules"] if s.get("active")]
        assert crons == [CRON], dep["schedules"]
        assert not dep["paused"]

        r = subprocess.run([str(BIN / "prefect"), "deployment", "run", "ulmfit/nightly"], env=client_env, cwd=ws,
                           capture_output=True, text=True, timeout=READY_S)
        assert r.returncode == 0, r.stdout + r.stderr
        match = re.search(r"UUID: ([0-9a-f-]{36})", r.stdout)
        assert match, r.stdout
        run_id = match.group(1)

        def finished():
            run = httpx.get(f"{api}/flow_runs/{run_id}", timeout=10).json()
            return run if run.get("state_type") in TERMINAL else None

        run = poll("finished flow run", finished, RUN_S, procs, every=3)
        assert run["state_type"] == "COMPLETED", (run["state_name"], tail(procs["transfer schedule"][1]))
        assert run["name"].startswith("train-awd16x32"), run["name"]
        assert run["deployment_id"] == dep["id"]
        assert (ws / "mlflow.db").is_file()  # the run used the workspace it was served from
    finally:
        for proc, _ in reversed(procs.values()):  # the runner first, then the server it talks to
            stop(proc)


def test_a_work_pool_deployment_runs_on_a_prefect_worker_and_registers_a_model(tmp_path):
    """`transfer schedule --pool` creates the process pool and the deployment and returns; a real `prefect worker`
    picks up a triggered run, which trains in the workspace and registers a model version."""
    from mlflow import MlflowClient

    ws = make_workspace(tmp_path / "ws", FAST)
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = clean_env(tmp_path / "prefect-home", MLFLOW_TRACKING_URI=f"sqlite:///{ws / 'mlflow.db'}",
                    PREFECT_API_URL=api, PREFECT_WORKER_QUERY_SECONDS="2")
    procs: dict[str, tuple[subprocess.Popen, Path]] = {}
    try:
        start_server(tmp_path, env, port, procs)
        r = subprocess.run([str(BIN / "transfer"), "schedule", "--pool", "local", "--cron", CRON], env=env, cwd=ws,
                           capture_output=True, text=True, timeout=READY_S)
        assert r.returncode == 0, r.stdout + r.stderr
        pool = httpx.get(f"{api}/work_pools/local", timeout=10).json()
        assert pool["type"] == "process"

        log = tmp_path / "worker.log"
        procs["prefect worker"] = (start([str(BIN / "prefect"), "worker", "start", "--pool", "local"], env,
                                         tmp_path, log), log)
        r = subprocess.run([str(BIN / "prefect"), "deployment", "run", "ulmfit/nightly"], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=READY_S)
        assert r.returncode == 0, r.stdout + r.stderr
        run_id = re.search(r"UUID: ([0-9a-f-]{36})", r.stdout).group(1)

        def finished():
            run = httpx.get(f"{api}/flow_runs/{run_id}", timeout=10).json()
            return run if run.get("state_type") in TERMINAL else None

        run = poll("finished flow run", finished, RUN_S, procs, every=3)
        assert run["state_type"] == "COMPLETED", (run["state_name"], tail(procs["prefect worker"][1]))
        assert run["work_pool_name"] == "local"
        versions = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"]).search_model_versions()
        assert len(versions) == 1  # the run trained in the workspace and registered its classifier
    finally:
        for proc, _ in reversed(procs.values()):
            stop(proc)
