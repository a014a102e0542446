"""A cell: one label budget x seed, trained and evaluated in its own cell workspace that links the shared LMs.

The benchmark (every dataset of a suite) and the sample-efficiency sweep (one workspace) both run their cells
here, one after another or as tasks on a Dask cluster (flows/scale.py): a cell writes only under its own folder,
so cells run at once.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import NamedTuple

import torch
from prefect import task

from tasks.pipeline import transient_only
from transfer.config import Params
from transfer.errors import TransferError
from transfer.stages import Workspace, run_stage

__all__ = ["LM_PARTS", "DOMAIN_PARTS", "CellResult", "link_parts", "cell_task", "run_cell", "failure_reason"]

LM_PARTS = (("artifacts", "tokenize"), ("artifacts", "pretrain"), ("metrics", "tokenize.json"),
            ("metrics", "pretrain.json"))
DOMAIN_PARTS = (("artifacts", "finetune_lm"), ("metrics", "finetune_lm.json"))


class CellResult(NamedTuple):
    prep: dict  # prepare's metrics
    evaluation: dict  # evaluate's metrics
    classifier_s: float
    cell_s: float
    threads: int  # torch threads the classifiers trained on: rows agree to the digit only at the same count


def _link(src: Path, dst: Path) -> None:
    """dst -> src (a symlink), replacing an older link; a real file or folder at dst is an error."""
    if not src.exists():
        raise TransferError(f"{src}: missing; the general or domain LM it belongs to is not built")
    if dst.is_symlink():
        if dst.resolve() == src.resolve():
            return
        dst.unlink()
    elif dst.exists():
        raise TransferError(f"{dst}: exists and is not a link to {src}; remove it or use another --out")
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.symlink_to(src.resolve(), target_is_directory=src.is_dir())


def link_parts(src_root: Path, dst_root: Path, parts: tuple[tuple[str, str], ...]) -> None:
    for part in parts:
        _link(src_root.joinpath(*part), dst_root.joinpath(*part))


@task(retries=1, retry_delay_seconds=2, retry_condition_fn=transient_only)
def cell_task(p: Params, ws: Path, dataset_ws: Path, cwd: str, threads: int | None = None) -> CellResult:
    """A cell as a task: on a Dask worker (one task per process) it reads the params' relative data paths from
    `cwd`, as the flow does, and trains on `threads` torch threads (its share of the cores). A cell whose worker
    dies is run again by Dask on another; it resumes from its own checkpoints."""
    if threads:
        torch.set_num_threads(threads)
    with contextlib.chdir(cwd):
        return run_cell(p, ws, dataset_ws)


def run_cell(p: Params, ws: Path, dataset_ws: Path) -> CellResult:
    """One budget x seed: its own prepared rows, classifiers and evaluation. It reads the shared general and
    domain LMs through links and writes only under `ws`."""
    started = time.perf_counter()
    paths = Workspace(ws)
    link_parts(dataset_ws, ws, LM_PARTS + DOMAIN_PARTS)
    prep = run_stage("prepare", p, paths)
    t0 = time.perf_counter()
    classifier = run_stage("train_classifier", p, paths)
    classifier_s = time.perf_counter() - t0
    evaluation = run_stage("evaluate", p, paths)
    for ckpt in paths.art("train_classifier").glob("checkpoint-*.pt"):  # the bundle stays; ~50 MB each
        ckpt.unlink()
    threads = max((m["torch_threads"] for m in classifier.values() if isinstance(m, dict) and "torch_threads" in m),
                  default=0)
    return CellResult(prep, evaluation, classifier_s, time.perf_counter() - started, threads)


def failure_reason(state) -> str:
    try:
        state.result()
    except Exception as e:  # noqa: BLE001  the cell's own error, whatever it was
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return state.name
