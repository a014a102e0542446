"""LM training speed with glibc's default malloc against `keep_freed_memory()` (transfer.device).

Each mode runs in its own subprocess (mallopt settings are per process): the library's AWD-LSTM LM on random
tokens, bf16 autocast where the CPU has it, the pretraining step (loss, backward, fused AdamW). Prints tokens/s,
minor page faults per step and the process's kernel (sys) and user CPU seconds.

    python bench/allocator.py                 # 16k vocab, 256/512, bs 64 x bptt 70, 15 timed steps
    python bench/allocator.py --vocab 8000 --steps 30
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def worker(args: argparse.Namespace) -> None:
    import torch

    from transfer.device import autocast, keep_freed_memory
    from transfer.model import LanguageModel, lm_config
    from transfer.train_lm import _lm_step

    kept = keep_freed_memory() if args.mode == "kept" else False
    torch.manual_seed(0)
    model = LanguageModel(lm_config(args.vocab, 0.1, emb_size=args.emb, hidden_size=args.hidden, n_layers=3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step = _lm_step(2.0, 1.0)

    def run(n: int) -> None:
        for _ in range(n):
            x, y = torch.randint(0, args.vocab, (2, args.bs, args.bptt))
            with autocast(torch.device("cpu"), "auto"):
                loss, _, _ = step(model, (x, y, 1.0))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    run(3)  # warm-up: first-touch of weights, optimizer state, kernels
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    run(args.steps)
    dt, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    tok_s = round(args.steps * args.bs * args.bptt / dt)
    print(json.dumps(dict(mode=args.mode, glibc_settings_applied=kept, tok_s=tok_s,
                          faults_per_step=round((r1.ru_minflt - r0.ru_minflt) / args.steps),
                          sys_s=round(r1.ru_stime - r0.ru_stime, 1), user_s=round(r1.ru_utime - r0.ru_utime, 1))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--emb", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--bptt", type=int, default=70)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--mode", choices=["default", "kept"], help=argparse.SUPPRESS)  # set for the subprocesses
    args = ap.parse_args()
    if args.mode:
        return worker(args)
    for mode in ("default", "kept"):  # one after the other: on 2 cores a second job halves the first one's speed
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--mode", mode], check=True)


if __name__ == "__main__":
    main()
