"""Where a workspace's pipeline stands: each stage done, part-trained (how far, how long to go) or not started.

Reads only `metrics/` and the training checkpoints, so it can watch a running pipeline, or tell how much of an
interrupted one the next run will resume rather than redo. A sample-efficiency sweep also writes
`metrics/sample_efficiency_progress.json`, from which `describe_sweep` tells which cell runs and how long is left.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from transfer.errors import TransferError
from transfer.io_utils import write_json
from transfer.train import load_checkpoint

__all__ = ["checkpoint_progress", "workspace_status", "SweepProgress", "sweep_progress", "describe_sweep",
           "format_duration"]

TRAINING_STAGES = ("pretrain", "finetune_lm", "train_classifier")


def checkpoint_progress(path: Path) -> dict:
    """Position of one training checkpoint: steps and epochs done (and in all), training seconds, ETA.

    The ETA is the remaining steps at the checkpoint's mean seconds a step (validation time not included);
    checkpoints written before `total_steps` was recorded report no total and no ETA.
    """
    ck = load_checkpoint(path, mmap=True)  # the weights and optimizer state stay on disk
    pos, history = ck["position"], ck["history"]
    train_s = sum(r["time_s"] for r in history)
    if not ck.get("finished") and pos["step_in_epoch"]:
        train_s += ck.get("epoch_acc", {}).get("seconds", 0.0)  # the epoch in progress
    step, total = pos["global_step"], ck.get("total_steps")
    eta = None
    if total is not None and not ck.get("finished") and step:
        eta = max(total - step, 0) * train_s / step
    last = history[-1] if history else {}
    return dict(name=path.stem.removeprefix("checkpoint-"), finished=bool(ck.get("finished")), step=step,
                total_steps=total, epochs_done=pos["global_epoch"], total_epochs=ck.get("total_epochs"),
                train_s=train_s, eta_s=eta,
                last_epoch={k: v for k, v in last.items() if k in ("train_loss", "valid_loss", "valid_ppl",
                                                                   "valid_accuracy")})


def _progress_or_problem(path: Path) -> dict:
    """`checkpoint_progress`, or the reason it cannot be read: one bad file must not hide the other stages."""
    try:
        return checkpoint_progress(path)
    except (TransferError, KeyError, TypeError, ValueError) as e:
        return dict(name=path.stem.removeprefix("checkpoint-"), finished=False, step=0, total_steps=None,
                    epochs_done=0, total_epochs=None, train_s=0.0, eta_s=None, last_epoch={},
                    unreadable=f"{path}: {e}" if not isinstance(e, TransferError) else str(e))


def _summary(stage: str, m: dict) -> str:
    """One line of what a finished stage reported."""
    if stage == "prepare":
        extra = f", {m['n_train_unlabelled']:,} unlabelled" if m.get("n_train_unlabelled") else ""
        return (f"{m['n_train']:,} train / {m['n_valid']:,} valid / {m['n_test']:,} test rows{extra}, "
                f"{len(m['classes'])} classes")
    if stage == "tokenize":
        return f"vocab {m['vocab_size']:,}, {m['general_tokens']:,} general-corpus tokens"
    if stage in ("pretrain", "finetune_lm"):
        return ", ".join(f"{d} valid ppl {r['valid_ppl']:.1f} ({format_duration(r['train_s'])})"
                         for d, r in m.items() if isinstance(r, dict) and "valid_ppl" in r)
    if stage == "train_classifier":
        return ", ".join(f"{d} valid acc {r['valid_accuracy']:.3f}"
                         for d, r in m.items() if isinstance(r, dict) and "valid_accuracy" in r)
    if stage == "evaluate":
        return ", ".join(f"{v} {100 * (1 - acc):.2f}%" for v, acc in m.items()) + " test error"
    return ""


def workspace_status(root: Path = Path(".")) -> list[dict]:
    """One entry per stage: state ('done', 'training', 'waiting', 'not started'), its summary and checkpoints.

    'training' means the stage has begun and not ended: a checkpoint is unfinished, or its checkpoints are all
    finished but it has written no metrics (e.g. between self-training rounds). The stage is running now, or the
    next run resumes it. A stage re-running after a params change is 'training' even though its old metrics
    file remains: some of its checkpoints are newer than that file, some not. Those no newer than the metrics are
    the earlier run's (`earlier_run`; in a sweep, the previous cell's rounds), which this run replaces as it
    reaches them. A stage after a training one is 'waiting': any metrics it has are from an earlier run (in a
    sweep, the previous cell's).
    """
    from transfer.stages import STAGES

    out: list[dict] = []
    for stage in STAGES:
        metrics_path = root / "metrics" / f"{stage}.json"
        ckpts = sorted((root / "artifacts" / stage).glob("checkpoint-*.pt")) if stage in TRAINING_STAGES else []
        runs = [_progress_or_problem(c) for c in ckpts]
        # A stage writes its metrics after its last checkpoint: checkpoints on both sides of them mean it runs
        # again. All of them newer is a restored copy (`dvc pull`, `dvc checkout`), not a new run.
        ended = metrics_path.stat().st_mtime_ns if metrics_path.exists() else None
        newer = [ended is not None and c.stat().st_mtime_ns > ended for c in ckpts]
        rerunning = any(newer) and not all(newer)
        for r, n in zip(runs, newer):
            r["earlier_run"] = rerunning and not n
        current = [r for r in runs if not r["earlier_run"] and not r.get("unreadable")]
        summary = ""
        if ended is not None:
            try:
                summary = _summary(stage, json.loads(metrics_path.read_text()))
            except (ValueError, KeyError, TypeError) as e:
                summary = f"unreadable {metrics_path} ({type(e).__name__}: {e})"
        if rerunning or any(not r["finished"] for r in current) or (current and ended is None):
            state = "training"
        elif any(o["state"] in ("training", "waiting") for o in out):
            state = "waiting"
        else:
            state = "done" if ended is not None else "not started"
        out.append(dict(stage=stage, state=state, summary=summary, checkpoints=runs))
    return out


class SweepProgress:
    """The sweep's progress file, `metrics/sample_efficiency_progress.json`: its layout is defined here only.

    {"cells": [[budget, seed], ...], "kept": [...], "done": [{"budget", "seed", "seconds"}], "current": [budget,
    seed] or null, "current_started", "started", "finished": unix seconds or null}. Written by the sweep
    (flows/experiments.py), read by `transfer status`.
    """

    def __init__(self, root: Path, plan: list[tuple[str, int]], kept: list[tuple[str, int]]):
        self.path = progress_path(root)
        self.state = dict(cells=plan, kept=kept, done=[], current=None, current_started=None, started=time.time(),
                          finished=None)
        write_json(self.path, self.state)

    def begin(self, budget: str, seed: int) -> None:
        write_json(self.path, {**self.state, "current": [budget, seed], "current_started": time.time()})

    def done(self, budget: str, seed: int, seconds: float) -> None:
        self.state["done"].append(dict(budget=budget, seed=seed, seconds=seconds))
        write_json(self.path, self.state)

    def finish(self) -> None:
        write_json(self.path, {**self.state, "finished": time.time()})


def progress_path(root: Path) -> Path:
    return root / "metrics" / "sample_efficiency_progress.json"


def sweep_progress(root: Path = Path(".")) -> dict | None:
    """The last sample-efficiency sweep's progress (`SweepProgress`), or None if there is none."""
    path = progress_path(root)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as e:
        return dict(error=f"unreadable {path} ({e})")


def describe_sweep(progress: dict, running: bool, now: float | None = None) -> str:
    """One line: cells done of planned, the cell running and for how long, and the time left at the mean
    wall time of the cells this invocation finished (cells kept from an earlier run took none)."""
    if "error" in progress:
        return progress["error"]
    now = time.time() if now is None else now
    total, kept, ran = len(progress["cells"]), len(progress["kept"]), progress["done"]
    n_done = kept + len(ran)
    head = f"sample-efficiency sweep: {n_done} of {total} cells done" + (f" ({kept} kept from the CSV)" if kept else "")
    if progress.get("finished"):
        return head + f", finished {time.strftime('%Y-%m-%d %H:%M', time.localtime(progress['finished']))}"
    current = progress.get("current")
    if not running:
        where = f" at budget {current[0]} seed {current[1]}" if current else ""
        return head + f"; interrupted{where}: the same command with --resume runs the {total - n_done} missing cells"
    parts = [head]
    elapsed = 0.0
    if current:
        elapsed = now - progress["current_started"]
        parts.append(f"budget {current[0]} seed {current[1]} running for {format_duration(elapsed)}")
    if ran:
        per_cell = sum(c["seconds"] for c in ran) / len(ran)
        left = max(per_cell * (total - n_done) - elapsed, 0.0)
        parts.append(f"~{format_duration(per_cell)} a cell, ~{format_duration(left)} to go")
    return "; ".join(parts)


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"
