"""Atomic writes: a reader sees the old file or the whole new one, never a torn one."""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

__all__ = ["atomic_path", "write_json", "write_csv", "file_digest"]


def _other_rank() -> bool:
    """A process of a data-parallel job other than rank 0 (transfer/distributed.py): rank 0 alone writes."""
    dist = sys.modules.get("torch.distributed")  # never imports torch: the CLI checks params without it
    return dist is not None and dist.is_available() and dist.is_initialized() and dist.get_rank() != 0


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temp path beside `path`; rename it onto `path` on success, delete it on error. In a data-parallel
    job the ranks other than 0 run the same code, but write into a private temp folder that is then deleted."""
    path = Path(path)
    if _other_rank():
        with tempfile.TemporaryDirectory(prefix="transfer-rank-") as scratch:
            yield Path(scratch) / path.name
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        if tmp.exists():
            with open(tmp, "rb+") as f:  # data on disk before the rename makes it visible
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_json(path: str | Path, obj: Any) -> Path:
    """Write `obj` as indented JSON, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    return Path(path)


def write_csv(path: str | Path, rows: list[dict]) -> Path:
    """Rows of dicts as CSV with a header from the first row, atomically."""
    with atomic_path(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["empty"])
        writer.writeheader()
        writer.writerows(rows)
    return Path(path)


def file_digest(path: str | Path, chunk: int = 1 << 20) -> str:
    """sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
