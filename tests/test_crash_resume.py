"""SIGKILL `transfer run` at seeded random moments; every rerun resumes, and the result equals an uninterrupted run."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import make_workspace

pytestmark = pytest.mark.slow
TRANSFER = str(Path(sys.executable).parent / "transfer")
# smaller still than TINY, with frequent checkpoints so kills land mid-stage and mid-write
FAST = ["pretrain.max_tokens=8000", "finetune_lm.max_tokens=6000", "pretrain.checkpoint_every=3",
        "finetune_lm.checkpoint_every=3", "classifier.checkpoint_every=3", "model.directions=[fwd]",
        'evaluate.variants=["tfidf", "ulmfit_fwd"]']


def _env(ws: Path, api: str | None = None) -> dict:
    """A workspace's own Prefect home and MLflow store; `api`: a running Prefect server (else a temporary one)."""
    return {**os.environ, "PREFECT_HOME": str(ws / ".prefect-home"), **({"PREFECT_API_URL": api} if api else {}),
            "MLFLOW_TRACKING_URI": f"sqlite:///{ws / 'mlflow.db'}", "PYTHONUNBUFFERED": "1"}


def _pipeline_running(ws: Path, since: float) -> bool:
    """Whether a pipeline run begun after `since` (epoch s) is open in MLflow: from then on the stages run.
    (Runs an earlier kill left RUNNING are older; the new process marks them KILLED.)"""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{ws / 'mlflow.db'}?mode=ro", uri=True, timeout=1)) as db:
            return db.execute("select count(*) from runs where status = 'RUNNING' and start_time >= ?",
                              (int(since * 1000),)).fetchone()[0] > 0
    except sqlite3.Error:  # not created yet, or mid-migration
        return False


def _run(ws: Path, api: str, kill_after: float | None = None) -> tuple[int | None, float]:
    """`transfer run --no-promote` in ws; SIGKILL its whole process group `kill_after` s after its pipeline run
    began. -> (exit code, None if killed; seconds from the pipeline run's start to the exit or kill)."""
    log, started = open(ws / "run.log", "ab"), time.time()
    proc = subprocess.Popen([TRANSFER, "run", "--no-promote"], cwd=ws, env=_env(ws, api), stdout=log, stderr=log,
                            start_new_session=True)
    try:
        began = None
        deadline = time.monotonic() + 900
        while proc.poll() is None and time.monotonic() < deadline:
            if began is None and _pipeline_running(ws, started):
                began = time.monotonic()
            if began is not None and kill_after is not None and time.monotonic() - began >= kill_after:
                os.killpg(proc.pid, signal.SIGKILL)  # the run and any process it started
                proc.wait()
                return None, time.monotonic() - began
            time.sleep(0.05)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            raise TimeoutError((ws / "run.log").read_text()[-3000:])
        return proc.returncode, time.monotonic() - (began or time.monotonic())
    finally:
        log.close()


def _variants(ws: Path) -> dict:
    return json.loads((ws / "artifacts" / "evaluate" / "report.json").read_text())["variants"]


def test_runs_killed_at_random_moments_resume_to_the_uninterrupted_result(tmp_path, prefect_api):
    straight = make_workspace(tmp_path / "straight", FAST)
    code, full = _run(straight, prefect_api)
    assert code == 0, (straight / "run.log").read_text()[-3000:]

    ws = make_workspace(tmp_path / "killed", FAST)
    rng = random.Random(7)
    kills = 0
    while kills < 6:
        # every kill lands while the pipeline's MLflow run is open, in a stage or between two
        code, _ = _run(ws, prefect_api, kill_after=rng.uniform(0.0, full * 0.9))
        if code is None:
            kills += 1
        else:  # finished before the kill: start over so that later kills land in training stages too
            assert code == 0, (ws / "run.log").read_text()[-3000:]
            for stage in ("pretrain", "finetune_lm", "train_classifier"):
                for f in (ws / "artifacts" / stage).glob("*"):
                    shutil.rmtree(f) if f.is_dir() else f.unlink()  # the classifier bundle is a folder
            (ws / "metrics" / "evaluate.json").unlink()
        for ck in ws.glob("artifacts/*/checkpoint-*.pt"):  # a kill mid-write leaves the old checkpoint whole
            torch.load(ck, weights_only=True)
    assert _run(ws, prefect_api)[0] == 0, (ws / "run.log").read_text()[-3000:]
    assert _variants(ws) == _variants(straight)
    # the MLflow runs the kills left RUNNING were marked KILLED when the next run started
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{ws / 'mlflow.db'}")
    statuses = [r.info.status for r in client.search_runs([e.experiment_id for e in client.search_experiments()])]
    assert "RUNNING" not in statuses and statuses.count("KILLED") >= 1, statuses
    for stage in ("pretrain", "finetune_lm"):
        a = torch.load(straight / "artifacts" / stage / "lm-fwd.pt", weights_only=True)
        b = torch.load(ws / "artifacts" / stage / "lm-fwd.pt", weights_only=True)
        assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a), stage
