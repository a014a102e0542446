"""Each pipeline stage as a Prefect task: content-keyed cache, retries where failures are transient, MLflow runs."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import mlflow
from prefect import task


from tasks import dvc_state
from tasks.cache import content_cache_policy, record_outputs
from tasks.registry import Decision, promote
from tasks.tracking import log_figure_png, log_metrics_history, metric_key, stage_run, step_metrics_listener
from transfer import progress
from transfer.config import Params, flatten
from transfer.errors import TransferError
from transfer.stages import STAGES, Launch, Workspace, run_stage, stage_inputs, stage_params
from transfer.stages.record import searched_folder

__all__ = ["stage_task", "direction_task", "log_stage", "register_classifier", "promote_task", "RETRIES",
           "transient_only"]

# reading user files and SQLite can fail for a moment (network mounts, a locked db); training resumes from
# its last checkpoint, so one retry of a training stage costs at most `checkpoint_every` steps
RETRIES = {"prepare": 2, "tokenize": 2, "pretrain": 1, "finetune_lm": 1, "train_classifier": 1, "evaluate": 1}



def transient_only(task, task_run, state) -> bool:
    """Prefect's retry condition: retry I/O and database hiccups, never a TransferError (bad data, params, a
    missing file), which fails the same way every time."""
    try:
        state.result()
    except TransferError:
        return False
    except Exception:  # noqa: BLE001  anything else may be transient
        return True
    return True


def stage_key(args: dict[str, Any]) -> dict[str, Any]:
    """What a stage's cached result depends on, from its record: the params it reads, its inputs' bytes (Paths are
    hashed by content), the code it runs (its own import closure) and where it writes (by location)."""
    stage, p, root = STAGES[args["stage"]], args["params"], Path(args["root"]).resolve()
    ws = Workspace(root)
    inputs = [searched_folder(x if x.is_absolute() else root / x) for x in map(Path, stage.deps(p, ws))]
    return {"stage": stage.name, "params": stage.params(p), "inputs": inputs, "code": stage.code_digest(),
            "root": str(root)}


@task(cache_policy=content_cache_policy(parts=stage_key), persist_result=True, result_serializer="json")
def stage_task(stage: str, params: Params, root: Path, dvc: bool = False, nproc: int = 1) -> dict[str, Any]:
    """Run one stage; cached on `stage_key` and this source. dvc: a DVC project's lock is shared with DVC (a stage
    DVC finished is reused, not rerun; a stage run here is committed to dvc.lock and the DVC cache). nproc: how
    many processes a training stage runs on; not in the key (the outputs are those params' outputs either way)."""
    ws, record = Workspace(root), STAGES[stage]
    if dvc and dvc_state.up_to_date(Path(root), stage):
        metrics = json.loads(record.result(ws).read_text())
    else:
        with progress.subscribe(step_metrics_listener()):
            metrics = run_stage(stage, params, ws, Launch(nproc=nproc))
        if dvc:
            dvc_state.commit(Path(root), stage)
    return record_outputs(record.outs(params, ws), stage=stage, metrics=metrics)


def direction_key(args: dict[str, Any]) -> dict[str, Any]:
    return {**stage_key(args), "direction": args["direction"]}


@task(cache_policy=content_cache_policy(parts=direction_key, exclude=("threads",)), persist_result=True,
      result_serializer="json", retries=1, retry_delay_seconds=2, retry_condition_fn=transient_only)
def direction_task(stage: str, params: Params, root: Path, direction: str, cwd: str,
                   threads: int | None = None) -> dict[str, Any]:
    """One direction's models of a training stage, on whichever worker takes it (a Dask worker, one task per process):
    trained to a finished checkpoint, so the stage's own task then only finishes the stage. Cached like the
    stage, per direction. Reads the params' relative paths from `cwd`; trains on `threads` torch threads."""
    import contextlib

    import torch

    if threads:
        torch.set_num_threads(threads)
    ws = Workspace(root)
    with contextlib.chdir(cwd):
        written = STAGES[stage].direction(params, ws, direction)
    return record_outputs(written, stage=stage, direction=direction)


def _history_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path) as f:
        rows = list(csv.DictReader(f))
    out = []
    for i, r in enumerate(rows):  # one MLflow step per row, metrics prefixed with the direction
        prefix = f"{r.pop('direction')}_" if "direction" in r else ""
        out.append({"row": i, **{prefix + k: float(v) for k, v in r.items() if v not in ("", None)}})
    return out


