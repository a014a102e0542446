"""The pipeline's stages, one module each, every one a `Stage` record (record.py) beside its body.

`transfer stage NAME` and `dvc repro` (dvc.yaml is generated from the records: `transfer dvc-yaml`) and the
Prefect tasks (tasks/pipeline.py) all run `run_stage`. Every stage reads its inputs from, and writes its outputs
to, fixed paths of a `Workspace`; outputs are written atomically, the metrics file last.
"""

from __future__ import annotations

from pathlib import Path

from transfer.config import Params
from transfer.errors import TransferError
from transfer.launch import DISTRIBUTED_STAGES, Launch, launch_stage
from transfer.stages import evaluate, finetune_lm, prepare, pretrain, tokenize, train_classifier
from transfer.stages.record import Stage
from transfer.stages.workspace import Workspace

__all__ = ["STAGES", "Stage", "Workspace", "Launch", "run_stage", "stage_params", "stage_inputs"]

STAGES: dict[str, Stage] = {m.STAGE.name: m.STAGE for m in (prepare, tokenize, pretrain, finetune_lm,
                                                              train_classifier, evaluate)}


def _stage(name: str) -> Stage:
    if name not in STAGES:
        raise TransferError(f"unknown stage {name!r}; stages are {', '.join(STAGES)}")
    return STAGES[name]


def stage_params(p: Params, stage: str) -> dict:
    """The params a stage's output depends on (its cache key, and dvc.yaml's `params:`)."""
    return _stage(stage).params(p)


def stage_inputs(p: Params, stage: str, ws: Workspace | None = None) -> list[Path]:
    """Files and folders whose content a stage's output depends on (besides params and code)."""
    return _stage(stage).deps(p, ws or Workspace())


def run_stage(name: str, p: Params, ws: Workspace | None = None, launch: Launch | None = None) -> dict:
    """Run a stage in this process, or (`launch` with several processes, a training stage) as a data-parallel
    job of worker processes (transfer/launch.py)."""
    stage, ws = _stage(name), ws or Workspace()
    for stale in ws.art(name).glob(".*.tmp-*"):  # left by a killed write; the workspace lock makes them dead
        stale.unlink()
    if launch is not None and launch.distributed and name in DISTRIBUTED_STAGES:
        return launch_stage(name, p, ws.root, launch)
    return stage.run(p, ws)
