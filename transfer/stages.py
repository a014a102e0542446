"""The pipeline's stages, each implemented once: `transfer stage NAME` (DVC) and the Prefect tasks call these.

Every stage reads its inputs from, and writes its outputs to, fixed paths under a workspace root:
`artifacts/<stage>/...`, `metrics/<stage>.json` and `plots/...`. Outputs are written atomically, and a
stage's metrics file is written last, so its presence means the stage finished.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pandas as pd
import torch

from transfer import hygiene, rules
from transfer.config import Params
from transfer.data import ClassificationLoader, Docs, LMLoader, load_token_stream, write_token_stream
from transfer.errors import TransferError
from transfer.evaluate import (
    Predictor, calibrated_average, classification_metrics, fit_temperature, member_name, save_classifier,
)
from transfer.io_utils import atomic_path, file_digest, write_csv, write_json
from transfer.model import LanguageModel, TextClassifier, classifier_config, lm_config
from transfer.plots import plot_confusion, plot_history, plot_lr_find, plot_lr_schedule
from transfer.pseudo import probe_teacher, select_pseudo_labels
from transfer.readers import iter_text_documents, read_table
from transfer.tokenizer import PAD_ID, Tokenizer, train_tokenizer
from transfer.train import (
    classifier_lr_find, finetune_lm, lm_perplexity, load_checkpoint, pick_device, pooled_features, pretrain_lm,
    train_classifier,
)

__all__ = ["STAGES", "Paths", "run_stage", "prepare", "tokenize", "pretrain", "finetune", "classify",
           "evaluate", "stage_inputs", "stage_params", "lr_find_classifier"]


@dataclass(frozen=True)
class Paths:
    """Where every stage's inputs and outputs live, relative to the workspace root."""

    root: Path = Path(".")

    def art(self, stage: str, name: str = "") -> Path:
        return self.root / "artifacts" / stage / name

    def metrics(self, stage: str) -> Path:
        return self.root / "metrics" / f"{stage}.json"

    def plot(self, name: str) -> Path:
        return self.root / "plots" / name


def _texts_file(path: Path, texts: Iterator[str] | list[str]) -> Path:
    """One document per line (newlines inside a document become spaces), atomically."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(" ".join(hygiene.CONTROL.sub(" ", t).split()) + "\n")
    return path


def _fingerprint(*parts: object) -> str:
    """Identity of a training run's inputs: a checkpoint from other inputs is never resumed."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _arch(p: Params) -> dict:
    """The model params one direction's weights depend on: adding `bwd` must not restart a finished `fwd`."""
    return {k: v for k, v in asdict(p.model).items() if k != "directions"}


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)


# --- prepare ----------------------------------------------------------------------------------------

