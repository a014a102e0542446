"""SentencePiece subword tokenizer: deterministic training from a document stream, batched encode/decode."""

from __future__ import annotations

import io
import math
import re
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import sentencepiece as spm

from transfer.errors import TransferError
from transfer.io_utils import atomic_path

__all__ = ["PAD_ID", "UNK_ID", "BOS_ID", "EOS_ID", "MODEL_TYPES", "train_tokenizer", "Tokenizer", "check_settings"]

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
MODEL_TYPES = ("unigram", "bpe")
MAX_SENTENCE_BYTES = 1 << 16  # sentencepiece silently skips longer lines, so longer ones are split first
TRAIN_THREADS = 4  # unigram scores depend on the thread count: a fixed default keeps models identical across machines


def train_tokenizer(docs: Iterable[str], model_path: Path, vocab_size: int = 15000, model_type: str = "unigram",
                    character_coverage: float = 0.9999, seed: int = 0, max_sentences: int = 1_000_000,
                    num_threads: int = TRAIN_THREADS, byte_fallback: bool = False) -> Tokenizer:
    """Train a SentencePiece model on `docs` and write it atomically to `model_path`.

    Documents are split into lines (sentences). They are spooled to a temporary file rather than held in memory;
    when there are more than `max_sentences` lines, a uniform sample of that many is drawn with `seed`.
    The same documents and arguments (num_threads included: unigram scores depend on it) give a byte-identical
    model file. Raises TransferError for an empty corpus or a vocab_size the corpus cannot fill.
    `byte_fallback` spells a character the model lacks (an emoji in a Wikipedia-trained model) as its UTF-8
    bytes, 256 pieces of the vocab, instead of the one <unk> id that every such character shares.
    """
    model_path = Path(model_path)
    if model_type not in MODEL_TYPES:
        raise TransferError(f"tokenizer model_type must be one of {list(MODEL_TYPES)}, got {model_type!r}")
    if vocab_size <= EOS_ID + 1:
        raise TransferError(f"tokenizer vocab_size={vocab_size} must be larger than the {EOS_ID + 1} special pieces")
    if not 0.98 <= character_coverage <= 1.0:  # sentencepiece's own limits
        raise TransferError(f"tokenizer character_coverage={character_coverage} must be between 0.98 and 1.0")
    if isinstance(docs, (str, bytes)):
        raise TypeError("docs must be an iterable of documents, not a single string")
    with tempfile.TemporaryDirectory(prefix="transfer-spm-") as tmp:
        spool = Path(tmp) / "sentences.txt"
        n_sentences = _spool_sentences(docs, spool)
        if n_sentences == 0:
            raise TransferError(f"cannot train the tokenizer for {model_path}: the corpus has no text")
        keep = _sample_mask(n_sentences, max_sentences, seed)
        proto = _train_proto(_read_spool(spool, keep), vocab_size=vocab_size, model_type=model_type,
                             character_coverage=character_coverage, seed=seed, num_threads=num_threads,
                             n_sentences=int(keep.sum()) if keep is not None else n_sentences,
                             byte_fallback=byte_fallback)
    with atomic_path(model_path) as tmp_model:
        tmp_model.write_bytes(proto)
    return Tokenizer.load(model_path)


def check_settings(tok: Tokenizer, want: dict, whose: str, remedy: str) -> None:
    """Raise TransferError naming the first `tokenizer.*` key whose value `want`s other than the model was trained
    with: a reused tokenizer (a published LM's, a benchmark's general LM) must be the one the params describe.
    `whose` names the tokenizer's owner, `remedy` the other way out besides setting the key."""
    have = tok.settings()
    show = lambda v: str(v).lower() if isinstance(v, bool) else v  # noqa: E731  (as YAML writes it)
    for key, value in want.items():
        same = math.isclose(have[key], value, abs_tol=1e-6) if isinstance(value, float) else have[key] == value
        if not same:
            raise TransferError(f"tokenizer.{key} is {show(value)} but the tokenizer of {whose} ({tok.path}) was "
                                f"trained with {show(have[key])}: set tokenizer.{key}: {show(have[key])}, or {remedy}")


def _spool_sentences(docs: Iterable[str], path: Path) -> int:
    """Write one stripped, non-empty line per sentence to `path`; return how many were written."""
    n = 0
    with open(path, "w", encoding="utf-8", errors="replace", newline="\n") as f:
        for doc in docs:
            for line in doc.splitlines():  # also splits \r, \x0b, \x1c, \u2028 ... so the spool reads back exactly
                line = line.strip()
                if not line:
                    continue
                for piece in _split_long(line, MAX_SENTENCE_BYTES):
                    f.write(piece)
                    f.write("\n")
                    n += 1
    return n


