"""Data-parallel pretraining on one CPU machine: 1 process x all threads against N processes x 1 thread each.

    python bench/ddp_throughput.py GENERAL_WS [--steps 15] [--out docs/results/ddp_cpu.json]

GENERAL_WS is a workspace whose `tokenize` stage is done (e.g. the dev suite's `general/`): its tokenizer and
token stream are linked, never copied. Both runs pretrain the forward LM of `examples/real_data.yaml` for the
same global batch (64 = 1 x 64 = 2 x 32) and the same tokens; tokens/s is the training rate the stage reports
(no start-up, no validation). Run it on an otherwise idle machine: it prints one table and writes a JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(ws: Path, nproc: int, steps: int) -> dict:
    bs = 64 // nproc
    shutil.rmtree(ws / "artifacts" / "pretrain", ignore_errors=True)
    (ws / "metrics" / "pretrain.json").unlink(missing_ok=True)
    cmd = [str(Path(sys.executable).parent / "transfer"), "stage", "pretrain", "--params",
           str(REPO / "examples" / "real_data.yaml"), "--nproc", str(nproc),
           "-S", "model.directions=[fwd]", "-S", "evaluate.variants=[tfidf,ulmfit_fwd]", "-S", "data.lm_eval=[]",
           "-S", f"pretrain.bs={bs}", "-S", f"pretrain.max_tokens={steps * 64 * 70}",
           "-S", "pretrain.valid_frac=0.0005", "-S", "pretrain.checkpoint_every=100000",
           "-S", "pretrain.fail_at_unigram=null"]  # a dozen steps do not beat unigram: speed only
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ws, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    m = json.loads((ws / "metrics" / "pretrain.json").read_text())["fwd"]
    return dict(processes=nproc, threads_each=(os.cpu_count() or 1) // nproc, bs_per_process=bs, global_bs=64,
                tokens=m["train_tokens"], tokens_per_s=round(m["tokens_per_s"], 1), train_s=round(m["train_s"], 1),
                wall_s=round(wall, 1), valid_ppl=round(m["valid_ppl"], 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("general", type=Path)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--work", type=Path, default=Path("/tmp/ddp_bench"))
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "ddp_cpu.json")
    args = ap.parse_args()
    ws = args.work
    (ws / "artifacts").mkdir(parents=True, exist_ok=True)
    (ws / "metrics").mkdir(exist_ok=True)
    for part in (("artifacts", "tokenize"), ("metrics", "tokenize.json")):
        link = ws.joinpath(*part)
        if not link.exists():
            link.symlink_to(args.general.resolve().joinpath(*part))
    rows = [run(ws, n, args.steps) for n in (1, 2)]
    print(f"{'processes x threads':>20} {'tokens':>8} {'tok/s':>8} {'train s':>8} {'wall s':>7}")
    for r in rows:
        print(f"{r['processes']:>10} x {r['threads_each']:<7} {r['tokens']:>8} {r['tokens_per_s']:>8} "
              f"{r['train_s']:>8} {r['wall_s']:>7}")
    args.out.write_text(json.dumps(dict(machine=_cpu(), rows=rows), indent=2) + "\n")


def _cpu() -> str:
    try:
        name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        name = "unknown CPU"
    return f"{name}, {os.cpu_count()} cores"


if __name__ == "__main__":
    main()
