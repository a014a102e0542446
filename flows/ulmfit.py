"""The ULMFiT flow: prepare -> tokenize -> pretrain -> finetune_lm -> train_classifier -> evaluate -> promote."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterable

import mlflow
from prefect import flow, get_run_logger

from flows.scale import dask_runner, worker_threads
from tasks import dvc_state, lm_registry
from tasks.cache import cache_dir
from tasks.pipeline import (RETRIES, direction_task, log_stage, promote_task, register_classifier, stage_task,
                            transient_only)
from tasks.tracking import ensure_experiment, start_pipeline_run
from transfer import rules
from transfer.config import Params, load_params
from transfer.demo import make_demo
from transfer.stages import STAGES, Workspace

DEMO_DIR = Path("data/demo")


def run_name(p: Params) -> str:
    """Says what the run trains: data, model size, label budget."""
    labels = "all" if p.data.max_train_labels is None else str(p.data.max_train_labels)
    return (f"{Path(p.data.train).stem}-awd{p.model.emb_size}x{p.model.hidden_size}-v{p.tokenizer.vocab_size}"
            f"-{'+'.join(p.model.directions)}-labels{labels}")


def ensure_demo_data(p: Params, root: Path) -> bool:
    """Generate the synthetic demo set when params point at it and it is not there yet; -> whether it did."""
    wanted = [p.data.train, p.data.test, *p.data.general]
    # only a missing demo folder: a mistyped file name under it must fail as "file not found", not regenerate
    if any(str(w).startswith(str(DEMO_DIR)) for w in wanted if w) and not (root / DEMO_DIR).exists():
        make_demo(root / DEMO_DIR)
        return True
    return False


def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    params = flow_run.parameters
    try:
        p = load_params(Path(params.get("root", ".")) / params.get("params_path", "params.yaml"),
                        params.get("overrides") or [])
        return run_name(p)
    except Exception:  # the flow itself reports bad params; the name must not fail first
        return "ulmfit-invalid-params"


@flow(name="ulmfit", flow_run_name=_flow_run_name, log_prints=True)
def ulmfit_flow(params_path: str = "params.yaml", overrides: list[str] | None = None, root: str = ".",
                promote: bool = True, nproc: int = 1, threads: int | None = None, concurrent: bool = False) -> dict:
    """Run every stage (cached on content), log to MLflow, register the classifier and apply the promotion gate.
    nproc > 1: the training stages run as data-parallel jobs of that many processes (transfer/launch.py).
    concurrent: the training stages' directions train at once on the flow's task runner (a Dask cluster)."""
    logger = get_run_logger()
    root_path = Path(root).resolve()
    p = load_params(root_path / params_path, overrides or [])
    lm_uri = p.pretrain.from_lm
    p, lm_version = lm_registry.resolve(p, root_path)  # pretrain.from_lm: models:/... -> a local folder
    made_demo = ensure_demo_data(p, root_path)
    paths = Workspace(root_path)
    # dvc.lock describes params.yaml: a run with overrides or another params file leaves it alone
    dvc = not overrides and (root_path / params_path).resolve() == root_path / "params.yaml" and \
        dvc_state.is_dvc_project(root_path)
    if dvc and made_demo:  # what `dvc repro` would have run for demo_data, so record it as DVC would
        dvc_state.commit(root_path, "demo_data")
    summary: dict = {"run_name": run_name(p), "stages": {}}
    experiment_id = ensure_experiment(p.mlflow.experiment, root_path / p.mlflow.artifact_location)
    with start_pipeline_run(run_name(p), p.to_dict(), experiment_id=experiment_id) as parent:
        summary["mlflow_run_id"] = parent.info.run_id
        if lm_version:  # the run links the published LM it started from
            mlflow.set_tags({"pretrain.from_lm": lm_uri, "pretrain.from_lm.version": lm_version})
        results, summary["stages"] = run_stage_tasks(p, paths, dvc=dvc, nproc=nproc, threads=threads,
                                                     concurrent=concurrent)
        evaluation = results["evaluate"]
        summary["variants"] = evaluation["variants"]
        summary["champion_candidate"] = evaluation["champion_candidate"]
        retrained = summary["stages"]["train_classifier"]["state"] != "Cached"
        if promote and evaluation["champion_candidate"] and not retrained and _registered(p):
            logger.info("classifier unchanged (cached): no new model version; the registry stays as it is")
        elif promote and evaluation["champion_candidate"]:
            version, _ = register_classifier(p, evaluation, root_path)
            # the gate judges by the metric the data calls for (rules: macro-F1 on imbalanced classes)
            decision = promote_task(rules.apply(p, results["prepare"]), version, evaluation)
            summary["registered_version"] = version
            summary["promotion"] = dict(promoted=decision.promoted, reason=decision.reason,
                                        champion_version=decision.champion_version)
            logger.info(f"model {p.registry.model_name} v{version}: "
                        f"{'promoted to champion' if decision.promoted else 'stays challenger'} ({decision.reason})")
    return summary


def _registered(p: Params) -> bool:
    """Whether the registry already holds a version of this model (a cached rerun then registers nothing)."""
    from mlflow import MlflowClient

    from tasks.tracking import tracking_uri

    return bool(MlflowClient(tracking_uri=tracking_uri()).search_model_versions(f"name='{p.registry.model_name}'",
                                                                                max_results=1))


def run_stage_tasks(p: Params, paths: Workspace, log_to_mlflow: bool = True, dvc: bool = False,
                    nproc: int = 1, stages: Iterable[str] = STAGES, threads: int | None = None,
                    concurrent: bool = False) -> tuple[dict, dict]:
    """Every stage (or `stages`) in order as a cached task -> (metrics by stage, {stage: {state, seconds}}).
    concurrent: a training stage's directions first train at once, as tasks on the flow's runner (Dask)."""
    logger = get_run_logger()
    results, states = {}, {}
    for stage in stages:
        t0 = time.perf_counter()
        if concurrent and STAGES[stage].direction and len(p.model.directions) > 1 and \
                not (dvc and dvc_state.up_to_date(paths.root, stage)):
            _train_directions(stage, p, paths, threads, logger)
        task = stage_task.with_options(name=stage, task_run_name=stage, retries=RETRIES[stage], retry_delay_seconds=5,
                                       retry_condition_fn=transient_only)
        state = task(stage, p, paths.root, dvc, nproc, return_state=True)
        result = state.result()
        if log_to_mlflow:
            log_stage(stage, p, result, state.name == "Cached", paths.root)
        results[stage] = result["metrics"]
        states[stage] = dict(state=state.name, seconds=time.perf_counter() - t0)
        logger.info(f"{stage}: {state.name} in {states[stage]['seconds']:.1f}s")
    return results, states


def _train_directions(stage: str, p: Params, paths: Workspace, threads: int | None, logger) -> None:
    futures = {d: direction_task.with_options(task_run_name=f"{stage}-{d}").submit(
        stage, p, paths.root, d, os.getcwd(), threads) for d in p.model.directions}
    for d, future in futures.items():
        future.result()  # raises the direction's own error
        logger.info(f"{stage} {d}: {future.state.name}")


def run_pipeline(params_path: str = "params.yaml", overrides: list[str] | None = None, root: str | Path = ".",
                 promote: bool = True, nproc: int = 1, dask_address: str | None = None,
                 workers: int | None = None) -> dict:
    """Run the flow with task results (the cache) persisted under `<root>/.prefect-results`; with `dask_address`
    or `workers` (flows/scale.py), the training stages' directions train at once on Dask workers."""
    kw = dict(params_path=params_path, overrides=list(overrides or []), root=str(root), promote=promote, nproc=nproc)
    runner = dask_runner(dask_address, workers)
    with cache_dir(Path(root) / ".prefect-results"):
        if runner is None:
            return ulmfit_flow(**kw)
        threads = worker_threads(workers)
        return ulmfit_flow.with_options(task_runner=runner)(**kw, threads=threads, concurrent=True)


if __name__ == "__main__":
    print(run_pipeline())