def _split_long(line: str, max_bytes: int) -> Iterator[str]:
    """Cut `line` into pieces of at most `max_bytes` UTF-8 bytes, preferring to cut at whitespace."""
    if len(line) * 4 <= max_bytes or len(line.encode("utf-8", "replace")) <= max_bytes:
        yield line
        return
    window = max_bytes // 4  # characters; a UTF-8 character is at most 4 bytes
    while line:
        if len(line) <= window:
            cut = len(line)
        else:
            cut = line.rfind(" ", window // 2, window)
            cut = window if cut <= 0 else cut
        piece, line = line[:cut].strip(), line[cut:].lstrip()
        if piece:
            yield piece


def _sample_mask(n: int, k: int, seed: int) -> np.ndarray | None:
    """Boolean mask choosing `k` of `n` lines uniformly with `seed`, or None to keep all lines."""
    if n <= k:
        return None
    mask = np.zeros(n, dtype=bool)
    mask[np.random.default_rng(seed).choice(n, size=k, replace=False)] = True
    return mask


def _read_spool(path: Path, keep: np.ndarray | None) -> Iterator[str]:
    with open(path, encoding="utf-8", newline="\n") as f:
        for i, line in enumerate(f):
            if keep is None or keep[i]:
                yield line[:-1]


def _train_proto(sentences: Iterator[str], *, vocab_size: int, model_type: str, character_coverage: float,
                 seed: int, num_threads: int, n_sentences: int, byte_fallback: bool) -> bytes:
    """Run the SentencePiece trainer on `sentences`; return the serialized model; map its errors to TransferError."""
    spm.set_random_generator_seed(seed)  # unused by unigram/bpe training today; set in case a version samples
    out = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences, model_writer=out,  # no model_prefix: no temp path baked into the model
            vocab_size=vocab_size, model_type=model_type, character_coverage=character_coverage,
            pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
            input_sentence_size=0,  # we sample ourselves: sentencepiece's own shuffle ignores the seed
            shuffle_input_sentence=False, max_sentence_length=MAX_SENTENCE_BYTES,
            num_threads=num_threads, byte_fallback=byte_fallback, minloglevel=2)
    except RuntimeError as e:
        raise TransferError(_explain_training_error(str(e), vocab_size, n_sentences, byte_fallback)) from None
    return out.getvalue()


def _explain_training_error(message: str, vocab_size: int, n_sentences: int, byte_fallback: bool) -> str:
    detail = re.sub(r"^\w+: \S+\(\d+\) \[.*?\] ?", "", message).strip()  # drop "INTERNAL: file.cc(744) [check] "
    limit = re.search(r"value <= (\d+)", message)
    if "too high" in message.lower() or limit:
        works = f"vocab_size <= {limit.group(1)}" if limit else f"a smaller vocab_size (try {max(8, vocab_size // 4)})"
        return (f"tokenizer vocab_size={vocab_size} is too large for a corpus of {n_sentences} lines; "
                f"use {works} or add more text")
    chars = re.search(r"smaller than required_chars\. \d+ vs (\d+)", message)
    if chars:
        return (f"tokenizer vocab_size={vocab_size} is too small: it needs at least {chars.group(1)} pieces (one per "
                f"character of the corpus, {EOS_ID + 1} special ones" + (", 256 bytes" if byte_fallback else "")
                + "); use a larger vocab_size or a lower character_coverage")
    return f"sentencepiece could not train the tokenizer ({n_sentences} lines): {detail or message}"


class Tokenizer:
    """A loaded SentencePiece model with the project's fixed special ids (pad/unk/bos/eos = 0/1/2/3)."""

    def __init__(self, processor: spm.SentencePieceProcessor, path: Path) -> None:
        self._sp = processor
        self.path = Path(path)
        self.vocab_size: int = processor.get_piece_size()

    @classmethod
    def load(cls, path: Path) -> Tokenizer:
        """Load a .model file written by `train_tokenizer`."""
        path = Path(path)
        if not path.is_file():
            raise TransferError(f"{path}: tokenizer model not found" + (" (it is a directory)" if path.is_dir() else ""))
        sp = spm.SentencePieceProcessor()
        try:
            sp.load(model_proto=path.read_bytes())
        except (RuntimeError, OSError):
            raise TransferError(f"{path}: not a valid sentencepiece model file (corrupt or truncated?)") from None
        ids = (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id())
        if ids != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise TransferError(f"{path}: special ids pad/unk/bos/eos are {ids}, expected "
                                f"{(PAD_ID, UNK_ID, BOS_ID, EOS_ID)}; retrain it with transfer.tokenizer")
        return cls(sp, path)

    def settings(self) -> dict:
        """What the model was trained with, under the `tokenizer.*` names of the params it is checked against."""
        from sentencepiece import sentencepiece_model_pb2 as pb

        proto = pb.ModelProto()
        proto.ParseFromString(self._sp.serialized_model_proto())
        spec = proto.trainer_spec
        return dict(vocab_size=self.vocab_size, model_type=pb.TrainerSpec.ModelType.Name(spec.model_type).lower(),
                    character_coverage=round(spec.character_coverage, 6),  # stored as float32
                    byte_fallback=bool(spec.byte_fallback))

    def pieces(self) -> list[str]:
        """The piece string of every id, in id order."""
        return [self._sp.id_to_piece(i) for i in range(self.vocab_size)]

    def encode(self, texts: list[str], num_threads: int = -1) -> list[list[int]]:
        """Token ids of each text (no bos/eos added); num_threads=-1 uses every core."""
        if isinstance(texts, str):
            raise TypeError("encode takes a list of texts, not a single string")
        return self._sp.encode(list(texts), out_type=int, num_threads=num_threads)

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Text of each id sequence (special ids decode to nothing)."""
        return self._sp.decode([seq.tolist() if isinstance(seq, np.ndarray) else list(map(int, seq)) for seq in ids])

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"
