"""Token streams for language modelling and length-aware batches for classification."""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

from transfer.errors import TransferError
from transfer.io_utils import atomic_path
from transfer.tokenizer import BOS_ID  # every document starts with it

__all__ = [
    "write_token_stream", "load_token_stream", "LMLoader", "Docs", "SortishSampler", "sorted_batches",
    "pad_batch", "ClassificationLoader",
]



def _stream_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


def write_token_stream(ids: Iterable[list[int]], path: Path, vocab_size: int, bos_id: int = BOS_ID,
                       chunk_tokens: int = 1 << 20) -> Path:
    """Concatenate `[bos] + doc` for every doc into a `.npy` file, streaming in ~1M-token chunks.

    uint16 when the vocab fits (half the disk and page cache of int32). Written atomically.
    """
    path, dtype = Path(path), _stream_dtype(vocab_size)
    n_total, buf = 0, []
    raw = path.with_name(f".{path.name}.raw-{os.getpid()}")  # tokens first; the .npy header needs the count
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(raw, "wb") as f:
            for doc in ids:
                buf.append(bos_id)
                buf.extend(doc)
                if len(buf) >= chunk_tokens:
                    np.asarray(buf, dtype=dtype).tofile(f)
                    n_total, buf = n_total + len(buf), []
            np.asarray(buf, dtype=dtype).tofile(f)
            n_total += len(buf)
        if n_total < 2:
            raise TransferError(f"{path}: token stream is empty; the corpus has no text")
        header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (n_total,)}
        with atomic_path(path) as tmp, open(tmp, "wb") as out, open(raw, "rb") as src:
            np.lib.format.write_array_header_1_0(out, header)
            shutil.copyfileobj(src, out, 1 << 24)
    finally:
        raw.unlink(missing_ok=True)
    return path


def load_token_stream(path: Path) -> np.ndarray:
    """Memory-map a token stream, so memory does not grow with the corpus."""
    try:
        return np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise TransferError(f"{path}: not a readable token stream ({e})") from None


class LMLoader:
    """Language-model batches: the stream is cut into `bs` parallel rows read left to right.

    Each batch has a variable length (AWD-LSTM): bptt with p=0.95 else bptt/2, then max(5, round(N(that, 5))).
    `lr_scale` of a batch is seq_len/bptt, the AWD-LSTM rule for keeping per-token step sizes equal.
    Batch lengths depend only on (seed, epoch), so an epoch can be resumed mid-way.
    Data-parallel (`world` > 1): the stream is cut into `bs * world` rows and rank `rank` reads rows
    [rank * bs, (rank + 1) * bs), a contiguous share; together the ranks read what one process at
    `bs * world` would, batch for batch.
    """

    def __init__(self, stream: np.ndarray, bs: int, bptt: int = 70, backwards: bool = False,
                 variable: bool = True, seed: int = 0, max_tokens: int | None = None, rank: int = 0,
                 world: int = 1):
        self.bs, self.bptt, self.variable, self.seed = bs, bptt, variable, seed
        m = len(stream) // (bs * world)  # tokens per row
        if m < 2:
            raise TransferError(f"token stream of {len(stream)} tokens is too short for batch size {bs}"
                                + (f" on each of {world} processes" if world > 1 else ""))
        n = m if max_tokens is None else max(2, min(m, max_tokens // (bs * world)))
        data = stream[::-1] if backwards else stream
        # a view: the memmap is never copied whole
        self.rows = data[: m * bs * world].reshape(bs * world, m)[rank * bs:(rank + 1) * bs, :n]
        self.n = n

    def seq_lens(self, epoch: int) -> list[int]:
        if not self.variable:
            return [min(self.bptt, self.n - 1 - i) for i in range(0, self.n - 1, self.bptt)]
        rng = np.random.default_rng([self.seed, epoch])
        lens, i = [], 0
        while i < self.n - 1:
            bptt = self.bptt if rng.random() < 0.95 else self.bptt / 2
            sl = min(max(5, round(rng.normal(bptt, 5))), self.n - 1 - i)
            lens.append(sl)
            i += sl
        return lens

    def __len__(self) -> int:
        return math.ceil((self.n - 1) / self.bptt)

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor, float]]:
        """Yield (x, y, lr_scale) for one epoch, skipping the first `start` batches."""
        lens = self.seq_lens(epoch)
        offsets = np.concatenate([[0], np.cumsum(lens)])
        for k in range(start, len(lens)):
            i, sl = offsets[k], lens[k]
            chunk = torch.from_numpy(np.ascontiguousarray(self.rows[:, i:i + sl + 1], dtype=np.int64))
            yield chunk[:, :-1], chunk[:, 1:], sl / self.bptt

    def tokens_per_epoch(self) -> int:
        return (self.n - 1) * self.bs


