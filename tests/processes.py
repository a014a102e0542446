"""Real processes for end-to-end tests: started in their own session, stopped by process group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

READY_S = 120  # server start-up / deployment registration on a loaded 2-core machine
BIN = Path(sys.executable).parent  # the venv's console scripts: transfer, mlflow, prefect, uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    """This environment without any Prefect/MLflow settings, the venv first on PATH, a private PREFECT_HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    home.mkdir(parents=True, exist_ok=True)
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", PREFECT_HOME=str(home), OMP_NUM_THREADS="1",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_ENABLED="false", PYTHONUNBUFFERED="1",
               **extra)
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
            if sig == signal.SIGTERM:  # the leader is gone; make sure no child outlives it
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


def start_server(tmp_path: Path, env: dict, port: int, procs: dict[str, tuple[subprocess.Popen, Path]]) -> str:
    """A real `prefect server` on 127.0.0.1:`port`, added to `procs`, once healthy; -> its API URL."""
    api = f"http://127.0.0.1:{port}/api"
    log = tmp_path / "server.log"
    procs["prefect server"] = (start([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1",
                                      "--port", str(port)], env, tmp_path, log), log)
    poll("healthy Prefect server", lambda: httpx.get(f"{api}/health", timeout=5).status_code == 200,
         READY_S, procs, every=1)
    return api
