"""Peak memory of LM pretraining as the token stream grows: it should stay flat (the stream is memory-mapped).

For each size (default 1M, 10M, 100M tokens) a random uint16 token stream is written straight into a .npy
with np.lib.format.open_memmap, in chunks (100M tokens = 200 MB on disk). A fresh subprocess then opens it
with transfer.data.load_token_stream and runs transfer.train_lm.pretrain_lm on an LMLoader over it (small
AWD-LSTM, fixed bptt, `max_tokens` chosen so that exactly --steps optimizer steps run) and reports:

  after import   RSS with torch + transfer imported (the floor)
  after open     RSS right after memory-mapping the stream
  peak           ru_maxrss at the end of training (getrusage RUSAGE_SELF)
  mmap resident  resident pages of the stream's mapping (from /proc/self/smaps): what the loader touched,
                 rounded up by the kernel (fault-around, large page-cache folios: up to ~2 MiB around each of
                 the bs read positions, so bounded by bs x 2 MiB plus the bytes read, whatever the stream size)
  anon end       RssAnon at the end (model, optimizer, activations' allocator cache): no file pages in it
  touched-all    RSS after summing the whole stream afterwards: the control that shows the RSS would grow
                 with the stream if the loader read it all (measured after the peak is recorded)

Streams are written to a temp dir (or --dir), dropped from the page cache before their run (fsync +
posix_fadvise DONTNEED: a big corpus is not cached either; --warm-cache skips it), and deleted afterwards.
Verdict FLAT: peak minus the stream's resident pages grows by at most --flat-mb from the smallest to the
largest stream, and the stream's resident pages stay within the bs x 2 MiB + bytes-read bound.

    python bench/memory.py                           # 1M, 10M, 100M tokens, 30 steps each
    python bench/memory.py --sizes 1e6,1e8 --steps 10 --hidden 256
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHUNK = 1 << 22  # tokens written per chunk (8 MB of uint16)


def _rss_kb() -> int:
    """Current resident set size (VmRSS), KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def drop_cache(path: Path) -> None:
    """Write the file back and drop its pages from the page cache (clean pages only can be dropped)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _mapping_rss_kb(path: Path) -> int:
    """Resident KiB of every mapping of `path` in this process (smaps 'Rss:' lines after its header)."""
    total, inside, target = 0, False, str(path.resolve())
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping header: addr-range perms offset dev inode [path]
                inside = line.rstrip("\n").endswith(target)
            elif inside and first == "Rss:":
                total += int(line.split()[1])
    return total


def write_stream(path: Path, n_tokens: int, vocab: int, seed: int = 0) -> float:
    """Random ids in [4, vocab) as a uint16 .npy, written chunk by chunk through a memmap -> seconds."""
    import numpy as np

    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint16, shape=(n_tokens,))
    for i in range(0, n_tokens, CHUNK):
        n = min(CHUNK, n_tokens - i)
        arr[i:i + n] = rng.integers(4, vocab, size=n, dtype=np.uint16)
    arr.flush()
    del arr
    return time.perf_counter() - t0


def worker(cfg: dict) -> dict:
    """Runs in a fresh process: open the stream, pretrain for cfg['steps'] steps, report memory."""
    import torch

    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    from transfer.config_train import PretrainParams
    from transfer.data import LMLoader, load_token_stream
    from transfer.model import LanguageModel, lm_config
    from transfer.train_lm import pretrain_lm

    out = {"rss_import_kb": _rss_kb()}
    path = Path(cfg["path"])
    stream = load_token_stream(path)
    out["rss_open_kb"] = _rss_kb()
    out["tokens"] = len(stream)
    bs, bptt, steps = cfg["bs"], cfg["bptt"], cfg["steps"]
    # n = steps*bptt + 1 tokens per row -> exactly `steps` fixed-length batches
    loader = LMLoader(stream, bs=bs, bptt=bptt, variable=False, max_tokens=bs * (steps * bptt + 1))
    torch.manual_seed(0)
    model = LanguageModel(lm_config(cfg["vocab"], drop_mult=0.3, emb_size=cfg["emb"], hidden_size=cfg["hidden"],
                                    n_layers=3))
    hp = PretrainParams(bs=bs, bptt=bptt, lr=5e-3, epochs=1, checkpoint_every=10_000, precision="fp32")
    t0 = time.perf_counter()
    history = pretrain_lm(model, loader, None, hp, progress=False)
    out["train_s"] = time.perf_counter() - t0
    out["steps"] = int(history[-1]["step"]) if history else 0
    out["loss"] = float(history[-1]["train_loss"]) if history else float("nan")
    out["peak_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: KiB
    out["rss_end_kb"] = _rss_kb()
    out["anon_end_kb"] = _status_kb("RssAnon")
    out["mmap_resident_kb"] = _mapping_rss_kb(path)
    int(stream.sum(dtype="uint64"))  # control: fault in every page of the stream
    out["rss_touched_all_kb"] = _rss_kb()
    return out


def _mb(kb: float) -> str:
    return f"{kb / 1024:8.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1e6,1e7,1e8", help="stream lengths in tokens, comma-separated (default 1e6,1e7,1e8)")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per run (default 30)")
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--bptt", type=int, default=70)
    ap.add_argument("--vocab", type=int, default=8000, help="vocab size (ids < vocab; uint16)")
    ap.add_argument("--emb", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch threads in the worker (0: torch default)")
    ap.add_argument("--dir", type=Path, default=None, help="where to write the streams (default: a temp dir)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds allowed per worker (default 600)")
    ap.add_argument("--flat-mb", type=float, default=25.0, help="peak growth (largest - smallest) allowed "
                    "for the FLAT verdict, MiB (default 25)")
    ap.add_argument("--warm-cache", action="store_true", help="keep the fresh stream in the page cache")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    if args.vocab > 65536:
        ap.error("--vocab must be <= 65536 for uint16 streams")
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    one, five, fifteen = os.getloadavg()
    print(f"loadavg {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs; model emb {args.emb} hidden "
          f"{args.hidden} x3 layers, vocab {args.vocab}, bs {args.bs} x bptt {args.bptt}, {args.steps} steps, "
          f"threads {args.threads or 'default'}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="transfer-mem-", dir=args.dir))
    results = []
    try:
        for n in sizes:
            path = tmp / f"stream-{n}.npy"
            try:
                write_s = write_stream(path, n, args.vocab)
                if not args.warm_cache:
                    drop_cache(path)
                cfg = dict(path=str(path), steps=args.steps, bs=args.bs, bptt=args.bptt, vocab=args.vocab,
                           emb=args.emb, hidden=args.hidden, threads=args.threads)
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
                proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(cfg)], env=env,
                                      capture_output=True, text=True, timeout=args.timeout)
                line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
                if proc.returncode != 0 or line is None:
                    sys.exit(f"worker for {n:,} tokens failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
                r = json.loads(line[len("RESULT "):])
                r.update(file_mb=path.stat().st_size / 2**20, write_s=write_s)
                results.append(r)
                print(f"{n:>12,} tokens: peak {r['peak_kb'] / 1024:.1f} MiB, train {r['train_s']:.1f}s "
                      f"({r['steps']} steps), loadavg {os.getloadavg()[0]:.2f}", flush=True)
            finally:
                path.unlink(missing_ok=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print()
    print(f"{'tokens':>12} {'file MiB':>9} {'import':>8} {'open':>8} {'peak':>8} {'end':>8} {'anon end':>8} "
          f"{'mmap res':>9} {'touched-all':>11} {'train s':>8}   (RSS in MiB)")
    for r in results:
        print(f"{r['tokens']:>12,} {r['file_mb']:9.1f} {_mb(r['rss_import_kb'])} {_mb(r['rss_open_kb'])} "
              f"{_mb(r['peak_kb'])} {_mb(r['rss_end_kb'])} {_mb(r['anon_end_kb'])} "
              f"{r['mmap_resident_kb'] / 1024:9.2f} {r['rss_touched_all_kb'] / 1024:11.1f} {r['train_s']:8.1f}")
    first, last = results[0], results[-1]
    growth = (last["peak_kb"] - first["peak_kb"]) / 1024
    growth_ex = ((last["peak_kb"] - last["mmap_resident_kb"]) - (first["peak_kb"] - first["mmap_resident_kb"])) / 1024
    open_growth = (last["rss_open_kb"] - first["rss_open_kb"]) / 1024
    read_per_row_mb = (args.steps * args.bptt + 1) * 2 / 2**20
    bound_mb = args.bs * (2 + read_per_row_mb)
    within = all(r["mmap_resident_kb"] / 1024 <= bound_mb for r in results)
    flat = growth_ex <= args.flat_mb and within
    print(f"\n{first['tokens']:,} -> {last['tokens']:,} tokens: peak {growth:+.1f} MiB, peak without the stream's "
          f"pages {growth_ex:+.1f} MiB (threshold {args.flat_mb:.0f}), after open {open_growth:+.1f} MiB; stream "
          f"pages resident <= {max(r['mmap_resident_kb'] for r in results) / 1024:.1f} MiB (bound bs x 2 MiB + read "
          f"= {bound_mb:.1f} MiB: {'ok' if within else 'EXCEEDED'}) -> {'FLAT' if flat else 'GROWS'}")
    one, five, fifteen = os.getloadavg()
    print(f"end: loadavg {one:.2f} {five:.2f} {fifteen:.2f}")


if __name__ == "__main__":
    main()
