"""`transfer benchmark`: one general LM for every dataset, a row per cell and variant, and --resume."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from tests.conftest import make_workspace
from tasks.tracking import code_version
from tests.processes import BIN, clean_env, free_port, start, stop
from transfer.benchmark import load_suite, markdown_table
from transfer.errors import TransferError

pytestmark = pytest.mark.slow
TRANSFER = str(Path(sys.executable).with_name("transfer"))

SUITE = """\
params: params.yaml
budgets: [40, all]
seeds: [0]
overrides: ["model.directions=[fwd]", "evaluate.variants=[tfidf,ulmfit_fwd,ulmfit+tfidf]"]
datasets:
  - name: demo
    train: data/demo/train.csv
    test: data/demo/test.csv
  - name: demo_held_out      # the same rows, its test split held out of train
    train: data/demo/train.csv
"""


def _run(ws: Path, *args: str, api: str | None = None, suite: str = "suite.yaml") -> subprocess.CompletedProcess:
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{ws / 'mlflow.db'}")
    if api:  # a running Prefect server: no temporary one per command
        env["PREFECT_API_URL"] = api
    return subprocess.run([TRANSFER, "benchmark", "--suite", suite, "--out", "out", *args], cwd=ws,
                          capture_output=True, text=True, env=env, timeout=900)


def test_a_suite_shares_one_general_lm_and_resumes(tmp_path, prefect_api):
    ws = make_workspace(tmp_path / "ws")
    (ws / "suite.yaml").write_text(SUITE)
    first = _run(ws, api=prefect_api)
    assert first.returncode == 0, first.stderr[-3000:]
    out = ws / "out"
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {"dataset", "budget", "seed", "variant", "error", "accuracy", "macro_f1", "seconds"} <= set(rows[0])
    cells = {(r["dataset"], r["budget"], r["seed"]) for r in rows}
    assert cells == {(d, b, "0") for d in ("demo", "demo_held_out") for b in ("40", "all")}
    assert len(rows) == 4 * 3  # every cell scores every variant
    for r in rows:
        assert float(r["error"]) == pytest.approx(1 - float(r["accuracy"]))
        assert 0 <= float(r["macro_f1"]) <= 1 and float(r["seconds"]) > 0
    assert {r["n_labels"] for r in rows if r["budget"] == "40"} == {"40"}
    assert all(r["chosen"] in ("average", "ulmfit", "tfidf") for r in rows if r["variant"] == "ulmfit+tfidf")
    # tiny classifiers train on one CPU thread, in order or on Dask (0: on an accelerator)
    assert {r["threads"] for r in rows} == {"0" if torch.cuda.is_available() else "1"}
    assert {r["commit"].split("+")[0] for r in rows} == {code_version().split("+")[0]}  # the code of every row

    # one general LM, built once; every dataset and cell links it, and a dataset's cells share its domain LM
    general = out / "general" / "artifacts" / "pretrain" / "lm-fwd.pt"
    for d in ("demo", "demo_held_out"):
        ds = out / "work" / d
        assert (ds / "artifacts" / "pretrain").is_symlink()
        assert (ds / "artifacts" / "pretrain" / "lm-fwd.pt").resolve() == general.resolve()
        for cell in ("40-s0", "all-s0"):
            lm = ds / "cells" / cell / "artifacts" / "finetune_lm"
            assert lm.is_symlink() and lm.resolve() == (ds / "artifacts" / "finetune_lm").resolve()
            assert not list((ds / "cells" / cell / "artifacts" / "train_classifier").glob("checkpoint-*"))
    table = (out / "results.md").read_text()
    assert "| demo | 40 | 1 |" in table and "| demo_held_out | all | 1 |" in table
    assert (out / "demo.png").stat().st_size > 0 and (out / "demo_held_out.png").stat().st_size > 0

    client = MlflowClient(tracking_uri=f"sqlite:///{ws / 'mlflow.db'}")
    parent = client.search_runs(client.get_experiment_by_name("transfer").experiment_id,
                                "tags.experiment = 'benchmark'")
    assert len(parent) == 1
    nested = client.search_runs(parent[0].info.experiment_id,
                                f"tags.mlflow.parentRunId = '{parent[0].info.run_id}'")
    assert sorted(r.info.run_name for r in nested) == ["demo-40-s0", "demo-all-s0", "demo_held_out-40-s0",
                                                       "demo_held_out-all-s0"]

    # --resume keeps every cell: nothing trains again, the rows are the same
    stamp = (out / "work" / "demo" / "cells" / "40-s0" / "metrics" / "evaluate.json").stat().st_mtime_ns
    again = _run(ws, "--resume", api=prefect_api)
    assert again.returncode == 0, again.stderr[-3000:]
    with open(out / "results.csv", newline="") as f:
        assert list(csv.DictReader(f)) == rows
    assert (out / "work" / "demo" / "cells" / "40-s0" / "metrics" / "evaluate.json").stat().st_mtime_ns == stamp

    # a suite whose tokenizer is not the one the general LM in OUT was built with: one error naming the key
    (ws / "other.yaml").write_text(SUITE.replace('["model.directions=[fwd]"',
                                                 '["model.directions=[fwd]", "tokenizer.byte_fallback=true"'))
    other = _run(ws, "--resume", api=prefect_api, suite="other.yaml")
    assert other.returncode != 0 and "Traceback" not in other.stderr
    assert re.search(r"tokenizer.byte_fallback is true but the tokenizer of the general LM in \S*out/general \(.*pass another "
                     r"--out", other.stderr)

    # the same suite on a real Dask cluster (a scheduler and two one-thread workers), one worker killed mid-cell:
    # every cell still ends done, with the sequential run's rows to the last digit (wall time aside)
    port = free_port()
    env = clean_env(tmp_path / "dask-home")  # one torch thread per worker
    scheduler = start([str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
                      env, ws, tmp_path / "scheduler.log")
    address = f"tcp://127.0.0.1:{port}"
    workers = [start([str(BIN / "dask"), "worker", address, "--nthreads", "1", "--nworkers", "1", "--no-dashboard",
                      "--memory-limit", "0"], env, ws, tmp_path / f"worker{i}.log") for i in range(2)]
    try:
        env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{ws / 'mlflow.db'}", PREFECT_API_URL=prefect_api)
        proc = subprocess.Popen([TRANSFER, "benchmark", "--suite", "suite.yaml", "--out", "out-dask", "--general-lm",
                                 "out/general", "--dask-address", address], cwd=ws, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        deadline, killed = time.monotonic() + 600, False
        while proc.poll() is None and time.monotonic() < deadline:  # a classifier is training: kill a worker
            if list((ws / "out-dask" / "work").glob("*/cells/*/artifacts/train_classifier/checkpoint-*.pt")):
                os.killpg(workers[0].pid, signal.SIGKILL)
                killed = True
                break
            time.sleep(0.2)
        output, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, output[-3000:]
        assert killed, "no cell was training while the benchmark ran"

        # the sample-efficiency sweep runs its cells on the same path: in order, then on the cluster
        sweep = [TRANSFER, "experiment", "sample-efficiency", "--budgets", "40,all", "--seeds", "0,1",
                 "-S", "model.directions=[fwd]", "-S", "evaluate.variants=[tfidf,ulmfit_fwd]"]
        by_run = []
        for extra in ([], ["--dask-address", address]):
            done = subprocess.run(sweep + extra, cwd=ws, env=env, capture_output=True, text=True, timeout=900)
            assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
            with open(ws / "plots" / "sample_efficiency.csv", newline="") as f:
                by_run.append([{k: v for k, v in r.items() if k != "lm_cache"} for r in csv.DictReader(f)])
        assert len(by_run[0]) == 2 * 2 * 2 and by_run[1] == by_run[0]
        assert {c.name for c in (ws / "sweep").iterdir()} == {"40-s0", "40-s1", "all-s0", "all-s1"}

        # the pipeline: both directions of each training stage train at once, one per worker (a fresh one replaces the
        # killed worker), to the weights the in-order sweep run made for the forward direction
        workers.append(start([str(BIN / "dask"), "worker", address, "--nthreads", "1", "--nworkers", "1",
                              "--no-dashboard", "--memory-limit", "0"], clean_env(tmp_path / "dask-home"), ws,
                             tmp_path / "worker2.log"))
        in_order = {s: (ws / "artifacts" / s / "lm-fwd.pt").read_bytes() for s in ("pretrain", "finetune_lm")}
        for s in ("pretrain", "finetune_lm", "train_classifier"):
            for ckpt in (ws / "artifacts" / s).glob("checkpoint-*.pt"):
                ckpt.unlink()
        run = subprocess.run([TRANSFER, "run", "--no-promote", "--dask-address", address], cwd=ws, env=env,
                             capture_output=True, text=True, timeout=900)
        log = run.stdout + run.stderr
        assert run.returncode == 0, log[-3000:]
        for s in ("pretrain", "finetune_lm", "train_classifier"):
            assert f"{s} fwd: Completed" in log and f"{s} bwd: Completed" in log
        for s in ("pretrain", "finetune_lm"):
            assert (ws / "artifacts" / s / "lm-fwd.pt").read_bytes() == in_order[s]
            assert (ws / "artifacts" / s / "lm-bwd.pt").is_file()
        # the forward classifier is the in-order sweep's all-label one (same LM, rows and seed)
        fwd = [json.loads((w / "metrics" / "train_classifier.json").read_text())["fwd"]
               for w in (ws, ws / "sweep" / "all-s0")]
        assert (fwd[0]["valid_accuracy"], fwd[0]["valid_loss"]) == (fwd[1]["valid_accuracy"], fwd[1]["valid_loss"])
    finally:
        for p in (*workers, scheduler):
            stop(p)
    with open(ws / "out-dask" / "results.csv", newline="") as f:
        on_dask = list(csv.DictReader(f))
    drop = lambda r: {k: v for k, v in r.items() if k != "seconds"}  # noqa: E731
    assert [drop(r) for r in on_dask] == [drop(r) for r in rows]


def test_suite_errors_name_the_file_and_key(tmp_path):
    bad = tmp_path / "suite.yaml"
    bad.write_text(SUITE.replace("seeds: [0]", "seeds: [0]\nbudget: [10]"))
    with pytest.raises(TransferError, match=r"suite.yaml: unknown key 'suite.budget'"):
        load_suite(bad)
    bad.write_text(SUITE.replace("name: demo_held_out", "name: demo"))
    with pytest.raises(TransferError, match="dataset 'demo' is listed twice"):
        load_suite(bad)
    bad.write_text(SUITE.replace("budgets: [40, all]", "budgets: [40, most]"))
    with pytest.raises(TransferError, match="label budget 'most'"):
        load_suite(bad)
    bad.write_text(SUITE.replace("  - name: demo\n", "  - name: demo\n    label: y\n"))
    with pytest.raises(TransferError, match=r"unknown key 'datasets\[0\].label'"):
        load_suite(bad)


def test_markdown_table_bolds_the_best_ulmfit_mean():
    rows = [dict(dataset="a", budget=b, seed=s, variant=v, error=e) for b, s, v, e in [
        ("100", 0, "tfidf", 0.30), ("100", 1, "tfidf", 0.34), ("100", 0, "ulmfit_fwd", 0.20),
        ("100", 1, "ulmfit_fwd", 0.24), ("100", 0, "ulmfit_bwd", 0.25), ("100", 1, "ulmfit_bwd", 0.27)]]
    table = markdown_table(rows)
    assert "| a | 100 | 2 | 32.0 [30.0, 34.0] | 26.0 [25.0, 27.0] | **22.0 [20.0, 24.0]** |" in table
