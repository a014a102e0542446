"""finetune_lm: the target-domain LM, started from the general LM and tuned on the domain texts."""

from __future__ import annotations

from pathlib import Path

from transfer import distributed
from transfer.config import Params
from transfer.corpus import iter_text_documents
from transfer.data import load_token_stream
from transfer.io_utils import file_digest
from transfer.stages.lm import lm_outs, train_directions
from transfer.stages.record import Stage
from transfer.stages.workspace import Workspace, encode_stream
from transfer.train import load_checkpoint
from transfer.train_lm import finetune_lm


def finetune(p: Params, ws: Workspace, only: str | None = None) -> dict:
    """Target-domain LM: start from the general LM, tune on the domain texts (frozen first, then all).
    only=DIRECTION: that direction's LM alone, nothing shared written (see `Stage.direction`)."""
    domain_txt = ws.art("prepare", "domain.txt")
    path = ws.art("finetune_lm", "domain.npy")
    docs = iter_text_documents([domain_txt])
    stream_path = distributed.main_writes(path, lambda: encode_stream(ws.tokenizer(), docs, path))
    init = lambda d: load_checkpoint(ws.art("pretrain", f"lm-{d}.pt"))  # noqa: E731
    data_id = lambda d: [file_digest(domain_txt), file_digest(ws.art("pretrain", f"lm-{d}.pt"))]  # noqa: E731
    return train_directions(STAGE, p, ws, p.finetune_lm, load_token_stream(stream_path), p.finetune_lm.valid_frac,
                            init, finetune_lm, data_id, only=only)


def _finetune_direction(p: Params, ws: Workspace, direction: str) -> list[Path]:
    finetune(p, ws, only=direction)
    return [ws.art("finetune_lm", f"lm-{direction}.pt")]


STAGE = Stage(
    name="finetune_lm", run=finetune,
    summary="target-domain LM: the general LM tuned on the domain texts",
    params=lambda p: {"model": p.section("model"), "finetune_lm": p.section("finetune_lm")},
    deps=lambda p, ws: [ws.art("prepare", "domain.txt"), ws.art("tokenize", "spm.model"), ws.art("pretrain")],
    outs=lm_outs("finetune_lm"),
    plots=("finetune_lm_loss.png",), curves=("finetune_lm_history.csv",), history="finetune_lm_history.csv",
    direction=_finetune_direction,
)
