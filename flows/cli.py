"""`transfer`: run the pipeline, one stage, predictions, promotion, serving and scheduling."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Iterator, Optional

import typer
from rich.console import Console
from rich.table import Table

from transfer.errors import TransferError

app = typer.Typer(help=__doc__, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
data_app = typer.Typer(help="Get data: the synthetic demo set, or public datasets with sha256 checks.",
                       no_args_is_help=True)
app.add_typer(data_app, name="data")
experiment_app = typer.Typer(help="Experiments that measure the recipe.", no_args_is_help=True)
app.add_typer(experiment_app, name="experiment")
lm_app = typer.Typer(help="General LMs built once for a fleet: publish them to the MLflow registry.",
                     no_args_is_help=True)
app.add_typer(lm_app, name="lm")
console = Console(stderr=True)
DEBUG = {"on": False}

ParamsOpt = typer.Option("params.yaml", "--params", "-p", help="Params file (the single source of truth).")
SetOpt = typer.Option(None, "--set", "-S", help="Override a param, as `dvc exp run -S`: section.key=value. Repeatable.")
LockOpt = typer.Option(600, help="Seconds to wait for another process in this workspace.")
LOCK = ".transfer.lock"


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors.")) -> None:
    DEBUG["on"] = debug


@app.command()
def run(params: Path = ParamsOpt, set_: Optional[list[str]] = SetOpt,
        promote: bool = typer.Option(True, help="Register the classifier and apply the champion gate."),
        nproc: int = typer.Option(1, "--nproc", min=1, help="Processes per training stage (data-parallel, "
                                  "torch.distributed; global batch = bs x nproc)."),
        dask_address: Optional[str] = typer.Option(
            None, "--dask-address", help="Train each training stage's directions at once on this Dask cluster "
            "(tcp://HOST:PORT; default $TRANSFER_DASK_ADDRESS); workers must share this workspace's filesystem."),
        workers: Optional[int] = typer.Option(None, "--workers", help="Train each training stage's directions at "
                                              "once on a local Dask cluster of N one-thread processes."),
        lock_timeout: float = typer.Option(0, help="Seconds to wait for another run in this workspace "
                                           "(0: refuse).")) -> None:
    """Run the whole pipeline as a Prefect flow (cached stages are skipped), then print a summary."""
    from transfer.config import load_params

    load_params(params, set_ or [])  # bad params fail in a line, before a Prefect server starts
    from flows.ulmfit import run_pipeline

    quiet_prefect_errors()
    with workspace_lock(lock_timeout, tracked=True):
        summary = run_pipeline(str(params), set_ or [], ".", promote, nproc, dask_address, workers)
    _print_summary(summary)


class _HideTransferErrors(logging.Filter):
    """Drops Prefect's log records about a TransferError (its tracebacks, its Failed states): the CLI prints the
    error once, as one line. `--debug` keeps them."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, TransferError) or "TransferError" in record.getMessage())


def quiet_prefect_errors() -> None:
    """Install `_HideTransferErrors` on the handlers Prefect logs to (unless --debug)."""
    if DEBUG["on"]:
        return
    import prefect  # noqa: F401  configures Prefect's logging handlers

    for name in ("", "prefect", "prefect.flow_runs", "prefect.task_runs"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _HideTransferErrors) for f in handler.filters):
                handler.addFilter(_HideTransferErrors())


@contextlib.contextmanager
def workspace_lock(timeout: float = 0, tracked: bool = False) -> Iterator[None]:
    """One writer per workspace: a second `transfer run`/`stage` waits `timeout` s, then refuses clearly.
    tracked: the command logs to MLflow; runs a killed process of this workspace left RUNNING become KILLED."""
    from filelock import FileLock, Timeout

    try:
        with FileLock(LOCK, timeout=timeout):
            if tracked:
                from tasks.tracking import mark_killed_runs

                mark_killed_runs()
            yield
    except Timeout:
        raise TransferError(f"another transfer process holds {LOCK} in {Path.cwd()}; wait for it, or pass "
                            "--lock-timeout SECONDS to queue behind it") from None


