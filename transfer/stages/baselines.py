"""The baseline every ULMFiT variant is judged against: TF-IDF n-grams + logistic regression."""

from __future__ import annotations

import numpy as np
import pandas as pd


def tfidf_proba(train: pd.DataFrame, text_sets: list[list[str]], classes: list[str], seed: int = 0,
                c: float = 10.0) -> list[np.ndarray]:
    """TF-IDF (word 1-2-grams + char 2-5-grams, sublinear tf, case kept) + logistic regression (inverse L2 `c`).

    Fitted once on `train`; returns class probabilities (columns in `classes` order) for each text set.
    """
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline, make_union

    features = make_union(
        TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, lowercase=False, token_pattern=r"(?u)\b\w+\b|[^\w\s]"),
        TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 5), sublinear_tf=True, lowercase=False, min_df=2),
    )
    clf = make_pipeline(features, LogisticRegression(C=c, max_iter=2000, random_state=seed))
    clf.fit(list(train["text"]), list(train["label"]))
    order = [list(clf.classes_).index(k) for k in classes]
    return [clf.predict_proba(texts)[:, order] for texts in text_sets]
