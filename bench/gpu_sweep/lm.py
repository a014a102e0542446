"""One direction's general LM, trained through the pipeline's own `train_directions`, so its checkpoint carries the
fingerprint a `transfer` run computes and resumes as finished; then `checkpoint-DIR.slim.pt`, without the Adam
moments (a finished checkpoint's optimizer state is never read): a third of the size, for a machine whose
return channel is small. Needs torch, sentencepiece, pandas and yaml (no Prefect or MLflow) and only the
workspace's `params.yaml` and `artifacts/tokenize/` (no corpus files; `data.lm_eval` is not scored).

    python bench/gpu_sweep/lm.py WS fwd [overrides ...]
"""
import sys
import time
from pathlib import Path

from transfer.config import load_params
from transfer.data import load_token_stream
from transfer.io_utils import file_digest
from transfer.stages import STAGES, Workspace
from transfer.stages.lm import train_directions
from transfer.train import load_checkpoint, save_checkpoint
from transfer.train_lm import pretrain_lm

ws = Path(sys.argv[1])
DIR = sys.argv[2]
overrides = sys.argv[3:]
p = load_params(ws / "params.yaml", overrides)
object.__setattr__(p.model, "directions", [DIR])  # past the check that every evaluate.variant has its LM
paths = Workspace(ws)
path = paths.art("tokenize", "general.npy")
t0 = time.time()
m = train_directions(STAGES["pretrain"], p, paths, p.pretrain, load_token_stream(path), p.pretrain.valid_frac,
                     lambda d: None, pretrain_lm, lambda d: file_digest(path))
print("metrics", m, "wall_s", round(time.time() - t0, 1), flush=True)
ck = load_checkpoint(paths.art("pretrain", f"checkpoint-{DIR}.pt"))
assert ck["finished"]
print("fingerprint", ck["fingerprint"], flush=True)
ck["optimizer"] = dict(state={}, param_groups=ck["optimizer"]["param_groups"])
save_checkpoint(paths.art("pretrain", f"checkpoint-{DIR}.slim.pt"), ck)
print("history", *ck["history"], sep="\n")
