"""Token streams and batching follow the recipe: parallel streams, variable BPTT, sortish order."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.data import (
    ClassificationLoader, Docs, LMLoader, SortishSampler, load_token_stream, pad_batch, sorted_batches,
    write_token_stream,
)
from transfer.errors import TransferError


def test_token_stream_is_a_memmapped_npy_with_bos_before_each_doc(tmp_path):
    path = write_token_stream(iter([[5, 6], [7]]), tmp_path / "s.npy", vocab_size=100, chunk_tokens=2)
    stream = load_token_stream(path)
    assert isinstance(stream, np.memmap) and stream.dtype == np.uint16
    assert stream.tolist() == [2, 5, 6, 2, 7]
    assert not [p for p in tmp_path.iterdir() if p.name != "s.npy"], "no temp files left behind"


def test_token_stream_uses_int32_when_the_vocab_does_not_fit_uint16(tmp_path):
    stream = load_token_stream(write_token_stream([[70_000]], tmp_path / "s.npy", vocab_size=70_001))
    assert stream.dtype == np.int32 and stream.tolist() == [2, 70_000]


def test_empty_token_stream_is_refused_and_nothing_written(tmp_path):
    with pytest.raises(TransferError, match="empty"):
        write_token_stream([], tmp_path / "s.npy", vocab_size=10)
    assert list(tmp_path.iterdir()) == []


def stream(n=10_000):
    return np.arange(n) % 1000


def test_lm_batches_are_bs_parallel_streams_and_targets_are_shifted_by_one():
    loader = LMLoader(stream(), bs=4, bptt=10, seed=1)
    rows = [[], [], [], []]
    for x, y, _ in loader.batches(0):
        assert x.shape == y.shape and x.shape[0] == 4
        assert torch.equal(x[:, 1:], y[:, :-1])
        for r in range(4):
            rows[r].extend(x[r].tolist())
    per_row = 10_000 // 4
    for r in range(4):  # each row reads its own contiguous quarter of the stream, in order
        assert rows[r] == (np.arange(r * per_row, (r + 1) * per_row - 1) % 1000).tolist()


def test_variable_bptt_follows_the_awd_lstm_rule_and_scales_the_lr():
    loader = LMLoader(stream(400_000), bs=2, bptt=70, seed=0)
    lens = loader.seq_lens(0)[:-1]  # the last batch is cut by the end of the stream
    assert min(lens) >= 5
    halves = np.mean(np.array(lens) < 52)  # bptt/2 = 35 +- a few sigma of 5
    assert 0.03 < halves < 0.07, "bptt/2 is drawn with p=0.05"
    full = [sl for sl in lens if sl >= 52]
    assert abs(np.mean(full) - 70) < 0.5 and 4 < np.std(full) < 6
    for (x, _, scale), sl in zip(loader.batches(0), loader.seq_lens(0)):
        assert x.shape[1] == sl and scale == pytest.approx(sl / 70)


def test_batch_lengths_depend_only_on_seed_and_epoch_so_epochs_can_resume():
    a, b = LMLoader(stream(), 4, 20, seed=3), LMLoader(stream(), 4, 20, seed=3)
    assert a.seq_lens(2) == b.seq_lens(2) and a.seq_lens(1) != a.seq_lens(2)
    full = list(a.batches(1))
    tail = list(a.batches(1, start=5))
    assert all(torch.equal(p[0], q[0]) for p, q in zip(full[5:], tail)) and len(tail) == len(full) - 5


def test_backwards_lm_reads_the_stream_reversed():
    s = stream(100)
    fwd = next(LMLoader(s, 1, 10, variable=False).batches())[0][0].tolist()
    bwd = next(LMLoader(s, 1, 10, backwards=True, variable=False).batches())[0][0].tolist()
    assert fwd == list(range(10)) and bwd == list(range(99, 89, -1))


def test_max_tokens_caps_an_epoch():
    loader = LMLoader(stream(), bs=4, bptt=10, max_tokens=400)
    assert loader.tokens_per_epoch() == 4 * 99
    assert sum(x.numel() for x, _, _ in loader.batches()) == 4 * 99


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 500), min_size=1, max_size=400), st.integers(1, 16), st.integers(0, 5))
def test_sortish_sampler_yields_each_index_exactly_once(lengths, bs, seed):
    sampler = SortishSampler(np.array(lengths), bs, seed)
    batches = sampler.batches(epoch=1)
    idx = np.concatenate(batches)
    assert sorted(idx.tolist()) == list(range(len(lengths)))
    assert len(batches) == len(sampler)
    # at most bs rows, bs + 1 where a last row would otherwise train alone (BatchNorm needs two)
    assert all(len(b) <= bs + 1 for b in batches) and sum(len(b) > bs for b in batches) <= 1
    assert len(lengths) == 1 or bs == 1 or all(len(b) > 1 for b in batches)
    assert max(lengths[i] for i in batches[0]) == max(lengths), "largest batch first"


def test_sortish_batches_are_length_sorted_within_chunks_and_shuffled_between_epochs():
    lengths = np.random.default_rng(0).integers(1, 1000, 2000)
    s = SortishSampler(lengths, bs=8, seed=0)
    e0, e1 = s.batches(0), s.batches(1)
    spread = np.mean([lengths[b].max() - lengths[b].min() for b in e0])
    assert spread < 50, "batches group documents of similar length"
    assert not all(np.array_equal(a, b) for a, b in zip(e0, e1))


def test_evaluation_batches_are_length_sorted():
    lengths = np.array([3, 9, 1, 7, 5])
    order = np.concatenate(sorted_batches(lengths, 2))
    assert lengths[order].tolist() == [9, 7, 5, 3, 1]


def test_pad_batch_right_pads_with_the_pad_id_and_backwards_reverses_each_doc():
    x, lengths = pad_batch([np.array([2, 5, 6]), np.array([2, 7])], pad_id=0)
    assert x.tolist() == [[2, 5, 6], [2, 7, 0]] and lengths.tolist() == [3, 2]
    xb, _ = pad_batch([np.array([2, 5, 6]), np.array([2, 7])], pad_id=0, backwards=True)
    assert xb.tolist() == [[6, 5, 2], [7, 2, 0]]


def test_docs_round_trip_and_classification_loader_covers_every_doc(tmp_path):
    docs = Docs.from_lists([[5, 6, 7], [8], [9, 10]])
    assert docs[0].tolist() == [2, 5, 6, 7] and docs.lengths.tolist() == [4, 2, 3]
    loaded = Docs.load(docs.save(tmp_path / "d.npz"))
    assert np.array_equal(loaded.ids, docs.ids) and np.array_equal(loaded.offsets, docs.offsets)
    loader = ClassificationLoader(docs, np.array([0, 1, 0]), bs=2, train=True)
    seen = [int(i) for _, _, y, idx in loader.batches() for i in idx]
    assert sorted(seen) == [0, 1, 2]
