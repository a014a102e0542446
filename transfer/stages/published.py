"""A published general LM (`transfer lm publish`): a folder with `spm.model`, `lm-<direction>.pt` and `lm.json`.

`pretrain.from_lm` names one; `tokenize` and `pretrain` then take its tokenizer and weights, after checking that
they fit the params, instead of training. `lm.json` holds the architecture, the vocabulary size, the
directions and what the publishing workspace measured (perplexities, corpus digest, params, git commit).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from transfer.config import Params
from transfer.errors import TransferError
from transfer.io_utils import atomic_path
from transfer.tokenizer import Tokenizer, check_settings

__all__ = ["MANIFEST", "read_manifest", "tokenizer_settings", "published_deps", "copy_file"]

MANIFEST = "lm.json"


def read_manifest(p: Params) -> tuple[Path, dict]:
    """The published LM's folder and manifest, checked against the params: a clear error naming the key that
    disagrees, before anything is trained or copied."""
    folder = Path(p.pretrain.from_lm)
    if not (folder / MANIFEST).is_file():
        raise TransferError(f"pretrain.from_lm: {folder} holds no {MANIFEST}; name a folder made by `transfer lm "
                            f"publish` (or a models:/NAME@ALIAS URI, resolved before the stage runs)")
    try:
        lm = json.loads((folder / MANIFEST).read_text())
    except ValueError as e:
        raise TransferError(f"{folder / MANIFEST}: not valid JSON ({e})") from None
    want = {"tokenizer.vocab_size": p.tokenizer.vocab_size, "model.emb_size": p.model.emb_size,
            "model.hidden_size": p.model.hidden_size, "model.n_layers": p.model.n_layers}
    have = {"tokenizer.vocab_size": lm.get("vocab_size"), **{f"model.{k}": lm.get(k) for k in
                                                              ("emb_size", "hidden_size", "n_layers")}}
    for key, value in want.items():
        if have[key] != value:
            raise TransferError(f"{key} is {value} but the published LM in {folder} has {have[key]}: set {key}: "
                                f"{have[key]}, or publish an LM of this size")
    check_settings(Tokenizer.load(folder / "spm.model"), tokenizer_settings(p), "the published LM",
                   "publish an LM trained with these params")
    missing = [d for d in p.model.directions if not (folder / f"lm-{d}.pt").is_file()]
    if missing:
        raise TransferError(f"model.directions includes {missing[0]!r} but the published LM in {folder} has only "
                            f"{', '.join(lm.get('directions', []))}")
    return folder, lm


def tokenizer_settings(p: Params) -> dict:
    """The `tokenizer.*` params a reused tokenizer must have been trained with (seed and sample size aside)."""
    t = p.tokenizer
    return dict(vocab_size=t.vocab_size, model_type=t.model_type, character_coverage=t.character_coverage,
                byte_fallback=t.byte_fallback)


def published_deps(p: Params) -> list[Path]:
    """The published LM's folder as a dependency; a models:/ or runs:/ URI is a params value, not a file."""
    return [] if p.pretrain.from_lm.startswith(("models:/", "runs:/")) else [Path(p.pretrain.from_lm)]


def copy_file(src: Path, dst: Path) -> Path:
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)
    return dst
