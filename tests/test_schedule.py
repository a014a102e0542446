"""End to end: a real Prefect server, `transfer schedule` serving the cron deployment, and one triggered run.

Processes are started in their own sessions and stopped by their process-group id (the id of the process we
started): terminate, then kill after a timeout.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_workspace

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent  # the venv's console scripts: transfer, prefect
CRON = "0 3 * * *"
READY_S = 120  # server start-up / deployment registration on a loaded 2-core machine
RUN_S = 480  # the tiny pipeline takes 1-3 minutes here, plus the runner's polling
# the conftest's tiny params, cut further: one direction, one short epoch per stage
FAST = ["model.directions=[fwd]", "evaluate.variants=[ulmfit_fwd]", "pretrain.max_tokens=3000",
        "finetune_lm.max_tokens=2000", "finetune_lm.freeze_epochs=0", "classifier.unfreeze_epochs=[1]"]
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    """This environment without any Prefect/MLflow settings, the venv first on PATH, a private PREFECT_HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    home.mkdir(parents=True, exist_ok=True)
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", PREFECT_HOME=str(home), OMP_NUM_THREADS="1",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_ENABLED="false", PYTHONUNBUFFERED="1", **extra)
    return env


def start(cmd: list[str], env: dict, cwd: Path, log: Path) -> subprocess.Popen:
    """Start `cmd` in a new session (its own process group), output to `log`."""
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM the process group we started (its id is proc.pid), SIGKILL it after `timeout` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout)
            if sig == signal.SIGTERM:  # the leader is gone; make sure no child (a flow-run process) outlives it
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return
        except subprocess.TimeoutExpired:
            continue


def tail(log: Path, n: int = 3000) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else ""


def poll(what: str, fn, timeout: float, procs: dict[str, tuple[subprocess.Popen, Path]], every: float = 2):
    """Call `fn` until it returns something truthy; fail if `timeout` passes or a watched process exits."""
    deadline = time.monotonic() + timeout
    while True:
        for name, (proc, log) in procs.items():
            if proc.poll() is not None:
                pytest.fail(f"{name} exited with {proc.returncode} while waiting for {what}:\n{tail(log)}")
        try:
            result = fn()
        except httpx.HTTPError:
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {name}:\n{tail(log)}" for name, (_, log) in procs.items())
            pytest.fail(f"no {what} within {timeout:.0f}s\n{logs}")
        time.sleep(every)


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
        log = tmp_path / "server.log"
        procs["prefect server"] = (start([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1",
                                          "--port", str(port)], env, tmp_path, log), log)
        poll("healthy Prefect server", lambda: httpx.get(f"{api}/health", timeout=5).status_code == 200,
             READY_S, procs, every=1)

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