def _print_summary(summary: dict) -> None:
    out = Console()
    t = Table(title=f"run {summary['run_name']}")
    for col in ("stage", "state", "seconds"):
        t.add_column(col)
    for stage, s in summary["stages"].items():
        t.add_row(stage, s["state"], f"{s['seconds']:.1f}")
    out.print(t)
    v = Table(title="test set, by variant")
    for col in ("variant", "accuracy", "error %", "macro-F1"):
        v.add_column(col)
    for name, m in summary["variants"].items():
        star = " *" if name == summary.get("champion_candidate") else ""
        v.add_row(name + star, f"{m['accuracy']:.4f}", f"{100 * m['error_rate']:.2f}", f"{m['macro_f1']:.4f}")
    out.print(v)
    if "promotion" in summary:
        pr = summary["promotion"]
        out.print(f"registered version {summary['registered_version']}: "
                  f"{'[green]champion[/green]' if pr['promoted'] else '[yellow]challenger[/yellow]'} — {pr['reason']}")
    out.print("Look closer:  mlflow ui --backend-store-uri sqlite:///mlflow.db   |   "
              "prefect server start (Prefect UI)   |   dvc metrics show   |   plots/*.png")


@app.command()
def stage(name: str = typer.Argument(..., help="prepare | tokenize | pretrain | finetune_lm | train_classifier | "
                                     "evaluate"),
          params: Path = ParamsOpt, set_: Optional[list[str]] = SetOpt,
          nproc: int = typer.Option(
              1, "--nproc", min=1, help="Worker processes on this machine for a training stage (pretrain, "
              "finetune_lm, train_classifier): data-parallel, gloo on CPU, NCCL on GPUs. The global batch is bs x "
              "all processes."),
          nnodes: str = typer.Option("1", help="Machines in the job, N or MIN:MAX; run the same command on each."),
          rdzv_endpoint: Optional[str] = typer.Option(None, help="HOST:PORT where the machines of a multi-node job "
                                                      "meet (torchrun's --rdzv-endpoint)."),
          rdzv_id: Optional[str] = typer.Option(None, help="Job id, the same on every machine (default: "
                                                "transfer-<stage>)."),
          lock_timeout: float = LockOpt) -> None:
    """Run one stage (what `dvc repro` calls). Reads and writes artifacts/, metrics/ and plots/.

    With --nproc N, a training stage runs on N processes through torch's elastic launcher; a killed worker stops
    the job and the same command resumes it from the last checkpoint. Multi-node: the same command on each
    machine, with --nnodes and --rdzv-endpoint, on a workspace every machine shares (rank 0 writes it).
    """
    from transfer.config import load_params
    from transfer.launch import Launch

    p = load_params(params, set_ or [])  # bad params fail before torch/pandas are imported
    launch = Launch(nproc=nproc, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id)
    from transfer.stages import run_stage

    # a multi-node job's machines share the workspace: the job id, not the lock, keeps it one writer (rank 0)
    lock = contextlib.nullcontext() if launch.multi_node else workspace_lock(lock_timeout)
    with lock:
        if name in ("tokenize", "pretrain") and p.pretrain.from_lm:
            from tasks.lm_registry import resolve

            p, _ = resolve(p, Path("."))
        if name == "prepare" and not all(Path(w).exists() for w in (p.data.train, p.data.test, *p.data.general) if w):
            from flows.ulmfit import ensure_demo_data  # imports prefect (seconds): only when an input is missing

            ensure_demo_data(p, Path("."))
        metrics = run_stage(name, p, launch=launch)
    typer.echo(json.dumps({k: v for k, v in metrics.items() if k != "details"}, indent=2, default=str))


