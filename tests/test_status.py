"""`transfer status`: each stage's state, and how far an unfinished training run is, read from the workspace."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest
from filelock import FileLock

from tests.test_crash_resume import FAST, TRANSFER
from tests.test_crash_resume import _env as _run_env
from tests.test_train import _lm_run
from tests.conftest import make_workspace
from transfer.config import load_params
from transfer.stages import run_stage
from transfer.status import checkpoint_progress, describe_sweep, format_duration, workspace_status
from transfer.train import load_checkpoint, save_checkpoint


def _env(ws):
    return {**_run_env(ws), "COLUMNS": "200"}  # rich wraps the table at 80 columns without a terminal


def test_an_interrupted_run_reports_the_steps_it_will_reach_and_a_finished_one_reaches_them(tmp_path):
    _lm_run(tmp_path, stop_after=25, name="checkpoint-fwd.pt")  # checkpoints every 7 steps: the last at 21
    part = checkpoint_progress(tmp_path / "checkpoint-fwd.pt")
    _lm_run(tmp_path, name="checkpoint-fwd.pt")  # resumes and finishes
    done = checkpoint_progress(tmp_path / "checkpoint-fwd.pt")
    assert not part["finished"] and done["finished"]
    assert part["step"] == 21 and part["total_epochs"] == done["total_epochs"] == 2
    assert part["total_steps"] == done["step"] == done["total_steps"], "the promised total is the steps trained"
    assert 0 < part["train_s"] < done["train_s"]
    # ETA: the remaining steps at the seconds a step measured so far
    assert part["eta_s"] == pytest.approx((part["total_steps"] - 21) * part["train_s"] / 21)
    assert done["eta_s"] is None and "valid_ppl" in done["last_epoch"]


def test_workspace_status_follows_the_stages(workspace, tmp_path):
    p = load_params("params.yaml")
    assert {s["state"] for s in workspace_status()} == {"not started"}
    for stage in ("prepare", "tokenize", "pretrain"):
        run_stage(stage, p)
    status = {s["stage"]: s for s in workspace_status()}
    assert [status[s]["state"] for s in ("prepare", "tokenize", "pretrain", "finetune_lm")] == \
        ["done", "done", "done", "not started"]
    ppl = json.loads((workspace / "metrics" / "pretrain.json").read_text())["fwd"]["valid_ppl"]
    assert f"fwd valid ppl {ppl:.1f}" in status["pretrain"]["summary"]
    assert "vocab 200" in status["tokenize"]["summary"]
    # an unfinished checkpoint in a stage's folder: the stage is training (now, or on the next run)
    _lm_run(tmp_path, stop_after=10, name="ck.pt")
    (workspace / "artifacts" / "finetune_lm").mkdir()
    shutil.copy(tmp_path / "ck.pt", workspace / "artifacts" / "finetune_lm" / "checkpoint-fwd.pt")
    status = {s["stage"]: s for s in workspace_status()}
    assert status["finetune_lm"]["state"] == "training"
    assert [(c["name"], c["step"]) for c in status["finetune_lm"]["checkpoints"]] == [("fwd", 7)]


def test_checkpoints_older_than_a_rerunning_stages_metrics_are_the_earlier_runs(tmp_path):
    """A sweep's next cell: round 1 trains again beside the previous cell's finished rounds and metrics."""
    _lm_run(tmp_path, stop_after=10, name="part.pt")
    _lm_run(tmp_path, name="done.pt")
    clas = tmp_path / "ws" / "artifacts" / "train_classifier"
    clas.mkdir(parents=True)
    (tmp_path / "ws" / "metrics").mkdir()
    metrics = tmp_path / "ws" / "metrics" / "train_classifier.json"
    metrics.write_text(json.dumps({"fwd": {"valid_accuracy": 0.9}}))
    os.utime(metrics, (time.time() - 60,) * 2)  # clear of the file clock's granularity
    for name in ("round1", "round2"):
        shutil.copy(tmp_path / "done.pt", clas / f"checkpoint-fwd-{name}.pt")
        os.utime(clas / f"checkpoint-fwd-{name}.pt", (time.time() - 120,) * 2)

    def train_classifier():
        return next(s for s in workspace_status(tmp_path / "ws") if s["stage"] == "train_classifier")

    ended = train_classifier()
    assert ended["state"] == "done", "a run's checkpoints are all older than the metrics it wrote after them"
    assert not any(c["earlier_run"] for c in ended["checkpoints"])
    shutil.copy(tmp_path / "part.pt", clas / "checkpoint-fwd-round1.pt")  # the new run's round 1, mid-training
    running = train_classifier()
    assert running["state"] == "training"
    assert [(c["name"], c["earlier_run"]) for c in running["checkpoints"]] == \
        [("fwd-round1", False), ("fwd-round2", True)]
    shutil.copy(tmp_path / "done.pt", clas / "checkpoint-fwd-round1.pt")  # between rounds: finished, no new metrics
    assert train_classifier()["state"] == "training", "a finished round newer than the metrics is this run's"
    # A restored copy (`dvc pull`): every checkpoint newer than the metrics, all finished
    shutil.copy(tmp_path / "done.pt", clas / "checkpoint-fwd-round2.pt")
    restored = train_classifier()
    assert restored["state"] == "done" and not any(c["earlier_run"] for c in restored["checkpoints"])


def test_status_cli_tells_training_progress_and_whether_a_process_holds_the_lock(tmp_path):
    ws = make_workspace(tmp_path / "ws", FAST)
    out = subprocess.run([TRANSFER, "status"], cwd=ws, env=_env(ws), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "not started" in out.stdout and not (ws / ".transfer.lock").exists(), "status creates no lock file"
    _lm_run(tmp_path, stop_after=25, name="ck.pt")
    (ws / "artifacts" / "pretrain").mkdir(parents=True)
    shutil.copy(tmp_path / "ck.pt", ws / "artifacts" / "pretrain" / "checkpoint-fwd.pt")
    # What a reader can catch between fit's last-epoch checkpoint and its finished one: every epoch done.
    _lm_run(tmp_path, name="done.pt")
    ck = load_checkpoint(tmp_path / "done.pt")
    (ws / "artifacts" / "finetune_lm").mkdir()
    save_checkpoint(ws / "artifacts" / "finetune_lm" / "checkpoint-fwd.pt", {**ck, "finished": False})
    # A stage between runs of its members (self-training rounds): checkpoints all finished, no new metrics yet.
    # It runs again (a sweep's next cell): newer than the metrics of the previous cell, beside a round of that
    # cell's older than them.
    (ws / "metrics").mkdir()
    (ws / "metrics" / "train_classifier.json").write_text(json.dumps({"fwd": {"valid_accuracy": 0.9}}))
    os.utime(ws / "metrics" / "train_classifier.json", (time.time() - 60,) * 2)
    (ws / "artifacts" / "train_classifier").mkdir()
    shutil.copy(tmp_path / "done.pt", ws / "artifacts" / "train_classifier" / "checkpoint-fwd.pt")
    shutil.copy(tmp_path / "done.pt", ws / "artifacts" / "train_classifier" / "checkpoint-fwd-round2.pt")
    os.utime(ws / "artifacts" / "train_classifier" / "checkpoint-fwd-round2.pt", (1, 1))
    # The previous sweep cell's evaluation, and a sweep in its fifth cell of six
    (ws / "metrics" / "evaluate.json").write_text(json.dumps({"tfidf": 0.875}))
    (ws / "metrics" / "sample_efficiency_progress.json").write_text(json.dumps(dict(
        cells=[["100", s] for s in (0, 1, 2)] + [["500", s] for s in (0, 1, 2)], kept=[["100", 0]],
        done=[dict(budget=b, seed=s, seconds=600.0) for b, s in (("100", 1), ("100", 2), ("500", 0))],
        current=["500", 1], current_started=time.time(), started=time.time() - 1800, finished=None)))
    with FileLock(ws / ".transfer.lock"):  # as a running `transfer run` holds it
        out = subprocess.run([TRANSFER, "status", "--json"], cwd=ws, env=_env(ws), capture_output=True, text=True,
                             timeout=120)
        table = subprocess.run([TRANSFER, "status"], cwd=ws, env=_env(ws), capture_output=True, text=True,
                               timeout=120)
    report = json.loads(out.stdout)
    assert report["lock_held"] is True
    pretrain = next(s for s in report["stages"] if s["stage"] == "pretrain")
    assert pretrain["state"] == "training" and pretrain["checkpoints"][0]["step"] == 21
    assert "step 21/" in table.stdout and "to go" in table.stdout and "is running" in table.stderr
    assert ck["position"]["global_epoch"] == ck["total_epochs"] == 2
    assert "epoch 2/2" in table.stdout and "epoch 3/2" not in table.stdout
    clas = next(s for s in report["stages"] if s["stage"] == "train_classifier")
    assert clas["state"] == "training" and "finished: fwd" in table.stdout
    assert "finished: fwd-round2" not in table.stdout
    assert "from the earlier run, replaced as this one reaches them: fwd-round2" in table.stdout
    evaluate = next(s for s in report["stages"] if s["stage"] == "evaluate")
    assert evaluate["state"] == "waiting", "metrics after a training stage are an earlier run's"
    assert "earlier run: tfidf 12.50% test error" in table.stdout
    assert report["sweep"]["current"] == ["500", 1]
    assert "4 of 6 cells done (1 kept from the CSV); budget 500 seed 1 running" in table.stdout


def _sweep(**kw):
    return dict(cells=[["100", s] for s in (0, 1, 2)] + [["500", s] for s in (0, 1, 2)], kept=[["100", 0]],
                done=[dict(budget="100", seed=1, seconds=600.0), dict(budget="100", seed=2, seconds=660.0)],
                current=["500", 0], current_started=1000.0, started=0.0, finished=None) | kw


def test_describe_sweep_counts_cells_and_estimates_time_left_from_the_cells_this_run_finished():
    # 3 of 6 done; a cell takes 630 s here, the running one has had 300: 3 * 630 - 300 left
    line = describe_sweep(_sweep(), running=True, now=1300.0)
    assert line == ("sample-efficiency sweep: 3 of 6 cells done (1 kept from the CSV); budget 500 seed 0 running "
                    "for 5m00s; ~10m30s a cell, ~26m30s to go")
    # no cell finished by this run yet: no per-cell time to estimate from
    assert "to go" not in describe_sweep(_sweep(done=[]), running=True, now=1300.0)
    assert describe_sweep(_sweep(), running=False, now=1300.0).endswith(
        "interrupted at budget 500 seed 0: the same command with --resume runs the 3 missing cells")
    finished = describe_sweep(_sweep(current=None, finished=5000.0), running=False)
    assert "3 of 6 cells done" in finished and "finished" in finished and "interrupted" not in finished


@pytest.mark.parametrize("seconds, text", [(0.4, "0s"), (59, "59s"), (61, "1m01s"), (3600 * 5 + 60 * 7, "5h07m")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_an_unreadable_checkpoint_is_reported_and_the_other_stages_still_shown(tmp_path):
    ws = make_workspace(tmp_path / "ws")
    (ws / "metrics").mkdir()
    (ws / "metrics" / "prepare.json").write_text(json.dumps(dict(classes=["a", "b"], n_train=9, n_valid=1, n_test=2)))
    (ws / "artifacts" / "pretrain").mkdir(parents=True)
    (ws / "artifacts" / "pretrain" / "checkpoint-fwd.pt").write_bytes(b"not a checkpoint")
    stages = {s["stage"]: s for s in workspace_status(ws)}
    assert stages["prepare"]["state"] == "done" and "9 train" in stages["prepare"]["summary"]
    (bad,) = stages["pretrain"]["checkpoints"]
    assert "checkpoint-fwd.pt" in bad["unreadable"] and stages["pretrain"]["state"] != "training"
    out = subprocess.run([TRANSFER, "status"], cwd=ws, env=_env(ws), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "unreadable checkpoint" in out.stdout and "finetune_lm" in out.stdout
