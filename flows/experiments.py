"""Sample efficiency: test error against the number of labelled examples, per variant (the paper's Figure 3).

A sweep takes hours on CPU, so the CSV is rewritten after every (budget, seed) cell, and `resume` keeps the
rows of an earlier CSV whose cell had the same params and data bytes: an interrupted sweep, or one split
over several invocations (`--budgets 100,200` then `--budgets 500,all`), ends with every row in one CSV.
Each cell trains in its own workspace, `sweep/<budget>-s<seed>/`, linking the workspace's LMs (flows/cells.py),
so cells can run at once on Dask workers.
"""

from __future__ import annotations

import csv
import hashlib
import json
import time
from pathlib import Path

import mlflow
from prefect import flow, get_run_logger

from flows.cells import CellResult, cell_task, failure_reason, run_cell
from flows.scale import dask_runner, worker_threads
from flows.ulmfit import ensure_demo_data, run_name, run_stage_tasks
from tasks.cache import cache_dir, content_digest
from tasks.tracking import code_version, ensure_experiment, log_figure_png, metric_key, start_pipeline_run
from transfer.config import Params, load_params
from transfer.errors import TransferError
from transfer.io_utils import write_csv, write_json
from transfer.status import SweepProgress
from transfer.plots import plot_sample_efficiency
from transfer.stages import Workspace, stage_inputs

DEFAULT_BUDGETS = ["100", "200", "500", "1000", "all"]
SHARED = ("prepare", "tokenize", "pretrain", "finetune_lm")  # run once in the workspace; every cell links them
COLUMNS = ["variant", "budget", "n_labels", "seed", "lm_texts", "error", "accuracy", "macro_f1", "threads", "lm_cache",
           "params_digest", "commit"]  # threads: torch threads the classifiers trained on; commit: the code that
# made the row ("" in rows from before either column)


def _budget_overrides(budget: str, seed: int) -> list[str]:
    labels = "null" if budget == "all" else str(int(budget))
    # the split seed stays fixed (same valid/test rows in every cell); the label draw and training vary
    return [f"data.max_train_labels={labels}", f"data.label_seed={seed}", f"classifier.seed={seed}"]


def cell_digest(p: Params, root: Path) -> str:
    """What a cell's rows depend on besides code: every param and the bytes of the labelled data files."""
    data = {str(f): content_digest(root / f) for f in stage_inputs(p, "prepare")}
    return hashlib.sha256(json.dumps([p.to_dict(), data], sort_keys=True).encode()).hexdigest()[:16]


def _read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        try:
            r.update(seed=int(r["seed"]), n_labels=int(r["n_labels"]),
                     **{k: float(r[k]) for k in ("error", "accuracy", "macro_f1")})
            if r["budget"] != "all":
                int(r["budget"])
        except (KeyError, ValueError):
            return []  # not a sweep CSV of this version: nothing to resume from
    return rows