@app.command("lr-find")
def lr_find(params: Path = ParamsOpt, set_: Optional[list[str]] = SetOpt,
            direction: str = typer.Option("fwd", help="Which domain LM's classifier: fwd | bwd."),
            num_it: int = typer.Option(100, help="Optimizer steps in each phase's LR sweep (1e-7 to 10)."),
            lock_timeout: float = LockOpt) -> None:
    """The LR finder before every phase of gradual unfreezing, from the domain-tuned LM.

    Each phase is swept, then trained as configured before the next one is swept.
    Writes plots/lr_find_<direction>.png and .csv; no stage's artifacts change.
    Needs the stages up to finetune_lm.
    """
    from transfer.config import load_params

    p = load_params(params, set_ or [])
    from transfer.stages import Workspace
    from transfer.stages.classifier import lr_find

    with workspace_lock(lock_timeout):
        rows = lr_find(p, Workspace(), direction=direction, num_it=num_it)
    table = Table(title=f"classifier LR finder ({direction}); plot: plots/lr_find_{direction}.png")
    for col in ("phase", "trains", "configured peak lr", "suggested lr"):
        table.add_column(col, justify="right")
    for r in rows:
        trains = "all groups" if r["freeze_to"] == 0 else f"last {-r['freeze_to']} group(s)"
        table.add_row(str(r["phase"] + 1), trains, f"{r['lr']:.2g}", f"{r['suggested_lr']:.2g}")
    Console().print(table)
    console.print("The suggestion is fastai's valley (2/3 down the longest descent of the smoothed loss), a "
                  "cautious starting point for classifier.lr / unfreeze_lr_mult: confirm it on validation "
                  "accuracy (on AG News the fixed 2e-2 beat it; docs/results/README.md, Ablations).")


@app.command()
def predict(texts: list[str] = typer.Argument(..., help="One or more texts to classify."),
            model: str = typer.Option(None, "--model", "-m", help="MLflow model URI (default: "
                                      "models:/<registry.model_name>@champion) or a bundle folder."),
            params: Path = ParamsOpt) -> None:
    """Print the predicted label and its probability for each text."""
    import pandas as pd

    from tasks.pyfunc_model import load_model

    uri = model
    if not (model and Path(model).is_dir() and (Path(model) / "meta.json").exists()):
        import mlflow

        from tasks.tracking import existing_tracking_uri, tracking_uri
        from transfer.config import load_params

        uri = model or f"models:/{load_params(params).registry.model_name}@champion"
        mlflow.set_tracking_uri(existing_tracking_uri() if uri.startswith(("models:/", "runs:/")) else tracking_uri())
    loaded, _ = load_model(uri)
    out = loaded.predict(pd.DataFrame({"text": texts}))
    rows = list(zip(out["label"], out["probability"]))
    for text, (label, prob) in zip(texts, rows):
        typer.echo(f"{label}\t{prob:.3f}\t{text[:80]}")


@lm_app.command("publish")
def lm_publish(name: str = typer.Option("general-lm", help="Registered model name."),
               params: Path = ParamsOpt, set_: Optional[list[str]] = SetOpt) -> None:
    """Register this workspace's tokenizer and general LMs (both directions) as one MLflow model version.

    It becomes `models:/NAME/latest`, and takes the alias `champion` when its held-out perplexity on the same
    evaluation text is the lowest. Another workspace then sets `pretrain.from_lm: models:/NAME@champion` (or
    `models:/NAME/latest`, or `models:/NAME/3`) and skips tokenizing and pretraining."""
    from tasks.lm_registry import publish
    from transfer.config import load_params

    p = load_params(params, set_ or [])
    version, champion, score = publish(Path("."), p, name)
    console.print(f"{name} version {version} (perplexity {score:,.1f}): models:/{name}/latest"
                  + (f", models:/{name}@champion" if champion else "; the champion stays (lower perplexity)"))


@app.command("dvc-yaml")
def dvc_yaml(params: Path = ParamsOpt, out: Path = typer.Option(Path("dvc.yaml"), "--out", help="File to write."),
             check: bool = typer.Option(False, "--check", help="Write nothing; exit 1 with a diff if the file "
                                        "differs from what the stage records say.")) -> None:
    """Write dvc.yaml from the stage records (transfer/stages/*.py): params, deps, code and outs of every stage."""
    from transfer.config import load_params
    from transfer.dvc_yaml import diff, render
    from transfer.io_utils import atomic_path

    p = load_params(params)
    if check:
        delta = diff(out, p)
        if delta:
            typer.echo(delta, nl=False)
            console.print(f"{out} differs from the stage records: run `transfer dvc-yaml` and commit it")
            raise typer.Exit(1)
        console.print(f"{out} matches the stage records")
        return
    with atomic_path(out) as tmp:
        tmp.write_text(render(p), encoding="utf-8")
    console.print(f"wrote {out}")


