"""The prepare stage's domain corpus: every training text, labelled or not, and no held-out text by default."""

from __future__ import annotations

import pandas as pd

from transfer.config import load_params
from transfer.stages import Workspace, run_stage


def _texts(ws, name: str) -> set[str]:
    return set(pd.read_csv(ws / "artifacts/prepare" / name, dtype=str, keep_default_na=False)["text"])


def test_domain_corpus_holds_every_training_text_and_no_validation_or_test_text(workspace):
    run_stage("prepare", load_params(workspace / "params.yaml", ["data.max_train_labels=40"]), Workspace(workspace))
    domain = set((workspace / "artifacts/prepare/domain.txt").read_text().splitlines())
    train, unlabelled = _texts(workspace, "train.csv"), _texts(workspace, "unlabelled.csv")
    valid, test = _texts(workspace, "valid.csv"), _texts(workspace, "test.csv")
    assert len(train) == 40 and unlabelled and valid and test
    assert domain == train | unlabelled
    assert not domain & (valid | test)


def test_transductive_flag_adds_the_validation_and_test_texts(workspace):
    p = load_params(workspace / "params.yaml", ["data.domain_include_test=true"])
    assert run_stage("prepare", p, Workspace(workspace))["domain_include_test"] is True
    domain = set((workspace / "artifacts/prepare/domain.txt").read_text().splitlines())
    held_out = _texts(workspace, "valid.csv") | _texts(workspace, "test.csv")
    assert domain == _texts(workspace, "train.csv") | held_out


# --- data hygiene (transfer/hygiene.py): control characters, duplicates, conflicting labels, the report


def _train(ws) -> pd.DataFrame:
    return pd.read_csv(ws / "data/demo/train.csv", dtype=str, keep_default_na=False)


def _write(ws, df: pd.DataFrame) -> None:
    df.to_csv(ws / "data/demo/train.csv", index=False)


def _report(ws) -> dict:
    import json

    return json.loads((ws / "artifacts/prepare/data_report.json").read_text())


def test_copies_of_a_text_never_straddle_the_splits_prepare_makes(workspace):
    df = _train(workspace)
    copies = df.iloc[:30].copy()
    copies["text"] = ["  " + t.upper() + " " for t in copies["text"]]  # the same text after normalising
    _write(workspace, pd.concat([df, copies, df.iloc[30:40]], ignore_index=True))
    p = load_params(workspace / "params.yaml", ["data.test_frac=0.3", "data.valid_frac=0.2"])
    run_stage("prepare", p, Workspace(workspace))
    from transfer.hygiene import normalise

    sides = {n: {normalise(t) for t in _texts(workspace, f"{n}.csv")} for n in ("train", "valid", "test")}
    assert not sides["train"] & sides["valid"] and not sides["train"] & sides["test"] and not sides["valid"] & sides["test"]
    rep = _report(workspace)
    assert rep["rows_read"]["train"] == len(df) + 40
    assert rep["duplicates"]["train"]["normalised"] + rep["duplicates"]["valid"]["normalised"] + \
        rep["duplicates"]["test"]["normalised"] == 40
    assert rep["overlap"] == {"train/valid": 0, "train/test": 0, "valid/test": 0}


def test_without_duplicates_the_split_is_sklearns_stratified_split(workspace):
    from sklearn.model_selection import train_test_split

    from transfer.hygiene import group_split

    df = _train(workspace)
    rest, out = group_split(df, 40, seed=3)
    want_rest, want_out = train_test_split(df, test_size=40, stratify=df["label"], random_state=3)
    assert list(out["text"]) == list(want_out["text"]) and list(rest["text"]) == list(want_rest["text"])


def test_conflicting_labels_fail_by_default_naming_the_rows_and_drop_or_majority_resolve_them(workspace):
    import pytest

    from transfer.errors import TransferError

    df = _train(workspace)
    labels = sorted(set(df["label"]))
    extra = pd.DataFrame({"text": ["the same words", "The  same words", "the same words", "a tie", "A tie"],
                          "label": [labels[0], labels[0], labels[1], labels[0], labels[1]]})
    _write(workspace, pd.concat([df, extra], ignore_index=True))
    n = len(df)
    with pytest.raises(TransferError, match=rf"train.csv: 2 texts carry conflicting labels.*data row {n + 1} "
                                            rf"'{labels[0]}', data row {n + 2} '{labels[0]}', data row {n + 3}"):
        run_stage("prepare", load_params(workspace / "params.yaml"), Workspace(workspace))
    assert not (workspace / "artifacts/prepare").exists()

    run_stage("prepare", load_params(workspace / "params.yaml", ["data.on_conflict=drop"]), Workspace(workspace))
    kept = {t.casefold() for n in ("train", "valid", "test") for t in _texts(workspace, f"{n}.csv")}
    assert "the same words" not in kept and "a tie" not in kept
    assert _report(workspace)["rows_dropped"]["train"] == {"conflicting_label": 5}

    metrics = run_stage("prepare", load_params(workspace / "params.yaml", ["data.on_conflict=majority"]),
                        Workspace(workspace))
    rows = pd.concat([pd.read_csv(workspace / "artifacts/prepare" / f"{n}.csv", dtype=str) for n in ("train", "valid", "test")])
    same = rows[rows["text"].str.casefold().str.split().str.join(" ") == "the same words"]
    assert len(same) == 2 and set(same["label"]) == {labels[0]}  # 2 votes to 1; one side of the split
    assert "a tie" not in set(rows["text"].str.casefold())
    assert metrics["data"]["rows_dropped"] == 3


def test_control_characters_become_spaces_and_are_counted(workspace):
    df = _train(workspace)
    df.loc[5, "text"] = "nul\x00inside and a bell\x07 too"
    df.loc[6, "text"] = df.loc[6, "text"] + "\x1b[31m"
    _write(workspace, df)
    metrics = run_stage("prepare", load_params(workspace / "params.yaml"), Workspace(workspace))
    out = workspace / "artifacts/prepare"
    written = "".join((out / f).read_text() for f in ("train.csv", "valid.csv", "test.csv", "domain.txt"))
    assert "\x00" not in written and "\x07" not in written and "\x1b" not in written
    assert "nul inside and a bell too" in written
    assert metrics["data"]["control_chars_cleaned"] == 2


def test_a_class_that_is_copies_of_one_text_cannot_be_split_and_says_so(workspace):
    import pytest

    from transfer.errors import TransferError

    df = _train(workspace)
    rare = pd.DataFrame({"text": ["the only words of this class"] * 3, "label": ["rare"] * 3})
    _write(workspace, pd.concat([df, rare, df.iloc[:5]], ignore_index=True))  # a copy elsewhere: group branch
    with pytest.raises(TransferError, match=r"train.csv: class 'rare' has 1 distinct text.*\(validation split\)"):
        run_stage("prepare", load_params(workspace / "params.yaml"), Workspace(workspace))


def test_too_few_rows_to_hold_out_a_split_names_the_file_and_the_rows_it_would_take(workspace):
    import pytest

    from transfer.errors import TransferError

    df = _train(workspace)
    _write(workspace, pd.concat([df[df["label"] == c].iloc[:2] for c in sorted(df["label"].unique())]))
    p = load_params(workspace / "params.yaml", ["data.valid_frac=0.7"])
    with pytest.raises(TransferError, match=r"train.csv: 8 rows are too few to hold out a validation split of 6 rows "
                                            r"\(70%\) with every one of 4 classes"):
        run_stage("prepare", p, Workspace(workspace))
    assert not (workspace / "artifacts/prepare/train.csv").exists()
