"""SIGKILL `transfer run` at seeded random moments; every rerun resumes, and the result equals an uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
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


def _env(ws: Path) -> dict:
    return {**os.environ, "PREFECT_HOME": str(ws / ".prefect-home"), "MLFLOW_TRACKING_URI": f"sqlite:///{ws / 'mlflow.db'}",
            "PYTHONUNBUFFERED": "1"}


def _run(ws: Path, kill_after: float | None = None) -> int | None:
    """`transfer run --no-promote` in ws; SIGKILL its whole process group after `kill_after` s. -> exit code, None if killed."""
    log = open(ws / "run.log", "ab")
    proc = subprocess.Popen([TRANSFER, "run", "--no-promote"], cwd=ws, env=_env(ws), stdout=log, stderr=log,
                            start_new_session=True)
    try:
        proc.wait(timeout=kill_after if kill_after is not None else 900)
        return proc.returncode
    except subprocess.TimeoutExpired:
        if kill_after is None:
            raise
        os.killpg(proc.pid, signal.SIGKILL)  # the run and its temporary Prefect server die together
        proc.wait()
        return None
    finally:
        log.close()


def _variants(ws: Path) -> dict:
    return json.loads((ws / "artifacts" / "evaluate" / "report.json").read_text())["variants"]


def test_runs_killed_at_random_moments_resume_to_the_uninterrupted_result(tmp_path):
    straight = make_workspace(tmp_path / "straight", FAST)
    t0 = time.perf_counter()
    assert _run(straight) == 0
    full = time.perf_counter() - t0

    ws = make_workspace(tmp_path / "killed", FAST)
    rng = random.Random(7)
    kills = 0
    while kills < 10:
        code = _run(ws, kill_after=rng.uniform(3.0, max(6.0, full * 0.8)))
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
    assert _run(ws) == 0, (ws / "run.log").read_text()[-3000:]
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