@app.command()
def serve(model: str = typer.Option(None, "--model", "-m", help="MLflow model URI (default: models:/<registry."
                                    "model_name>@champion) or a bundle folder."),
          params: Path = ParamsOpt,
          host: str = typer.Option("127.0.0.1", help="Interface to listen on (0.0.0.0: every interface)."),
          port: int = typer.Option(5001, help="TCP port."),
          max_body_kb: int = typer.Option(1024, help="Largest request body accepted, in KiB (bigger: 413).")) -> None:
    """Serve a classifier over HTTP: POST /invocations (MLflow's JSON request shapes), GET /health, GET /version.

    Every request is checked before the model sees it: malformed ones get a 4xx naming the problem, never a 5xx."""
    import uvicorn

    from tasks.pyfunc_model import load_model
    from tasks.serving import create_app
    from tasks.tracking import existing_tracking_uri
    from transfer.config import load_params

    uri = model or f"models:/{load_params(params).registry.model_name}@champion"
    if uri.startswith(("models:/", "runs:/")):
        import mlflow

        mlflow.set_tracking_uri(existing_tracking_uri())
    loaded, classes = load_model(uri)
    console.print(f"serving {uri} ({', '.join(classes)}) on http://{host}:{port}/invocations")
    uvicorn.run(create_app(loaded, classes, uri, max_body_kb * 1024), host=host, port=port, log_level="warning")


@app.command()
def promote(version: str = typer.Argument(..., help="Registered model version to judge."),
            params: Path = ParamsOpt, set_: Optional[list[str]] = SetOpt) -> None:
    """Apply the champion gate to a registered version by hand, using its recorded test metrics."""
    from mlflow import MlflowClient

    from tasks.registry import promote as gate
    from tasks.registry import version_metrics
    from tasks.tracking import existing_tracking_uri
    from transfer.config import load_params

    p = load_params(params, set_ or []).registry
    client = MlflowClient(tracking_uri=existing_tracking_uri())
    metrics = version_metrics(client, p.model_name, version)
    # the tfidf baseline and chance figures come from the version's tags, written when it was registered
    d = gate(p.model_name, version, metrics, p.metric, p.min_delta, p.min_accuracy, client=client,
             min_delta_over_baseline=p.min_delta_over_baseline, require_above_chance=p.require_above_chance)
    typer.echo(f"version {version}: {'promoted to champion' if d.promoted else 'not promoted'} — {d.reason}")


@app.command()
def schedule(cron: str = typer.Option(None, help="Cron expression; default: schedule.cron from params."),
             pool: Optional[str] = typer.Option(None, "--pool", help="Deploy to this Prefect process work pool "
                                                "(created if missing) and return; `prefect worker start --pool "
                                                "NAME` on any machine runs the scheduled runs."),
             params: Path = ParamsOpt, set_: Optional[list[str]] = SetOpt) -> None:
    """Deploy the flow on a cron schedule (needs a Prefect server: PREFECT_API_URL).

    Without --pool it serves the deployment in the foreground until stopped (Ctrl-C): one machine. Keep it
    running as a service, e.g. `nohup transfer schedule > schedule.log 2>&1 &`, or a systemd unit with
    `ExecStart=/path/to/repo/.venv/bin/transfer schedule` and `WorkingDirectory=/path/to/repo`. With --pool the
    runs go to Prefect workers, which need this package installed and this workspace at the same path.
    """
    from prefect.settings import get_current_settings

    # the environment or the active profile (`prefect config set PREFECT_API_URL=...`, as the server suggests)
    if not get_current_settings().api.url:
        raise TransferError("schedules need a running Prefect server: start `prefect server start` and set "
                            "PREFECT_API_URL=http://127.0.0.1:4200/api (environment or `prefect config set`)")
    from flows.deploy import deploy_to_pool, serve_scheduled  # after the check: it imports mlflow and torch

    if pool:
        deployment_id = deploy_to_pool(pool, str(params), set_ or [], cron)
        console.print(f"deployed ulmfit to work pool {pool!r} (deployment {deployment_id}); start a worker with "
                      f"`prefect worker start --pool {pool}`")
        return
    serve_scheduled(str(params), set_ or [], cron)