def _split(df: pd.DataFrame, frac: float, seed: int, what: str, source: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Stratified, seeded split that keeps copies of a text together -> (rest, held out)."""
    counts = df["label"].value_counts()
    if len(counts) < 2:
        raise TransferError(f"{source}: only one class ({counts.index[0]!r}); a classifier needs at least two")
    small = counts[counts < 2]
    if len(small):
        raise TransferError(f"{source}: class {small.index[0]!r} has {int(small.iloc[0])} row; holding out a "
                            f"stratified {what} split needs at least 2 rows per class")
    n_out = max(len(counts), round(len(df) * frac))
    if len(df) - n_out < len(counts):
        raise TransferError(f"{source}: {len(df)} rows are too few to hold out a {what} split of {frac:.0%} "
                            f"with every one of {len(counts)} classes on both sides")
    return hygiene.group_split(df, n_out, seed)


def _subsample(df: pd.DataFrame, n: int, seed: int, source: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Stratified, seeded choice of `n` labelled rows (every class keeps at least one), and the rest."""
    from sklearn.model_selection import train_test_split

    if n > len(df):
        raise TransferError(f"data.max_train_labels is {n} but {source} has only {len(df)} training rows")
    k = df["label"].nunique()
    if n < k:
        raise TransferError(f"data.max_train_labels is {n}, fewer than the {k} classes in {source}")
    if n == len(df):
        return df, df.iloc[:0]
    keep, rest = train_test_split(df, train_size=n, stratify=df["label"], random_state=seed)
    return keep.reset_index(drop=True), rest.reset_index(drop=True)


def prepare(p: Params, paths: Paths = Paths()) -> dict:
    """Read the labelled tables, split and subsample them, and gather the domain texts for LM tuning."""
    d = p.data
    read_n: dict[str, int] = {}
    dropped: dict[str, dict[str, int]] = {}
    controls: dict[str, int] = {}

    def read(name: str, path: str) -> pd.DataFrame:
        df = read_table(path, list(d.text_cols), d.label_col, d.encoding, d.header)
        read_n[name] = len(df)
        df, controls[name] = hygiene.clean_controls(df)
        return df

    # conflicting labels are resolved in the training table only; held-out files are the user's yardstick
    train, n = hygiene.resolve_conflicts(read("train", d.train), d.on_conflict, d.train)
    table, dropped["train"] = train, {"conflicting_label": n} if n else {}
    test = read("test", d.test) if d.test else None
    if test is None:
        train, test = _split(train, d.test_frac, d.seed, "test", d.train)
    valid = read("valid", d.valid) if d.valid else None
    if valid is None:
        train, valid = _split(train, d.valid_frac, d.seed, "validation", d.train)
    classes = sorted(train["label"].unique())
    for name, df, src in (("validation", valid, d.valid or d.train), ("test", test, d.test or d.train)):
        unknown = sorted(set(df["label"]) - set(classes))
        if unknown:
            raise TransferError(f"{src}: label {unknown[0]!r} occurs in the {name} rows but never in training")
    labelled, unlabelled = ((train, train.iloc[:0]) if d.max_train_labels is None
                            else _subsample(train, d.max_train_labels, d.label_seed, d.train))
    # every training text, labelled or not, is in-domain LM text (the paper's semi-supervised setting);
    # file order, so label budgets leave domain.txt (and the tuned LM) unchanged. Validation rows stay out
    # like test rows: the tuned LM memorises its texts (AG News: ppl 24 on them vs 86 on unseen ones), which
    # lifted validation accuracy 6 points above test and made every choice made on it favour memorisation.
    held_out = set(test["text"]) | set(valid["text"])
    domain = [t for t in table["text"] if t not in held_out]
    if d.domain_include_test:  # transductive: every text the classifier is judged on, labels unused
        domain += list(valid["text"]) + list(test["text"])
    extra = iter_text_documents(list(d.domain), d.encoding) if d.domain else iter(())

    out = paths.art("prepare")
    # domain.txt first: data.domain files are only read (and may fail) now; the tables must not change before
    _texts_file(out / "domain.txt", (t for src in (domain, extra) for t in src))
    for name, df in (("train", labelled), ("valid", valid), ("test", test)):
        with atomic_path(out / f"{name}.csv") as tmp:
            df[["text", "label"]].to_csv(tmp, index=False)
    with atomic_path(out / "unlabelled.csv") as tmp:  # the budget's unlabelled rows, for self-training: no labels
        unlabelled[["text"]].to_csv(tmp, index=False)
    report = hygiene.report({"train": train, "valid": valid, "test": test}, read_n, dropped, controls)
    write_json(out / "data_report.json", report)
    metrics = dict(classes=classes, n_train=len(labelled), n_train_unlabelled=len(train) - len(labelled),
                   n_valid=len(valid), n_test=len(test), domain_include_test=d.domain_include_test,
                   test_digest=file_digest(out / "test.csv"), data=hygiene.summary(report))
    if d.rules:  # the classifier settings that depend on the data, with their reasons
        metrics["data_stats"] = rules.data_stats(list(labelled["text"]), list(labelled["label"]), len(unlabelled))
        metrics["rules"] = rules.resolve(metrics["data_stats"], p)
    write_json(paths.metrics("prepare"), metrics)
    return metrics


# --- tokenize ---------------------------------------------------------------------------------------

def _encode_stream(tok: Tokenizer, docs: Iterator[str], path: Path, batch: int = 10_000) -> Path:
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


def tokenize(p: Params, paths: Paths = Paths()) -> dict:
    """Train SentencePiece on the general corpus and encode it into a memory-mapped token stream."""
    d, t = p.data, p.tokenizer
    general = lambda: iter_text_documents(list(d.general), d.encoding, d.general_doc_per)  # noqa: E731
    t0 = time.perf_counter()
    tok = train_tokenizer(general(), paths.art("tokenize", "spm.model"), t.vocab_size, t.model_type,
                          t.character_coverage, t.seed, t.max_sentences)
    t1 = time.perf_counter()
    stream = load_token_stream(_encode_stream(tok, general(), paths.art("tokenize", "general.npy")))
    metrics = dict(vocab_size=tok.vocab_size, general_tokens=int(len(stream)), train_s=t1 - t0,
                   encode_s=time.perf_counter() - t1)
    write_json(paths.metrics("tokenize"), metrics)
    return metrics


# --- language models --------------------------------------------------------------------------------

def _lm(p: Params, vocab_size: int, drop_mult: float) -> LanguageModel:
    return LanguageModel(lm_config(vocab_size, drop_mult, emb_size=p.model.emb_size,
                                   hidden_size=p.model.hidden_size, n_layers=p.model.n_layers))


def _save_state(path: Path, state: dict) -> Path:
    with atomic_path(path) as tmp:
        torch.save({k: v.detach().cpu() for k, v in state.items()}, tmp)
    return path


def _lm_stage(stage: str, p: Params, paths: Paths, hp, stream: np.ndarray, valid_frac: float,
              init: Callable[[str], dict | None], run: Callable, data_id: Callable[[str], object]) -> dict:
    vocab = Tokenizer.load(paths.art("tokenize", "spm.model"))
    cut = int(len(stream) * (1 - valid_frac))
    unigram = unigram_perplexity(stream[:cut], stream[cut:], vocab.vocab_size)
    metrics, rows = {}, []
    for direction in p.model.directions:
        _seed(hp.seed)
        model = _lm(p, vocab.vocab_size, hp.drop_mult)
        state = init(direction)
        if state is not None:
            model.load_state_dict(state)
        backwards = direction == "bwd"
        train = LMLoader(stream[:cut], hp.bs, hp.bptt, backwards=backwards, seed=hp.seed, max_tokens=hp.max_tokens)
        valid = LMLoader(stream[cut:], hp.bs, hp.bptt, backwards=backwards, variable=False)
        history = run(model, train, valid, hp, desc=f"{stage} {direction}",
                      ckpt_path=paths.art(stage, f"checkpoint-{direction}.pt"),
                      fingerprint=_fingerprint(stage, asdict(hp), _arch(p), data_id(direction), direction))
        _save_state(paths.art(stage, f"lm-{direction}.pt"), model.state_dict())
        rows += [dict(direction=direction, **r) for r in history]
        # Summed over epochs, which carry their time across an interruption: a resumed run reports its whole cost.
        train_s = sum(r["time_s"] for r in history)
        metrics[direction] = dict(valid_ppl=history[-1]["valid_ppl"], valid_loss=history[-1]["valid_loss"],
                                  unigram_ppl=unigram, recoveries=int(history[-1].get("recoveries", 0)),
                                  tokens_per_s=sum(r["items_per_s"] * r["time_s"] for r in history) / max(train_s, 1e-9),
                                  train_s=train_s, train_tokens=train.tokens_per_epoch())
    write_csv(paths.plot(f"{stage}_history.csv"), rows)
    plot_history(rows, paths.plot(f"{stage}_loss.png"), f"{stage}: loss per epoch")
    ratio = hp.fail_at_unigram
    failed = {d: m["valid_ppl"] for d, m in metrics.items() if ratio is not None and m["valid_ppl"] >= ratio * unigram}
    if failed:  # no metrics file: the stage is not done, and the next stage never reads a dead LM
        raise TransferError(f"{stage}: held-out perplexity " + ", ".join(f"{d} {v:,.1f}" for d, v in failed.items())
                            + f" against {unigram:,.1f} for word frequencies alone (unigram; {stage}.fail_at_unigram "
                            f"is {ratio}): the LM failed to learn. See {paths.plot(f'{stage}_loss.png')}; lower "
                            f"{stage}.lr or raise {stage}.warmup_min_steps")
    write_json(paths.metrics(stage), metrics)
    return metrics


def unigram_perplexity(train: np.ndarray, valid: np.ndarray, vocab_size: int) -> float:
    """Perplexity on `valid` of the add-one-smoothed token frequencies of `train`: what an LM must beat by far."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(np.exp(-logp[np.asarray(valid, dtype=np.int64)].mean()))


def pretrain(p: Params, paths: Paths = Paths()) -> dict:
    """General-domain LM, one per direction; reports perplexity on a held-out tail and on `data.lm_eval`."""
    path = paths.art("tokenize", "general.npy")
    metrics = _lm_stage("pretrain", p, paths, p.pretrain, load_token_stream(path), p.pretrain.valid_frac,
                        lambda d: None, pretrain_lm, lambda d: file_digest(path))
    if p.data.lm_eval:
        tok = Tokenizer.load(paths.art("tokenize", "spm.model"))
        docs = iter_text_documents(list(p.data.lm_eval), p.data.encoding, p.data.general_doc_per)
        stream = load_token_stream(_encode_stream(tok, docs, paths.art("pretrain", "lm_eval.npy")))
        for direction in p.model.directions:
            model = _lm(p, tok.vocab_size, p.pretrain.drop_mult)
            model.load_state_dict(load_checkpoint(paths.art("pretrain", f"lm-{direction}.pt")))
            loader = LMLoader(stream, p.pretrain.bs, p.pretrain.bptt, backwards=direction == "bwd", variable=False)
            ppl = lm_perplexity(model.to(pick_device()), loader, p.pretrain.precision)["valid_ppl"]
            metrics[direction].update(lm_eval_ppl=ppl, lm_eval_tokens=int(len(stream)))
        write_json(paths.metrics("pretrain"), metrics)
    return metrics


def finetune(p: Params, paths: Paths = Paths()) -> dict:
    """Target-domain LM: start from the general LM, tune on the domain texts (frozen first, then all)."""
    tok = Tokenizer.load(paths.art("tokenize", "spm.model"))
    domain_txt = paths.art("prepare", "domain.txt")
    stream_path = _encode_stream(tok, iter_text_documents([domain_txt]), paths.art("finetune_lm", "domain.npy"))
    init = lambda d: load_checkpoint(paths.art("pretrain", f"lm-{d}.pt"))  # noqa: E731
    data_id = lambda d: [file_digest(domain_txt), file_digest(paths.art("pretrain", f"lm-{d}.pt"))]  # noqa: E731
    return _lm_stage("finetune_lm", p, paths, p.finetune_lm, load_token_stream(stream_path), 0.1, init,
                     finetune_lm, data_id)


# --- classifier -------------------------------------------------------------------------------------

def _labelled(paths: Paths, split: str, tok: Tokenizer, classes: list[str],
              extra: tuple[list[str], np.ndarray] | None = None) -> tuple[Docs, np.ndarray, pd.DataFrame]:
    df = pd.read_csv(paths.art("prepare", f"{split}.csv"), dtype=str, keep_default_na=False)
    index = {c: i for i, c in enumerate(classes)}
    texts, y = list(df["text"]), df["label"].map(index).to_numpy()
    if extra is not None:  # pseudo-labelled rows (text, class index) join the labelled ones
        texts, y = texts + list(extra[0]), np.concatenate([y, np.asarray(extra[1], dtype=y.dtype)])
    return Docs.from_lists(tok.encode(texts)), y, df


def _new_classifier(p: Params, vocab_size: int, n_classes: int, encoder_from: Path | None) -> TextClassifier:
    """A classifier of the params' sizes, its encoder from an LM state_dict (None: random init)."""
    hp = p.classifier
    cfg = classifier_config(vocab_size, hp.drop_mult, emb_size=p.model.emb_size,
                            hidden_size=p.model.hidden_size, n_layers=p.model.n_layers)
    model = TextClassifier(cfg, n_classes, bptt=hp.bptt, max_len=hp.max_len)
    if encoder_from is not None:
        lm_state = load_checkpoint(encoder_from)
        enc = {k[len("encoder."):]: v for k, v in lm_state.items() if k.startswith("encoder.")}
        try:
            model.encoder.load_state_dict(enc)
        except RuntimeError as e:
            raise TransferError(f"{encoder_from}: encoder does not fit model params ({str(e).splitlines()[0]})") from None
    return model


def _classifier_setup(p: Params, paths: Paths, direction: str, encoder_from: Path | None,
                      pseudo: tuple[list[str], np.ndarray] | None = None,
                      ) -> tuple[TextClassifier, ClassificationLoader, ClassificationLoader, str]:
    """A classifier with its encoder from an LM state_dict (None: random init) and its loaders -> (+ data id)."""
    hp = p.classifier
    tok = Tokenizer.load(paths.art("tokenize", "spm.model"))
    classes = json.loads(paths.metrics("prepare").read_text())["classes"]
    dtr, ytr, _ = _labelled(paths, "train", tok, classes, pseudo)
    dva, yva, _ = _labelled(paths, "valid", tok, classes)
    _seed(hp.seed)
    model = _new_classifier(p, tok.vocab_size, len(classes), encoder_from)
    data_id = file_digest(paths.art("prepare", "train.csv"))
    if pseudo is not None:
        data_id += _fingerprint(list(pseudo[0]), [int(c) for c in pseudo[1]])
    if encoder_from is not None:
        data_id += file_digest(encoder_from)
    backwards = direction == "bwd"
    bs = min(hp.bs, max(8, len(dtr) // 10))  # few labels: smaller batches, so every epoch has ~10 steps
    train = ClassificationLoader(dtr, ytr, bs, train=True, pad_id=PAD_ID, backwards=backwards, seed=hp.seed)
    valid = ClassificationLoader(dva, yva, p.evaluate.batch_size, train=False, pad_id=PAD_ID, backwards=backwards)
    return model, train, valid, data_id


def fit_classifier(p: Params, paths: Paths, direction: str, encoder_from: Path | None, ckpt_path: Path,
                   step_log: list | None = None, pseudo: tuple[list[str], np.ndarray] | None = None,
                   ) -> tuple[TextClassifier, list[dict]]:
    """One classifier: encoder weights from an LM state_dict (None: random init), then gradual unfreezing.

    `pseudo` (texts, class indices) adds self-training rows to the labelled training rows.
    """
    model, train, valid, data_id = _classifier_setup(p, paths, direction, encoder_from, pseudo)
    history = train_classifier(model, train, valid, p.classifier, ckpt_path=ckpt_path,
                               desc=f"classifier {Path(ckpt_path).stem.removeprefix('checkpoint-')}",
                               fingerprint=_fingerprint("clas", asdict(p.classifier), _arch(p), data_id, direction),
                               step_log=step_log)
    return model, history


def lr_find_classifier(p: Params, paths: Paths = Paths(), direction: str = "fwd", num_it: int = 100) -> list[dict]:
    """The LR finder before every unfreezing phase, from the domain LM, on the labelled training rows.

    Advisory: writes `plots/lr_find_<direction>.csv` (phase, lr, smoothed loss) and `.png`, and returns one
    row per phase (configured and suggested peak lr); no artifact or metric of any stage changes.
    """
    if direction not in p.model.directions:
        raise TransferError(f"direction {direction!r} is not in model.directions {p.model.directions}")
    lm = paths.art("finetune_lm", f"lm-{direction}.pt")
    for need in (paths.metrics("prepare"), paths.art("tokenize", "spm.model"), lm):
        if not need.exists():
            raise TransferError(f"{need}: missing; run the stages up to finetune_lm first (`transfer run`, or "
                                f"`transfer stage prepare|tokenize|pretrain|finetune_lm`)")
    p = rules.apply(p, json.loads(paths.metrics("prepare").read_text()))
    model, train, _, _ = _classifier_setup(p, paths, direction, lm)
    results = classifier_lr_find(model, train, p.classifier, num_it=num_it)
    write_csv(paths.plot(f"lr_find_{direction}.csv"),
              [dict(phase=r["phase"], lr=lr, loss=loss) for r in results for lr, loss in zip(r["lrs"], r["losses"])])
    plot_lr_find(results, paths.plot(f"lr_find_{direction}.png"),
                 f"classifier LR finder ({direction}), before each unfreezing phase")
    return [{k: v for k, v in r.items() if k not in ("lrs", "losses")} for r in results]


def _lm_features(p: Params, paths: Paths, vocab_size: int, doc_sets: list[Docs]) -> list[np.ndarray]:
    """Frozen domain LMs' concat-pooled features of each doc set, one block of 3 * emb_size per direction."""
    blocks: list[list[np.ndarray]] = [[] for _ in doc_sets]
    for direction in p.model.directions:
        model = _new_classifier(p, vocab_size, 2, paths.art("finetune_lm", f"lm-{direction}.pt")).to(pick_device())
        for out, docs in zip(blocks, doc_sets):
            loader = ClassificationLoader(docs, None, p.evaluate.batch_size, train=False, pad_id=PAD_ID,
                                          backwards=direction == "bwd")
            out.append(pooled_features(model, loader, p.classifier.precision))
    return [np.concatenate(b, axis=1) for b in blocks]


def _probe_pseudo_labels(p: Params, paths: Paths, tok: Tokenizer, classes: list[str], unlabelled: list[str],
                         ) -> tuple[tuple[list[str], np.ndarray], dict[str, float]]:
    """Round 1's pseudo-labels from a self-trained linear probe on the frozen domain LMs (`pseudo.probe_teacher`)."""
    hp = p.classifier
    t0 = time.perf_counter()
    dtr, ytr, _ = _labelled(paths, "train", tok, classes)
    dva, yva, _ = _labelled(paths, "valid", tok, classes)
    x_train, x_valid, x_unlabelled = _lm_features(p, paths, tok.vocab_size,
                                                  [dtr, dva, Docs.from_lists(tok.encode(unlabelled))])
    proba, probs = probe_teacher(x_train, ytr, x_unlabelled, len(classes), hp.self_train_rounds,
                                 hp.pseudo_label_frac, hp.probe_c)
    idx, labels = select_pseudo_labels(probs, hp.pseudo_label_frac)
    valid_acc = float((proba(x_valid).argmax(1) == yva).mean())
    stats = dict(probe_valid_accuracy=valid_acc, probe_s=time.perf_counter() - t0, round1_pseudo_labelled=len(idx))
    return ([unlabelled[i] for i in idx], labels), stats


def classify(p: Params, paths: Paths = Paths()) -> dict:
    """ULMFiT classifiers (`classifier.members` per direction) from the domain-tuned LMs, in one servable bundle.

    Members of a direction differ only in their seed (init, dropout masks, batch order); averaging them cuts
    the variance of one fine-tuning run. Self-training (`classifier.self_train_rounds`): after each round the
    members' ensemble labels the budget's unlabelled training texts; the confident share joins the labelled
    rows and every member is retrained from its domain LM. With `self_train_teacher: probe`, a linear probe on
    the frozen domain LMs labels round 1 and round 0 is skipped. Validation rows guard both choices: rounds go
    on only while the round's validation accuracy improves (the best round is kept), and the bundle's ensemble
    holds only the members that do not lower its validation accuracy (`select_members`).
    """
    prepared = json.loads(paths.metrics("prepare").read_text())
    p = rules.apply(p, prepared)
    hp = p.classifier
    classes = prepared["classes"]
    tok = Tokenizer.load(paths.art("tokenize", "spm.model"))
    unlabelled = list(pd.read_csv(paths.art("prepare", "unlabelled.csv"), dtype=str, keep_default_na=False)["text"])
    valid = pd.read_csv(paths.art("prepare", "valid.csv"), dtype=str, keep_default_na=False)
    y_valid = valid["label"].map({c: i for i, c in enumerate(classes)}).to_numpy()
    rounds = hp.self_train_rounds if unlabelled else 0
    pseudo: tuple[list[str], np.ndarray] | None = None
    self_training: dict[str, float] = {}
    first = 0
    if rounds and hp.self_train_teacher == "probe":
        pseudo, self_training = _probe_pseudo_labels(p, paths, tok, classes, unlabelled)
        first = 1
    best: dict | None = None
    for r in range(first, rounds + 1):
        states, metrics, rows, steps, models = {}, {}, [], [], {}
        for direction, i in itertools.product(p.model.directions, range(hp.members)):
            t0 = time.perf_counter()
            log: list[dict] = []
            name = member_name(direction, i)
            ckpt = paths.art("train_classifier", f"checkpoint-{name}" + (f"-round{r}" if r else "") + ".pt")
            member = replace(p, classifier=replace(hp, seed=hp.seed + 1000 * i))
            model, history = fit_classifier(member, paths, direction, paths.art("finetune_lm", f"lm-{direction}.pt"),
                                            ckpt, log, pseudo)
            states[name] = model.state_dict()
            models[name] = model
            rows += [dict(direction=name, **row) for row in history]
            steps = steps or log
            metrics[name] = dict(valid_accuracy=history[-1]["valid_accuracy"],
                                 valid_loss=history[-1]["valid_loss"], train_s=time.perf_counter() - t0)
        member_probs = {n: Predictor(tok, {n: m}, classes, p.evaluate.batch_size).predict_proba(list(valid["text"]))
                        for n, m in models.items()}
        ensemble, ensemble_acc = select_members(member_probs, y_valid)
        this = dict(round=r, states=states, metrics=metrics, rows=rows, steps=steps, ensemble=ensemble,
                    valid_accuracy=ensemble_acc, cfg=next(iter(models.values())).cfg)
        if rounds:
            self_training[f"round{r}_valid_accuracy"] = ensemble_acc
        if best is not None and ensemble_acc <= best["valid_accuracy"]:
            break  # self-training stopped helping on the validation rows: keep the best round so far
        best = this
        if r < rounds:
            probs = Predictor(tok, {n: models[n] for n in ensemble}, classes,
                              p.evaluate.batch_size).predict_proba(unlabelled)
            idx, labels = select_pseudo_labels(probs, hp.pseudo_label_frac)
            pseudo = ([unlabelled[i] for i in idx], labels)
            self_training[f"round{r + 1}_pseudo_labelled"] = len(idx)
    assert best is not None
    save_classifier(paths.art("train_classifier", "model"), paths.art("tokenize", "spm.model"), classes, best["cfg"],
                    best["states"], hp.bptt, hp.max_len, ensemble=best["ensemble"])
    write_csv(paths.plot("classifier_history.csv"), best["rows"])
    write_csv(paths.plot("lr_schedule.csv"), [dict(step=s["step"], lr=s["lr"]) for s in best["steps"]])
    plot_history(best["rows"], paths.plot("classifier_loss.png"), "classifier: loss per epoch")
    plot_lr_schedule(best["steps"], paths.plot("lr_schedule.png"), "classifier LR: gradual unfreezing + STLR")
    metrics = dict(best["metrics"], ensemble=dict(members="+".join(best["ensemble"]),
                                                  valid_accuracy=best["valid_accuracy"]))
    if self_training:
        metrics["self_training"] = dict(self_training, kept_round=best["round"])
    write_json(paths.metrics("train_classifier"), metrics)
    return metrics


def select_members(member_probs: dict[str, np.ndarray], y: np.ndarray) -> tuple[list[str], float]:
    """The ensemble by validation: the best member, then each next-best one whose averaged-in probabilities
    do not lower validation accuracy. A member at chance (a diverged LM's classifier) is never averaged in.

    Returns (member names, the ensemble's validation accuracy).
    """
    acc = {n: float((pr.argmax(1) == y).mean()) for n, pr in member_probs.items()}
    order = sorted(acc, key=lambda n: (-acc[n], n))
    chosen, best = [order[0]], acc[order[0]]
    for n in order[1:]:
        trial = float((np.mean([member_probs[m] for m in chosen + [n]], axis=0).argmax(1) == y).mean())
        if trial >= best:
            chosen, best = chosen + [n], trial
    return chosen, best


# --- evaluate ---------------------------------------------------------------------------------------

def tfidf_proba(train: pd.DataFrame, text_sets: list[list[str]], classes: list[str], seed: int = 0) -> list[np.ndarray]:
    """TF-IDF (word 1-2-grams + char 2-5-grams, sublinear tf, case kept) + logistic regression.

    Fitted once on `train`; returns class probabilities (columns in `classes` order) for each text set.
    """
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline, make_union

    features = make_union(
        TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, lowercase=False, token_pattern=r"(?u)\b\w+\b|[^\w\s]"),
        TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 5), sublinear_tf=True, lowercase=False, min_df=2),
    )
    clf = make_pipeline(features, LogisticRegression(C=10.0, max_iter=2000, random_state=seed))
    clf.fit(list(train["text"]), list(train["label"]))
    order = [list(clf.classes_).index(c) for c in classes]
    return [clf.predict_proba(texts)[:, order] for texts in text_sets]


