"""Data hygiene at `prepare`: control characters, duplicates, conflicting labels, leak-free splits, the report.

The rules, applied to every labelled table the same way:
- Control characters (C0 and C1, NUL included; tab and line breaks are whitespace) become a space: they carry
  no words, break CSV and text tools downstream, and SentencePiece would learn pieces for them.
- Two texts are duplicates when they are equal after `normalise` (Unicode NFKC, case folded, whitespace
  collapsed). Duplicates with different labels conflict; `data.on_conflict` says what happens: `error` (the
  default: the table is wrong or the task is ill-posed), `drop` (every row of a conflicting text goes) or
  `majority` (the most frequent label wins; a tie drops the text).
- A split the project makes keeps every copy of a text on one side (group-aware), so no text is both learned
  and judged. Overlap between files the user gives is reported, not changed.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from typing import Any, Callable

import numpy as np
import pandas as pd

from transfer.errors import TransferError

__all__ = ["clean_controls", "normalise", "resolve_conflicts", "group_split", "report", "summary"]

CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]+")  # keeps \t \n \r, which are whitespace


def clean_controls(df: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """Control characters in `text` -> one space; returns the table and how many rows changed."""
    cleaned = [CONTROL.sub(" ", t) for t in df["text"]]
    changed = sum(a != b for a, b in zip(cleaned, df["text"]))
    if not changed:
        return df, 0
    out = df.copy()
    out["text"] = [" ".join(t.split()) if t != old else t for t, old in zip(cleaned, df["text"])]
    return out, changed


def normalise(text: str) -> str:
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def resolve_conflicts(df: pd.DataFrame, on_conflict: str, source: str,
                      row_name: Callable[[int], str] = lambda i: f"data row {i + 1}") -> tuple[pd.DataFrame, int]:
    """Rows whose normalised text carries more than one label, handled by `on_conflict`; -> (table, rows dropped)."""
    keys = [normalise(t) for t in df["text"]]
    labels_of: dict[str, Counter] = {}
    for k, y in zip(keys, df["label"]):
        labels_of.setdefault(k, Counter())[y] += 1
    conflicting = {k for k, c in labels_of.items() if len(c) > 1}
    if not conflicting:
        return df, 0
    if on_conflict == "error":
        first = next(k for k in keys if k in conflicting)
        rows = [i for i, k in enumerate(keys) if k == first]
        shown = ", ".join(f"{row_name(i)} {df['label'].iloc[i]!r}" for i in rows[:4])
        raise TransferError(f"{source}: {len(conflicting)} text{'s carry' if len(conflicting) > 1 else ' carries'} "
                            f"conflicting labels, e.g. {df['text'].iloc[rows[0]][:60]!r} at {shown}; fix the "
                            f"labels, or set data.on_conflict: drop (remove them) or majority (keep the most "
                            f"frequent label)")
    if on_conflict == "drop":
        keep = [k not in conflicting for k in keys]
    else:  # majority; a tie has no majority and drops the text
        winner = {}
        for k in conflicting:
            (top, n), *rest = labels_of[k].most_common()
            winner[k] = top if not rest or rest[0][1] < n else None
        keep = [k not in conflicting or winner[k] == y for k, y in zip(keys, df["label"])]
    kept = df[np.array(keep, dtype=bool)].reset_index(drop=True)
    return kept, len(df) - len(kept)


def group_split(df: pd.DataFrame, n_out: int, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Stratified, seeded split that keeps every copy of a (normalised) text on one side -> (rest, held out).

    Without duplicates this is exactly sklearn's stratified `train_test_split`; with them, one row per text
    is split and its copies follow it."""
    from sklearn.model_selection import train_test_split

    keys = pd.Series([normalise(t) for t in df["text"]])
    first = ~keys.duplicated()
    if first.all():
        rest, out = train_test_split(df, test_size=n_out, stratify=df["label"], random_state=seed)
        return rest.reset_index(drop=True), out.reset_index(drop=True)
    reps = np.flatnonzero(first.to_numpy())  # positions of each text's first copy
    rep_labels = df["label"].to_numpy()[reps]
    distinct = pd.Series(rep_labels).value_counts()
    if distinct.min() < 2:
        raise TransferError(f"class {distinct.idxmin()!r} has {int(distinct.min())} distinct text; a split that keeps "
                            f"copies of a text together needs at least 2 distinct texts per class")
    n_classes = len(distinct)
    n_groups_out = min(len(reps) - n_classes, max(n_classes, round(len(reps) * n_out / len(df))))
    if n_groups_out < n_classes:
        raise TransferError(f"{len(reps)} distinct texts are too few to hold out a split with every one of "
                            f"{n_classes} classes on both sides")
    _, out_reps = train_test_split(reps, test_size=n_groups_out, stratify=rep_labels, random_state=seed)
    held = keys.isin(set(keys.iloc[out_reps])).to_numpy()
    return df[~held].reset_index(drop=True), df[held].reset_index(drop=True)


def _percentiles(texts: pd.Series) -> dict[str, float]:
    words = np.array([len(t.split()) for t in texts]) if len(texts) else np.zeros(1)
    return {f"p{q}": float(np.percentile(words, q)) for q in (5, 50, 95, 99)} | {"max": int(words.max())}


def report(tables: dict[str, pd.DataFrame], read: dict[str, int], dropped: dict[str, dict[str, int]],
           controls: dict[str, int]) -> dict[str, Any]:
    """What `prepare` saw: rows read and dropped (and why), duplicates, overlap between splits, class balance,
    lengths in words and control characters cleaned, per split."""
    # object Series: a plain list would become a fixed-width numpy string array (rows x longest text) in groupby
    normalised = {name: pd.Series([normalise(t) for t in df["text"]], index=df.index, dtype=object)
                  for name, df in tables.items()}
    keys = {name: set(n) for name, n in normalised.items()}
    out: dict[str, Any] = {"rows_read": read, "rows_dropped": dropped, "control_chars_cleaned": controls}
    out["duplicates"] = {name: {"exact": int(df["text"].duplicated().sum()),
                                "normalised": int(len(df) - len(keys[name]))} for name, df in tables.items()}
    names = list(tables)
    out["conflicting_texts"] = {name: int(df["label"].groupby(normalised[name]).nunique().gt(1).sum())
                                for name, df in tables.items() if df["label"].notna().all()}
    out["overlap"] = {f"{a}/{b}": len(keys[a] & keys[b]) for i, a in enumerate(names) for b in names[i + 1:]}
    out["classes"] = {name: {str(k): int(v) for k, v in df["label"].value_counts().sort_index().items()}
                      for name, df in tables.items() if df["label"].notna().all()}
    out["words"] = {name: _percentiles(df["text"]) for name, df in tables.items()}
    return out


def summary(rep: dict[str, Any]) -> dict[str, int]:
    """The report's headline counts (the stage's metrics; the full report is artifacts/prepare/data_report.json)."""
    return {"rows_dropped": sum(sum(why.values()) for why in rep["rows_dropped"].values()),
            "control_chars_cleaned": sum(rep["control_chars_cleaned"].values()),
            "duplicates_train": rep["duplicates"]["train"]["normalised"],
            "conflicting_texts": sum(rep["conflicting_texts"].values()),
            "overlap_train_valid": rep["overlap"]["train/valid"], "overlap_train_test": rep["overlap"]["train/test"]}
