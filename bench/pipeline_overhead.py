"""Pipeline overhead: wall time of `transfer run` first, fully cached, and after a classifier-only change.

In a fresh temp workspace (tests/conftest.py `make_workspace`: tiny params + small synthetic data; `--demo`
uses the repo's params.yaml and its demo data instead), each run is a subprocess `transfer run` with its own
PREFECT_HOME (Prefect's ephemeral local server and database) and MLFLOW_TRACKING_URI=sqlite:///<ws>/mlflow.db:

  prefect warm-up  an empty flow, twice, in the same PREFECT_HOME: the first creates Prefect's database (so
                   the pipeline's first run is not charged for it); the second is the floor any run pays
  first            every stage computed
  cached           the same command again: every stage should be Cached
  classifier-only  `-S classifier.lr=0.02`: only train_classifier and evaluate should run again

Prints seconds per run, the stage states parsed from the summary table, and cached/first (target < 1/3).
The workspace is deleted afterwards unless --keep.

    python bench/pipeline_overhead.py                 # tiny config, ~minutes on 2 busy cores
    python bench/pipeline_overhead.py --demo          # the repo's params.yaml (make run's demo config)
    python bench/pipeline_overhead.py --keep --timeout 1200
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]
TARGET_RATIO = 1 / 3
_ROW = re.compile(r"^[│|]\s*(\w+)\s*[│|]\s*(\w+)\s*[│|]\s*([\d.]+)\s*[│|]\s*$")


def load_line() -> str:
    one, five, fifteen = os.getloadavg()
    return f"loadavg {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


def transfer_exe() -> str:
    """The `transfer` console script of this interpreter's environment."""
    exe = Path(sys.executable).parent / "transfer"
    found = str(exe) if exe.exists() else shutil.which("transfer")
    if not found:
        sys.exit("no `transfer` executable next to this python or on PATH (pip install -e . in the venv)")
    return found


def make_ws(root: Path, demo: bool, overrides: list[str] = ()) -> Path:
    """A tiny workspace (conftest.make_workspace) or, with demo=True, a copy of the repo's params.yaml."""
    if demo:
        root.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / "params.yaml", root / "params.yaml")
        from transfer.demo import make_demo

        make_demo(root / "data" / "demo")  # what the first run would generate, kept out of the timing
        return root
    sys.path.insert(0, str(REPO))
    from tests.conftest import make_workspace

    return make_workspace(root, list(overrides))


CODE_DIRS = ("transfer", "tasks", "flows")


