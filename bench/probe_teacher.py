"""How good a first teacher is a linear probe on the frozen domain LMs, per self-training round of the probe?

Takes a workspace whose `finetune_lm` stage is done (e.g. one built from `examples/ag_news.yaml`) and, for each
label draw (seed), reruns only `prepare` in a scratch copy that links the workspace's tokenizer and domain LMs,
so the workspace itself is left untouched. Features (`stages.self_training.lm_features`) are computed once per text; the
probe (`pseudo.probe_teacher`) takes seconds per round. Prints validation and test error % per probe round
and the accuracy of the pseudo-labels round 1 of `train_classifier` would get. Pick settings on validation.

    python bench/probe_teacher.py ../ws -p ../ws/params.yaml --budget 100 --seeds 0 1 2 --c 0.003 0.01
    python bench/probe_teacher.py ../ws -p ../ws/params.yaml -S 'model.directions=[fwd]'
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from transfer.config import load_params
from transfer.data import Docs
from transfer.pseudo import probe_teacher, select_pseudo_labels
from transfer.stages import Workspace, run_stage
from transfer.stages.self_training import lm_features
from transfer.tokenizer import Tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workspace", type=Path, help="workspace with finished tokenize and finetune_lm stages")
    ap.add_argument("-p", "--params", type=Path, required=True, help="that workspace's params file")
    ap.add_argument("-S", "--set", action="append", default=[], help="override, as for `transfer run -S`")
    ap.add_argument("--budget", type=int, default=100, help="labelled training rows per draw")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="label draws (data.label_seed)")
    ap.add_argument("--c", type=float, nargs="+", default=None, help="probe_c values (default: the params')")
    ap.add_argument("--rounds", type=int, default=None, help="probe rounds (default: self_train_rounds)")
    args = ap.parse_args()

    src = Workspace(args.workspace.resolve())
    params_path = args.params.resolve()
    base = load_params(params_path, args.set)
    cs = args.c or [base.classifier.probe_c]
    rounds = base.classifier.self_train_rounds if args.rounds is None else args.rounds
    frac = base.classifier.pseudo_label_frac
    cache: dict[str, np.ndarray] = {}
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = Workspace(Path(tmp))
        for stage, name in [("tokenize", "spm.model")] + [("finetune_lm", f"lm-{d}.pt") for d in base.model.directions]:
            paths.art(stage).mkdir(parents=True, exist_ok=True)
            os.symlink(src.art(stage, name), paths.art(stage, name))
        tok = Tokenizer.load(paths.art("tokenize", "spm.model"))
        cwd = os.getcwd()
        os.chdir(src.root)  # data paths resolve from the workspace, as for `transfer` run there
        try:
            for seed in args.seeds:
                p = load_params(params_path, [*args.set, f"data.max_train_labels={args.budget}",
                                              f"data.label_seed={seed}"])
                classes = run_stage("prepare", p, paths)["classes"]
                index = {c: i for i, c in enumerate(classes)}
                frames = {s: pd.read_csv(paths.art("prepare", f"{s}.csv"), dtype=str, keep_default_na=False)
                          for s in ("train", "unlabelled", "valid", "test")}
                new = sorted({t for df in frames.values() for t in df["text"]} - cache.keys())
                if new:
                    docs = Docs.from_lists(tok.encode(new))
                    cache.update(zip(new, lm_features(p, paths, tok.vocab_size, [docs])[0]))
                x = {s: np.stack([cache[t] for t in df["text"]]) for s, df in frames.items()}
                y = {s: frames[s]["label"].map(index).to_numpy() for s in ("train", "valid", "test")}
                truth = _unlabelled_truth(p, frames["unlabelled"], index)  # scoring the pseudo-labels only
                for c in cs:
                    for r in range(rounds + 1):
                        proba, probs = probe_teacher(x["train"], y["train"], x["unlabelled"], len(classes), r, frac, c)
                        idx, labels = select_pseudo_labels(probs, frac)
                        row = dict(seed=seed, c=c, probe_rounds=r,
                                   valid_error=100 * float((proba(x["valid"]).argmax(1) != y["valid"]).mean()),
                                   test_error=100 * float((proba(x["test"]).argmax(1) != y["test"]).mean()),
                                   pseudo_labelled=int(len(idx)),
                                   pseudo_accuracy=100 * float((labels == truth[idx]).mean()))
                        results.append(row)
                        print(json.dumps(row), flush=True)
        finally:
            os.chdir(cwd)
    df = pd.DataFrame(results)
    print(df.groupby(["c", "probe_rounds"])[["valid_error", "test_error", "pseudo_accuracy"]].mean().round(2))


def _unlabelled_truth(p, unlabelled: pd.DataFrame, index: dict[str, int]) -> np.ndarray:
    """Labels of the budget's unlabelled rows, looked up in the training table (scoring only, never training)."""
    from transfer.readers import read_table

    d = p.data
    table = read_table(d.train, list(d.text_cols), d.label_col, d.encoding, d.header)
    label_of = dict(zip(table["text"], table["label"]))
    return np.array([index[label_of[t]] for t in unlabelled["text"]])


if __name__ == "__main__":
    main()
