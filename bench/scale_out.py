"""Wall time of `transfer benchmark` in order, on a local Dask cluster of 1 worker, and of 2 workers.

    python bench/scale_out.py [WORKDIR]
    python bench/scale_out.py WORKDIR --suite SUITE --general-lm DIR --lms OUT

Without `--suite`: a tiny suite on the synthetic demo data (the test suite's tiny params; 2 datasets x 2
budgets x 2 seeds = 8 cells), one general LM built first and shared (`--general-lm`), so each run times the
domain LMs and the cells. With `--suite`: real cells, in order and on 2 workers; the domain LMs are copied from
OUT (a finished `transfer benchmark` output of the same suite), so only the cells are timed.
Prints one line per mode: wall seconds, and the CSV's rows compared with the sequential run's (wall time aside).
On 2 cores little speed-up is expected: the workers share the cores the sequential run had. Rows match only
where every cell trains on the same number of torch threads (tiny models always use one).
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.conftest import make_workspace  # noqa: E402  (the tiny params and demo data the tests use)

TRANSFER = str(Path(sys.executable).with_name("transfer"))
SUITE = """\
params: params.yaml
budgets: [40, all]
seeds: [0, 1]
overrides: ["model.directions=[fwd]", "evaluate.variants=[tfidf,ulmfit_fwd]"]
datasets:
  - name: demo
    train: data/demo/train.csv
    test: data/demo/test.csv
  - name: demo_held_out
    train: data/demo/train.csv
"""


SEQUENTIAL = ("in order, in process", "out-seq", [])
TWO_WORKERS = ("Dask, 2 local workers", "out-w2", ["--workers", "2"])


def run(ws: Path, out: str, *args: str, suite: str = "suite.yaml") -> float:
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{ws / 'mlflow.db'}")
    t0 = time.perf_counter()
    subprocess.run([TRANSFER, "benchmark", "--suite", suite, "--out", out, *args], cwd=ws, env=env,
                   check=True, capture_output=True, text=True)
    return time.perf_counter() - t0


def rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return [{k: v for k, v in r.items() if k != "seconds"} for r in csv.DictReader(f)]


def time_modes(ws: Path, modes: list[tuple[str, str, list[str]]], *args: str, suite: str = "suite.yaml",
               before=lambda out: None) -> None:
    """One `transfer benchmark` per (label, out, extra args); prints wall seconds and whether rows equal the first's."""
    base = None
    for label, out, extra in modes:
        before(out)
        seconds = run(ws, out, *args, *extra, suite=suite)
        got = rows(ws / out / "results.csv")
        base = base or got
        print(f"{label:24s} {seconds:7.1f} s   {len(got)} rows, {'same as in order' if got == base else 'DIFFERENT'}")


def real_cells(root: Path, suite: Path, general: Path, lms: Path) -> None:
    """The suite's cells in order, then on 2 local workers, each out folder seeded with OUT's domain LMs."""
    def seed_lms(out: str) -> None:
        for dataset in (lms / "work").iterdir():  # the dataset workspaces, without their cells
            for part in ("artifacts", "metrics", "plots"):
                if (dataset / part).exists():
                    shutil.copytree(dataset / part, root / out / "work" / dataset.name / part, symlinks=True,
                                    dirs_exist_ok=True)

    root.mkdir(parents=True, exist_ok=True)
    time_modes(root, [SEQUENTIAL, TWO_WORKERS], "--general-lm", str(general.resolve()), suite=str(suite.resolve()),
               before=seed_lms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("workdir", nargs="?", type=Path)
    ap.add_argument("--suite", type=Path, help="a real suite file (absolute data paths)")
    ap.add_argument("--general-lm", type=Path, help="with --suite: the general LM workspace")
    ap.add_argument("--lms", type=Path, help="with --suite: a finished benchmark OUT holding the domain LMs")
    args = ap.parse_args()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="scale-out-"))
    if args.suite:
        if not (args.general_lm and args.lms):
            ap.error("--suite needs --general-lm and --lms")
        return real_cells(root, args.suite, args.general_lm, args.lms)
    ws = make_workspace(root / "ws")
    (ws / "suite.yaml").write_text(SUITE)
    print(f"general LM (once): {run(ws, 'out-general', '--datasets', 'demo', '--budgets', '40', '--seeds', '0'):.1f} s")
    time_modes(ws, [SEQUENTIAL, ("Dask, 1 local worker", "out-w1", ["--workers", "1"]), TWO_WORKERS],
               "--general-lm", "out-general/general")


if __name__ == "__main__":
    main()