def snapshot_code(dest: Path) -> Path:
    """Copy the packages `transfer run` imports, so edits to the live tree mid-benchmark change nothing.

    Put first on PYTHONPATH it shadows the editable install (whose finder comes after sys.path), and the cache
    keys, which hash the library directory, stay the same across the runs.
    """
    for name in CODE_DIRS:
        shutil.copytree(REPO / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def source_fingerprint(root: Path = REPO) -> str:
    """sha256 over the .py files of the code directories (path + bytes)."""
    import hashlib

    h = hashlib.sha256()
    for name in CODE_DIRS:
        for f in sorted((root / name).rglob("*.py")):
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def run_env(ws: Path, prefect_home: Path, code: Path | None = None) -> dict[str, str]:
    env = {**os.environ, "PREFECT_HOME": str(prefect_home), "MLFLOW_TRACKING_URI": f"sqlite:///{ws / 'mlflow.db'}"}
    env.pop("PREFECT_API_URL", None)  # always Prefect's ephemeral local server, never a shared one
    env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")  # busy machines start slowly
    env.setdefault("PYTHONUNBUFFERED", "1")
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")]))
    return env


_LOG = re.compile(r"^(\d\d):(\d\d):(\d\d(?:\.\d+)?) \| \w+\s*\| (.*)$")
_MARKS = [  # (phase that ends at the first log line matching, pattern)
    ("python + imports", re.compile(r"Starting temporary server")),
    ("prefect server start", re.compile(r"Beginning flow run")),
    ("stages (incl. MLflow logging)", re.compile(r"Flow run .* - evaluate: \w+ in")),
    ("register + promote", re.compile(r"Flow run .* - Finished in state")),
]


def phases(log_text: str, start: datetime.datetime, end: datetime.datetime) -> list[tuple[str, float]]:
    """Split a run's wall time at Prefect's log lines -> [(phase, seconds)]; the rest is teardown."""
    def seconds_of_day(d: datetime.datetime) -> float:
        return d.hour * 3600 + d.minute * 60 + d.second + d.microsecond / 1e6

    t_prev, out, marks = seconds_of_day(start), [], list(_MARKS)
    for line in log_text.splitlines():
        m = _LOG.match(line)
        if not m or not marks:
            continue
        t = int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
        if t < t_prev - 43200:  # past midnight
            t += 86400
        if marks[0][1].search(m.group(4)):
            out.append((marks[0][0], t - t_prev))
            t_prev = t
            marks.pop(0)
    if not marks:
        t_end = seconds_of_day(end)
        out.append(("teardown + exit", (t_end + 86400 if t_end < t_prev - 43200 else t_end) - t_prev))
    return out


def timed(cmd: list[str], cwd: Path, env: dict[str, str], log: Path, timeout: float
          ) -> tuple[float, str, list[tuple[str, float]]]:
    """Run cmd, return (seconds, stdout, phases); on failure print the log tail and exit."""
    t0 = time.perf_counter()
    wall0 = datetime.datetime.now()
    with open(log, "w") as err:
        try:
            proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            sys.exit(f"{' '.join(cmd)} ran past --timeout {timeout:.0f}s (stderr: {log})")
    seconds = time.perf_counter() - t0
    log.with_suffix(".out").write_text(proc.stdout)
    split = phases(log.read_text(errors="replace"), wall0, wall0 + datetime.timedelta(seconds=seconds))
    if proc.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:])
        sys.exit(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}\n"
                 f"--- stderr tail ---\n{tail}")
    return seconds, proc.stdout, split


def stage_states(stdout: str) -> dict[str, tuple[str, float]]:
    """{stage: (state, seconds)} from the summary table `transfer run` prints."""
    rows = {}
    for line in stdout.splitlines():
        m = _ROW.match(line.strip())
        if m:
            rows[m.group(1)] = (m.group(2), float(m.group(3)))
    return rows


def run_transfer(ws: Path, env: dict[str, str], extra: list[str], log: Path, timeout: float
                 ) -> tuple[float, dict[str, tuple[str, float]], list[tuple[str, float]]]:
    """`transfer run EXTRA` in ws -> (seconds, {stage: (state, seconds)}, [(phase, seconds)])."""
    seconds, out, split = timed([transfer_exe(), "run", *extra], ws, env, log, timeout)
    return seconds, stage_states(out), split


@contextlib.contextmanager
def tiny_pipeline(demo: bool = False, timeout: float = 1800, keep: bool = False, quiet: bool = False
                  ) -> Iterator[tuple[Path, dict[str, str]]]:
    """A temp workspace after one `transfer run` (so a champion exists) -> (workspace, env for it)."""
    tmp = Path(tempfile.mkdtemp(prefix="transfer-bench-"))
    try:
        ws = make_ws(tmp / "ws", demo)
        env = run_env(ws, tmp / "prefect-home", snapshot_code(tmp / "code"))
        if not quiet:
            print(f"running the {'demo' if demo else 'tiny'} pipeline in {ws} ...", flush=True)
        seconds, _, _ = run_transfer(ws, env, [], tmp / "first.log", timeout)
        if not quiet:
            print(f"pipeline done in {seconds:.1f}s", flush=True)
        yield ws, env
    finally:
        if keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


