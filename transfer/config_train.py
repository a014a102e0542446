"""The training sections of params.yaml: the knobs all three training stages share, and each stage's own.

Split from transfer/config.py (the file-level `Params` and its loader); the range checks they run are the shared
ones in transfer/config_sections.py. transfer.train.TrainHP is the subset the training loop reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transfer.config_sections import _at_least, _fraction, _one_of, _require

__all__ = ["TrainParams", "LMTrainParams", "PretrainParams", "FinetuneLMParams", "ClassifierParams"]


@dataclass(frozen=True)
class TrainParams:
    """Optimiser, regularisation and schedule knobs shared by all three training stages."""

    bs: int = 32  # sequences per batch
    bptt: int = 70  # tokens per truncated-backprop window (LM); chunk length when encoding documents (classifier)
    lr: float = 2e-3  # peak learning rate of the last layer group
    lr_decay: float = 2.6  # discriminative lrs: group k from the top trains at lr / lr_decay**k
    wd: float = 0.01  # AdamW weight decay
    clip: float | None = 0.25  # max gradient norm; None: no clipping
    betas: list[float] = field(default_factory=lambda: [0.7, 0.99])  # Adam betas (ULMFiT uses 0.7, not 0.9)
    drop_mult: float = 1.0  # scales every AWD-LSTM dropout together
    alpha: float = 2.0  # activation regularisation (AR) weight
    beta: float = 1.0  # temporal activation regularisation (TAR) weight
    schedule: str = "stlr"  # "stlr": slanted triangular; "one_cycle": cosine one-cycle
    cut_frac: float = 0.1  # share of steps spent warming up
    warmup_min_steps: int = 0  # floor on the warm-up, in optimizer steps per phase (at most half the phase), so a
    # short budget does not reach the peak lr within a few dozen steps
    ratio: float = 32  # peak lr / lowest lr of the schedule
    checkpoint_every: int = 200  # optimiser steps between resumable checkpoints
    early_stop_patience: int | None = None  # evaluations without improvement before stopping; None: never
    seed: int = 0
    precision: str = "auto"  # "auto": bf16 autocast on a GPU or a bf16-capable CPU, else fp32
    spike_factor: float | None = None  # divergence: a step loss above this times the running mean of the loss
    # (or any non-finite loss) rewinds to a state 20-40 steps back and halves the lr; None: non-finite losses only
    max_recoveries: int = 3  # rewinds allowed before training stops with an error; 0: stop at the first divergence

    def __post_init__(self) -> None:
        _at_least(self.bs, "bs", 1)
        _at_least(self.bptt, "bptt", 2)
        _require(self.lr > 0, "lr", f"must be > 0, got {self.lr!r}")
        _at_least(self.lr_decay, "lr_decay", 1)
        _at_least(self.wd, "wd", 0)
        _require(self.clip is None or self.clip > 0, "clip", f"must be > 0 or null, got {self.clip!r}")
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas",
                 f"must be two numbers in [0, 1), got {self.betas!r}")
        _require(0 <= self.drop_mult <= 1, "drop_mult", f"must be in [0, 1], got {self.drop_mult!r}")
        _at_least(self.alpha, "alpha", 0)
        _at_least(self.beta, "beta", 0)
        _one_of(self.schedule, "schedule", ["stlr", "one_cycle"])
        _fraction(self.cut_frac, "cut_frac")
        _at_least(self.ratio, "ratio", 1)
        _at_least(self.checkpoint_every, "checkpoint_every", 1)
        _at_least(self.early_stop_patience, "early_stop_patience", 1)
        _one_of(self.precision, "precision", ["auto", "fp32", "bf16"])
        _at_least(self.warmup_min_steps, "warmup_min_steps", 0)
        _require(self.spike_factor is None or self.spike_factor > 1, "spike_factor",
                 f"must be > 1 or null, got {self.spike_factor!r}")
        _at_least(self.max_recoveries, "max_recoveries", 0)


@dataclass(frozen=True)
class LMTrainParams(TrainParams):
    """Language-model training: epochs over a token stream, optionally capped."""

    epochs: int = 1
    max_tokens: int | None = None  # cap on tokens per epoch (a prefix of every batch row); None: all
    spike_factor: float | None = 2.0  # an LM's step loss moves by a few % between steps; a doubling is divergence
    fail_at_unigram: float | None = 0.8  # the stage fails if held-out perplexity ends at or above this share of the
    # unigram model's (healthy 1-epoch Wikipedia LMs: ~0.3; the diverged backward LM: 0.92); None: report only

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least(self.epochs, "epochs", 1)
        _at_least(self.max_tokens, "max_tokens", 1)
        _require(self.fail_at_unigram is None or 0 < self.fail_at_unigram, "fail_at_unigram",
                 f"must be > 0 or null, got {self.fail_at_unigram!r}")


@dataclass(frozen=True)
class PretrainParams(LMTrainParams):
    valid_frac: float = 0.02  # share of the general stream held out to report perplexity
    from_lm: str | None = None  # a published general LM (models:/NAME@ALIAS, or its folder): tokenize and
    # pretrain take its tokenizer and weights instead of training (`transfer lm publish` makes one)

    def __post_init__(self) -> None:
        super().__post_init__()
        _fraction(self.valid_frac, "valid_frac")


@dataclass(frozen=True)
class FinetuneLMParams(LMTrainParams):
    epochs: int = 2  # all layer groups trainable
    freeze_epochs: int = 1  # run first, before `epochs`: only the last layer group trains
    valid_frac: float = 0.1  # share of the domain stream (its end) held out to report perplexity

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least(self.freeze_epochs, "freeze_epochs", 0)
        _fraction(self.valid_frac, "valid_frac")


@dataclass(frozen=True)
class ClassifierParams(TrainParams):
    lr: float = 1e-2
    drop_mult: float = 0.5
    max_len: int = 1440  # tokens of each document's end that get gradients (BPT3C); earlier chunks run no-grad
    unfreeze_epochs: list[int] = field(default_factory=lambda: [1, 1, 1, 2])  # gradual unfreezing: phase k
    # trains the last k layer groups, the final phase trains all of them
    unfreeze_lr_mult: list[float] | None = None  # phase k's peak lr is lr * unfreeze_lr_mult[k]; None: lr in every
    # phase. fastai's tutorial lowers it as more layers thaw (2e-2, 1e-2, 5e-3, 1e-3 = 2, 1, 0.5, 0.1 of 1e-2)
    min_steps_per_phase: int = 0  # lengthen a phase to at least this many steps (tiny data sets)
    min_steps_last_phase: int = 0  # lengthen the last phase (every layer trains) to at least this many steps
    self_train_rounds: int = 0  # label budgets: rounds of retraining on pseudo-labelled unlabelled training texts
    pseudo_label_frac: float = 0.5  # share of the unlabelled texts pseudo-labelled per round, most confident first
    self_train_teacher: str = "classifier"  # who labels round 1: "classifier" (round 0's fine-tuned ensemble) or
    # "probe" (logistic regression on the frozen domain LMs' features, self-trained); round 0 trains either way
    probe_c: float = 0.003  # the probe's inverse L2 strength, on standardised features
    members: int = 1  # classifiers per direction, member i seeded seed + 1000 * i; the ulmfit variants average them
    class_weights: bool = False  # weight the loss by inverse class frequency (imbalanced classes)
    min_steps_per_epoch: int = 10  # few labels: the batch shrinks (to no less than min_bs) so an epoch has this many
    min_bs: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least(self.max_len, "max_len", 1)
        _at_least(self.self_train_rounds, "self_train_rounds", 0)
        _at_least(self.members, "members", 1)
        for key, value in (("bs", self.bs), ("min_bs", self.min_bs)):  # the head's BatchNorm trains on >= 2 rows
            _require(value >= 2, key, f"must be >= 2 (BatchNorm needs two rows), got {value!r}")
        _require(0 < self.pseudo_label_frac <= 1, "pseudo_label_frac",
                 f"must be in (0, 1], got {self.pseudo_label_frac!r}")
        _require(self.self_train_teacher in ("classifier", "probe"), "self_train_teacher",
                 f"must be 'classifier' or 'probe', got {self.self_train_teacher!r}")
        _require(self.probe_c > 0, "probe_c", f"must be > 0, got {self.probe_c!r}")
        _require(len(self.unfreeze_epochs) > 0 and all(e >= 0 for e in self.unfreeze_epochs), "unfreeze_epochs",
                 f"must be a non-empty list of epoch counts >= 0, got {self.unfreeze_epochs!r}")
        _require(self.epochs > 0, "unfreeze_epochs", "must train for at least one epoch in total")
        if self.unfreeze_lr_mult is not None:
            _require(len(self.unfreeze_lr_mult) == len(self.unfreeze_epochs), "unfreeze_lr_mult",
                     f"must have one multiplier per unfreeze_epochs entry ({len(self.unfreeze_epochs)}), "
                     f"got {self.unfreeze_lr_mult!r}")
            _require(all(m > 0 for m in self.unfreeze_lr_mult), "unfreeze_lr_mult",
                     f"must be positive, got {self.unfreeze_lr_mult!r}")
        _at_least(self.min_steps_per_phase, "min_steps_per_phase", 0)
        _at_least(self.min_steps_last_phase, "min_steps_last_phase", 0)
        _at_least(self.min_steps_per_epoch, "min_steps_per_epoch", 1)

    @property
    def epochs(self) -> int:
        """Total classifier epochs over all unfreezing phases."""
        return sum(self.unfreeze_epochs)
