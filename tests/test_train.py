"""The loops learn, resume to identical weights, and save/load faithfully."""

import math
import platform
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from transfer.config_train import ClassifierParams, FinetuneLMParams, PretrainParams
from transfer.data import ClassificationLoader, Docs, LMLoader
from transfer.errors import TransferError
from transfer.model import LanguageModel, TextClassifier, classifier_config, lm_config
from transfer.device import autocast, cpu_supports_bf16
from transfer.guard import Diverged
from transfer.train import Phase, load_checkpoint
from transfer.train_clas import lr_find, train_classifier, unfreezing_phases, valley_lr
from transfer.train_lm import _lm_step, finetune_lm, pretrain_lm

V = 40
LM_HP = PretrainParams(epochs=2, bs=16, bptt=20, lr=3e-2, drop_mult=0.2, checkpoint_every=10**6)
CLAS_HP = ClassifierParams(bs=16, bptt=8, lr=2e-2, unfreeze_epochs=[1, 1, 1, 3], checkpoint_every=10**6)


def markov_stream(n: int, seed: int = 0) -> np.ndarray:
    """Token t is followed by (3t+1) mod V nine times in ten: learnable, far from unigram."""
    rng = np.random.default_rng(seed)
    s = np.empty(n, dtype=np.int64)
    s[0] = 4
    for i in range(1, n):
        s[i] = (s[i - 1] * 3 + 1) % V if rng.random() < 0.9 else rng.integers(4, V)
    return s


def unigram_ppl(train: np.ndarray, valid: np.ndarray) -> float:
    p = np.bincount(train, minlength=V) + 1.0
    p /= p.sum()
    return float(np.exp(-np.log(p[valid]).mean()))


def small_lm(seed=0) -> LanguageModel:
    torch.manual_seed(seed)
    return LanguageModel(lm_config(V, drop_mult=LM_HP.drop_mult, emb_size=16, hidden_size=32))


def test_language_model_beats_the_unigram_model_by_far():
    train, valid = markov_stream(20_000), markov_stream(2_000, seed=1)
    history = pretrain_lm(small_lm(), LMLoader(train, 8, 20), LMLoader(valid, 8, 20, variable=False), LM_HP,
                          progress=False)
    assert history[-1]["valid_ppl"] < 0.25 * unigram_ppl(train, valid)
    assert history[-1]["valid_ppl"] < history[0]["valid_ppl"]


def test_finetune_lm_first_trains_only_embedding_and_decoder():
    model = small_lm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hp = FinetuneLMParams(bs=8, bptt=10, checkpoint_every=10**6, freeze_epochs=1, epochs=1)
    loader = LMLoader(markov_stream(2_000), 8, 10)
    finetune_lm(model, loader, None, hp, progress=False, stop_after_steps=len(loader.seq_lens(0)))
    after = model.state_dict()
    assert not torch.equal(after["encoder.embed.weight"], before["encoder.embed.weight"])
    assert not torch.equal(after["decoder.bias"], before["decoder.bias"])
    assert torch.equal(after["encoder.rnns.0.weight_hh_l0_raw"], before["encoder.rnns.0.weight_hh_l0_raw"])
    assert torch.equal(after["encoder.rnns.2.module.weight_ih_l0"], before["encoder.rnns.2.module.weight_ih_l0"])


def topic_docs(n: int, seed: int) -> tuple[Docs, np.ndarray]:
    """3 classes; each document mixes noise tokens with a few tokens of its class's own range."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, n)
    docs = []
    for y in labels:
        length = int(rng.integers(8, 30))
        doc = rng.integers(16, V, length)
        hits = rng.choice(length, size=3, replace=False)
        doc[hits] = rng.integers(4 + 4 * y, 8 + 4 * y, 3)
        docs.append(doc.tolist())
    return Docs.from_lists(docs), labels


def small_classifier(seed=0, drop_mult=0.5) -> TextClassifier:
    torch.manual_seed(seed)
    return TextClassifier(classifier_config(V, drop_mult, emb_size=16, hidden_size=32), 3, bptt=CLAS_HP.bptt)


def test_pretrained_classifier_beats_chance_by_a_wide_margin():
    (dtr, ytr), (dva, yva) = topic_docs(400, 0), topic_docs(150, 1)
    lm = small_lm()
    pretrain_lm(lm, LMLoader(dtr.ids, 8, 20), None, LM_HP, progress=False)  # ULMFiT: LM on the texts first
    model = small_classifier(drop_mult=0.0)  # a 16-wide model has no capacity to spare for dropout
    model.encoder.load_state_dict(lm.encoder.state_dict())
    history = train_classifier(model, ClassificationLoader(dtr, ytr, 16, train=True),
                               ClassificationLoader(dva, yva, 64, train=False), CLAS_HP, progress=False)
    assert history[-1]["valid_accuracy"] > 0.8  # chance is 1/3
    assert [r["phase"] for r in history] == [0, 1, 2, 3, 3, 3]


_REFAULTS = """
import resource, sys, torch
from transfer.device import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "kept" else False
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(60):  # 64 MB, over glibc's largest mmap threshold (32 MB): allocated, written, freed, as an LM
    torch.ones(64 << 20, dtype=torch.uint8)  # step's logits are. The kept heap settles after 1-10 of them
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt settings are glibc's")
def test_keep_freed_memory_stops_large_tensors_faulting_in_again():
    def faults(mode):
        out = subprocess.run([sys.executable, "-c", _REFAULTS, mode], capture_output=True, text=True, check=True)
        applied, n = out.stdout.split()
        return applied == "True", int(n)

    (applied_default, default), (applied, kept) = faults("default"), faults("kept")
    assert applied and not applied_default
    assert default > 3 * kept, (default, kept)  # ~983k 4 KB faults by default (every time); kept: <= ~160k


