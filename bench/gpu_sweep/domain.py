"""`prepare` (all labels) and `finetune_lm` (both directions) in workspace WS, whose `artifacts/pretrain/lm-*.pt`
exist; the labelled tables are $DATA/train.csv and $DATA/test.csv.

    DATA=../shared/data/ag_news/split python bench/gpu_sweep/domain.py WS [overrides ...]
"""
import os
import sys
import time
from pathlib import Path

from transfer.config import load_params
from transfer.stages import Workspace, run_stage

base = Path(sys.argv[1]).resolve()
data = Path(os.environ["DATA"]).resolve()
p = load_params(base / "params.yaml", [f"data.train={data}/train.csv", f"data.test={data}/test.csv", *sys.argv[2:]])
paths = Workspace(base)
run_stage("prepare", p, paths)
t0 = time.time()
print("finetune_lm", run_stage("finetune_lm", p, paths), "wall_s", round(time.time() - t0, 1), flush=True)
