"""Self-training: label the unlabelled training texts with the classifier's own confident predictions.

With a label budget, most training texts have no label. The classifier trained on the labelled few predicts
them; the most confident share of each predicted class joins the labelled rows and a fresh classifier is
trained from the domain LM on both. Per-class quotas keep one over-predicted class from flooding the set.
"""

from __future__ import annotations

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