def test_gradual_unfreezing_phases_and_minimum_steps():
    assert unfreezing_phases(5, [1, 1, 1, 2], steps_per_epoch=10) == [
        Phase(-1, 1), Phase(-2, 1), Phase(-3, 1), Phase(0, 2)]
    # 3 steps an epoch (about 100 labels at bs 32): every phase stretched to >= 20 steps
    assert [p.epochs for p in unfreezing_phases(5, [1, 1, 1, 2], 3, min_steps_per_phase=20)] == [7, 7, 7, 7]
    # the last-phase floor lengthens only the phase that trains every layer, and never shortens it
    assert [p.epochs for p in unfreezing_phases(5, [1, 1, 1, 2], 45, min_steps_last_phase=300)] == [1, 1, 1, 7]
    assert [p.epochs for p in unfreezing_phases(5, [1, 1, 1, 2], 200, min_steps_last_phase=300)] == [1, 1, 1, 2]
    assert [p.epochs for p in unfreezing_phases(5, [1, 1, 1, 2], 10, 50, min_steps_last_phase=120)] == [5, 5, 5, 12]


def test_unfreeze_lr_mult_scales_each_phase_schedule():
    (dtr, ytr) = topic_docs(96, 0)
    log = []
    hp = replace(CLAS_HP, unfreeze_epochs=[1, 1], unfreeze_lr_mult=[2.0, 0.1])
    train_classifier(small_classifier(), ClassificationLoader(dtr, ytr, 16, train=True), None, hp,
                     progress=False, step_log=log)
    lrs = [r["lr"] for r in log]
    first, second = lrs[:len(lrs) // 2], lrs[len(lrs) // 2:]  # equal-length phases: the same STLR shape
    assert max(first) == pytest.approx(2.0 * hp.lr)
    assert second == pytest.approx([lr * 0.05 for lr in first])
    assert [p.lr_mult for p in unfreezing_phases(5, [1, 1], 6, lr_mults=[2.0, 0.1])] == [2.0, 0.1]


def test_a_training_set_one_row_over_whole_batches_trains():
    (dtr, ytr) = topic_docs(33, 0)  # 2 batches of 16 and 1 row: alone, that row would fail the head's BatchNorm
    loader = ClassificationLoader(dtr, ytr, 16, train=True)
    assert len(loader) == 2 and sorted(len(b) for b in loader.order(0)) == [16, 17]
    history = train_classifier(small_classifier(), loader, None, replace(CLAS_HP, unfreeze_epochs=[1]),
                               progress=False)
    assert len(history) == 1 and math.isfinite(history[0]["train_loss"])


def _lm_run(tmp_path, stop_after=None, name="ck.pt"):
    train, valid = markov_stream(4_000), markov_stream(600, 1)
    model = small_lm()
    hp = replace(LM_HP, epochs=2, checkpoint_every=7)
    history = pretrain_lm(model, LMLoader(train, 8, 12, seed=5), LMLoader(valid, 8, 12, variable=False), hp,
                          ckpt_path=tmp_path / name, fingerprint="f", progress=False, stop_after_steps=stop_after)
    return model, history


def test_interrupt_then_resume_gives_the_same_weights_as_no_interruption(tmp_path):
    straight, h1 = _lm_run(tmp_path, name="a.pt")
    _lm_run(tmp_path, stop_after=25, name="b.pt")  # crash between the checkpoints at steps 21 and 28
    assert load_checkpoint(tmp_path / "b.pt")["position"]["global_step"] == 21
    resumed, h2 = _lm_run(tmp_path, name="b.pt")
    for (k, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), k
    assert [r["valid_ppl"] for r in h1] == pytest.approx([r["valid_ppl"] for r in h2], rel=1e-6)
    # The interrupted epoch reports all its steps, not only those after the resume: the same mean loss, and
    # tokens (rate x seconds) over the whole epoch.
    assert [r["train_loss"] for r in h1] == pytest.approx([r["train_loss"] for r in h2], rel=1e-5)
    tokens = [r["items_per_s"] * r["time_s"] for r in h1]
    assert [r["items_per_s"] * r["time_s"] for r in h2] == pytest.approx(tokens, rel=1e-6)


def test_classifier_resume_mid_phase_matches(tmp_path):
    (dtr, ytr) = topic_docs(96, 0)
    hp = replace(CLAS_HP, unfreeze_epochs=[1, 2], checkpoint_every=4)

    def run(name, stop=None):
        model = small_classifier()
        train_classifier(model, ClassificationLoader(dtr, ytr, 16, train=True), None, hp,
                         ckpt_path=tmp_path / name, fingerprint="x", progress=False, stop_after_steps=stop)
        return model

    straight = run("a.pt")
    run("b.pt", stop=10)
    resumed = run("b.pt")
    for (k, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), atol=1e-6), k


