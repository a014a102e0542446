"""tokenize: train SentencePiece on the general corpus and encode it into a memory-mapped token stream."""

from __future__ import annotations

import time
from pathlib import Path

from transfer.config import Params
from transfer.corpus import iter_text_documents
from transfer.data import load_token_stream
from transfer.io_utils import write_json
from transfer.stages.published import copy_file, published_deps, read_manifest
from transfer.stages.record import Stage
from transfer.stages.workspace import Workspace, encode_stream
from transfer.tokenizer import train_tokenizer

DATA_KEYS = ("general", "general_doc_per", "encoding")


def tokenize(p: Params, ws: Workspace) -> dict:
    """Train SentencePiece on the general corpus and encode it into a memory-mapped token stream; with
    `pretrain.from_lm`, take the published LM's tokenizer instead."""
    if p.pretrain.from_lm:
        folder, lm = read_manifest(p)
        copy_file(folder / "spm.model", ws.art("tokenize", "spm.model"))
        metrics = dict(vocab_size=lm["vocab_size"], general_tokens=lm.get("general_tokens", 0), from_lm=str(folder))
        write_json(ws.metrics("tokenize"), metrics)
        return metrics
    d, t = p.data, p.tokenizer
    general = lambda: iter_text_documents(list(d.general), d.encoding, d.general_doc_per)  # noqa: E731
    t0 = time.perf_counter()
    tok = train_tokenizer(general(), ws.art("tokenize", "spm.model"), t.vocab_size, t.model_type,
                          t.character_coverage, t.seed, t.max_sentences, byte_fallback=t.byte_fallback)
    t1 = time.perf_counter()
    stream = load_token_stream(encode_stream(tok, general(), ws.art("tokenize", "general.npy")))
    metrics = dict(vocab_size=tok.vocab_size, general_tokens=int(len(stream)), train_s=t1 - t0,
                   encode_s=time.perf_counter() - t1)
    write_json(ws.metrics("tokenize"), metrics)
    return metrics


STAGE = Stage(
    name="tokenize", run=tokenize,
    summary="SentencePiece on the general corpus, encoded into a memory-mapped token stream",
    params=lambda p: {"data": {k: p.section("data")[k] for k in DATA_KEYS}, "tokenizer": p.section("tokenizer"),
                      "pretrain": {"from_lm": p.pretrain.from_lm}},
    deps=lambda p, ws: published_deps(p) if p.pretrain.from_lm else [Path(g) for g in p.data.general],
    outs=lambda p, ws: [ws.art("tokenize"), ws.metrics("tokenize")],
)
