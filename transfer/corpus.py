"""Raw text corpora: files, folders and globs read lazily as documents, and decoding that names the bad line.

The decoding helpers are shared with the labelled-table reader (transfer/readers.py), which re-exports
`iter_text_documents` so that `from transfer.readers import iter_text_documents` keeps working.
"""

from __future__ import annotations

import codecs
import glob
import itertools
import os
from pathlib import Path
from typing import Iterator, Sequence

from transfer.errors import TransferError

__all__ = ["iter_text_documents"]

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