@dataclass
class Docs:
    """Ragged token-id documents: one flat array plus offsets (cheap to save and slice)."""

    ids: np.ndarray  # int32, all documents concatenated
    offsets: np.ndarray  # int64, len(docs)+1

    @classmethod
    def from_lists(cls, docs: Iterable[list[int]], bos_id: int = BOS_ID) -> "Docs":
        docs = [[bos_id, *d] for d in docs]
        lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
        flat = np.fromiter((t for d in docs for t in d), dtype=np.int32, count=int(lengths.sum()))
        return cls(flat, np.concatenate([[0], np.cumsum(lengths)]))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.ids[self.offsets[i]: self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def save(self, path: Path) -> Path:
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                np.savez(f, ids=self.ids, offsets=self.offsets)
        return Path(path)

    @classmethod
    def load(cls, path: Path) -> "Docs":
        with np.load(path) as z:
            return cls(z["ids"], z["offsets"])


class SortishSampler:
    """Training order: shuffle, sort chunks of bs*50 by length, cut into batches, largest batch first.

    Batches of similar length waste little padding; the largest first surfaces out-of-memory at once.
    """

    def __init__(self, lengths: np.ndarray, bs: int, seed: int = 0):
        self.lengths, self.bs, self.seed = np.asarray(lengths), bs, seed

    def batches(self, epoch: int = 0) -> list[np.ndarray]:
        rng = np.random.default_rng([self.seed, epoch])
        idx = rng.permutation(len(self.lengths))
        chunk = self.bs * 50
        idx = np.concatenate([c[np.argsort(-self.lengths[c], kind="stable")]
                              for c in np.split(idx, range(chunk, len(idx), chunk))])
        batches = _cut(idx, self.bs)
        first = int(np.argmax([self.lengths[b].max() for b in batches]))
        batches[0], batches[first] = batches[first], batches[0]
        rest = batches[1:]
        order = rng.permutation(len(rest))
        return [batches[0]] + [rest[i] for i in order]

    def __len__(self) -> int:
        return n_batches(len(self.lengths), self.bs)


def _cut(idx: np.ndarray, bs: int) -> list[np.ndarray]:
    """`idx` in batches of `bs`; a last batch of one row joins the one before it (bs + 1 rows), because the
    classifier head's BatchNorm cannot train or recalibrate on a single row (100 labels + 1,901 pseudo-labels
    at bs 10 is such a count)."""
    batches = np.split(idx, range(bs, len(idx), bs))
    if bs > 1 and len(batches) > 1 and len(batches[-1]) == 1:
        batches[-2:] = [np.concatenate(batches[-2:])]
    return batches


def n_batches(n: int, bs: int) -> int:
    """How many batches `_cut` makes of n rows."""
    return math.ceil(n / bs) - (bs > 1 and n > bs and n % bs == 1)


def sorted_batches(lengths: np.ndarray, bs: int) -> list[np.ndarray]:
    """Evaluation order: longest first, so each batch pads little."""
    return _cut(np.argsort(-np.asarray(lengths), kind="stable"), bs)


def pad_batch(seqs: list[np.ndarray], pad_id: int = 0, backwards: bool = False,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to (bs, T) with `pad_id`; `backwards` reverses each document first. -> (x, lengths)."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    x = torch.full((len(seqs), int(lengths.max())), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        x[i, : len(s)] = torch.from_numpy(np.ascontiguousarray(s[::-1] if backwards else s, dtype=np.int64))
    return x, lengths


class ClassificationLoader:
    """Padded (x, lengths, y) batches: sortish order when training, length-sorted for evaluation."""

    def __init__(self, docs: Docs, labels: np.ndarray | None, bs: int, train: bool, pad_id: int = 0,
                 backwards: bool = False, seed: int = 0):
        self.docs, self.labels, self.bs, self.train = docs, labels, bs, train
        self.pad_id, self.backwards = pad_id, backwards
        self.sampler = SortishSampler(docs.lengths, bs, seed) if train else None

    def order(self, epoch: int = 0) -> list[np.ndarray]:
        return self.sampler.batches(epoch) if self.train else sorted_batches(self.docs.lengths, self.bs)

    def __len__(self) -> int:
        return n_batches(len(self.docs), self.bs)

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]]:
        """Yield (x, lengths, y, indices); y is empty when there are no labels."""
        for b in self.order(epoch)[start:]:
            x, lengths = pad_batch([self.docs[i] for i in b], self.pad_id, self.backwards)
            y = torch.from_numpy(self.labels[b].astype(np.int64)) if self.labels is not None else torch.empty(0)
            yield x, lengths, y, b