def test_a_checkpoint_from_other_params_is_not_resumed(tmp_path):
    _lm_run(tmp_path, stop_after=8, name="c.pt")
    model = small_lm()
    with pytest.warns(UserWarning, match="different params"):
        pretrain_lm(model, LMLoader(markov_stream(4_000), 8, 12), None, replace(LM_HP, epochs=1),
                    ckpt_path=tmp_path / "c.pt", fingerprint="other", progress=False)
    assert load_checkpoint(tmp_path / "c.pt")["fingerprint"] == "other"


def test_checkpoints_load_with_weights_only_and_refuse_garbage(tmp_path):
    _lm_run(tmp_path, stop_after=8, name="d.pt")
    ck = torch.load(tmp_path / "d.pt", weights_only=True)
    assert {"model", "optimizer", "rng_torch", "position", "history"} <= set(ck)
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(TransferError, match="bad.pt"):
        load_checkpoint(tmp_path / "bad.pt")
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name], "no temp files left"


def test_lr_find_sweeps_exponentially_and_restores_weights():
    model = small_lm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loader = LMLoader(markov_stream(40_000), 8, 10)
    batches = (b for e in range(100) for b in loader.batches(e))
    lrs, losses, suggestion = lr_find(model, batches, _lm_step(0, 0), num_it=100)
    assert lrs[0] == pytest.approx(1e-7) and all(b / a == pytest.approx(lrs[1] / lrs[0]) for a, b in zip(lrs, lrs[1:]))
    if len(lrs) < 100:  # stopped early: only because the smoothed loss blew up
        assert losses[-1] > 4 * min(losses) or not math.isfinite(losses[-1])
    else:
        assert lrs[-1] == pytest.approx(10.0)
    assert min(losses) < losses[0] and 1e-6 < suggestion < 10
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_valley_suggestion_lies_in_the_descent_not_in_the_noise_before_it():
    # the shape of AG News' classifier curve: a noisy, nearly flat start, a long descent, then divergence
    lrs = list(np.geomspace(1e-7, 10, 100))
    noise = np.random.default_rng(0).normal(0, 0.03, 100)
    losses = [1.5 + noise[i] if lr < 1e-4 else 1.45 - 0.45 * np.log10(lr / 1e-4) / 3.5 if lr < 0.3
              else 1.0 + 3 * (lr - 0.3) for i, lr in enumerate(lrs)]
    # what the steepest-slope rule picked here: a point of the noise, orders of magnitude too low
    assert lrs[int(np.argmin(np.gradient(losses, np.log(lrs))))] < 1e-4
    assert 1e-3 < valley_lr(lrs, losses) < 0.3
    assert valley_lr(lrs[:1], losses[:1]) == lrs[0]
    assert valley_lr([1e-3, 1e-2], [1.0, 0.5]) == 1e-3  # a run from the first point: not wrapped to the last


@pytest.mark.parametrize("precision", ["auto", "fp32", "bf16"])
def test_precision_param_picks_bf16_only_where_asked_or_supported(precision):
    cpu = torch.device("cpu")
    if precision == "bf16" and not cpu_supports_bf16():
        with pytest.raises(TransferError, match="native bf16.*'auto' or 'fp32'"):
            autocast(cpu, precision)
        return
    expect_bf16 = precision == "bf16" or (precision == "auto" and cpu_supports_bf16())
    with autocast(cpu, precision):
        out = torch.ones(4, 4) @ torch.ones(4, 4)
    assert out.dtype == (torch.bfloat16 if expect_bf16 else torch.float32)


