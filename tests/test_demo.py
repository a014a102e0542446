"""transfer.demo: synthetic, deterministic, quick, and a learnable but not trivial 4-class task."""

from __future__ import annotations

import time

import pandas as pd
import pytest

from transfer.demo import TOPICS, make_demo


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    start = time.perf_counter()
    paths = make_demo(tmp_path_factory.mktemp("demo"))
    return paths, time.perf_counter() - start


def test_same_seed_gives_byte_identical_files(demo, tmp_path):
    paths, _ = demo
    again = make_demo(tmp_path, seed=0)
    for name in ("general", "train", "test"):
        assert again[name].read_bytes() == paths[name].read_bytes(), name


def test_another_seed_gives_other_data(demo, tmp_path):
    paths, _ = demo
    other = make_demo(tmp_path, seed=1, n_general_docs=50, n_labelled=40)
    assert other["train"].read_bytes()[:2000] != paths["train"].read_bytes()[:2000]


def test_default_corpus_is_a_few_hundred_thousand_words_made_in_under_five_seconds(demo):
    paths, seconds = demo
    lines = paths["general"].read_text(encoding="utf-8").splitlines()
    words = sum(len(line.split()) for line in lines)
    assert seconds < 5
    assert len(lines) == 5000 and all(line.strip() for line in lines)  # one non-empty document per line
    assert 200_000 <= words <= 400_000
    assert 300 <= len({w.strip(".,").lower() for line in lines for w in line.split()}) <= 3000


def test_labelled_tables_have_text_and_label_for_four_balanced_topics(demo):
    paths, _ = demo
    train, test = pd.read_csv(paths["train"]), pd.read_csv(paths["test"])
    assert list(train.columns) == list(test.columns) == ["text", "label"]
    assert (len(train), len(test)) == (1500, 500)
    assert set(train["label"]) == set(test["label"]) == set(TOPICS)
    assert train["label"].value_counts().min() > 0.15 * len(train)
    assert train["text"].str.strip().str.len().min() > 0


def test_labelled_texts_use_the_general_corpus_vocabulary(demo):
    paths, _ = demo
    general = set(paths["general"].read_text(encoding="utf-8").lower().replace(".", " ").replace(",", " ").split())
    train = pd.read_csv(paths["train"])
    words = " ".join(train["text"]).lower().replace(".", " ").replace(",", " ").split()
    assert sum(w in general for w in words) / len(words) > 0.99  # pretraining on it can transfer


def test_the_label_is_in_the_word_order_not_the_word_counts(demo):
    from sklearn.feature_extraction.text import CountVectorizer
    from sklearn.naive_bayes import MultinomialNB

    paths, _ = demo
    train, test = pd.read_csv(paths["train"]), pd.read_csv(paths["test"])

    def accuracy(texts_train, texts_test) -> float:
        vectorizer = CountVectorizer()
        model = MultinomialNB().fit(vectorizer.fit_transform(texts_train), train["label"])
        return (model.predict(vectorizer.transform(texts_test)) == test["label"]).mean()

    lead = lambda texts: texts.str.split(". ", regex=False).str[0]  # noqa: E731  the first sentence
    assert accuracy(train["text"], test["text"]) < 0.5  # the whole bag: every topic present, none leads
    assert accuracy(lead(train["text"]), lead(test["text"])) > 0.8  # the lead sentence alone carries the label
    assert (train["text"].str.count(r"\. ") >= 1).all()  # every text has a lead and at least one more sentence


def test_only_the_three_outputs_are_written(demo):
    paths, _ = demo
    assert sorted(p.name for p in paths["general"].parent.iterdir()) == ["general.txt", "test.csv", "train.csv"]
