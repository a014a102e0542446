"""One sample-efficiency cell (budget, seed, extra overrides) through the pipeline's own stages (prepare,
train_classifier, evaluate) in its own workspace CELL, reusing WS's tokenizer and domain LMs (symlinks), with
the overrides `transfer experiment sample-efficiency` gives a cell. Appends one JSON line to OUT: test error per
variant, validation accuracy per member, self-training's per-round validation accuracy.

    DATA=... python bench/gpu_sweep/cell.py WS CELL OUT TAG BUDGET SEED [overrides ...]
"""
import json
import os
import sys
import time
from pathlib import Path

import torch

from transfer.config import load_params
from transfer.stages import Workspace, run_stage

torch.set_num_threads(1)  # run.sh starts 15 cells at once on one machine

base, cell, out, tag, budget = Path(sys.argv[1]).resolve(), Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
seed, extra = int(sys.argv[6]), sys.argv[7:]
data = Path(os.environ["DATA"]).resolve()
labels = "null" if budget == "all" else budget
ov = [f"data.train={data}/train.csv", f"data.test={data}/test.csv", f"data.max_train_labels={labels}",
      f"data.label_seed={seed}", f"classifier.seed={seed}", *extra]
p = load_params(base / "params.yaml", ov)
(cell / "artifacts").mkdir(parents=True, exist_ok=True)
for d in ("tokenize", "finetune_lm"):
    if not (cell / "artifacts" / d).exists():
        (cell / "artifacts" / d).symlink_to(base / "artifacts" / d)
paths = Workspace(cell)
t0 = time.time()
prep = run_stage("prepare", p, paths)
clas = run_stage("train_classifier", p, paths)
ev = run_stage("evaluate", p, paths)
row = dict(tag=tag, budget=budget, seed=seed, n_labels=prep["n_train"], overrides=extra, wall_s=round(time.time() - t0, 1),
           errors={v: m["error_rate"] for v, m in ev["variants"].items()},
           self_training=clas.get("self_training"),
           valid={k: v["valid_accuracy"] for k, v in clas.items() if isinstance(v, dict) and "valid_accuracy" in v})
with open(out, "a") as f:
    f.write(json.dumps(row) + "\n")
print(json.dumps(row), flush=True)