@app.command()
def status(as_json: bool = typer.Option(False, "--json", help="Print the status as JSON (for scripts)."),
           ) -> None:
    """Where the pipeline in this workspace stands: each stage done, part-trained (progress, ETA), waiting for
    the stage before it, or not started; and, during a sample-efficiency sweep, its cells done and time left.

    Reads metrics/ and the training checkpoints only; safe to run beside a running pipeline.
    """
    from flows.status_view import print_status
    from transfer.status import sweep_progress, workspace_status

    stages = workspace_status(Path("."))
    sweep = sweep_progress(Path("."))
    held = _lock_held()
    if as_json:
        typer.echo(json.dumps(dict(lock_held=held, stages=stages, sweep=sweep), indent=2))
        return
    print_status(stages, sweep, held)
    if any(s["state"] == "training" for s in stages):
        console.print("a transfer process is running in this workspace" if held else
                      "no transfer process holds the workspace lock: unfinished checkpoints resume on the next run "
                      "(if params and data are unchanged)")


def _lock_held() -> bool:
    """Whether another process holds the workspace lock (checked without creating a lock file)."""
    from filelock import FileLock, Timeout

    if not Path(LOCK).exists():
        return False
    try:
        with FileLock(LOCK, timeout=0):
            return False
    except Timeout:
        return True


@data_app.command("demo")
def data_demo(out: Path = typer.Option(Path("data/demo"), help="Folder for general.txt, train.csv, test.csv."),
              seed: int = typer.Option(0)) -> None:
    """Write the deterministic synthetic demo corpus and labelled set (no third-party text)."""
    from transfer.demo import make_demo

    for name, path in make_demo(out, seed=seed).items():
        typer.echo(f"{name}: {path}")


@data_app.command("download")
def data_download(name: str = typer.Argument(..., help="wikitext-103 | imdb"),
                  dest: Path = typer.Option(Path("data"), help="Destination folder."),
                  url: str = typer.Option(None, help="Mirror URL (the sha256 is still checked).")) -> None:
    """Download a public dataset, verify its sha256 and convert it for params.yaml."""
    from transfer.download import download

    for k, v in download(name, dest, url_override=url).items():
        typer.echo(f"{k}: {v}")


@experiment_app.command("sample-efficiency")
def sample_efficiency(budgets: str = typer.Option("100,200,500,1000,all",
                                                  help="Label budgets, comma-separated; 'all' = every row."),
                      seeds: str = typer.Option("0,1,2", help="Seeds per budget (label draw and classifier init)."),
                      params: Path = ParamsOpt, set_: Optional[list[str]] = SetOpt,
                      resume: bool = typer.Option(False, help="Keep the rows of plots/sample_efficiency.csv whose "
                                                  "cell had the same params and data (any budget); run only the "
                                                  "missing cells. The CSV is rewritten after every cell."),
                      dask_address: Optional[str] = typer.Option(None, "--dask-address",
                                                                 help="Run the cells at once on this Dask cluster "
                                                                 "(tcp://HOST:PORT; default $TRANSFER_DASK_ADDRESS); "
                                                                 "workers must share this workspace's filesystem."),
                      workers: Optional[int] = typer.Option(None, "--workers", help="Run the cells at once on a "
                                                            "local Dask cluster of N one-thread processes (cores/N "
                                                            "torch threads each)."),
                      lock_timeout: float = typer.Option(0, help="Seconds to wait for another run in this "
                                                         "workspace (0: refuse).")) -> None:
    """Test error vs labelled examples for every evaluate.variants entry: CSV + PNG in plots/, logged to MLflow.

    The LM stages run once in the workspace; each (budget, seed) cell trains in sweep/<budget>-s<seed>/, which
    links them, so with --workers or --dask-address the cells run at once.
    """
    from flows.experiments import run_sample_efficiency

    quiet_prefect_errors()
    with workspace_lock(lock_timeout, tracked=True):  # it reruns the workspace's stages: a concurrent run would mix them
        rows = run_sample_efficiency(budgets.split(","), [int(x) for x in seeds.split(",")], str(params),
                                     set_ or [], resume=resume, dask_address=dask_address, workers=workers)
    t = Table(title="mean test error % by label budget")
    variants = sorted({r["variant"] for r in rows})
    budget_list = sorted({r["budget"] for r in rows}, key=lambda b: (b == "all", int(b) if b != "all" else 0))
    t.add_column("variant")
    for b in budget_list:
        t.add_column(b)
    for v in variants:
        cells = []
        for b in budget_list:
            errs = [r["error"] for r in rows if r["variant"] == v and r["budget"] == b]
            cells.append(f"{100 * sum(errs) / len(errs):.1f}")
        t.add_row(v, *cells)
    Console().print(t)
    Console().print("plots/sample_efficiency.png, plots/sample_efficiency.csv, metrics/sample_efficiency.json")


