"""Readers for labelled tables (CSV/TSV/Parquet/JSON lines); bad input raises TransferError naming the file and
row. Raw text corpora are read by transfer/corpus.py; `iter_text_documents` is re-exported here for callers
that import both readers from one place.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd

from transfer.corpus import UTF16_NUL_HINT, _codec, _decode_error, _encoding_hint, _lines, iter_text_documents
from transfer.errors import TransferError

__all__ = ["iter_text_documents", "read_table", "TABLE_SUFFIXES"]

TABLE_SUFFIXES = (".csv", ".tsv", ".parquet", ".jsonl", ".json")


# --------------------------------------------------------------------------- labelled tables


def read_table(path: str | Path, text_cols: list[str], label_col: str | None, encoding: str = "utf-8",
               header: bool = True) -> pd.DataFrame:
    """Read a labelled table into columns "text" (the text columns joined with " ") and "label" (str).

    The format follows the suffix: .csv, .tsv, .parquet, .jsonl / .json (JSON lines, or one JSON array).
    header=False (CSV/TSV): columns are named "0", "1", ... by position. Every value is read as text, so labels
    like "01" or "NA" survive. label_col=None gives a "label" column of None. Rows with no text or no label raise
    TransferError naming the row: "data row N" counts data rows from 1 (header excluded); JSON lines say "line N".
    """
    path = Path(path)
    text_cols = [str(c) for c in ([text_cols] if isinstance(text_cols, (str, int)) else text_cols)]
    label_col = None if label_col is None else str(label_col)
    if not text_cols:
        raise TransferError(f"{path}: no text columns given (text_cols is empty)")
    _check_table_file(path)
    suffix = path.suffix.lower()
    if suffix in (".csv", ".tsv"):
        table, row_name = _read_delimited(path, "," if suffix == ".csv" else "\t", encoding, header)
    elif suffix == ".parquet":
        table, row_name = _read_parquet(path)
    elif suffix in (".jsonl", ".json"):
        table, row_name = _read_json_records(path, encoding)
    else:
        raise TransferError(f"{path}: unknown table format {path.suffix!r}; use one of {', '.join(TABLE_SUFFIXES)}")
    if len(table) == 0:
        raise TransferError(f"{path}: no data rows" + (" (only a header)" if header and suffix in (".csv", ".tsv")
                                                        else ""))
    columns = [str(c) for c in table.columns]
    _check_columns(path, columns, text_cols, label_col, header and suffix in (".csv", ".tsv"))

    col_values = {c: table.iloc[:, columns.index(c)].tolist() for c in text_cols + ([label_col] if label_col else [])}
    parts = [[_cell(path, v, c, row_name, i, text=True) for i, v in enumerate(col_values[c])] for c in text_cols]
    texts = [" ".join(p.strip() for p in row if p is not None and p.strip()) for row in zip(*parts)]
    _require_all(path, texts, row_name, f"text is empty or missing (column{'s' if len(text_cols) > 1 else ''} "
                                        f"{', '.join(map(repr, text_cols))})")
    if label_col is None:
        labels: list[str | None] = [None] * len(texts)
    else:
        labels = [None if v is None else v.strip()
                  for v in (_cell(path, v, label_col, row_name, i) for i, v in enumerate(col_values[label_col]))]
        _require_all(path, labels, row_name, f"label is empty or missing (column {label_col!r})")
        if suffix in (".csv", ".tsv"):
            _check_swallowed_rows(path, "," if suffix == ".csv" else "\t", columns, label_col, parts, labels)
    return pd.DataFrame({"text": pd.Series(texts, dtype=object), "label": pd.Series(labels, dtype=object)})


def _check_table_file(path: Path) -> None:
    if path.is_dir():
        raise TransferError(f"{path}: is a folder; expected a table file ({', '.join(TABLE_SUFFIXES)})")
    if not path.exists():
        raise TransferError(f"{path}: file not found")
    if path.stat().st_size == 0:
        raise TransferError(f"{path}: file is empty")


def _check_columns(path: Path, columns: list[str], text_cols: list[str], label_col: str | None,
                   header: bool) -> None:
    dupes = sorted({c for c in columns if columns.count(c) > 1})
    if dupes:
        raise TransferError(f"{path}: duplicate column name{'s' if len(dupes) > 1 else ''} "
                            f"{', '.join(map(repr, dupes))} in the header; column names must be unique")
    for kind, names in (("text", text_cols), ("label", [label_col] if label_col else [])):
        missing = [c for c in names if c not in columns]
        if not missing:
            continue
        shown = ", ".join(map(repr, columns[:20])) + (f", ... ({len(columns)} in all)" if len(columns) > 20 else "")
        msg = (f"{path}: {kind} column{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))} not found; "
               f"available columns: {shown}")
        delimited = path.suffix.lower() in (".csv", ".tsv")
        if len(columns) == 1 and delimited:
            msg += "; only 1 column found; is the delimiter right? (.csv is read comma-separated, .tsv tab-separated)"
        elif delimited and not header:
            msg += ' (header=False: columns are named by position "0", "1", ...)'
        elif delimited and all(c.isdigit() for c in missing):
            msg += " (the first row was read as the header; use header=False to name columns by position)"
        raise TransferError(msg)


def _cell(path: Path, value: Any, column: str, row_name: Callable[[int], str], i: int, text: bool = False
          ) -> str | None:
    """A table value as text; None when missing. Integral floats read "1", not "1.0" (parquet int+null columns).
    A text column (text=True) must hold strings: numbers there mean the wrong column was named."""
    if value is None or isinstance(value, str):
        return value
    if text and isinstance(value, (bool, int, float, np.bool_, np.integer, np.floating)) and not (
            isinstance(value, (float, np.floating)) and math.isnan(value)):
        raise TransferError(f"{path}, {row_name(i)}: text column {column!r} holds the number {value!r}, not text; "
                            f"is text_cols naming the right column?")
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        f = float(value)
        return None if math.isnan(f) else str(int(f)) if f.is_integer() and abs(f) < 1e16 else repr(f)
    if value is pd.NA or value is pd.NaT:
        return None
    if isinstance(value, (dict, list, tuple, np.ndarray, bytes)):
        raise TransferError(f"{path}, {row_name(i)}: column {column!r} holds a {type(value).__name__}, expected text")
    return str(value)


def _check_swallowed_rows(path: Path, sep: str, columns: list[str], label_col: str, parts: list[list[str | None]],
                          labels: list[str | None]) -> None:
    """A quoted text spanning lines, one of which reads as a whole row of this table (a known label in the label
    column), is a missing closing quote that merged rows; legitimate multi-line texts pass."""
    known, width, at = set(labels), len(columns), columns.index(label_col)
    for column in parts:
        for i, value in enumerate(column):
            if value is None or ("\n" not in value and "\r" not in value):
                continue
            for line in value.splitlines():
                fields = next(csv.reader([line], delimiter=sep), [])
                if len(fields) == width and fields[at].strip() in known:
                    raise TransferError(f"{path}, {_data_row(i)}: a quoted field runs over several lines and "
                                        f"holds what reads as another row ({line[:60]!r}); is a closing quote "
                                        f"missing?")


def _require_all(path: Path, values: list[str | None], row_name: Callable[[int], str], problem: str) -> None:
    bad = [i for i, v in enumerate(values) if not v]
    if bad:
        more = f"; {len(bad)} rows in all have this problem" if len(bad) > 1 else ""
        raise TransferError(f"{path}, {row_name(bad[0])}: {problem}{more}")


def _data_row(i: int) -> str:
    return f"data row {i + 1}"


def _read_delimited(path: Path, sep: str, encoding: str, header: bool) -> tuple[pd.DataFrame, Callable[[int], str]]:
    codec = _codec(encoding)
    kind = "CSV" if sep == "," else "TSV"
    hint = _encoding_hint(path, codec)
    if hint == UTF16_NUL_HINT:  # UTF-16 bytes decode as (wrong) UTF-8 with NULs: say so before columns look garbled
        raise TransferError(f"{path}: not {encoding} text{hint}")
    try:
        # header=None: the header row is read as data, so duplicate names stay visible (pandas would rename them)
        raw = pd.read_csv(path, sep=sep, header=None, dtype=str, na_filter=False, encoding=codec,
                          skip_blank_lines=True, engine="c")
    except UnicodeError:
        raise TransferError(_decode_error(path, codec, encoding)) from None
    except pd.errors.EmptyDataError:
        raise TransferError(f"{path}: file is empty (no rows)") from None
    except MemoryError:
        raise
    except Exception as e:  # pandas' C parser raises several types; all mean "not a well-formed table"
        detail = " ".join(str(e).split())
        hint = ("; is the delimiter right, or is a field with a delimiter missing its quotes?"
                if "fields in line" in detail else "")
        raise TransferError(f"{path}: cannot parse as {kind}: {detail}{hint}") from None
    if header:
        raw.columns = [str(name).strip() for name in raw.iloc[0]]
        raw = raw.iloc[1:]
    else:
        raw.columns = [str(i) for i in range(raw.shape[1])]
    return raw, _data_row


def _read_parquet(path: Path) -> tuple[pd.DataFrame, Callable[[int], str]]:
    try:
        table = pd.read_parquet(path).astype(object)  # materialize now: bad string data fails here, not later
    except MemoryError:
        raise
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ...
        raise TransferError(f"{path}: cannot read as Parquet: {' '.join(str(e).split())}") from None
    return table, _data_row


def _read_json_records(path: Path, encoding: str) -> tuple[pd.DataFrame, Callable[[int], str]]:
    """JSON lines (one object per line), or a file holding one JSON array of objects."""
    codec = _codec(encoding)
    records: list[dict] = []
    line_of: list[int] = []
    lines = _lines(path, codec, encoding)
    for lineno, line in enumerate(lines, 1):
        stripped = line.strip()
        if not stripped:
            continue
        if not records and stripped.startswith("["):
            return _json_array(path, "\n".join(itertools.chain([line], lines)), lineno - 1)
        try:
            obj = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise TransferError(f"{path}, line {lineno}: not valid JSON ({e.msg}, column {e.colno})") from None
        except RecursionError:
            raise TransferError(f"{path}, line {lineno}: JSON nested too deeply") from None
        if not isinstance(obj, dict):
            raise TransferError(f"{path}, line {lineno}: expected a JSON object {{...}}, got {type(obj).__name__}")
        records.append(obj)
        line_of.append(lineno)
    return _records_frame(records), lambda i: f"line {line_of[i]}"


def _json_array(path: Path, text: str, lines_before: int) -> tuple[pd.DataFrame, Callable[[int], str]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TransferError(f"{path}, line {e.lineno + lines_before}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise TransferError(f"{path}: JSON nested too deeply") from None
    if not isinstance(data, list):
        raise TransferError(f"{path}: expected JSON lines or a JSON array of objects")
    for i, obj in enumerate(data):
        if not isinstance(obj, dict):
            raise TransferError(f"{path}, record {i + 1}: expected a JSON object {{...}}, got {type(obj).__name__}")
    return _records_frame(data), lambda i: f"record {i + 1}"


def _records_frame(records: list[dict]) -> pd.DataFrame:
    columns = list(dict.fromkeys(k for r in records for k in r))
    return pd.DataFrame({c: pd.Series([r.get(c) for r in records], dtype=object) for c in columns},
                        index=pd.RangeIndex(len(records)))
