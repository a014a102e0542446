"""One state for both engines: what `transfer run` builds is recorded in dvc.lock, and what DVC built is reused.

In a DVC project (a `.dvc/` folder and a `dvc.yaml` beside the params), after each stage of the flow the stage's
outputs are committed the way `dvc commit` does (lock entry and DVC cache), so `dvc status`, `dvc repro` and
`dvc push` see them; and a stage whose DVC lock entry is up to date is not run again by the flow. Runs with
`-S` overrides or another params file are not recorded: dvc.lock describes params.yaml.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from pathlib import Path
from typing import Iterator

__all__ = ["is_dvc_project", "up_to_date", "commit"]


def is_dvc_project(root: Path) -> bool:
    return (root / ".dvc").is_dir() and (root / "dvc.yaml").is_file()


@contextlib.contextmanager
def _repo(root: Path) -> Iterator[object]:
    from dvc.repo import Repo

    logging.getLogger("dvc").setLevel(logging.WARNING)  # DVC's progress and info lines are not ours to print
    with Repo(str(root)) as repo:
        yield repo


def _stages(repo) -> set[str]:
    return {s.name for s in repo.index.stages if getattr(s, "name", None)}


def up_to_date(root: Path, stage: str) -> bool:
    """True when dvc.lock records `stage` and its deps, params and outs all match the workspace."""
    if not is_dvc_project(root):
        return False
    with _repo(root) as repo:
        if stage not in _stages(repo) or not (root / "dvc.lock").is_file():
            return False
        return repo.status(targets=[stage]) == {}


def commit(root: Path, stage: str) -> bool:
    """Record `stage`'s current deps, params and outs in dvc.lock and the DVC cache; False if not a DVC stage or
    if DVC could not (a lock held by a running `dvc` command): the stage's outputs stand, and it is warned."""
    if not is_dvc_project(root):
        return False
    try:
        with _repo(root) as repo:
            if stage not in _stages(repo):
                return False
            repo.commit(stage, force=True)
    except Exception as e:  # noqa: BLE001  DVC's own errors; the work is done, only the record is missing
        warnings.warn(f"{stage}: not recorded in dvc.lock ({type(e).__name__}: {e}); `dvc commit {stage}` records it")
        return False
    return True
