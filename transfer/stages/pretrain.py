"""pretrain: the general-domain LM, one per direction, with perplexity on a held-out tail and on `data.lm_eval`."""

from __future__ import annotations

from pathlib import Path

from transfer import distributed
from transfer.config import Params
from transfer.corpus import iter_text_documents
from transfer.data import LMLoader, load_token_stream
from transfer.device import pick_device
from transfer.io_utils import file_digest, write_json
from transfer.stages.lm import language_model, lm_outs, train_directions
from transfer.stages.published import copy_file, published_deps, read_manifest
from transfer.stages.record import Stage
from transfer.stages.workspace import Workspace, encode_stream
from transfer.train import load_checkpoint
from transfer.train_lm import lm_perplexity, pretrain_lm


def pretrain(p: Params, ws: Workspace, only: str | None = None) -> dict:
    """General-domain LM, one per direction; reports perplexity on a held-out tail and on `data.lm_eval`. With
    `pretrain.from_lm`, the published LM's weights and the figures it was published with. only=DIRECTION: that
    direction's LM alone, nothing shared written (see `Stage.direction`)."""
    if p.pretrain.from_lm:
        folder, lm = read_manifest(p)
        for direction in p.model.directions:
            copy_file(folder / f"lm-{direction}.pt", ws.art("pretrain", f"lm-{direction}.pt"))
        metrics = {d: dict(lm["metrics"].get(d, {}), from_lm=str(folder)) for d in p.model.directions}
        write_json(ws.metrics("pretrain"), metrics)
        return metrics
    path = ws.art("tokenize", "general.npy")
    metrics = train_directions(STAGE, p, ws, p.pretrain, load_token_stream(path), p.pretrain.valid_frac,
                               lambda d: None, pretrain_lm, lambda d: file_digest(path),
                               finish=not p.data.lm_eval, only=only)
    if p.data.lm_eval and not only:
        tok = ws.tokenizer()
        docs = iter_text_documents(list(p.data.lm_eval), p.data.encoding, p.data.general_doc_per)
        path = ws.art("pretrain", "lm_eval.npy")
        stream = load_token_stream(distributed.main_writes(path, lambda: encode_stream(tok, docs, path)))
        for direction in p.model.directions:
            model = language_model(p, tok.vocab_size, p.pretrain.drop_mult)
            model.load_state_dict(load_checkpoint(ws.art("pretrain", f"lm-{direction}.pt")))
            loader = LMLoader(stream, p.pretrain.bs, p.pretrain.bptt, backwards=direction == "bwd", variable=False)
            ppl = lm_perplexity(model.to(pick_device()), loader, p.pretrain.precision)["valid_ppl"]
            metrics[direction].update(lm_eval_ppl=ppl, lm_eval_tokens=int(len(stream)))
        write_json(ws.metrics("pretrain"), metrics)
    return metrics


def _pretrain_direction(p: Params, ws: Workspace, direction: str) -> list[Path]:
    if p.pretrain.from_lm:  # nothing to train: the stage copies the published LM
        return []
    pretrain(p, ws, only=direction)
    return [ws.art("pretrain", f"lm-{direction}.pt")]


STAGE = Stage(
    name="pretrain", run=pretrain,
    summary="general-domain AWD-LSTM LM, one per direction (+ perplexity on data.lm_eval files)",
    params=lambda p: {"model": p.section("model"), "pretrain": p.section("pretrain"),
                      "data": {k: p.section("data")[k] for k in ("lm_eval", "encoding", "general_doc_per")}},
    deps=lambda p, ws: published_deps(p) if p.pretrain.from_lm else
    [ws.art("tokenize", "general.npy"), ws.art("tokenize", "spm.model"), *map(Path, p.data.lm_eval)],
    outs=lm_outs("pretrain"),
    plots=("pretrain_loss.png",), curves=("pretrain_history.csv",), history="pretrain_history.csv",
    direction=_pretrain_direction,
)