def test_bf16_without_native_support_fails_before_training(monkeypatch, tmp_path):
    # on AVX2 torch's LSTM has no bf16 kernel: asking for bf16 there must fail clearly, before any checkpoint
    monkeypatch.setattr("transfer.device.cpu_supports_bf16", lambda: False)
    model, stream = small_lm(), markov_stream(4000)
    hp = replace(LM_HP, epochs=1, precision="bf16", checkpoint_every=1)
    with pytest.raises(TransferError, match="precision 'bf16'"):
        pretrain_lm(model, LMLoader(stream, hp.bs, hp.bptt), None, hp, progress=False, ckpt_path=tmp_path / "lm.pt",
                    fingerprint="f")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not cpu_supports_bf16(), reason="this CPU has no native bf16 (AVX-512 BF16 or AMX)")
def test_bf16_training_keeps_fp32_weights():
    model, stream = small_lm(), markov_stream(4000)
    hp = replace(LM_HP, epochs=1, precision="bf16")
    pretrain_lm(model, LMLoader(stream, hp.bs, hp.bptt), None, hp, progress=False)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def _spiking(step_loss, at: set[int], how: str):
    """A step loss that blows up on the listed calls, as a diverging run's does."""
    calls = {"n": 0}

    def step(model, batch):
        loss, n, scale = step_loss(model, batch)
        calls["n"] += 1
        if calls["n"] in at:
            loss = loss * float("nan") if how == "nan" else loss * 10
        return loss, n, scale
    return step


@pytest.mark.parametrize("how", ["spike", "nan"])
def test_divergence_rewinds_and_halves_the_lr_then_finishes(how, monkeypatch):
    import transfer.train_lm as T

    loader = LMLoader(markov_stream(8_000), 8, 20, variable=False)
    hp = replace(LM_HP, epochs=1, spike_factor=2.0)
    monkeypatch.setattr(T, "_lm_step", lambda a, b: _spiking(_lm_step(a, b), {45}, how))
    log = []
    with pytest.warns(UserWarning, match="diverged; rewound to step 20 and halved the lr"):
        pretrain_lm(small_lm(), loader, None, hp, progress=False, step_log=log)
    assert [r["step"] for r in log] == list(range(len(loader.seq_lens(0))))  # every step once, in order
    assert all(math.isfinite(r["loss"]) for r in log)
    reference = []
    monkeypatch.setattr(T, "_lm_step", _lm_step)
    pretrain_lm(small_lm(), loader, None, hp, progress=False, step_log=reference)
    assert [r["lr"] for r in log[:20]] == [r["lr"] for r in reference[:20]]
    assert [r["lr"] for r in log[20:]] == pytest.approx([r["lr"] / 2 for r in reference[20:]])


def test_divergence_beyond_max_recoveries_stops_with_a_clear_error(monkeypatch):
    import transfer.train_lm as T

    loader = LMLoader(markov_stream(8_000), 8, 20, variable=False)
    monkeypatch.setattr(T, "_lm_step", lambda a, b: _spiking(_lm_step(a, b), set(range(30, 10**6)), "spike"))
    with pytest.raises(Diverged, match=r"pretrain: loss .* diverged again after 2 recoveries"):
        with pytest.warns(UserWarning):
            pretrain_lm(small_lm(), loader, None, replace(LM_HP, epochs=1, max_recoveries=2), progress=False)


def test_warm_up_floor_delays_the_peak_lr():
    loader = LMLoader(markov_stream(8_000), 8, 20, variable=False)
    n = len(loader.seq_lens(0))
    peaks = {}
    for floor in (0, 20):
        log = []
        pretrain_lm(small_lm(), loader, None, replace(LM_HP, epochs=1, warmup_min_steps=floor), progress=False,
                    step_log=log)
        lrs = [r["lr"] for r in log]
        peaks[floor] = lrs.index(max(lrs))
    assert peaks[0] == math.floor(n * LM_HP.cut_frac) and peaks[20] == 20, (n, peaks)


def test_progress_lines_when_not_a_terminal(capfd, monkeypatch):
    from transfer import progress

    monkeypatch.setenv("TRANSFER_PROGRESS_SECONDS", "0")  # a line at every step
    events = []
    loader = LMLoader(markov_stream(4_000), 8, 20, variable=False)
    with progress.subscribe(events.append):
        pretrain_lm(small_lm(), loader, None, replace(LM_HP, epochs=1), desc="pretrain bwd")
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("pretrain bwd epoch 1/1: step")]
    n = len(loader.seq_lens(0))
    assert len(lines) == n and len(events) == n
    assert lines[-1].startswith(f"pretrain bwd epoch 1/1: step {n}/{n} (100%), loss ")
    assert " tok/s, ETA " in lines[0] and "\r" not in lines[0]  # plain lines, no bar
    assert [e["global_step"] for e in events] == list(range(1, n + 1)) and events[0]["name"] == "pretrain bwd"
