"""Data-parallel training: the sharding rules and DDP's traps in one process, and one real 2-process job (gloo)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import make_workspace
from tests.processes import BIN, clean_env, start, stop, tail
from tests.test_train import CLAS_HP, markov_stream, small_classifier, small_lm, topic_docs
from transfer import distributed
from transfer.config import load_params
from transfer.data import ClassificationLoader, LMLoader
from transfer.evaluate import Predictor
from transfer.model import LanguageModel, layer_groups, lm_config
from transfer.stages import Workspace, run_stage
from transfer.train import Phase, fit, load_checkpoint
from transfer.train_clas import _clas_step, train_classifier
from transfer.train_lm import _lm_step


@given(n=st.integers(200, 3000), bs=st.integers(1, 8), world=st.integers(1, 4), backwards=st.booleans())
@settings(max_examples=40, deadline=None)
def test_ranks_read_contiguous_shares_that_together_are_one_process_at_the_global_batch(n, bs, world, backwards):
    stream = np.arange(n, dtype=np.int64)
    if n // (bs * world) < 2:
        return
    one = list(LMLoader(stream, bs * world, 10, backwards=backwards, seed=3).batches(1))
    ranks = [list(LMLoader(stream, bs, 10, backwards=backwards, seed=3, rank=r, world=world).batches(1))
             for r in range(world)]
    assert all(len(r) == len(one) for r in ranks)  # every rank takes the same number of steps
    for k, (x, y, scale) in enumerate(one):
        assert torch.equal(torch.cat([r[k][0] for r in ranks]), x)
        assert torch.equal(torch.cat([r[k][1] for r in ranks]), y)
        assert all(r[k][2] == scale for r in ranks)


@given(n=st.integers(1, 40), world=st.integers(1, 5))
def test_each_rank_takes_the_same_number_of_batches_and_none_twice(n, world):
    batches = lambda epoch, start=0: iter(range(start, n))  # noqa: E731
    taken = []
    for r in range(world):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(distributed, "rank", lambda r=r: r)
            mp.setattr(distributed, "world_size", lambda: world)
            sharded, steps = distributed.shard_batches(batches, n)
            mine = list(sharded(0))
            assert len(mine) == steps == max(1, n // world)
            assert list(sharded(0, 1)) == mine[1:]  # a resumed epoch skips what this rank already took
            taken.append(mine)
    flat = [b for t in taken for b in t]
    assert len(set(flat)) == len(flat) if n >= world else set(flat) <= set(range(n))


@pytest.fixture
def one_rank_group(tmp_path):
    """A real gloo process group of one rank: DDP's reducer runs, its checks included, in this process."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ddp_follows_gradual_unfreezing_and_weight_drop(one_rank_group):
    """Under DDP (a real reducer, one rank): a head-only phase leaves the frozen groups as they were; the phases
    that open more groups train them (a wrapper built once would fail waiting for frozen groups' gradients, or
    never reduce the opened ones); the weight-dropped LSTMs, whose weights are recomputed every forward from a
    raw parameter, train that parameter."""
    docs, labels = topic_docs(64, 0)
    hp = replace(CLAS_HP, min_steps_per_phase=0)

    def train(phases):
        model = small_classifier()
        before = [[p.detach().clone() for p in g] for g in layer_groups(model)]
        history = train_classifier(model, ClassificationLoader(docs, labels, 16, train=True), None,
                                   replace(hp, unfreeze_epochs=phases), progress=False)
        assert len(history) == len(phases)
        return [any(not torch.equal(a, b) for a, b in zip(g0, g)) for g0, g in zip(before, layer_groups(model))]

    assert train([1]) == [True] * 5  # one phase trains every group: embedding, 3 LSTMs, head
    assert train([1, 1, 1]) == [True] * 5  # head, then +1 LSTM, then all: a DDP wrapper per phase
    model = small_classifier()
    with torch.no_grad():
        before = {n: p.clone() for n, p in model.named_parameters() if n.endswith("_raw")}
    fit(model, [Phase(-1, 1)], *_batches(docs, labels), _clas_step, None, hp, progress=False)
    after = dict(model.named_parameters())
    assert len(before) == 3 and all(torch.equal(v, after[n]) for n, v in before.items())  # frozen: untouched
    fit(model, [Phase(0, 1)], *_batches(docs, labels), _clas_step, None, hp, progress=False)
    assert all(not torch.equal(v, after[n]) for n, v in before.items())


def test_ddp_step_gives_the_gradients_of_the_plain_model_ar_and_tar_included(one_rank_group):
    """The LM step's AR and TAR read the model's second and third outputs: through DDP's forward they must reach
    the same gradients, weight-dropped LSTM weights included (same seed, same masks)."""
    x = torch.from_numpy(markov_stream(16 * 21)[: 16 * 21].reshape(16, 21).astype(np.int64))
    grads = []
    for wrap in (False, True):
        model = small_lm()
        net = distributed.wrap(model) if wrap else model
        torch.manual_seed(7)
        loss, _, _ = _lm_step(alpha=2.0, beta=1.0)(net, (x[:, :-1], x[:, 1:], 1.0))
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert isinstance(distributed.wrap(small_lm()), torch.nn.parallel.DistributedDataParallel)
    assert any(n.endswith("_raw") for n in grads[0])
    for n, g in grads[0].items():
        assert torch.allclose(g, grads[1][n], atol=1e-6), n


