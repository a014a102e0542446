"""Compare whole pretraining runs: held-out perplexity after each epoch against tokens seen and training time.

Each RUN is LABEL=WORKSPACE, a workspace whose `pretrain` stage has run: its `plots/pretrain_history.csv` gives
per-epoch held-out perplexity and training seconds, its `metrics/pretrain.json` the token count of an epoch and
the final perplexity on `data.lm_eval` (WikiText-2 valid in `examples/ag_news.yaml`). Prints a table and writes
a plot (perplexity against millions of tokens, one line per run and direction).

    python bench/pretrain_runs.py 3ep=/work/bi 4ep=/work/ep4 --out docs/results/pretrain_epochs.png
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from transfer.plots import _figure, _save


def load_run(label: str, workspace: Path) -> list[dict]:
    metrics = json.loads((workspace / "metrics" / "pretrain.json").read_text())
    rows, minutes = [], {}
    with open(workspace / "plots" / "pretrain_history.csv") as f:
        for r in csv.DictReader(f):
            d, epoch = r["direction"], int(r["epoch"])
            minutes[d] = minutes.get(d, 0.0) + float(r["time_s"]) / 60
            rows.append(dict(run=label, direction=d, epoch=epoch + 1, valid_ppl=float(r["valid_ppl"]),
                             mtokens=(epoch + 1) * metrics[d]["train_tokens"] / 1e6, train_min=minutes[d],
                             lm_eval_ppl=metrics[d].get("lm_eval_ppl")))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="LABEL=WORKSPACE")
    ap.add_argument("--out", type=Path, default=Path("pretrain_runs.png"))
    args = ap.parse_args()
    rows = []
    for spec in args.runs:
        label, _, workspace = spec.partition("=")
        rows += load_run(label, Path(workspace))

    print(f"{'run':<8}{'dir':<5}{'epoch':>6}{'M tokens':>10}{'train min':>11}{'held-out ppl':>14}")
    for r in rows:
        print(f"{r['run']:<8}{r['direction']:<5}{r['epoch']:>6}{r['mtokens']:>10.1f}{r['train_min']:>11.1f}"
              f"{r['valid_ppl']:>14.1f}")
    for key in sorted({(r["run"], r["direction"]) for r in rows}):
        last = [r for r in rows if (r["run"], r["direction"]) == key][-1]
        if last["lm_eval_ppl"] is not None:
            print(f"{key[0]} {key[1]}: lm_eval (final) ppl {last['lm_eval_ppl']:.1f}")

    plt = _figure()
    fig, ax = plt.subplots(figsize=(6, 4))
    for run, direction in sorted({(r["run"], r["direction"]) for r in rows}):
        rs = [r for r in rows if (r["run"], r["direction"]) == (run, direction)]
        ax.plot([r["mtokens"] for r in rs], [r["valid_ppl"] for r in rs], "o-", label=f"{run} {direction}")
    ax.set(xlabel="tokens seen (millions)", ylabel="held-out perplexity (per token)",
           title="general LM: perplexity after each epoch")
    ax.legend()
    ax.grid(alpha=0.3)
    print(f"wrote {_save(fig, args.out)}")


if __name__ == "__main__":
    main()
