"""Inference speed of the registered classifier: in-process pyfunc, then over HTTP from `mlflow models serve`.

The model is an MLflow URI (default models:/transfer-classifier@champion; tracking store from
$MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the current directory), or, with --workspace, the champion
of a tiny pipeline run first in a temp dir (tests/conftest.py make_workspace + `transfer run`). Documents are
synthetic (transfer.demo.make_demo, a different seed from the training data). Measured:

  in-process  mlflow.pyfunc.load_model time; a --docs batch (default 1,000) -> documents/s (median of
              --repeats); --calls single-document predictions (default 200) -> p50/p99 latency
  HTTP        `mlflow models serve -m URI --env-manager local -h 127.0.0.1 -p PORT` (started here, stopped by
              PID in `finally`): startup time; --calls single-document POSTs -> p50/p99; the --docs batch as
              one POST -> documents/s; and a check that HTTP labels equal the in-process labels

    python bench/inference.py --workspace                     # self-contained: tiny pipeline, then measure
    MLFLOW_TRACKING_URI=sqlite:///mlflow.db python bench/inference.py -m models:/transfer-classifier@champion
    python bench/inference.py --workspace --no-serve --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(REPO)]  # sibling bench scripts, tests.conftest

from pipeline_overhead import load_line, tiny_pipeline  # noqa: E402

DEFAULT_URI = "models:/transfer-classifier@champion"


# --------------------------------------------------------------------------- shared with load_test.py


def tracking_uri_from_env() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def demo_texts(n: int, seed: int = 12345) -> list[str]:
    """n synthetic labelled-style documents (make_demo with a seed the pipeline does not use)."""
    from transfer.demo import make_demo

    with tempfile.TemporaryDirectory(prefix="transfer-texts-") as d:
        paths = make_demo(d, seed=seed, n_general_docs=1, n_labelled=max(n, 8), test_frac=0.25)
        texts = []
        for split in ("train", "test"):
            with open(paths[split], newline="", encoding="utf-8") as f:
                texts += [row["text"] for row in csv.DictReader(f)]
    return texts[:n]


def split_payload(texts: list[str]) -> dict:
    return {"dataframe_split": {"columns": ["text"], "data": [[t] for t in texts]}}


def percentiles_ms(seconds: list[float]) -> tuple[float, float]:
    a = np.asarray(seconds) * 1000
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def latency_line(seconds: list[float]) -> str:
    p50, p99 = percentiles_ms(seconds)
    a = np.asarray(seconds) * 1000
    return (f"p50 {p50:.1f} ms  p99 {p99:.1f} ms  (mean {a.mean():.1f}, max {a.max():.0f} ms, "
            f"{int((a > 1000).sum())} over 1 s)")


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path
    startup_s: float

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        return "".join(self.log.read_text(errors="replace").splitlines(keepends=True)[-lines:])


def stop_process_group(proc: subprocess.Popen, grace: float = 15) -> None:
    """SIGTERM the process group we started (its leader is proc.pid), SIGKILL it if still there after `grace`."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        proc.wait()
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader, so a zombie does not keep the group "alive"
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