def _batches(docs, labels):
    loader = ClassificationLoader(docs, labels, 16, train=True)
    return loader.batches, lambda e: len(loader)


def test_two_processes_train_resume_after_a_killed_worker_and_match_one_process(tmp_path, monkeypatch):
    """The one multi-process test: 2 gloo workers through torch's elastic launcher, on the tiny demo.

    - `transfer run --nproc 2` trains the general and domain LMs and the classifiers on 2 processes; rank 0
      alone logs, and the bundle loads in this single process;
    - `transfer stage pretrain --nproc 2` with a worker SIGKILLed mid-epoch stops with one clear error, and the
      rerun resumes to the same weights as the run's uninterrupted 2-process pretrain;
    - pretrain on 2 processes at bs 16 reaches the held-out perplexity of 1 process at bs 32 (the same global
      batch and tokens) within 3%, and its LMs load in a single process.
    """
    # fp32: under the bf16 autocast that precision 'auto' takes on a CPU with native bf16, the two float orders
    # land 6.3% apart (AVX-512 BF16, 2026-12-07), which says nothing about the data split across ranks
    root = make_workspace(tmp_path / "ws", ["pretrain.max_tokens=300000", "pretrain.drop_mult=0.1",
                                            "pretrain.checkpoint_every=5", "pretrain.bs=16", "pretrain.precision=fp32"])
    monkeypatch.chdir(root)
    ws = Workspace(".")
    env = clean_env(tmp_path / "home")
    transfer = str(BIN / "transfer")
    run = subprocess.run([transfer, "run", "--nproc", "2"], env=env, cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    Predictor.from_dir(ws.art("train_classifier", "model")).predict_proba(["a text to classify"])
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    names = [r.info.run_name for r in client.search_runs([e.experiment_id for e in client.search_experiments()])]
    assert all(names.count(s) == 1 for s in ("pretrain", "finetune_lm", "train_classifier")), names
    uninterrupted = {d: load_checkpoint(ws.art("pretrain", f"lm-{d}.pt")) for d in ("fwd", "bwd")}
    two = json.loads(ws.metrics("pretrain").read_text())

    for f in [*ws.art("pretrain").glob("checkpoint-*.pt"), ws.metrics("pretrain")]:
        f.unlink()
    cmd, log = [transfer, "stage", "pretrain", "--nproc", "2"], tmp_path / "killed.log"
    proc = start(cmd, env, root, log)
    ckpt = ws.art("pretrain", "checkpoint-fwd.pt")
    deadline = time.monotonic() + 120
    while not ckpt.exists():  # the first checkpoint, 5 of ~190 steps into the first epoch
        assert proc.poll() is None and time.monotonic() < deadline, tail(log)
        time.sleep(0.1)
    workers = _workers(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)  # rank 1, mid-epoch
    assert proc.wait(timeout=60) == 2, tail(log)
    out = log.read_text(errors="replace")
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rank 1 was killed by SIGKILL" in errors[0], out[-3000:]
    assert "Traceback" not in out
    assert not ws.metrics("pretrain").exists()  # not done: nothing reads a half-trained LM
    assert load_checkpoint(ckpt)["world"] == 2
    resumed = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    p = load_params("params.yaml")
    for d in ("fwd", "bwd"):
        state = torch.load(ws.art("pretrain", f"lm-{d}.pt"), weights_only=True)
        for k, v in uninterrupted[d].items():
            assert torch.allclose(v, state[k], atol=1e-6), (d, k)
        lm = LanguageModel(lm_config(p.tokenizer.vocab_size, emb_size=p.model.emb_size,
                                     hidden_size=p.model.hidden_size, n_layers=p.model.n_layers))
        lm.load_state_dict(state)  # a 2-process LM is a plain single-process state_dict

    one = run_stage("pretrain", load_params("params.yaml", ["pretrain.bs=32"]), ws)  # 1 process, in this one
    for d in ("fwd", "bwd"):
        assert two[d]["valid_ppl"] == pytest.approx(one[d]["valid_ppl"], rel=0.03)
        assert two[d]["train_tokens"] == one[d]["train_tokens"]


def _workers(agent_pid: int) -> list[int]:
    """The launcher's worker processes (children of `agent_pid`), in rank order."""
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            environ = dict(kv.split(b"=", 1) for kv in open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
                           if b"=" in kv)
        except (OSError, IndexError, ValueError):
            continue
        if ppid == agent_pid and b"RANK" in environ:
            found[int(environ[b"RANK"])] = int(entry)
    return [found[r] for r in sorted(found)]
