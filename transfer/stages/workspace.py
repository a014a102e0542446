"""The workspace: where every stage's inputs and outputs live, and cached readers for what several stages read.

Layout under the root: `artifacts/<stage>/...`, `metrics/<stage>.json` (written last: its presence means the
stage finished) and `plots/...`. The readers cache by file identity (size, mtime, inode), so a stage loads the
tokenizer and the prepared tables once, and a rerun of `prepare` in the same process is seen.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pandas as pd
import torch

from transfer.data import write_token_stream
from transfer.io_utils import atomic_path
from transfer.tokenizer import Tokenizer

__all__ = ["Workspace", "encode_stream", "save_state", "seed_everything"]


class Workspace:
    def __init__(self, root: str | Path = "."):
        self.root = Path(root)
        self._cache: dict[tuple, Any] = {}

    def __repr__(self) -> str:
        return f"Workspace({str(self.root)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Workspace) and other.root == self.root

    def __hash__(self) -> int:
        return hash(self.root)

    def art(self, stage: str, name: str = "") -> Path:
        return self.root / "artifacts" / stage / name

    def metrics(self, stage: str) -> Path:
        return self.root / "metrics" / f"{stage}.json"

    def plot(self, name: str) -> Path:
        return self.root / "plots" / name

    def _cached(self, path: Path, load: Callable[[Path], Any]) -> Any:
        st = path.stat()
        key = (str(path), load.__name__, st.st_size, st.st_mtime_ns, st.st_ino)
        if key not in self._cache:
            self._cache[key] = load(path)
        return self._cache[key]

    def tokenizer(self) -> Tokenizer:
        return self._cached(self.art("tokenize", "spm.model"), Tokenizer.load)

    def prepared(self) -> dict:
        """metrics/prepare.json: the classes, split sizes and the rules resolved from the data."""
        return self._cached(self.metrics("prepare"), lambda p: json.loads(p.read_text()))

    def table(self, split: str) -> pd.DataFrame:
        """artifacts/prepare/<split>.csv (train, valid, test: text + label; unlabelled: text), every value text."""
        def read_csv(p: Path) -> pd.DataFrame:
            return pd.read_csv(p, dtype=str, keep_default_na=False)

        return self._cached(self.art("prepare", f"{split}.csv"), read_csv)


def encode_stream(tok: Tokenizer, docs: Iterator[str], path: Path, batch: int = 10_000) -> Path:
    """Documents -> a memory-mapped token stream at `path`, encoded `batch` documents at a time."""
    def batches() -> Iterator[list[int]]:
        buf: list[str] = []
        for doc in docs:
            buf.append(doc)
            if len(buf) == batch:
                yield from tok.encode(buf)
                buf = []
        if buf:
            yield from tok.encode(buf)

    return write_token_stream(batches(), path, tok.vocab_size)


def save_state(path: Path, state: dict) -> Path:
    with atomic_path(path) as tmp:
        torch.save({k: v.detach().cpu() for k, v in state.items()}, tmp)
    return path


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