def evaluate(p: Params, paths: Paths = Paths()) -> dict:
    """Every requested variant on the same test split; the best ULMFiT variant is the champion candidate.

    `ulmfit+tfidf` averages the ULMFiT ensemble's and TF-IDF's probabilities after temperature-scaling each
    on the validation rows (labelled training rows held out from tuning), so neither member dominates by
    being more confident.
    """
    prep = json.loads(paths.metrics("prepare").read_text())
    p = rules.apply(p, prep)  # the scratch and no_lm_tuning classifiers train as the ULMFiT ones do
    classes = prep["classes"]
    index = {c: i for i, c in enumerate(classes)}
    frames = {s: pd.read_csv(paths.art("prepare", f"{s}.csv"), dtype=str, keep_default_na=False)
              for s in ("train", "valid", "test")}
    y, y_valid = (frames[s]["label"].map(index).to_numpy() for s in ("test", "valid"))
    texts, valid_texts = list(frames["test"]["text"]), list(frames["valid"]["text"])
    bundle = paths.art("train_classifier", "model")
    split_texts = {"test": texts, "valid": valid_texts}
    direction_probs: dict[tuple[str, str], np.ndarray] = {}  # (direction, split): each inferred once
    tfidf: dict[str, np.ndarray] = {}  # split -> probabilities of one TF-IDF fit

    def ulmfit(directions: list[str] | None, split: str) -> np.ndarray:
        """One direction's members, or (None) the bundle's ensemble as chosen on validation rows."""
        key = "+".join(directions) if directions else "ensemble"
        if (key, split) not in direction_probs:
            predictor = Predictor.from_dir(bundle, directions, p.evaluate.batch_size)
            direction_probs[key, split] = predictor.predict_proba(split_texts[split])
        return direction_probs[key, split]

    def tfidf_probs(split: str) -> np.ndarray:
        if not tfidf:
            tfidf["test"], tfidf["valid"] = tfidf_proba(frames["train"], [texts, valid_texts], classes, p.data.seed)
        return tfidf[split]

    probs: dict[str, np.ndarray] = {}
    timings: dict[str, float] = {}
    chosen: dict[str, str] = {}
    for variant in p.evaluate.variants:
        t0 = time.perf_counter()
        if variant == "tfidf":
            probs[variant] = tfidf_probs("test")
        elif variant in ("ulmfit_fwd", "ulmfit_bwd"):
            probs[variant] = ulmfit([variant.split("_")[1]], "test")
        elif variant == "ulmfit_ensemble":
            probs[variant] = ulmfit(None, "test")
        elif variant == "ulmfit+tfidf":  # the average, or its better member where the validation rows say so
            temps = [fit_temperature(ulmfit(None, "valid"), y_valid), fit_temperature(tfidf_probs("valid"), y_valid)]
            options = {"average": lambda split: calibrated_average([ulmfit(None, split), tfidf_probs(split)], temps),
                       "ulmfit": lambda split: ulmfit(None, split), "tfidf": tfidf_probs}
            valid_acc = {k: float((f("valid").argmax(1) == y_valid).mean()) for k, f in options.items()}
            chosen[variant] = max(options, key=lambda k: valid_acc[k])  # ties: the average (listed first)
            probs[variant] = options[chosen[variant]]("test")
        else:  # scratch, no_lm_tuning: the same classifier recipe from a random or an untuned-LM encoder
            source = None if variant == "scratch" else paths.art("pretrain", "lm-fwd.pt")
            # checkpoints in evaluate's own folder: train_classifier's outputs stay untouched
            model, _ = fit_classifier(p, paths, "fwd", source, paths.art("evaluate", f"checkpoint-{variant}.pt"))
            tok = Tokenizer.load(paths.art("tokenize", "spm.model"))
            probs[variant] = Predictor(tok, {"fwd": model}, classes, p.evaluate.batch_size).predict_proba(texts)
        timings[variant] = time.perf_counter() - t0
    with atomic_path(paths.art("evaluate", "probabilities.npz")) as tmp, open(tmp, "wb") as f:
        np.savez(f, y=y, **probs)  # per-variant test probabilities, for later ensembles and error analysis
    results = {}
    for variant, pr in probs.items():
        m = classification_metrics(y, pr.argmax(1), classes)
        results[variant] = dict(accuracy=m["accuracy"], error_rate=m["error_rate"], macro_f1=m["macro_f1"],
                                seconds=timings[variant], full=m)
    # the registered bundle predicts with its validation-chosen ensemble: that is the candidate, never a test pick
    ulmfit_variants = [v for v in ("ulmfit_ensemble", "ulmfit_fwd", "ulmfit_bwd") if v in results]
    champion = ulmfit_variants[0] if ulmfit_variants else None
    if champion:
        best = results[champion]["full"]
        write_csv(paths.plot("confusion.csv"), [dict(actual=classes[a], predicted=classes[b])
                                                  for a, b in zip(y, probs[champion].argmax(1))])
        plot_confusion(best["confusion_matrix"], classes, paths.plot("confusion.png"), f"{champion} on test")
    # chance: always the training rows' most frequent class (picked without looking at test labels)
    most_frequent = index[frames["train"]["label"].value_counts().idxmax()]
    majority = classification_metrics(y, np.full_like(y, most_frequent), classes)
    metrics = dict(variants={v: {k: r[k] for k in ("accuracy", "error_rate", "macro_f1")} for v, r in results.items()},
                   chance={k: majority[k] for k in ("accuracy", "error_rate", "macro_f1")},
                   details={v: r["full"] for v, r in results.items()}, champion_candidate=champion,
                   chosen_on_validation=chosen, seconds={v: r["seconds"] for v, r in results.items()},
                   test_digest=prep["test_digest"], n_test=len(y))
    # the whole record beside the outputs; metrics/evaluate.json keeps the headline (test accuracy per variant)
    # flat, so `dvc metrics show` stays one readable row
    write_json(paths.art("evaluate", "report.json"), metrics)
    write_json(paths.metrics("evaluate"), {v: r["accuracy"] for v, r in metrics["variants"].items()})
    return metrics