def log_stage(stage: str, params: Params, result: dict, cached: bool, root: Path) -> str:
    """A nested MLflow run for the stage: params section, input digests, metrics, curves, plots."""
    paths = Workspace(root)
    # a cache hit logs params and metrics only: its inputs, curves and plots are in the run that computed it
    inputs = {} if cached else {str(p): p for p in stage_inputs(params, stage, paths) if p.exists()}
    with stage_run(stage, stage_params(params, stage), inputs=inputs) as run:
        mlflow.set_tag("cache", "hit" if cached else "miss")
        scalars = {metric_key(k): v for k, v in flatten(_scalar_metrics(stage, result.get("metrics", {}))).items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if scalars:
            mlflow.log_metrics(scalars)
        if cached:
            return run.info.run_id
        record = STAGES[stage]
        if record.history:
            log_metrics_history(_history_rows(paths.plot(record.history)), step_key="row")
        for png in record.plots:
            if paths.plot(png).exists():
                log_figure_png(paths.plot(png), f"plots/{png}")
        if stage == "prepare":
            mlflow.log_artifact(str(paths.art("prepare", "data_report.json")))
        if stage in TRAINED:
            _log_trained_model(stage, params, paths)
        if stage == "tokenize":
            mlflow.log_artifact(str(paths.art("tokenize", "spm.model")), artifact_path="tokenizer")
        if stage == "evaluate":
            mlflow.log_artifact(str(paths.art("evaluate", "report.json")))
        return run.info.run_id


TRAINED = {"pretrain": "pretrain", "finetune_lm": "finetune_lm", "train_classifier": "classifier"}


def _log_trained_model(stage: str, params: Params, paths: Workspace) -> None:
    """The weights a training stage made, with the tokenizer and the architecture to load them (data only:
    state_dicts for `torch.load(weights_only=True)`), tagged with the device and precision they trained at."""
    from transfer.device import describe, resolved_precision

    section = TRAINED[stage]
    mlflow.set_tags({"device": describe(), "precision": resolved_precision(params.section(section)["precision"])})
    if stage == "train_classifier":
        mlflow.log_artifacts(str(paths.art(stage, "model")), artifact_path="model")
        return
    for direction in params.model.directions:
        mlflow.log_artifact(str(paths.art(stage, f"lm-{direction}.pt")), artifact_path="model")
    mlflow.log_artifact(str(paths.art("tokenize", "spm.model")), artifact_path="model")
    arch = dict(params.section("model"), vocab_size=json.loads(paths.metrics("tokenize").read_text())["vocab_size"])
    mlflow.log_dict(arch, "model/architecture.json")


def _scalar_metrics(stage: str, metrics: dict) -> dict:
    if stage == "evaluate":
        return {"variants": metrics.get("variants", {})}
    return {k: v for k, v in metrics.items() if k not in ("classes", "test_digest")}


@task(retries=3, retry_delay_seconds=2, retry_condition_fn=transient_only)
def register_classifier(params: Params, evaluation: dict, root: Path) -> tuple[str, str]:
    """Log the bundle as a raw-text pyfunc model in its own nested run and register a new version."""
    from mlflow.models import infer_signature

    import pandas as pd
    from tasks import pyfunc_model

    paths = Workspace(root)
    bundle = paths.art("train_classifier", "model")
    example = pd.DataFrame({"text": ["an example document to classify"]})
    classes = json.loads((bundle / "meta.json").read_text())["classes"]
    output = pd.DataFrame({"label": [classes[0]], "probability": [1.0], **{f"prob_{c}": [0.0] for c in classes}})
    champion_variant = evaluation["champion_candidate"]
    with stage_run("register", {"registry": params.section("registry")}) as run:
        info = mlflow.pyfunc.log_model(  # data only: weights, tokenizer, meta.json; the code is the installed package
            name="classifier", loader_module=pyfunc_model.LOADER_MODULE, data_path=str(bundle),
            signature=infer_signature(example, output), input_example=example,
            pip_requirements=pyfunc_model.pip_requirements(), registered_model_name=params.registry.model_name,
        )
        metrics = evaluation["variants"][champion_variant]
        mlflow.log_metrics({k: float(v) for k, v in metrics.items()})
        mlflow.set_tag("variant", champion_variant)
        return str(info.registered_model_version), run.info.run_id


@task(retries=3, retry_delay_seconds=2, retry_condition_fn=transient_only)
def promote_task(params: Params, version: str, evaluation: dict) -> Decision:
    r = params.registry
    metrics = evaluation["variants"][evaluation["champion_candidate"]]
    return promote(r.model_name, version, metrics, r.metric, r.min_delta, r.min_accuracy,
                   test_digest=evaluation["test_digest"], baseline_metrics=evaluation["variants"].get("tfidf"),
                   min_delta_over_baseline=r.min_delta_over_baseline, chance_metrics=evaluation.get("chance"),
                   require_above_chance=r.require_above_chance)
