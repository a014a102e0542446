"""Self-training: label the unlabelled training texts with the classifier's own confident predictions.

With a label budget, most training texts have no label. The classifier trained on the labelled few predicts
them; the most confident share of each predicted class joins the labelled rows and a fresh classifier is
trained from the domain LM on both. Per-class quotas keep one over-predicted class from flooding the set.

The first teacher matters most, and a classifier fine-tuned on ~100 rows is a weak one. `probe_teacher` is a
stronger one for almost no time: logistic regression on the frozen domain LM's pooled features, self-trained in
feature space (AG News, 100 labels, forward LM: test error 27.4% fine-tuned, 22.6% probe, 19.9% self-trained probe).
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def select_pseudo_labels(probs: np.ndarray, frac: float) -> tuple[np.ndarray, np.ndarray]:
    """Rows of `probs` (n, classes) to keep and their predicted labels.

    Each class gets a quota of `frac * n / classes` rows, filled with the rows predicted as that class in
    order of confidence (a class predicted less often than its quota gives all of its rows).
    Returns (row indices in ascending order, labels).
    """
    if probs.ndim != 2 or not 0 < frac <= 1:
        raise ValueError(f"need probs of shape (n, classes) and 0 < frac <= 1, got {probs.shape} and {frac}")
    n, k = probs.shape
    pred, conf = probs.argmax(1), probs.max(1)
    quota = int(frac * n / k)
    keep = []
    for c in range(k):
        rows = np.flatnonzero(pred == c)
        keep.append(rows[np.argsort(-conf[rows], kind="stable")[:quota]])
    idx = np.sort(np.concatenate(keep)) if keep else np.zeros(0, dtype=int)
    return idx, pred[idx]


def probe_teacher(x_labelled: np.ndarray, y_labelled: np.ndarray, x_unlabelled: np.ndarray, n_classes: int,
                  rounds: int, frac: float, c: float) -> tuple[Callable[..., np.ndarray], np.ndarray]:
    """Self-trained linear probe -> (fitted predict_proba callable, its probabilities on `x_unlabelled`).

    Features are standardised with statistics of every training row, labelled or not; each round refits a
    logistic regression (inverse L2 strength `c`) on the labelled rows plus `select_pseudo_labels(frac)` of
    the previous round's predictions. Probabilities have `n_classes` columns, also for classes never labelled.
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(np.concatenate([x_labelled, x_unlabelled]))
    xl, xu = scaler.transform(x_labelled), scaler.transform(x_unlabelled)

    def fit(x: np.ndarray, y: np.ndarray) -> Callable[..., np.ndarray]:
        lr = LogisticRegression(C=c, max_iter=3000).fit(x, y)

        def proba(z: np.ndarray, scaled: bool = False) -> np.ndarray:
            out = np.zeros((len(z), n_classes))
            out[:, lr.classes_] = lr.predict_proba(z if scaled else scaler.transform(z))
            return out
        return proba

    proba = fit(xl, y_labelled)
    for _ in range(rounds):
        idx, labels = select_pseudo_labels(proba(xu, scaled=True), frac)
        proba = fit(np.concatenate([xl, xu[idx]]), np.concatenate([y_labelled, labels]))
    return proba, proba(xu, scaled=True)
