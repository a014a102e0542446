"""Settings that depend on the data, resolved at `prepare` from its statistics: the same rules for every dataset.

With `data.rules: true`, `prepare` measures the labelled rows (`data_stats`), `resolve` turns the statistics
into classifier settings with the reason for each, both are recorded in metrics/prepare.json (and so in the
stage's MLflow run), and the classifier stages read them back with `apply`. No rule names a dataset.

Evidence so far (docs/results/README.md): the batch-size and minimum-steps rules were chosen on AG News validation
rows (100 to 5,472 labels); `max_len` was checked on BBC News validation rows (280-980 tokens within 3 rows of
201) and the validation share on the dev sets' (how much a choice on n rows gives up); the last phase's floor on
TweetEval emotion and irony validation rows (all labels, 3 seeds); the class-balance rule follows the data's own
statistics and waits for the dev suite's validation rows to be confirmed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from transfer.config import Params

__all__ = ["data_stats", "resolve", "apply", "valid_rows", "TOKENS_PER_WORD"]

TOKENS_PER_WORD = 1.3  # SentencePiece unigram at 8k-16k pieces on English news and tweets: 1.2-1.4
MAX_LEN_CAP = 1440  # the paper's BPT3C window (20 x bptt 72): gradients on at most this many final tokens
IMBALANCED = 3.0  # largest class / smallest class above which the loss weights classes
LAST_PHASE_STEPS = 600  # optimizer steps; see resolve
MIN_VALID_ROWS = 200  # the guards compare validation accuracies a few points apart; see valid_rows


def data_stats(texts: list[str], labels: list[str], n_unlabelled: int) -> dict[str, Any]:
    """Size, class balance and length (words) of the labelled training rows."""
    words = np.array([len(t.split()) for t in texts]) if texts else np.zeros(1)
    _, counts = np.unique(np.asarray(labels), return_counts=True)
    return dict(n_labelled=len(texts), n_unlabelled=n_unlabelled, n_classes=len(counts),
                imbalance=float(counts.max() / max(counts.min(), 1)),
                words_p50=float(np.percentile(words, 50)), words_p90=float(np.percentile(words, 90)),
                words_p95=float(np.percentile(words, 95)))


def valid_rows(n_rows: int, frac: float) -> dict[str, Any]:
    """How many training rows to hold out for validation when the data has no validation file.

    `frac` of the rows, but at least MIN_VALID_ROWS (and at most a quarter of the rows): every guard (self-training
    rounds, ensemble members, the ulmfit+tfidf mix, the registry gate) decides on validation accuracy, and on a
    few dozen rows one row is several points.
    """
    by_frac = round(n_rows * frac)
    n = max(by_frac, min(MIN_VALID_ROWS, n_rows // 4))
    why = (f"{frac:g} of {n_rows:,} rows" if n == by_frac
           else f"{frac:g} of {n_rows:,} rows would be {by_frac}, too few to compare on (at least {MIN_VALID_ROWS}, "
                f"at most a quarter)")
    return dict(value=n, why=why)


def resolve(stats: dict[str, Any], p: Params) -> dict[str, dict[str, Any]]:
    """`{"section.key": {"value": v, "why": "..."}}` for every setting a rule decides."""
    hp = p.classifier
    out: dict[str, dict[str, Any]] = {}
    bptt = hp.bptt
    tokens_p95 = stats["words_p95"] * TOKENS_PER_WORD
    # gradients on the whole of 95% of documents, in whole bptt chunks; longer ones keep their end (BPT3C)
    max_len = int(min(MAX_LEN_CAP, max(bptt, math.ceil(tokens_p95 / bptt) * bptt)))
    out["classifier.max_len"] = dict(value=max_len, why=f"95th percentile length ~{tokens_p95:.0f} tokens "
                                     f"({stats['words_p95']:.0f} words), in whole chunks of {bptt}, at most "
                                     f"{MAX_LEN_CAP}")
    # about ten optimizer steps an epoch on few labels (AG News, 100 labels: bs 10 beat bs 32 on validation rows);
    # long documents halve the batch, so a step's memory and time stay near those of short ones
    bs = min(hp.bs, max(8, stats["n_labelled"] // 10))
    if tokens_p95 > 400 and bs > 16:
        bs //= 2
    out["classifier.bs"] = dict(value=int(bs), why=f"{stats['n_labelled']:,} labelled rows (~10 steps an epoch "
                                f"at least), p95 {tokens_p95:.0f} tokens")
    # few labels: 100 labels give ~10 steps an epoch; every unfreezing phase gets >= 50 (AG News validation rows:
    # 50 beat 0 and 150)
    out["classifier.min_steps_per_phase"] = dict(value=50, why="phases of a few steps leave layers untrained")
    # the phase that trains every layer: two epochs of a few thousand rows (~100 steps) undertrain it. TweetEval
    # emotion and irony, all labels, 3 seeds, mean validation accuracy: 2 epochs 0.566, 6 0.603, 12 (~600 steps)
    # 0.615. In steps, so large sets and self-training rounds (thousands of pseudo-labelled rows) stay near 2 epochs
    out["classifier.min_steps_last_phase"] = dict(value=LAST_PHASE_STEPS, why=f"the phase that trains every layer "
                                                  f"gets at least {LAST_PHASE_STEPS} optimizer steps")
    rounds = hp.self_train_rounds if stats["n_unlabelled"] else 0
    out["classifier.self_train_rounds"] = dict(
        value=rounds, why=f"{stats['n_unlabelled']:,} unlabelled training texts" if rounds else "no unlabelled texts")
    weighted = stats["imbalance"] > IMBALANCED
    out["classifier.class_weights"] = dict(value=weighted, why=f"largest class / smallest {stats['imbalance']:.1f}"
                                           f" ({'above' if weighted else 'within'} {IMBALANCED:g})")
    # on imbalanced classes accuracy rewards predicting the big class: the gate judges macro-F1 there
    if weighted and p.registry.metric == "accuracy":
        out["registry.metric"] = dict(value="macro_f1", why=f"imbalanced classes ({stats['imbalance']:.1f}): "
                                      "accuracy would reward the largest class")
    return out


def apply(p: Params, prepared: dict[str, Any]) -> Params:
    """`p` with the settings `prepare` resolved (metrics/prepare.json's `rules`); unchanged without them."""
    rules = prepared.get("rules") or {}
    for key, entry in rules.items():
        section, name = key.split(".", 1)
        p = dataclasses.replace(p, **{section: dataclasses.replace(getattr(p, section), **{name: entry["value"]})})
    return p
