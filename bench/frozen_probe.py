"""How much of a task do the LM's features hold before fine-tuning? Linear probes on frozen features, all labels.

Reads a benchmark cell (`transfer benchmark --out OUT`: OUT/work/DATASET/cells/all-sSEED) and fits a logistic
regression (standardised features, each C given) on its training rows, over three feature sets per LM (the
general LM and the domain LM): concat pooling of the last layer (what the classifier's head reads), and the
mean of the input embeddings (a bag of embeddings). Prints train / validation / test accuracy per row; pick
C on validation. If a probe matches the fine-tuned classifier on validation, the features, not the
fine-tuning schedule, are the limit.

    python bench/frozen_probe.py SUITE OUT DATASET [--seed 1] [--c 0.001 0.003 0.01 0.03 0.1] [--json rows.jsonl]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler

from transfer.benchmark import cell_overrides, load_suite
from transfer.data import ClassificationLoader, Docs
from transfer.stages import Workspace
from transfer.stages.classifier import new_classifier
from transfer.tokenizer import PAD_ID
from transfer.train_clas import pooled_features

SPLITS = ("train", "valid", "test")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("suite", type=Path, help="the suite file the benchmark ran")
    ap.add_argument("out", type=Path, help="the benchmark's --out folder")
    ap.add_argument("dataset", help="a dataset name of the suite")
    ap.add_argument("--seed", type=int, default=0, help="the all-labels cell's seed")
    ap.add_argument("--c", type=float, nargs="+", default=[0.001, 0.003, 0.01, 0.03, 0.1],
                    help="inverse L2 strengths to fit")
    ap.add_argument("--json", type=Path, default=None, help="append each row to this JSON-lines file")
    args = ap.parse_args()

    suite = load_suite(args.suite)
    d = next((x for x in suite.datasets if x.name == args.dataset), None)
    if d is None:
        raise SystemExit(f"{args.suite}: no dataset named {args.dataset!r}")
    p = suite.params_for(d, cell_overrides("all", args.seed))
    ws = Workspace(args.out / "work" / d.name / "cells" / f"all-s{args.seed}")
    tok, classes = ws.tokenizer(), ws.prepared()["classes"]
    frames = {s: pd.read_csv(ws.art("prepare", f"{s}.csv"), dtype=str, keep_default_na=False) for s in SPLITS}
    y = {s: f["label"].map({c: i for i, c in enumerate(classes)}).to_numpy() for s, f in frames.items()}
    ids = {s: tok.encode(list(f["text"])) for s, f in frames.items()}
    for lm, path in (("general", ws.art("pretrain", "lm-fwd.pt")), ("domain", ws.art("finetune_lm", "lm-fwd.pt"))):
        model = new_classifier(p, tok.vocab_size, 2, path)
        emb = model.encoder.embed.weight.detach().numpy()
        features = {
            f"{lm}_concat": {s: pooled_features(model, ClassificationLoader(Docs.from_lists(i), None, 64, train=False,
                                                                            pad_id=PAD_ID), "fp32")
                             for s, i in ids.items()},
            f"{lm}_bag_of_embeddings": {s: np.stack([emb[np.asarray(t)].mean(0) if t else np.zeros(emb.shape[1])
                                                     for t in i]) for s, i in ids.items()},
        }
        for name, x in features.items():
            scaler = StandardScaler().fit(x["train"])
            for c in args.c:
                clf = LogisticRegression(C=c, max_iter=3000).fit(scaler.transform(x["train"]), y["train"])
                acc = {s: float((clf.predict(scaler.transform(x[s])) == y[s]).mean()) for s in SPLITS}
                row = dict(dataset=d.name, seed=args.seed, features=name, c=c,
                           **{f"{s}_accuracy": round(a, 4) for s, a in acc.items()})
                print(json.dumps(row), flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