@contextlib.contextmanager
def mlflow_server(model_uri: str, tracking_uri: str, port: int = 0, workers: int = 1,
                  startup_timeout: float = 300, env: dict[str, str] | None = None) -> Iterator[Server]:
    """`mlflow models serve` on 127.0.0.1 in its own process group; stopped by PID in `finally`."""
    import httpx

    port = port or free_port()
    logdir = Path(tempfile.mkdtemp(prefix="transfer-serve-"))
    log = logdir / "serve.log"
    cmd = [sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri, "--env-manager", "local",
           "-h", "127.0.0.1", "-p", str(port), "-w", str(workers)]
    run_env = {**(env or os.environ), "MLFLOW_TRACKING_URI": tracking_uri}
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=run_env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", proc, log, 0.0)
    try:
        deadline = t0 + startup_timeout
        while True:
            if not server.alive():
                raise RuntimeError(f"mlflow models serve exited {proc.returncode} before answering:\n{server.log_tail()}")
            try:
                if httpx.get(server.url + "/ping", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() > deadline:
                raise RuntimeError(f"mlflow models serve did not answer /ping within {startup_timeout:.0f}s:\n"
                                   f"{server.log_tail()}")
            time.sleep(0.5)
        server.startup_s = time.perf_counter() - t0
        yield server
    finally:
        stop_process_group(proc)
        shutil.rmtree(logdir, ignore_errors=True)


@contextlib.contextmanager
def model_source(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """-> (model URI, tracking URI): the given URI, or the champion of a tiny pipeline with --workspace."""
    if args.workspace:
        with tiny_pipeline(timeout=args.pipeline_timeout) as (ws, env):
            yield DEFAULT_URI, env["MLFLOW_TRACKING_URI"]
    else:
        yield args.model_uri, tracking_uri_from_env()


def add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("-m", "--model-uri", default=DEFAULT_URI, help=f"MLflow model URI (default {DEFAULT_URI})")
    ap.add_argument("--workspace", action="store_true", help="first run the tiny pipeline in a temp dir and "
                    "use its champion (ignores --model-uri)")
    ap.add_argument("--pipeline-timeout", type=float, default=1200, help="seconds allowed for --workspace's "
                    "pipeline run (default 1200)")
    ap.add_argument("--startup-timeout", type=float, default=300, help="seconds allowed for the server to "
                    "answer /ping (default 300)")


# --------------------------------------------------------------------------- the benchmark


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--docs", type=int, default=1000, help="documents in the batch measurement (default 1000)")
    ap.add_argument("--calls", type=int, default=200, help="single-document calls for latency (default 200)")
    ap.add_argument("--repeats", type=int, default=3, help="batch repeats; the median is reported (default 3)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in this process (0: torch default); "
                    "the server keeps torch's default")
    ap.add_argument("--warmup", type=int, default=20, help="untimed calls before each measurement (default 20; "
                    "a fresh server answers its first ~10 requests slowly)")
    ap.add_argument("--no-serve", action="store_true", help="skip the HTTP measurements")
    ap.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    args = ap.parse_args()

    import httpx
    import mlflow
    import pandas as pd
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"start: {load_line()}; torch threads {torch.get_num_threads()}", flush=True)
    texts = demo_texts(args.docs)
    single = texts[: min(args.calls, len(texts))]
    single = (single * (args.calls // max(len(single), 1) + 1))[: args.calls]
    rows: list[tuple[str, str]] = []

    with model_source(args) as (uri, tracking):
        mlflow.set_tracking_uri(tracking)
        print(f"model {uri} (tracking {tracking})", flush=True)
        t0 = time.perf_counter()
        model = mlflow.pyfunc.load_model(uri)
        rows.append(("in-process load_model", f"{time.perf_counter() - t0:.2f} s"))
        model.predict(pd.DataFrame({"text": texts[:16]}))  # warm-up: first-call allocations, lazy imports
        for t in texts[: args.warmup]:
            model.predict(pd.DataFrame({"text": [t]}))

        batch_s, local_labels = [], None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = model.predict(pd.DataFrame({"text": texts}))
            batch_s.append(time.perf_counter() - t0)
            local_labels = list(out["label"])
        med = float(np.median(batch_s))
        rows.append((f"in-process batch of {len(texts)}", f"{len(texts) / med:,.0f} docs/s  "
                     f"({med:.2f} s median of {args.repeats}; best {len(texts) / min(batch_s):,.0f} docs/s)"))
        lat = []
        for t in single:
            frame = pd.DataFrame({"text": [t]})
            t0 = time.perf_counter()
            model.predict(frame)
            lat.append(time.perf_counter() - t0)
        rows.append((f"in-process single doc x{len(lat)}", latency_line(lat)))
        print("in-process done", flush=True)
        del model

        if not args.no_serve:
            with mlflow_server(uri, tracking, args.port, startup_timeout=args.startup_timeout) as server:
                rows.append(("HTTP server startup (to /ping 200)", f"{server.startup_s:.1f} s"))
                with httpx.Client(base_url=server.url, timeout=120) as client:
                    for t in texts[: max(args.warmup, 1)]:  # warm-up: the first requests of a new server are slow
                        client.post("/invocations", json=split_payload([t])).raise_for_status()
                    lat = []
                    for t in single:
                        body = split_payload([t])
                        t0 = time.perf_counter()
                        r = client.post("/invocations", json=body)
                        lat.append(time.perf_counter() - t0)
                        r.raise_for_status()
                    rows.append((f"HTTP single doc x{len(lat)}", latency_line(lat)))
                    batch_s, http_labels = [], None
                    body = split_payload(texts)
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        r = client.post("/invocations", json=body)
                        batch_s.append(time.perf_counter() - t0)
                        r.raise_for_status()
                        http_labels = [p["label"] for p in r.json()["predictions"]]
                    med = float(np.median(batch_s))
                    rows.append((f"HTTP batch of {len(texts)} (one POST)",
                                 f"{len(texts) / med:,.0f} docs/s  ({med:.2f} s median of {args.repeats}; "
                                 f"best {len(texts) / min(batch_s):,.0f} docs/s)"))
                    same = sum(a == b for a, b in zip(local_labels, http_labels))
                    rows.append(("HTTP labels == in-process labels", f"{same}/{len(texts)}"))
                if not server.alive():
                    sys.exit("the server died during the benchmark:\n" + server.log_tail())

    width = max(len(r[0]) for r in rows)
    print()
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    print(f"end: {load_line()}")


if __name__ == "__main__":
    main()