STAGES: dict[str, Callable[[Params, Paths], dict]] = {
    "prepare": prepare, "tokenize": tokenize, "pretrain": pretrain, "finetune_lm": finetune,
    "train_classifier": classify, "evaluate": evaluate,
}


def stage_params(p: Params, stage: str) -> dict:
    """The params a stage's output depends on (its cache key, and dvc.yaml's `params:`)."""
    s = p.section
    data_keys = {"prepare": None, "tokenize": ["general", "general_doc_per", "encoding"]}
    sections = {
        "prepare": {"data": s("data")},
        "tokenize": {"data": {k: s("data")[k] for k in data_keys["tokenize"]}, "tokenizer": s("tokenizer")},
        "pretrain": {"model": s("model"), "pretrain": s("pretrain"),
                     "data": {k: s("data")[k] for k in ("lm_eval", "encoding", "general_doc_per")}},
        "finetune_lm": {"model": s("model"), "finetune_lm": s("finetune_lm")},
        "train_classifier": {"model": s("model"), "classifier": s("classifier"),
                             "evaluate": {"batch_size": s("evaluate")["batch_size"]},
                             "data": {"rules": s("data")["rules"]}},
        "evaluate": {"model": s("model"), "classifier": s("classifier"), "evaluate": s("evaluate"),
                     "data": {"seed": s("data")["seed"], "rules": s("data")["rules"]}},
    }
    return sections[stage]


