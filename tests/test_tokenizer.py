"""Specification of transfer.tokenizer: deterministic SentencePiece training, round trips, clear errors."""

from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from transfer.errors import TransferError
from transfer.tokenizer import (BOS_ID, EOS_ID, MAX_SENTENCE_BYTES, PAD_ID, UNK_ID, Tokenizer, check_settings,
                                train_tokenizer)

REPO = Path(__file__).resolve().parents[1]
SYLLABLES = "ka to ri mu se na lo pe vi du ha ze bo ly qui gra ston wel fen dar".split()


def corpus(n: int = 600, seed: int = 0) -> list[str]:
    """Deterministic toy documents: n lines of 4-12 words drawn (Zipf-like) from ~400 made-up words."""
    rng = random.Random(seed)
    words = sorted({"".join(random.Random(i).choices(SYLLABLES, k=1 + i % 3)) for i in range(500)})
    weights = [1 / (rank + 1) for rank in range(len(words))]
    return [" ".join(rng.choices(words, weights, k=rng.randint(4, 12))) + "." for _ in range(n)]


def test_special_ids_are_fixed(tmp_path: Path) -> None:
    tok = train_tokenizer(corpus(), tmp_path / "spm.model", vocab_size=120)
    assert (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)
    assert tok.pieces()[:4] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert tok.vocab_size == 120 == len(tok.pieces())
    assert tok.path == tmp_path / "spm.model"


def test_same_corpus_and_params_give_byte_identical_model_across_processes(tmp_path: Path) -> None:
    # max_sentences < corpus lines, so the sample is drawn; sentencepiece's own sampler differs per process
    kwargs = dict(vocab_size=100, max_sentences=300, seed=3)
    a = train_tokenizer(corpus(), tmp_path / "a.model", **kwargs).path.read_bytes()
    b = train_tokenizer(iter(corpus()), tmp_path / "b.model", **kwargs).path.read_bytes()
    code = ("import sys; from pathlib import Path; from tests.test_tokenizer import corpus; "
            "from transfer.tokenizer import train_tokenizer; "
            f"train_tokenizer(corpus(), Path(sys.argv[1]), **{kwargs!r})")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "c.model")], cwd=REPO, check=True)
    assert a == b == (tmp_path / "c.model").read_bytes()


def test_seed_selects_the_sample(tmp_path: Path) -> None:
    a = train_tokenizer(corpus(), tmp_path / "a.model", vocab_size=100, max_sentences=200, seed=0)
    b = train_tokenizer(corpus(), tmp_path / "b.model", vocab_size=100, max_sentences=200, seed=1)
    assert a.path.read_bytes() != b.path.read_bytes()


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_encode_decode_round_trip(tmp_path: Path, model_type: str) -> None:
    tok = train_tokenizer(corpus(), tmp_path / "spm.model", vocab_size=100, model_type=model_type)
    texts = corpus(20, seed=7) + ["an unseen zebra quokka word", ""]
    ids = tok.encode(texts)
    assert len(ids) == len(texts) and ids[-1] == []
    assert all(0 <= i < tok.vocab_size and i not in (PAD_ID, BOS_ID, EOS_ID) for seq in ids for i in seq)
    assert tok.decode(ids) == texts
    assert tok.encode(texts, num_threads=1) == ids


def test_reload_encodes_identically(tmp_path: Path) -> None:
    tok = train_tokenizer(corpus(), tmp_path / "spm.model", vocab_size=100)
    again = Tokenizer.load(tmp_path / "spm.model")
    assert again.pieces() == tok.pieces()
    assert again.encode(corpus(5)) == tok.encode(corpus(5))


def test_training_consumes_a_generator_once(tmp_path: Path) -> None:
    pulled = []

    def docs():
        for d in corpus():
            pulled.append(d)
            yield d

    train_tokenizer(docs(), tmp_path / "spm.model", vocab_size=100)
    assert pulled == corpus()


def test_multiline_documents_are_split_into_sentences(tmp_path: Path) -> None:
    docs = ["\n".join(corpus(30, seed=s)) + "\r\n\n" for s in range(20)]  # doc_per="file" style documents
    tok = train_tokenizer(docs, tmp_path / "spm.model", vocab_size=100)
    assert not any("\n" in p or "\r" in p for p in tok.pieces())


