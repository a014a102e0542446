"""prepare: read the labelled tables, clean and split them, and gather the domain texts for LM tuning."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pandas as pd

from transfer import hygiene, rules
from transfer.config import Params
from transfer.corpus import iter_text_documents
from transfer.errors import TransferError
from transfer.io_utils import atomic_path, file_digest, write_json
from transfer.readers import read_table
from transfer.stages.record import Stage
from transfer.stages.workspace import Workspace


def texts_file(path: Path, texts: Iterator[str]) -> Path:
    """One document per line (newlines and control characters inside a document become spaces), atomically."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(" ".join(hygiene.CONTROL.sub(" ", t).split()) + "\n")
    return path


def _split(df: pd.DataFrame, frac: float, seed: int, what: str, source: str,
           rows: int | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Stratified, seeded split of `frac` (or `rows`) of the rows that keeps copies of a text together -> (rest,
    held out)."""
    counts = df["label"].value_counts()
    if len(counts) < 2:
        raise TransferError(f"{source}: only one class ({counts.index[0]!r}); a classifier needs at least two")
    small = counts[counts < 2]
    if len(small):
        raise TransferError(f"{source}: class {small.index[0]!r} has {int(small.iloc[0])} row; holding out a "
                            f"stratified {what} split needs at least 2 rows per class")
    n_out = max(len(counts), round(len(df) * frac) if rows is None else rows)
    if len(df) - n_out < len(counts):
        size = f"{n_out} rows" + (f" ({frac:.0%})" if rows is None else "")
        raise TransferError(f"{source}: {len(df)} rows are too few to hold out a {what} split of {size} "
                            f"with every one of {len(counts)} classes on both sides")
    try:
        return hygiene.group_split(df, n_out, seed)
    except TransferError as e:  # copies of texts leave too few distinct ones: say which file
        raise TransferError(f"{source}: {e} ({what} split)") from None


def _subsample(df: pd.DataFrame, n: int, seed: int, source: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Stratified, seeded choice of `n` labelled rows (every class keeps at least one), and the rest."""
    from sklearn.model_selection import train_test_split

    if n > len(df):
        raise TransferError(f"data.max_train_labels is {n} but {source} has only {len(df)} training rows")
    k = df["label"].nunique()
    if n < k:
        raise TransferError(f"data.max_train_labels is {n}, fewer than the {k} classes in {source}")
    if n == len(df):
        return df, df.iloc[:0]
    keep, rest = train_test_split(df, train_size=n, stratify=df["label"], random_state=seed)
    return keep.reset_index(drop=True), rest.reset_index(drop=True)


def prepare(p: Params, ws: Workspace) -> dict:
    """Read the labelled tables, split and subsample them, and gather the domain texts for LM tuning."""
    d = p.data
    read_n: dict[str, int] = {}
    dropped: dict[str, dict[str, int]] = {}
    controls: dict[str, int] = {}

    def read(name: str, path: str) -> pd.DataFrame:
        df = read_table(path, list(d.text_cols), d.label_col, d.encoding, d.header)
        read_n[name] = len(df)
        df, controls[name] = hygiene.clean_controls(df)
        return df

    # conflicting labels are resolved in the training table only; held-out files are the user's yardstick
    train, n = hygiene.resolve_conflicts(read("train", d.train), d.on_conflict, d.train)
    table, dropped["train"] = train, {"conflicting_label": n} if n else {}
    test = read("test", d.test) if d.test else None
    if test is None:
        train, test = _split(train, d.test_frac, d.seed, "test", d.train)
    valid = read("valid", d.valid) if d.valid else None
    valid_rows = rules.valid_rows(len(train), d.valid_frac) if d.rules and valid is None else None
    if valid is None:
        train, valid = _split(train, d.valid_frac, d.seed, "validation", d.train,
                              valid_rows["value"] if valid_rows else None)
    classes = sorted(train["label"].unique())
    for name, df, src in (("validation", valid, d.valid or d.train), ("test", test, d.test or d.train)):
        unknown = sorted(set(df["label"]) - set(classes))
        if unknown:
            raise TransferError(f"{src}: label {unknown[0]!r} occurs in the {name} rows but never in training")
    labelled, unlabelled = ((train, train.iloc[:0]) if d.max_train_labels is None
                            else _subsample(train, d.max_train_labels, d.label_seed, d.train))
    # every training text, labelled or not, is in-domain LM text (the paper's semi-supervised setting);
    # file order, so label budgets leave domain.txt (and the tuned LM) unchanged. Validation rows stay out
    # like test rows: the tuned LM memorises its texts (AG News: ppl 24 on them vs 86 on unseen ones), which
    # lifted validation accuracy 6 points above test and made every choice made on it favour memorisation.
    held_out = set(test["text"]) | set(valid["text"])
    domain = [t for t in table["text"] if t not in held_out]
    if d.domain_include_test:  # transductive: every text the classifier is judged on, labels unused
        domain += list(valid["text"]) + list(test["text"])
    extra = iter_text_documents(list(d.domain), d.encoding) if d.domain else iter(())

    out = ws.art("prepare")
    # domain.txt first: data.domain files are only read (and may fail) now; the tables must not change before
    texts_file(out / "domain.txt", (t for src in (domain, extra) for t in src))
    for name, df in (("train", labelled), ("valid", valid), ("test", test)):
        with atomic_path(out / f"{name}.csv") as tmp:
            df[["text", "label"]].to_csv(tmp, index=False)
    with atomic_path(out / "unlabelled.csv") as tmp:  # the budget's unlabelled rows, for self-training: no labels
        unlabelled[["text"]].to_csv(tmp, index=False)
    report = hygiene.report({"train": train, "valid": valid, "test": test}, read_n, dropped, controls)
    write_json(out / "data_report.json", report)
    metrics = dict(classes=classes, n_train=len(labelled), n_train_unlabelled=len(train) - len(labelled),
                   n_valid=len(valid), n_test=len(test), domain_include_test=d.domain_include_test,
                   test_digest=file_digest(out / "test.csv"), data=hygiene.summary(report))
    if d.rules:  # the classifier settings that depend on the data, with their reasons
        metrics["data_stats"] = rules.data_stats(list(labelled["text"]), list(labelled["label"]), len(unlabelled))
        metrics["rules"] = rules.resolve(metrics["data_stats"], p)
        if valid_rows:  # beside the rules, not in them: `rules.apply` has nothing to set after the split
            metrics["valid_rows"] = valid_rows
    write_json(ws.metrics("prepare"), metrics)
    return metrics


STAGE = Stage(
    name="prepare", run=prepare,
    summary="read, clean, split and subsample the labelled tables; gather domain text for LM tuning",
    params=lambda p: {"data": p.section("data")},
    deps=lambda p, ws: [Path(f) for f in [p.data.train, p.data.valid, p.data.test, *p.data.domain] if f],
    outs=lambda p, ws: [ws.art("prepare"), ws.metrics("prepare")],
)