def stage_inputs(p: Params, stage: str, paths: Paths = Paths()) -> list[Path]:
    """Files whose content a stage's output depends on (besides params and code)."""
    a = paths.art
    d = p.data
    dirs = list(p.model.directions)
    inputs = {
        "prepare": [Path(f) for f in [d.train, d.valid, d.test, *d.domain] if f],
        "tokenize": [Path(g) for g in d.general],
        "pretrain": [a("tokenize", "general.npy"), a("tokenize", "spm.model"), *map(Path, d.lm_eval)],
        "finetune_lm": [a("prepare", "domain.txt"), a("tokenize", "spm.model")] + [a("pretrain", f"lm-{x}.pt") for x in dirs],
        "train_classifier": [a("prepare", "train.csv"), a("prepare", "valid.csv"), a("prepare", "unlabelled.csv"),
                             a("tokenize", "spm.model")]
        + [a("finetune_lm", f"lm-{x}.pt") for x in dirs],
        "evaluate": [a("prepare", "train.csv"), a("prepare", "valid.csv"), a("prepare", "test.csv"),
                     a("train_classifier", "model"), a("pretrain", "lm-fwd.pt") if "fwd" in dirs else None],
    }
    return [x for x in inputs[stage] if x is not None]


def stage_outputs(p: Params, stage: str, paths: Paths = Paths()) -> list[Path]:
    """Files a finished stage leaves behind (checked before a cached result is trusted)."""
    a, dirs = paths.art, list(p.model.directions)
    outputs = {
        "prepare": [a("prepare", f) for f in ("train.csv", "valid.csv", "test.csv", "domain.txt", "unlabelled.csv",
                                               "data_report.json")],
        "tokenize": [a("tokenize", "spm.model"), a("tokenize", "general.npy")],
        "pretrain": [a("pretrain", f"lm-{x}.pt") for x in dirs],
        "finetune_lm": [a("finetune_lm", f"lm-{x}.pt") for x in dirs],
        "train_classifier": [a("train_classifier", "model")],
        "evaluate": [a("evaluate", "probabilities.npz"), a("evaluate", "report.json")],
    }
    return outputs[stage] + [paths.metrics(stage)]


def run_stage(name: str, p: Params, paths: Paths = Paths()) -> dict:
    if name not in STAGES:
        raise TransferError(f"unknown stage {name!r}; stages are {', '.join(STAGES)}")
    for stale in paths.art(name).glob(".*.tmp-*"):  # left by a killed write; the workspace lock makes them dead
        stale.unlink()
    return STAGES[name](p, paths)