def test_overlong_line_is_split_not_dropped(tmp_path: Path) -> None:
    # sentencepiece silently skips lines longer than max_sentence_length; the only 'ж' is in the long line
    long_line = " ".join(["жжж"] * (MAX_SENTENCE_BYTES // 3))
    assert len(long_line.encode()) > MAX_SENTENCE_BYTES
    tok = train_tokenizer(corpus() + [long_line], tmp_path / "spm.model", vocab_size=100)
    assert any("ж" in p for p in tok.pieces())


def test_vocab_too_large_names_a_size_that_works(tmp_path: Path) -> None:
    path = tmp_path / "spm.model"
    path.write_bytes(b"previous model")
    with pytest.raises(TransferError) as err:
        train_tokenizer(corpus(), path, vocab_size=5000)
    message = str(err.value)
    assert "vocab_size=5000 is too large" in message and "Traceback" not in message
    assert err.value.__cause__ is None and err.value.__suppress_context__
    assert path.read_bytes() == b"previous model"  # a failed run leaves the old file alone
    assert list(tmp_path.iterdir()) == [path]  # and no temp file
    size = int(re.search(r"vocab_size <= (\d+)", message).group(1))
    assert train_tokenizer(corpus(), path, vocab_size=size).vocab_size == size


def test_vocab_too_small_for_the_alphabet_is_explained(tmp_path: Path) -> None:
    with pytest.raises(TransferError, match="vocab_size=12 is too small"):
        train_tokenizer(corpus(), tmp_path / "spm.model", vocab_size=12)


def test_byte_fallback_keeps_characters_the_corpus_never_had_apart(tmp_path: Path) -> None:
    text = "ka 😡 to 😢"  # two emojis the corpus lacks: one shared UNK without byte fallback
    plain = train_tokenizer(corpus(), tmp_path / "plain.model", vocab_size=200)
    (ids,) = plain.encode([text])
    assert ids.count(UNK_ID) == 2
    bytes_ = train_tokenizer(corpus(), tmp_path / "bytes.model", vocab_size=400, byte_fallback=True)
    (ids,) = bytes_.encode([text])
    assert UNK_ID not in ids and bytes_.decode([ids]) == [text]
    spelled = [bytes_.pieces()[i] for i in ids]
    assert "".join(p for p in spelled if p.startswith("<0x")) == "".join(f"<0x{b:02X}>" for b in "😡😢".encode())


def test_byte_fallback_counts_its_256_pieces_when_the_vocab_is_too_small(tmp_path: Path) -> None:
    with pytest.raises(TransferError, match=r"vocab_size=200 is too small: it needs at least \d+ pieces .*256 bytes"):
        train_tokenizer(corpus(), tmp_path / "spm.model", vocab_size=200, byte_fallback=True)
    assert not (tmp_path / "spm.model").exists()


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_a_model_file_says_how_it_was_trained(tmp_path: Path, model_type: str) -> None:
    tok = train_tokenizer(corpus(), tmp_path / "spm.model", vocab_size=400, model_type=model_type,
                          character_coverage=0.9995, byte_fallback=True)
    want = dict(vocab_size=400, model_type=model_type, character_coverage=0.9995, byte_fallback=True)
    assert Tokenizer.load(tok.path).settings() == want
    check_settings(tok, want, "this one", "retrain it")  # agrees: nothing raised
    other = "bpe" if model_type == "unigram" else "unigram"
    with pytest.raises(TransferError, match=f"tokenizer.model_type is {other} but the tokenizer of the reused "
                                            f"LM .* was trained with {model_type}: set tokenizer.model_type: "
                                            f"{model_type}, or retrain it"):
        check_settings(tok, dict(want, model_type=other), "the reused LM", "retrain it")


@pytest.mark.parametrize("docs", [[], ["", "   ", "\n\r\n"]])
def test_empty_corpus_is_an_error(tmp_path: Path, docs: list[str]) -> None:
    with pytest.raises(TransferError, match="no text"):
        train_tokenizer(docs, tmp_path / "spm.model", vocab_size=100)
    assert not (tmp_path / "spm.model").exists()


@pytest.mark.parametrize("kwargs, problem", [
    (dict(model_type="wordpiece"), "model_type"),
    (dict(character_coverage=0.5), "character_coverage"),
    (dict(vocab_size=4), "special pieces"),
])
def test_bad_params_are_errors(tmp_path: Path, kwargs: dict, problem: str) -> None:
    with pytest.raises(TransferError, match=problem):
        train_tokenizer(corpus(), tmp_path / "spm.model", **{"vocab_size": 100, **kwargs})


def test_load_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(TransferError, match=re.escape(str(tmp_path / "nope.model")) + ".*not found"):
        Tokenizer.load(tmp_path / "nope.model")


def test_load_corrupt_file_names_the_path(tmp_path: Path) -> None:
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(TransferError, match=re.escape(str(bad)) + ".*not a valid sentencepiece model"):
        Tokenizer.load(bad)
