#!/usr/bin/env bash
# GPU smoke check: nvidia-smi, ~300 bf16 steps of the default-size LM through transfer.train_lm.pretrain_lm
# (with a checkpoint path), tokens/s and peak CUDA memory, then the checkpoint loaded on CPU
# (load_checkpoint, weights_only) into a CPU LanguageModel whose logits must match the GPU model's.
#
#   bash bench/gpu_check.sh                                  # on a CUDA machine, project pip-installed
#   GPU_CHECK_ALLOW_CPU=1 STEPS=5 bash bench/gpu_check.sh    # dry run: tiny sizes on CPU, no GPU needed
#
# Env: STEPS (default 300), PYTHON (default python), GPU_CHECK_ALLOW_CPU=1 (dry run, hides any GPU).
# Exits non-zero on any failure.
set -euo pipefail

PYTHON=${PYTHON:-python}
export STEPS=${STEPS:-300}
export GPU_CHECK_ALLOW_CPU=${GPU_CHECK_ALLOW_CPU:-0}

if [[ "$GPU_CHECK_ALLOW_CPU" == 1 ]]; then
    echo "== dry run (GPU_CHECK_ALLOW_CPU=1): tiny sizes on CPU"
    export CUDA_VISIBLE_DEVICES=""  # fit() picks CUDA whenever it can
else
    if ! command -v nvidia-smi >/dev/null; then
        echo "FAIL: nvidia-smi not found (set GPU_CHECK_ALLOW_CPU=1 for a CPU dry run)" >&2
        exit 1
    fi
    echo "== nvidia-smi"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

"$PYTHON" - "$WORK/lm.ckpt" <<'PY'
import dataclasses, math, os, sys, time
from pathlib import Path

import numpy as np
import torch

from transfer.config_train import PretrainParams
from transfer.data import LMLoader
from transfer.device import pick_device
from transfer.model import LanguageModel, lm_config
from transfer.train import load_checkpoint
from transfer.train_lm import pretrain_lm

ckpt = Path(sys.argv[1])
steps = int(os.environ["STEPS"])
dry = os.environ["GPU_CHECK_ALLOW_CPU"] == "1"
device = pick_device()
print(f"== torch {torch.__version__}, device {device}, cuda {torch.version.cuda}")
if not dry:
    assert device.type == "cuda", "torch.cuda.is_available() is False"
    assert torch.cuda.is_bf16_supported(), f"{torch.cuda.get_device_name()} does not support bf16"
    print(f"   {torch.cuda.get_device_name()}, cudnn {torch.backends.cudnn.version()}")

sizes = dict(emb_size=16, hidden_size=32) if dry else dict(emb_size=400, hidden_size=1152)
vocab, bs, bptt, warmup = (100, 4, 10, 2) if dry else (15000, 32, 70, 20)
warmup = min(warmup, max(steps - 1, 0))
cfg = lm_config(vocab, **sizes)

stamps = []
class TimedLoader(LMLoader):
    """Stamps the clock each time fit() pulls a batch (loss.item() syncs the GPU every step)."""
    def batches(self, epoch=0, start=0):
        for b in super().batches(epoch, start):
            stamps.append(time.perf_counter())
            yield b
        stamps.append(time.perf_counter())

rng = np.random.default_rng(0)
n_tokens = (steps * bptt + 1) * bs  # variable=False: exactly `steps` full-length batches
train = TimedLoader(rng.integers(4, vocab, n_tokens, dtype=np.uint16), bs, bptt, variable=False)
valid = LMLoader(rng.integers(4, vocab, 20 * bptt * bs, dtype=np.uint16), bs, bptt, variable=False)
hp = dataclasses.replace(PretrainParams(), epochs=1, bs=bs, bptt=bptt, precision="bf16", checkpoint_every=10**9)

torch.manual_seed(0)
model = LanguageModel(cfg)
n_params = sum(p.numel() for p in model.parameters())
print(f"== pretrain_lm: {n_params / 1e6:.1f}M params, {len(train.seq_lens(0))} steps of {bs}x{bptt}, bf16")
if device.type == "cuda":
    torch.cuda.reset_peak_memory_stats()
t0 = time.perf_counter()
history = pretrain_lm(model, train, valid, hp, ckpt_path=ckpt, progress=False)
wall = time.perf_counter() - t0
row = history[-1]
assert len(stamps) == steps + 1, f"expected {steps} steps, fit ran {len(stamps) - 1}"
assert math.isfinite(row["train_loss"]) and math.isfinite(row["valid_loss"]), row
steady = (steps - warmup) * bs * bptt / (stamps[-1] - stamps[warmup])
print(f"   train_loss {row['train_loss']:.3f} (ln V = {math.log(vocab):.3f}), valid_ppl {row['valid_ppl']:.1f}, "
      f"wall {wall:.1f} s incl. validation + checkpoint")
print(f"   tokens/s: {steady:,.0f} steady (first {warmup} steps excluded), "
      f"{row['items_per_s']:,.0f} whole epoch")
if device.type == "cuda":
    print(f"   torch.cuda.max_memory_allocated: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")

print(f"== checkpoint {ckpt.stat().st_size / 2**20:.0f} MiB -> CPU (weights_only)")
ck = load_checkpoint(ckpt)
assert ck["finished"], "checkpoint is not marked finished"
assert all(t.device.type == "cpu" for t in ck["model"].values())
cpu_model = LanguageModel(cfg)
cpu_model.load_state_dict(ck["model"])  # strict: every key and shape must match
cpu_model.eval()
model.eval()
x = torch.from_numpy(rng.integers(4, vocab, (2, bptt))).long()
with torch.no_grad():
    ref = model(x.to(device))[0].float().cpu()  # fp32 on the training device (no autocast here)
    got = cpu_model(x)[0]
err = (ref - got).abs().max().item()
print(f"   CPU vs {device.type} logits, max abs diff {err:.2e}")
assert err < 1e-2, f"CPU logits differ from the {device.type} model's by {err}"
print("OK")
PY