@app.command()
def benchmark(suite: Path = typer.Option(..., "--suite", help="Suite file: base params, datasets, budgets, seeds "
                                         "(benchmarks/dev.yaml)."),
              out: Path = typer.Option(Path("benchmark-results"), "--out", help="Folder for results.csv, results.md, "
                                       "the plots and every cell's workspace."),
              budgets: Optional[str] = typer.Option(None, help="Label budgets, comma-separated ('all' = every row); "
                                                    "default: the suite's."),
              seeds: Optional[str] = typer.Option(None, help="Seeds, comma-separated; default: the suite's."),
              datasets: Optional[str] = typer.Option(None, help="Only these datasets of the suite, comma-separated."),
              general_lm: Optional[Path] = typer.Option(None, "--general-lm", help="A workspace whose tokenize and "
                                                        "pretrain stages are done; default: the suite's, else built "
                                                        "once in OUT/general."),
              resume: bool = typer.Option(False, help="Keep the rows of OUT/results.csv whose cell had the same "
                                          "params, data and general LM; run only the missing cells."),
              dask_address: Optional[str] = typer.Option(None, "--dask-address",
                                                         help="Run the cells at once on this Dask scheduler "
                                                         "(tcp://HOST:8786; default $TRANSFER_DASK_ADDRESS); "
                                                         "workers must share OUT's filesystem."),
              workers: Optional[int] = typer.Option(None, "--workers", help="Run the cells at once on a local "
                                                    "Dask cluster of N processes (cores / N torch threads each).")
              ) -> None:
    """Every dataset of a suite at every label budget and seed: one general LM, each dataset's domain LMs, the
    classifiers and the baselines. Writes OUT/results.csv (one row per dataset x budget x seed x variant),
    OUT/results.md (means, with the min and max over seeds) and OUT/<dataset>.png; one MLflow parent run, a
    nested run per cell. Interrupted? Run it again with --resume: finished cells are kept, training resumes from
    its checkpoints."""
    from flows.benchmark import run_benchmark
    from transfer.benchmark import check_budget

    quiet_prefect_errors()
    budget_list = [check_budget(b.strip()) for b in budgets.split(",")] if budgets else None
    try:
        seed_list = [int(s) for s in seeds.split(",")] if seeds else None
    except ValueError:
        raise TransferError(f"--seeds must be integers separated by commas, got {seeds!r}") from None
    with workspace_lock(0, tracked=True):
        rows = run_benchmark(str(suite), str(out), budget_list, seed_list, str(general_lm) if general_lm else None,
                             resume, [d.strip() for d in datasets.split(",")] if datasets else None,
                             dask_address, workers)
    from transfer.benchmark import markdown_table

    typer.echo(markdown_table(rows) if rows else "no cells ran")
    console.print(f"{out}/results.csv, {out}/results.md, {out}/<dataset>.png")


def main() -> None:
    """Entry point: project errors print as one paragraph (no traceback unless --debug)."""
    try:
        app()
    except TransferError as e:
        if DEBUG["on"]:
            traceback.print_exc()
        from rich.markup import escape

        # escaped: a path, value or column name like "[/x]" is text, not markup; one paragraph even when a
        # wrapped library error spans lines
        message = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        console.print(f"[bold red]error:[/bold red] {escape(message)}", highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
