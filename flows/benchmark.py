"""`transfer benchmark`: every dataset of a suite at every label budget and seed, against the same baselines.

Layout under OUT: `general/` (the general LM, built once unless the suite or `--general-lm` names one),
`work/<dataset>/` (its prepared data and domain LMs), `work/<dataset>/cells/<budget>-s<seed>/` (one cell's
classifiers and evaluation; it links the LMs, never copies or retrains them), and the results: `results.csv`
(one row per dataset x budget x seed x variant, rewritten after every cell), `results.md` and `<dataset>.png`.
`resume` keeps the rows whose cell had the same params, data bytes and general LM.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import time
from pathlib import Path

import mlflow
from prefect import flow, get_run_logger

from flows.cells import LM_PARTS, CellResult, cell_task, failure_reason, link_parts, run_cell
from flows.scale import dask_runner, worker_threads
from tasks.cache import content_digest
from tasks.tracking import code_version, ensure_experiment, log_figure_png, metric_key, start_pipeline_run
from transfer.benchmark import COLUMNS, Dataset, Suite, cell_key, cell_overrides, load_suite, markdown_table
from transfer.config import Params, load_params
from transfer.errors import TransferError
from transfer.io_utils import atomic_path, file_digest, write_csv, write_json
from transfer.plots import plot_sample_efficiency
from transfer.stages import Workspace, run_stage, stage_inputs
from transfer.stages.published import tokenizer_settings
from transfer.tokenizer import Tokenizer, check_settings


def general_lm(suite: Suite, root: Path, logger) -> tuple[Path, str]:
    """The general LM's workspace (built with the suite's base params if missing) and its identity (digest)."""
    base = load_params(suite.params, list(suite.overrides))
    paths = Workspace(root)
    for stage in ("tokenize", "pretrain"):
        if not paths.metrics(stage).is_file():
            logger.info(f"general LM: {stage} in {root} (checkpointed; a rerun resumes)")
            run_stage(stage, base, paths)
    files = [paths.art("tokenize", "spm.model"), *(paths.art("pretrain", f"lm-{d}.pt") for d in base.model.directions)]
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise TransferError(f"{missing[0]}: missing; the general LM in {root} has no such direction")
    check_settings(Tokenizer.load(files[0]), tokenizer_settings(base), f"the general LM in {root}",
                   "pass another --out (or --general-lm) to build one with these params")
    return root, hashlib.sha256("".join(file_digest(f) for f in files).encode()).hexdigest()[:16]


def domain_lm(p: Params, ws: Path, general: Path, general_id: str, logger) -> float:
    """prepare + finetune_lm for a dataset (every budget shares them); returns the seconds it took (0: kept)."""
    paths = Workspace(ws)
    link_parts(general, ws, LM_PARTS)
    run_stage("prepare", p, paths)
    key_path = ws / "metrics" / "finetune_lm.key"
    key = hashlib.sha256(json.dumps([p.section("model"), p.section("finetune_lm"), general_id,
                                     file_digest(paths.art("prepare", "domain.txt"))], sort_keys=True,
                                    default=str).encode()).hexdigest()
    if paths.metrics("finetune_lm").is_file() and key_path.is_file() and key_path.read_text() == key:
        return 0.0
    t0 = time.perf_counter()
    logger.info(f"{ws.name}: tuning the domain LMs")
    run_stage("finetune_lm", p, paths)
    with atomic_path(key_path) as tmp:
        tmp.write_text(key)
    return time.perf_counter() - t0


def _read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    try:
        for r in rows:
            r.update(seed=int(r["seed"]), **{k: float(r[k]) for k in ("error", "accuracy", "macro_f1", "seconds")})
    except (KeyError, ValueError):
        return []  # not a results file of this version: nothing to resume from
    return rows


def _write_results(rows: list[dict], out: Path, suite: Suite) -> None:
    write_csv(out / "results.csv", rows)
    with atomic_path(out / "results.md") as tmp:
        tmp.write_text("Test error % (mean [min, max] over seeds); bold: the best ULMFiT variant.\n\n"
                       + markdown_table(rows))
    for d in suite.datasets:
        mine = [dict(r, n_labels=int(r["n_labels"])) for r in rows if r["dataset"] == d.name]
        if mine:
            plot_sample_efficiency(mine, out / f"{d.name}.png", f"{d.name}: test error vs labelled examples")


@flow(name="benchmark", log_prints=True)
def benchmark_flow(suite_path: str, out: str, budgets: list[str] | None = None, seeds: list[int] | None = None,
                   general: str | None = None, resume: bool = False, datasets: list[str] | None = None,
                   threads: int | None = None, concurrent: bool = False) -> list[dict]:
    """The general LM, each dataset's domain LM, then the cells: one after another, or (`concurrent`) all at once
    as tasks on the flow's task runner (a Dask cluster). The CSV, table and plots are rewritten after every cell,
    rows in suite order whatever order the cells finish in."""
    logger = get_run_logger()
    suite = load_suite(suite_path)
    budgets, seeds = budgets or suite.budgets, seeds if seeds is not None else suite.seeds
    chosen: list[Dataset] = [d for d in suite.datasets if not datasets or d.name in datasets]
    unknown = sorted(set(datasets or []) - {d.name for d in suite.datasets})
    if unknown:
        raise TransferError(f"{suite_path}: no dataset named {unknown[0]!r} (it has "
                            f"{', '.join(d.name for d in suite.datasets)})")
    out_path = Path(out).resolve()
    general_root, general_id = general_lm(suite, Path(general or suite.general_lm or out_path / "general").resolve(),
                                          logger)

    def cell_params(d: Dataset, budget: str, seed: int) -> Params:
        return suite.params_for(d, cell_overrides(budget, seed))

    def key(d: Dataset, budget: str, seed: int) -> str:
        p = cell_params(d, budget, seed)
        return cell_key(p, {str(f): content_digest(f) for f in stage_inputs(p, "prepare")}, general_id)

    rows = _read_rows(out_path / "results.csv") if resume else []
    by_name = {d.name: d for d in suite.datasets}
    keys = {c: key(by_name[c[0]], *c[1:]) for c in {(r["dataset"], r["budget"], r["seed"]) for r in rows}
            if c[0] in by_name}
    rows = [r for r in rows if keys.get((r["dataset"], r["budget"], r["seed"])) == r["cell_digest"]]
    done = {(r["dataset"], r["budget"], r["seed"]) for r in rows}
    order = {(d.name, b, s): i for i, (d, b, s) in enumerate((d, b, s) for d in suite.datasets for b in budgets
                                                             for s in seeds)}
    base = load_params(suite.params, list(suite.overrides))
    experiment_id = ensure_experiment(base.mlflow.experiment, Path(base.mlflow.artifact_location).resolve())
    tags = {"experiment": "benchmark", "suite": str(suite_path), "general_lm": general_id,
            "resumed_cells": str(len(done))}
    commit = code_version()

    def record(d: Dataset, budget: str, seed: int, domain_s: float, result: CellResult) -> None:
        prep, evaluation, classifier_s, cell_s, threads = result
        with mlflow.start_run(run_name=f"{d.name}-{budget}-s{seed}", nested=True, experiment_id=experiment_id,
                              tags={"dataset": d.name, "budget": budget, "seed": str(seed),
                                    "torch_threads": str(threads)}):
            mlflow.log_metrics({"domain_lm_s": domain_s, "cell_s": cell_s})
            for variant, m in evaluation["variants"].items():
                extra = classifier_s if variant.startswith("ulmfit") else 0.0
                rows.append(dict(dataset=d.name, budget=budget, seed=seed, variant=variant,
                                 error=m["error_rate"], accuracy=m["accuracy"], macro_f1=m["macro_f1"],
                                 seconds=evaluation["seconds"][variant] + extra, n_labels=prep["n_train"],
                                 n_test=evaluation["n_test"], threads=threads,
                                 chosen=evaluation.get("chosen_on_validation", {}).get(variant, ""),
                                 cell_digest=key(d, budget, seed), commit=commit))
                mlflow.log_metrics({metric_key(f"{variant}.{k}"): m[k] for k in ("error_rate", "accuracy", "macro_f1")})
        rows.sort(key=lambda r: order.get((r["dataset"], r["budget"], r["seed"]), len(order)))
        _write_results([{c: r.get(c, "") for c in COLUMNS} for r in rows], out_path, suite)

    failed: list[str] = []
    with start_pipeline_run(f"benchmark-{Path(suite_path).stem}", base.to_dict(), experiment_id=experiment_id,
                            tags=tags):
        pending = []  # (dataset, budget, seed, domain seconds, future)
        for d in chosen:
            ws = out_path / "work" / d.name
            todo = [(b, s) for b in budgets for s in seeds if (d.name, b, s) not in done]
            if not todo:
                logger.info(f"{d.name}: every cell kept from {out_path / 'results.csv'}")
                continue
            domain_s = domain_lm(cell_params(d, "all", 0), ws, general_root, general_id, logger)
            for budget, seed in todo:
                p, cell_ws = cell_params(d, budget, seed), ws / "cells" / f"{budget}-s{seed}"
                logger.info(f"{d.name} budget {budget} seed {seed}" + (" submitted" if concurrent else ""))
                if concurrent:
                    task = cell_task.with_options(task_run_name=f"{d.name}-{budget}-s{seed}")
                    pending.append((d, budget, seed, domain_s, task.submit(p, cell_ws, ws, os.getcwd(), threads)))
                else:
                    record(d, budget, seed, domain_s, run_cell(p, cell_ws, ws))
        for d, budget, seed, domain_s, future in pending:
            future.wait()
            if future.state.is_completed():
                record(d, budget, seed, domain_s, future.result())
            else:
                failed.append(f"{d.name} budget {budget} seed {seed}: {failure_reason(future.state)}")
                logger.error(f"cell {failed[-1]}")
        _write_results([{c: r.get(c, "") for c in COLUMNS} for r in rows], out_path, suite)
        write_json(out_path / "summary.json", dict(general_lm=str(general_root), general_lm_digest=general_id,
                                                   cells=len({(r["dataset"], r["budget"], r["seed"]) for r in rows})))
        if (out_path / "results.csv").is_file():
            mlflow.log_artifact(str(out_path / "results.csv"))
            mlflow.log_artifact(str(out_path / "results.md"))
            for d in chosen:
                if (out_path / f"{d.name}.png").is_file():
                    log_figure_png(out_path / f"{d.name}.png", f"{d.name}.png")
    if failed:
        raise TransferError(f"{len(failed)} cell(s) failed, the others are in {out_path / 'results.csv'}: "
                            + "; ".join(failed) + ". Run again with --resume to retry only them")
    return rows


def run_benchmark(suite: str, out: str, budgets: list[str] | None = None, seeds: list[int] | None = None,
                  general: str | None = None, resume: bool = False, datasets: list[str] | None = None,
                  dask_address: str | None = None, workers: int | None = None) -> list[dict]:
    """The benchmark flow; with `dask_address` (a running scheduler) or `workers` (a local cluster of that many
    one-thread processes), its cells run at once on Dask workers, each on its share of the cores."""
    out_path = Path(out)
    out_path.mkdir(parents=True, exist_ok=True)
    args = (suite, str(out_path), budgets, seeds, general, resume, datasets)
    runner = dask_runner(dask_address, workers)
    if runner is None:
        return benchmark_flow(*args)
    threads = worker_threads(workers)
    return benchmark_flow.with_options(task_runner=runner)(*args, threads=threads, concurrent=True)

