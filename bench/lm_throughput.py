"""LM training throughput on CPU: the library's loop (`transfer.train_lm.pretrain_lm`) vs a minimal torch loop.

Both loops run batch 32 x bptt 70 (fixed length: the library's LMLoader gets `variable=False`), and time
forward + backward + optimizer step. Each measurement runs in its own subprocess, so its peak RSS
(getrusage ru_maxrss) is its own and neither loop inherits the other's allocator or thread-pool state.

Steady state: the first `--warmup` steps are excluded. The library loop is timed by stamping the clock each
time `fit` pulls a batch from the loader, so the interval between stamps k and k+n covers exactly n full
optimizer steps (including the loader's own slicing). The first plain run lasts `--seconds` after its
warm-up and fixes the step count; every other run (`--repeats`, alternating which loop goes first) runs
exactly that many steps, and each loop reports its best run. Process CPU time per step is reported too:
on a shared machine other jobs inflate wall time much more than our own CPU time.

    python bench/lm_throughput.py                     # both sizes, fp32, ~30 s per measurement
    python bench/lm_throughput.py --sizes small --seconds 10 --threads 1 --repeats 3
    python bench/lm_throughput.py --bf16 --profile    # + torch.profiler top ops of both loops
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

SIZES = {
    "default": dict(emb=400, hidden=1152, vocab=15000),
    "small": dict(emb=256, hidden=512, vocab=8000),
    "ag_news": dict(emb=256, hidden=512, vocab=16000),  # examples/ag_news.yaml
}
N_LAYERS = 3


# --------------------------------------------------------------------------- the two measured loops (workers)


def _torch_setup(cfg: dict):
    import torch

    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    torch.manual_seed(0)
    return torch


def _random_stream(vocab: int, n: int):
    import numpy as np

    # ids >= 4 avoid the special tokens; uint16 like write_token_stream's on-disk format
    return np.random.default_rng(0).integers(4, vocab, size=n, dtype=np.uint16)


def _profile_table(prof, rows: int = 15) -> str:
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def run_library(cfg: dict) -> dict:
    """`pretrain_lm` on an LMLoader(variable=False) over a random stream, for exactly cfg['steps'] steps."""
    torch = _torch_setup(cfg)
    from dataclasses import replace

    from transfer.config_train import PretrainParams
    from transfer.data import LMLoader
    from transfer.model import LanguageModel, lm_config
    from transfer.train_lm import pretrain_lm

    size, bs, bptt, steps = SIZES[cfg["size"]], cfg["bs"], cfg["bptt"], cfg["steps"]
    stamps: list[tuple[float, float]] = []

    class TimedLoader(LMLoader):
        """Stamps the clock each time fit() asks for the next batch, i.e. after each optimizer step."""

        def batches(self, epoch: int = 0, start: int = 0):
            for batch in super().batches(epoch, start):
                stamps.append(_now())
                yield batch
            stamps.append(_now())  # fit() pulls once more after its last step

    max_tokens = (steps * bptt + 1) * bs  # exactly `steps` full-length batches
    loader = TimedLoader(_random_stream(size["vocab"], max_tokens + bs), bs, bptt, variable=False,
                         max_tokens=max_tokens)
    assert loader.seq_lens(0) == [bptt] * steps, "stream does not split into full batches"
    model = LanguageModel(lm_config(size["vocab"], emb_size=size["emb"], hidden_size=size["hidden"],
                                    n_layers=N_LAYERS))
    hp = replace(PretrainParams(), epochs=1, bs=bs, bptt=bptt, precision="bf16" if cfg["bf16"] else "fp32",
                 checkpoint_every=10**9)
    n_params = sum(p.numel() for p in model.parameters())
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    history = pretrain_lm(model, loader, None, hp, progress=False)  # no ckpt_path: no checkpoint writes
    wall = time.perf_counter() - t0
    out = _summary(cfg, stamps, wall, n_params, load0)
    out["history_tok_s"] = history[-1]["items_per_s"]  # whole epoch, warm-up steps included
    if cfg["profile"]:
        from torch.profiler import ProfilerActivity, profile

        small = TimedLoader(_random_stream(size["vocab"], (6 * bptt + 2) * bs), bs, bptt, variable=False,
                            max_tokens=(6 * bptt + 1) * bs)
        pretrain_lm(model, small, None, hp, progress=False)  # warm-up run
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            pretrain_lm(model, small, None, hp, progress=False)
        out["profile"] = _profile_table(prof)
    return out


def run_plain(cfg: dict) -> dict:
    """nn.Embedding -> 3 nn.LSTM -> tied Linear, no dropout/AR/TAR/clipping; AdamW; fixed-length TBPTT."""
    torch = _torch_setup(cfg)
    from torch import nn
    import torch.nn.functional as F

    size, bs, bptt = SIZES[cfg["size"]], cfg["bs"], cfg["bptt"]
    V, E, H = size["vocab"], size["emb"], size["hidden"]

    class PlainLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, E)
            dims = [E] + [H] * (N_LAYERS - 1) + [E]
            self.rnns = nn.ModuleList(nn.LSTM(dims[i], dims[i + 1], batch_first=True) for i in range(N_LAYERS))
            self.dec = nn.Linear(E, V)
            self.dec.weight = self.emb.weight

        def forward(self, x, hidden):
            out, new = self.emb(x), []
            for rnn, h in zip(self.rnns, hidden):
                out, h = rnn(out, h)
                new.append((h[0].detach(), h[1].detach()))
            return self.dec(out), new

    model = PlainLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n_params = sum(p.numel() for p in model.parameters())
    window = 64  # batches of distinct data, reused cyclically (throughput does not depend on the values)
    data = torch.from_numpy(_random_stream(V, bs * (window * bptt + 1)).astype("int64")).view(bs, -1)
    hidden = [(torch.zeros(1, bs, r.hidden_size), torch.zeros(1, bs, r.hidden_size)) for r in model.rnns]
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg["bf16"])

    def step(k: int) -> None:
        nonlocal hidden
        i = (k % window) * bptt
        x, y = data[:, i:i + bptt], data[:, i + 1:i + bptt + 1]
        with amp:
            logits, hidden = model(x, hidden)
        loss = F.cross_entropy(logits.float().reshape(-1, V), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()  # the library loop reads the loss every step too

    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    stamps = [_now()]
    k = 0
    fixed = cfg["steps"]  # None: run --seconds past the warm-up
    while True:
        step(k)
        k += 1
        stamps.append(_now())
        if fixed is not None and k >= fixed:
            break
        if (fixed is None and k >= cfg["warmup"] + cfg["min_steps"]
                and stamps[-1][0] - stamps[cfg["warmup"]][0] >= cfg["seconds"]):
            break
    wall = time.perf_counter() - t0
    out = _summary(cfg, stamps, wall, n_params, load0)
    if cfg["profile"]:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for j in range(6):
                step(k + j)
        out["profile"] = _profile_table(prof)
    return out


def _now() -> tuple[float, float]:
    # process CPU time (all threads) next to wall time: other jobs on the machine inflate wall time
    # far more than they inflate our own CPU time
    return time.perf_counter(), time.process_time()


def _summary(cfg: dict, stamps: list[tuple[float, float]], wall: float, n_params: int, load0: float) -> dict:
    import torch

    w = cfg["warmup"]
    steps = len(stamps) - 1
    if steps <= w:
        raise SystemExit(f"only {steps} steps ran; need more than --warmup {w}")
    per_step = (stamps[-1][0] - stamps[w][0]) / (steps - w)
    cpu_per_step = (stamps[-1][1] - stamps[w][1]) / (steps - w)
    return dict(steps=steps, measured_steps=steps - w, s_per_step=per_step, cpu_s_per_step=cpu_per_step,
                step_wall_s=[round(b[0] - a[0], 4) for a, b in zip(stamps, stamps[1:])],
                tok_s=cfg["bs"] * cfg["bptt"] / per_step, wall_s=wall, params=n_params,
                maxrss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
                threads=torch.get_num_threads(), load_before=load0, load_after=os.getloadavg()[0])


# --------------------------------------------------------------------------- driver


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _run_worker(cfg: dict) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # fit() picks CUDA when it can; this bench is CPU-only
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(cfg)], env=env,
                          capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    sys.stderr.write(proc.stdout + proc.stderr)
    raise SystemExit(f"worker {cfg['loop']}/{cfg['size']} failed (exit {proc.returncode})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--sizes", default="default,small",
                    help=f"comma-separated, from {list(SIZES)} (default: %(default)s)")
    ap.add_argument("--seconds", type=float, default=30.0,
                    help="measured seconds per loop after warm-up (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per loop, alternating which goes first; the best is reported (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=2, help="steps excluded from the rate (default: %(default)s)")
    ap.add_argument("--min-steps", type=int, default=4,
                    help="measured steps at least, even if that takes longer than --seconds (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast on CPU in both loops")
    ap.add_argument("--bs", type=int, default=32, help="batch size (default: %(default)s)")
    ap.add_argument("--bptt", type=int, default=70, help="fixed sequence length (default: %(default)s)")
    ap.add_argument("--profile", action="store_true",
                    help="also print torch.profiler's top ops over 6 steps of each loop")
    ap.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        cfg = json.loads(args.worker)
        result = (run_library if cfg["loop"] == "library" else run_plain)(cfg)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        ap.error(f"unknown size(s) {unknown}; choose from {list(SIZES)}")

    import torch

    threads = args.threads or torch.get_num_threads()
    print(f"CPU: {_cpu_model()} ({os.cpu_count()} logical cores) | torch {torch.__version__} | "
          f"threads {threads} | cpu capability {torch.backends.cpu.get_cpu_capability()} | "
          f"python {platform.python_version()}")
    print(f"bs {args.bs} x bptt {args.bptt} (LMLoader variable=False), {'bf16 autocast' if args.bf16 else 'fp32'}, "
          f"{N_LAYERS}-layer LSTM, warm-up {args.warmup} steps excluded, ~{args.seconds:.0f} s per measurement")
    print(f"load average at start (1/5/15 min): {' / '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"(this bench itself adds ~{threads} while running)\n", flush=True)

    base = dict(bs=args.bs, bptt=args.bptt, threads=args.threads, bf16=args.bf16, warmup=args.warmup,
                seconds=args.seconds, min_steps=max(args.min_steps, 1), profile=False)
    results, runs = [], []
    for size in sizes:
        # the first plain run fixes the step count; later runs of both loops repeat exactly that many steps,
        # alternating which loop goes first, and each loop keeps its best (least disturbed) run
        first = _run_worker(dict(base, loop="plain", size=size, steps=None))
        steps, done = first["steps"], {"plain": [first], "library": []}
        order = ["library", "plain"]
        while len(done["library"]) < args.repeats or len(done["plain"]) < args.repeats:
            for loop in order:
                if len(done[loop]) < args.repeats:
                    done[loop].append(_run_worker(dict(base, loop=loop, size=size, steps=steps)))
            order.reverse()
        if args.profile:
            for loop in ("library", "plain"):
                r = _run_worker(dict(base, loop=loop, size=size, steps=args.warmup + 1, profile=True))
                print(f"--- torch.profiler, {size} / {loop} (6 steps, sorted by self CPU time) ---")
                print(r["profile"], flush=True)
        best = {loop: min(rs, key=lambda r: r["s_per_step"]) for loop, rs in done.items()}
        for loop in ("library", "plain"):
            runs += [dict(size=size, loop=loop, **r) for r in done[loop]]
            results.append(dict(size=size, loop=loop, runs=len(done[loop]),
                                tok_s_runs=[r["tok_s"] for r in done[loop]], **best[loop]))
        results[-2]["ratio"] = best["library"]["tok_s"] / best["plain"]["tok_s"]
        results[-2]["cpu_ratio"] = best["plain"]["cpu_s_per_step"] / best["library"]["cpu_s_per_step"]

    head = (f"{'size':<8} {'E/H/V':<15} {'params':>7} {'loop':<8} {'steps':>5} {'s/step':>7} {'tok/s':>8} "
            f"{'hist tok/s':>10} {'lib/plain':>9} {'cpu-s/step':>10} {'cpu ratio':>9} {'maxRSS MiB':>10} "
            f"{'load1 before/after':>19}")
    print(head)
    print("-" * len(head))
    for r in results:
        s = SIZES[r["size"]]
        dims = f"{s['emb']}/{s['hidden']}/{s['vocab']}"
        hist = f"{r['history_tok_s']:,.0f}" if "history_tok_s" in r else "-"
        ratio = f"{r['ratio']:.3f}" if "ratio" in r else ""
        cpu_ratio = f"{r['cpu_ratio']:.3f}" if "cpu_ratio" in r else ""
        print(f"{r['size']:<8} {dims:<15} {r['params'] / 1e6:>6.1f}M {r['loop']:<8} {r['measured_steps']:>5} "
              f"{r['s_per_step']:>7.3f} {r['tok_s']:>8,.0f} {hist:>10} {ratio:>9} {r['cpu_s_per_step']:>10.3f} "
              f"{cpu_ratio:>9} {r['maxrss_mib']:>10,.0f} {r['load_before']:>9.2f}/{r['load_after']:<9.2f}")
    if args.repeats > 1:
        for r in results:
            print(f"  {r['size']}/{r['loop']} tok/s of each run: " + ", ".join(f"{x:,.0f}" for x in r["tok_s_runs"]))
    print("\ntok/s: steady state (warm-up excluded), best of the runs. hist tok/s: pretrain_lm's history items_per_s "
          "(whole epoch, warm-up included).\nlib/plain: tok/s ratio, target >= 0.9. cpu-s/step: process CPU time "
          "(all threads) per step; cpu ratio = plain/library cpu-s, which other jobs on the machine disturb less.\n"
          "The library loop also does dropouts (embedding, locked, DropConnect), AR/TAR, grad clipping and "
          "per-group LRs; the plain loop does none of these.")
    print(f"load average at end (1/5/15 min): {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps(dict(args=vars(args) | {"json": str(args.json)}, results=results, runs=runs),
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