_EMPTY_FLOW = "from prefect import flow\n@flow\ndef noop():\n    return 1\nnoop()\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", action="store_true", help="use the repo's params.yaml instead of the tiny test config")
    ap.add_argument("--no-warmup", action="store_true", help="skip the Prefect warm-up (the first run then "
                    "also creates Prefect's database)")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds allowed per subprocess (default 1200)")
    ap.add_argument("--keep", action="store_true", help="keep the temp workspace and logs")
    ap.add_argument("--live", action="store_true", help="run the live working tree instead of a snapshot of "
                    "transfer/, tasks/, flows/ taken at start (concurrent edits then cause cache misses)")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="transfer-overhead-"))
    rows: list[tuple[str, float, str]] = []
    print(f"start: {load_line()}", flush=True)
    try:
        ws = make_ws(tmp / "ws", args.demo)
        code = None if args.live else snapshot_code(tmp / "code")
        env = run_env(ws, tmp / "prefect-home", code)
        fingerprint = source_fingerprint(code or REPO)
        print(f"workspace {ws} ({'repo params.yaml' if args.demo else 'tiny test config'}); code "
              f"{'live tree' if args.live else 'snapshot'} {fingerprint}", flush=True)
        if not args.no_warmup:
            for i, label in enumerate(("prefect warm-up (creates db)", "prefect empty flow (floor)")):
                s, _, _ = timed([sys.executable, "-c", _EMPTY_FLOW], ws, env, tmp / f"warmup{i}.log", args.timeout)
                rows.append((label, s, ""))
                print(f"{label}: {s:.1f}s", flush=True)
        runs = [("first", []), ("cached", []), ("classifier-only", ["-S", "classifier.lr=0.02"])]
        seconds, changed, states_by_run, breakdowns = {}, [], {}, {}
        for name, extra in runs:
            s, states, split = run_transfer(ws, env, extra, tmp / f"{name}.log", args.timeout)
            seconds[name] = s
            now = source_fingerprint(code or REPO)
            if now != fingerprint:
                changed.append(name)
                fingerprint = now
            summary = " ".join(f"{st}:{state[:4]}/{sec:.1f}s" for st, (state, sec) in states.items()) or "(no stage table)"
            states_by_run[name] = {st: state for st, (state, _) in states.items()}
            rows.append((f"transfer run: {name}", s, summary))
            breakdowns[name] = split
            print(f"{name}: {s:.1f}s  [{summary}]  {load_line()}", flush=True)
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    width = max(len(r[0]) for r in rows)
    print()
    print(f"{'run':<{width}}  {'seconds':>8}  stage:state/seconds (Comp = computed, Cach = cached)")
    for label, s, summary in rows:
        print(f"{label:<{width}}  {s:8.1f}  {summary}")
    if all(breakdowns.values()):
        print("\nwhere the time goes (split at Prefect's log lines; seconds):")
        names = [p for p, _ in breakdowns["first"]]
        print(f"{'phase':<30}" + "".join(f"{n:>17}" for n in breakdowns))
        for i, phase in enumerate(names):
            print(f"{phase:<30}" + "".join(f"{(b[i][1] if i < len(b) else float('nan')):17.1f}" for b in breakdowns.values()))
    ratio = seconds["cached"] / seconds["first"]
    ratio_cls = seconds["classifier-only"] / seconds["first"]
    print(f"\ncached/first          = {ratio:.3f}  (target < {TARGET_RATIO:.3f}: {'PASS' if ratio < TARGET_RATIO else 'FAIL'})")
    print(f"classifier-only/first = {ratio_cls:.3f}")
    cached_ok = bool(states_by_run["cached"]) and all(v == "Cached" for v in states_by_run["cached"].values())
    recomputed = sorted(k for k, v in states_by_run["classifier-only"].items() if v != "Cached")
    print(f"cached rerun fully cached: {'yes' if cached_ok else 'NO'}; classifier-only recomputed: "
          f"{', '.join(recomputed) or 'nothing'} (expected: evaluate, train_classifier)")
    if changed:
        print(f"WARNING: the code changed during: {', '.join(changed)} (someone edited the live tree); "
              "cache misses there are expected, rerun without --live")
    print(f"end: {load_line()}")


if __name__ == "__main__":
    main()
