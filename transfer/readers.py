"""Readers for raw text corpora and labelled tables; bad input raises TransferError naming the file and line/row."""

from __future__ import annotations

import codecs
import csv
import glob
import itertools
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pandas as pd

from transfer.errors import TransferError

__all__ = ["iter_text_documents", "read_table", "TABLE_SUFFIXES"]

TABLE_SUFFIXES = (".csv", ".tsv", ".parquet", ".jsonl", ".json")
DOC_PER = ("line", "file")


# --------------------------------------------------------------------------- text corpora


def iter_text_documents(paths: Sequence[str | Path], encoding: str = "utf-8", doc_per: str = "line") -> Iterator[str]:
    """Yield the documents of text files, lazily, file by file.

    `paths` are files, folders (all files below, sorted, hidden ones skipped) or glob patterns; they are checked
    now, the files are read as the iterator advances. WikiExtractor `<doc ...>` / `</doc>` lines are dropped.
    doc_per="line": every non-blank line (stripped) is a document. doc_per="file": every file is one document,
    or every `<doc>` article in a WikiExtractor file; its non-blank lines are joined with "\\n".
    """
    if doc_per not in DOC_PER:
        raise TransferError(f"doc_per must be one of {list(DOC_PER)}, got {doc_per!r}")
    codec = _codec(encoding)
    files = _expand_paths(paths)
    return _documents(files, codec, encoding, doc_per)


def _documents(files: list[Path], codec: str, encoding: str, doc_per: str) -> Iterator[str]:
    split = _line_docs if doc_per == "line" else _file_docs
    found = False
    for path in files:
        for doc in split(_lines(path, codec, encoding)):
            found = True
            yield doc
    if not found:
        where = str(files[0]) if len(files) == 1 else f"{len(files)} files ({files[0]} ... {files[-1]})"
        raise TransferError(f"{where}: no text found (every line is blank or a <doc> tag)")


def _is_doc_tag(line: str) -> bool:
    return (line.startswith("<doc ") and line.endswith(">")) or line == "</doc>"


def _line_docs(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        line = line.strip()
        if line and not _is_doc_tag(line):
            yield line


def _file_docs(lines: Iterator[str]) -> Iterator[str]:
    buf: list[str] = []
    for line in lines:
        line = line.strip()
        if _is_doc_tag(line):  # a WikiExtractor article starts or ends
            if buf:
                yield "\n".join(buf)
            buf = []
        elif line:
            buf.append(line)
    if buf:
        yield "\n".join(buf)


def _expand_paths(paths: Sequence[str | Path]) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if len(paths) == 0:
        raise TransferError("no text files given (the list of files, folders or globs is empty)")
    files: list[Path] = []
    for p in paths:
        path = Path(p).expanduser()
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = _files_under(path)
            if not found:
                raise TransferError(f"{path}: folder holds no files")
            files.extend(found)
        elif any(c in str(p) for c in "*?["):
            found = []
            for match in sorted(glob.glob(str(path), recursive=True)):
                m = Path(match)
                found.extend([m] if m.is_file() else _files_under(m) if m.is_dir() else [])
            if not found:
                raise TransferError(f"{p}: no files match this pattern")
            files.extend(found)
        elif path.exists():
            raise TransferError(f"{path}: not a regular file or folder")
        else:
            raise TransferError(f"{path}: no such file or folder")
    return files


def _files_under(folder: Path) -> list[Path]:
    """Files below `folder`, sorted, skipping hidden files and folders (.git, .DS_Store, ...)."""
    return sorted(f for f in folder.rglob("*")
                  if f.is_file() and not any(part.startswith(".") for part in f.relative_to(folder).parts))


# --------------------------------------------------------------------------- decoding


def _codec(encoding: str) -> str:
    """The codec to open files with; plain UTF-8 becomes utf-8-sig so a byte-order mark is dropped."""
    try:
        name = codecs.lookup(encoding).name
    except (LookupError, TypeError):
        raise TransferError(f"unknown text encoding {encoding!r}") from None
    return "utf-8-sig" if name == "utf-8" else encoding


def _lines(path: Path, codec: str, encoding: str) -> Iterator[str]:
    """Lines of a text file without line endings (\\n, \\r\\n and \\r all end a line)."""
    try:
        with open(path, encoding=codec, newline=None) as f:
            for line in f:
                yield line.rstrip("\n")
    except UnicodeError:  # UnicodeDecodeError, or e.g. "UTF-16 stream does not start with BOM"
        raise TransferError(_decode_error(path, codec, encoding)) from None
    except OSError as e:
        raise TransferError(f"{path}: cannot read ({e.strerror or e})") from None


UTF16_NUL_HINT = "; every other byte is NUL, as in UTF-16 text: try data.encoding: utf-16-le (or utf-16-be)"


def _nul_interleaved(head: bytes) -> bool:
    """ASCII text written as UTF-16 without a byte-order mark: every other byte is NUL."""
    return len(head) >= 4 and head.count(0) > len(head) // 4


def _encoding_hint(path: Path, codec: str) -> str:
    """For a file read as UTF-8: what its first bytes look like (a UTF-16/32 byte-order mark, UTF-16 without
    one), else the usual suspect, Latin-1. Other encodings: no hint."""
    if codecs.lookup(codec).name not in ("utf-8", "utf-8-sig"):
        return ""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return ""
    boms = [(codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF16_LE, "utf-16"),
            (codecs.BOM_UTF16_BE, "utf-16")]
    for bom, name in boms:
        if head.startswith(bom):
            return f"; the file starts with a {name.upper()} byte-order mark: try data.encoding: {name}"
    if _nul_interleaved(head):
        return UTF16_NUL_HINT
    return "; try data.encoding: latin-1"


def _decode_error(path: Path, codec: str, encoding: str) -> str:
    """Message naming the first line of `path` that `codec` cannot decode (the fast reader only knows a chunk)."""
    hint = _encoding_hint(path, codec)
    decoder = codecs.getincrementaldecoder(codec)()
    line = 1
    try:
        with open(path, "rb") as f:
            for raw in itertools.chain(f, [None]):
                text = decoder.decode(b"", final=True) if raw is None else decoder.decode(raw)
                line += text.count("\n") + text.count("\r") - text.count("\r\n")
    except UnicodeDecodeError as e:
        bad = e.object[e.start:e.end][:4].hex(" ")
        return f"{path}, line {line}: bytes are not valid {encoding} (byte 0x{bad}{hint})"
    except UnicodeError as e:
        return f"{path}, line {line}: bytes are not valid {encoding} ({e})"
    except OSError:
        pass
    return f"{path}: bytes are not valid {encoding}{hint and ' (' + hint[2:] + ')'}"


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