@flow(name="sample-efficiency", log_prints=True)
def sample_efficiency_flow(budgets: list[str] | None = None, seeds: list[int] | None = None,
                           params_path: str = "params.yaml", overrides: list[str] | None = None,
                           root: str = ".", resume: bool = False, threads: int | None = None,
                           concurrent: bool = False) -> list[dict]:
    """The LM stages once (cached tasks in the workspace), then every (budget, seed) cell in its own cell
    workspace under `sweep/` that links them: one after another, or (`concurrent`) at once as tasks on the
    flow's task runner (a Dask cluster). Rows stay in (budget, seed) order whatever order cells finish in."""
    logger = get_run_logger()
    budgets, seeds = budgets or DEFAULT_BUDGETS, seeds if seeds is not None else [0, 1, 2]
    root_path = Path(root).resolve()
    paths = Workspace(root_path)
    base = load_params(root_path / params_path, overrides or [])
    ensure_demo_data(base, root_path)

    def cell(budget: str, seed: int) -> Params:
        return load_params(root_path / params_path, [*(overrides or []), *_budget_overrides(budget, seed)])

    csv_path = paths.plot("sample_efficiency.csv")
    rows: list[dict] = []
    if resume:
        previous = _read_rows(csv_path)
        digests = {key: cell_digest(cell(*key), root_path) for key in {(r["budget"], r["seed"]) for r in previous}}
        rows = [r for r in previous if r.get("params_digest") == digests[r["budget"], r["seed"]]]
        logger.info(f"resume: {len({(r['budget'], r['seed']) for r in rows})} cells kept from {csv_path}, "
                    f"{len(previous) - len(rows)} rows of other params or data dropped")
        write_csv(csv_path, [{c: r.get(c, "") for c in COLUMNS} for r in rows])  # even if every cell is kept
    done = {(r["budget"], r["seed"]) for r in rows}
    # for `transfer status`: which cell runs, and the wall time a cell takes
    plan = [(b, s) for b in budgets for s in seeds]
    order = {c: i for i, c in enumerate(plan)}
    progress = SweepProgress(root_path, plan, [c for c in plan if c in done])
    experiment_id = ensure_experiment(base.mlflow.experiment, root_path / base.mlflow.artifact_location)
    failed: list[str] = []
    with start_pipeline_run(f"sample-efficiency-{run_name(base)}", base.to_dict(), experiment_id=experiment_id,
                            tags={"experiment": "sample-efficiency", "resumed_cells": str(len(done))}):
        for r in rows:
            mlflow.log_metric(metric_key(f"{r['variant']}.error.b{r['budget']}"), r["error"], step=r["seed"])
        todo = [c for c in plan if c not in done]
        # the shared LM stages, cached: label budgets never retrain the tokenizer or the language models
        _, states = run_stage_tasks(base, paths, log_to_mlflow=False, stages=SHARED) if todo else ({}, {})
        lm_cache = ",".join(f"{k}={states[k]['state']}" for k in SHARED if k != "prepare") if todo else ""
        logger.info(f"LM stages: {lm_cache}")
        commit = code_version()

        def record(budget: str, seed: int, result: CellResult, seconds: float) -> None:
            prep, evaluation = result.prep, result.evaluation
            # which texts tuned the domain LM: transductive results must say so wherever they go
            lm_texts = "train+valid+test" if prep["domain_include_test"] else "train"
            digest = cell_digest(cell(budget, seed), root_path)
            for variant, m in evaluation["variants"].items():
                rows.append(dict(variant=variant, budget=budget, n_labels=prep["n_train"], seed=seed,
                                 lm_texts=lm_texts, error=m["error_rate"], accuracy=m["accuracy"],
                                 macro_f1=m["macro_f1"], threads=result.threads, lm_cache=lm_cache,
                                 params_digest=digest, commit=commit))
                mlflow.log_metric(metric_key(f"{variant}.error.b{budget}"), m["error_rate"], step=seed)
            rows.sort(key=lambda r: order.get((r["budget"], r["seed"]), len(order)))
            # after every cell: an interrupted sweep keeps what it finished
            write_csv(csv_path, [{c: r.get(c, "") for c in COLUMNS} for r in rows])
            progress.done(budget, seed, seconds)

        pending = []
        for budget, seed in todo:
            t0 = time.time()
            progress.begin(budget, seed)
            args = (cell(budget, seed), root_path / "sweep" / f"{budget}-s{seed}", root_path)
            if concurrent:
                task = cell_task.with_options(task_run_name=f"{budget}-s{seed}")
                pending.append((budget, seed, t0, task.submit(*args, str(root_path), threads)))
            else:
                record(budget, seed, run_cell(*args), time.time() - t0)
        for budget, seed, t0, future in pending:
            future.wait()
            if future.state.is_completed():
                record(budget, seed, future.result(), time.time() - t0)
            else:
                failed.append(f"budget {budget} seed {seed}: {failure_reason(future.state)}")
                logger.error(f"cell {failed[-1]}")
        transductive = " (LM also tuned on test texts)" if base.data.domain_include_test else ""
        png = plot_sample_efficiency(rows, paths.plot("sample_efficiency.png"),
                                     f"test error vs labelled examples{transductive} (mean, min-max over seeds)")
        write_json(paths.metrics("sample_efficiency"), _summary(rows))
        progress.finish()
        mlflow.log_artifact(str(csv_path))
        log_figure_png(png, "sample_efficiency.png")
    if failed:
        raise TransferError(f"{len(failed)} cell(s) failed, the others are in {csv_path}: " + "; ".join(failed)
                            + ". Run again with --resume to retry only them")
    return rows


def _summary(rows: list[dict]) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault(r["variant"], {}).setdefault(r["budget"], []).append(r["error"])
    return {v: {b: dict(mean_error=sum(e) / len(e), n_seeds=len(e)) for b, e in bs.items()} for v, bs in out.items()}


def run_sample_efficiency(budgets: list[str], seeds: list[int], params_path: str = "params.yaml",
                          overrides: list[str] | None = None, root: str | Path = ".", resume: bool = False,
                          dask_address: str | None = None, workers: int | None = None) -> list[dict]:
    """The sweep; with `dask_address` (a running scheduler) or `workers` (a local cluster of that many
    one-thread processes), its cells run at once on Dask workers, each on its share of the cores."""
    args = (budgets, seeds, params_path, list(overrides or []), str(root), resume)
    runner = dask_runner(dask_address, workers)
    with cache_dir(Path(root) / ".prefect-results"):
        if runner is None:
            return sample_efficiency_flow(*args)
        threads = worker_threads(workers)
        return sample_efficiency_flow.with_options(task_runner=runner)(*args, threads=threads, concurrent=True)


if __name__ == "__main__":
    print(json.dumps(run_sample_efficiency(DEFAULT_BUDGETS, [0, 1, 2]), indent=1))
