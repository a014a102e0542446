"""What the two LM stages share: one AWD-LSTM LM per direction trained on a token stream, judged against unigram."""

from __future__ import annotations

from dataclasses import asdict
from typing import Callable

import numpy as np

from transfer import distributed
from transfer.config import Params
from transfer.data import LMLoader
from transfer.errors import TransferError
from transfer.io_utils import write_csv, write_json
from transfer.model import LanguageModel, lm_config
from transfer.plots import plot_history
from transfer.stages.record import Stage, fingerprint
from transfer.stages.workspace import Workspace, save_state, seed_everything


def language_model(p: Params, vocab_size: int, drop_mult: float) -> LanguageModel:
    return LanguageModel(lm_config(vocab_size, drop_mult, emb_size=p.model.emb_size,
                                   hidden_size=p.model.hidden_size, n_layers=p.model.n_layers))


def architecture(p: Params) -> dict:
    """The model params one direction's weights depend on: adding `bwd` must not restart a finished `fwd`."""
    return {k: v for k, v in asdict(p.model).items() if k != "directions"}


def unigram_perplexity(train: np.ndarray, valid: np.ndarray, vocab_size: int) -> float:
    """Perplexity on `valid` of the add-one-smoothed token frequencies of `train`: what an LM must beat by far."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(np.exp(-logp[np.asarray(valid, dtype=np.int64)].mean()))


def train_directions(stage: Stage, p: Params, ws: Workspace, hp, stream: np.ndarray, valid_frac: float,
                     init: Callable[[str], dict | None], run: Callable, data_id: Callable[[str], object],
                     finish: bool = True, only: str | None = None) -> dict:
    """Train one LM per direction on `stream` (its last `valid_frac` held out), save lm-<direction>.pt, draw the
    loss curves; fail if an LM ends near the unigram perplexity. The checkpoint fingerprint holds the stage's
    code digest, so a finished checkpoint of older code is retrained, never taken as done. finish=False: the
    caller writes the metrics file (it marks the stage done) after its own further work. only=DIRECTION: train
    that direction alone and write nothing the directions share (its checkpoint and lm-<direction>.pt only)."""
    name, vocab = stage.name, ws.tokenizer()
    cut = int(len(stream) * (1 - valid_frac))
    unigram = unigram_perplexity(stream[:cut], stream[cut:], vocab.vocab_size)
    code = stage.code_digest()
    metrics, rows = {}, []
    for direction in [only] if only else p.model.directions:
        seed_everything(hp.seed)
        model = language_model(p, vocab.vocab_size, hp.drop_mult)
        state = init(direction)
        if state is not None:
            model.load_state_dict(state)
        backwards = direction == "bwd"
        # data-parallel: this rank's contiguous share of the rows; the global batch is bs x processes
        train = LMLoader(stream[:cut], hp.bs, hp.bptt, backwards=backwards, seed=hp.seed, max_tokens=hp.max_tokens,
                         rank=distributed.rank(), world=distributed.world_size())
        valid = LMLoader(stream[cut:], hp.bs, hp.bptt, backwards=backwards, variable=False)
        history = run(model, train, valid, hp, desc=f"{name} {direction}",
                      ckpt_path=ws.art(name, f"checkpoint-{direction}.pt"),
                      fingerprint=fingerprint(name, asdict(hp), architecture(p), data_id(direction), direction, code))
        save_state(ws.art(name, f"lm-{direction}.pt"), model.state_dict())
        rows += [dict(direction=direction, **r) for r in history]
        # Summed over epochs, which carry their time across an interruption: a resumed run reports its whole cost.
        train_s = sum(r["time_s"] for r in history)
        metrics[direction] = dict(valid_ppl=history[-1]["valid_ppl"], valid_loss=history[-1]["valid_loss"],
                                  unigram_ppl=unigram, recoveries=int(history[-1].get("recoveries", 0)),
                                  tokens_per_s=sum(r["items_per_s"] * r["time_s"] for r in history) / max(train_s, 1e-9),
                                  train_s=train_s, train_tokens=train.tokens_per_epoch() * distributed.world_size())
    distributed.barrier()  # rank 0's lm-<direction>.pt are on disk before any rank reads them back
    if only:
        return metrics
    write_csv(ws.plot(stage.history), rows)
    plot_history(rows, ws.plot(stage.plots[0]), f"{name}: loss per epoch")
    ratio = hp.fail_at_unigram
    failed = {d: m["valid_ppl"] for d, m in metrics.items() if ratio is not None and m["valid_ppl"] >= ratio * unigram}
    if failed:  # no metrics file: the stage is not done, and the next stage never reads a dead LM
        raise TransferError(f"{name}: held-out perplexity " + ", ".join(f"{d} {v:,.1f}" for d, v in failed.items())
                            + f" against {unigram:,.1f} for word frequencies alone (unigram; {name}.fail_at_unigram "
                            f"is {ratio}): the LM failed to learn. See {ws.plot(stage.plots[0])}; lower "
                            f"{name}.lr or raise {name}.warmup_min_steps")
    if finish:
        write_json(ws.metrics(name), metrics)
    return metrics


def lm_outs(name: str) -> Callable[[Params, Workspace], list]:
    return lambda p, ws: [ws.art(name), ws.plot(f"{name}_history.csv"), ws.plot(f"{name}_loss.png"), ws.metrics(name)]
