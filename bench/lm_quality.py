"""LM quality against wall time: train the library's AWD-LSTM on a real token stream and report perplexity.

One run per config, each in its own subprocess, one after another (never in parallel: on 2 cores a second
job halves the first one's speed). Every run trains on the same first tokens of `--stream` and is scored on
`--eval` (e.g. WikiText-2 valid, encoded with the same SentencePiece model) with a fixed bptt in eval mode.

    python bench/lm_quality.py --stream W/artifacts/tokenize/general.npy --eval W/artifacts/pretrain/lm_eval.npy \
        --tokens 400000 --grid precision=fp32,bf16
    python bench/lm_quality.py ... --grid lr_decay=2.6,1 --grid size=256x512,400x1152

Fixed wall time instead of fixed tokens: `--seconds 360` gives each config the tokens its own measured
speed (a 12-step probe) fits into 360 s, so a bigger model sees fewer tokens. The probe includes warm-up, so
runs land under the budget (217 of 300 s for 256x512): compare configs at the seconds each row reports. Vocab sizes: `--grid tok=DIR1,DIR2`,
each DIR holding `general.npy` and `eval.npy` from its own SentencePiece model; per-token perplexities of
different vocabs do not compare, so pass `--words N` (words in the eval text) to report word-level perplexity,
exp(total eval NLL / N).

Prints one JSON line per run and a table at the end: tokens, seconds, tok/s, eval ppl.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass(frozen=True)
class HP:
    """The TrainHP fields the loop reads (transfer.train.TrainHP)."""

    epochs: int = 1
    lr: float = 2e-2
    lr_decay: float = 1.0
    wd: float = 0.01
    clip: float | None = 0.25
    betas: tuple = (0.7, 0.99)
    alpha: float = 2.0
    beta: float = 1.0
    schedule: str = "stlr"
    cut_frac: float = 0.1
    ratio: float = 32.0
    checkpoint_every: int = 0
    early_stop_patience: int | None = None
    seed: int = 0
    precision: str = "fp32"
    warmup_min_steps: int = 0
    spike_factor: float | None = None
    max_recoveries: int = 3


def worker(cfg: dict) -> dict:
    import numpy as np
    import torch

    from transfer.data import LMLoader, load_token_stream
    from transfer.model import LanguageModel, lm_config
    from transfer.train_lm import lm_perplexity, pretrain_lm

    torch.set_num_threads(cfg["threads"])
    tok_dir = Path(cfg["tok"]) if cfg["tok"] else None
    stream = load_token_stream(tok_dir / "general.npy" if tok_dir else Path(cfg["stream"]))
    ev = load_token_stream(tok_dir / "eval.npy" if tok_dir else Path(cfg["eval"]))
    vocab = int(max(int(np.max(stream)), int(np.max(ev)))) + 1 if not cfg["vocab"] else cfg["vocab"]
    emb, hidden = (int(v) for v in cfg["size"].split("x"))
    hp = replace(HP(), lr=cfg["lr"], lr_decay=cfg["lr_decay"], precision=cfg["precision"], wd=cfg["wd"])

    def fresh() -> LanguageModel:
        torch.manual_seed(0)
        return LanguageModel(lm_config(vocab, cfg["drop_mult"], emb_size=emb, hidden_size=hidden, n_layers=3))

    tokens = cfg["tokens"]
    if cfg["seconds"]:  # fixed wall time: this config's own speed decides how many tokens it gets
        probe = pretrain_lm(fresh(), LMLoader(stream, cfg["bs"], 70, max_tokens=cfg["bs"] * 70 * 12), None, hp,
                            progress=False)
        tokens = int(probe[-1]["items_per_s"] * cfg["seconds"])
    model = fresh()
    train = LMLoader(stream, cfg["bs"], 70, max_tokens=tokens)
    t0 = time.perf_counter()
    pretrain_lm(model, train, None, hp, progress=False)
    seconds = time.perf_counter() - t0
    ppl = lm_perplexity(model, LMLoader(ev, 32, 70, variable=False), "fp32")["valid_ppl"]
    ppl_same = lm_perplexity(model, LMLoader(ev, 32, 70, variable=False), cfg["precision"])["valid_ppl"]
    word_ppl = float(np.exp(np.log(ppl) * len(ev) / cfg["words"])) if cfg["words"] else None
    return dict(cfg, tokens_trained=train.tokens_per_epoch(), seconds=round(seconds, 1),
                tok_per_s=round(train.tokens_per_epoch() / seconds), eval_ppl=round(ppl, 2),
                eval_ppl_in_precision=round(ppl_same, 2), eval_word_ppl=word_ppl and round(word_ppl, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stream", default="", help="training token stream (.npy from the tokenize stage)")
    ap.add_argument("--eval", default="", help="evaluation token stream (.npy), same tokenizer")
    ap.add_argument("--tokens", type=int, default=400_000, help="training tokens per run")
    ap.add_argument("--seconds", type=float, default=0, help="fixed wall time per run instead of --tokens")
    ap.add_argument("--words", type=int, default=0, help="words in the eval text: also report word-level ppl")
    ap.add_argument("--grid", action="append", default=[],
                    help="KEY=V1,V2 to vary (keys: precision, lr, lr_decay, size, drop_mult, bs, wd, tok)")
    ap.add_argument("--plot", help="write eval perplexity against wall time to this PNG")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="append JSON lines here too")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(json.loads(a.worker))))
        return
    base = dict(stream=a.stream, eval=a.eval, tokens=a.tokens, threads=a.threads, vocab=0, precision="fp32",
                lr=2e-2, lr_decay=1.0, size="256x512", drop_mult=0.1, bs=64, wd=0.01, tok="", seconds=a.seconds,
                words=a.words)
    if not (a.stream and a.eval) and not any(g.startswith("tok=") for g in a.grid):
        ap.error("give --stream and --eval, or --grid tok=DIR,... (each DIR with general.npy and eval.npy)")
    keys = [g.split("=", 1)[0] for g in a.grid]
    values = [[type(base[k])(v) if not isinstance(base[k], str) else v for v in g.split("=", 1)[1].split(",")]
              for k, g in zip(keys, a.grid)]
    rows = []
    for combo in itertools.product(*values):
        cfg = dict(base, **dict(zip(keys, combo)))
        out = subprocess.run([sys.executable, __file__, "--stream", a.stream, "--eval", a.eval,
                              "--worker", json.dumps(cfg)], capture_output=True, text=True)
        if out.returncode:
            sys.exit(out.stderr[-3000:])
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(json.dumps(row), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    print(f"\n| {' | '.join(keys) or 'config'} | tokens | s | tok/s | eval ppl (fp32) | eval ppl (own precision) "
          "| eval word ppl |")
    print("|" + "---|" * (max(len(keys), 1) + 6))
    for r in rows:
        cells = [str(r[k]) for k in keys] or ["base"]
        print(f"| {' | '.join(cells)} | {r['tokens_trained']:,} | {r['seconds']} | {r['tok_per_s']:,} | "
              f"{r['eval_ppl']} | {r['eval_ppl_in_precision']} | {r['eval_word_ppl'] or '-'} |")
    if a.plot:
        plot(rows, keys, Path(a.plot), "word" if a.words else "token")


def plot(rows: list[dict], keys: list[str], path: Path, unit: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        y = r["eval_word_ppl"] if unit == "word" else r["eval_ppl"]
        ax.scatter(r["seconds"], y)
        ax.annotate(" ".join(f"{k}={Path(str(r[k])).name}" for k in keys), (r["seconds"], y), fontsize=8,
                    xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("training wall time (s, 2 cores)")
    ax.set_yscale("log")  # configs differ by orders of magnitude early in training
    ax.set_ylabel(f"eval {unit}-level perplexity (log)")
    ax.set_title("LM quality at fixed wall time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
