"""The AWD-LSTM pieces do what the recipe says."""

import pytest
import torch

from transfer.model import (
    CLAS_DROPOUTS, LM_DROPOUTS, EmbeddingDropout, LanguageModel, RNNDropout, TextClassifier, WeightDropout,
    classifier_config, concat_pool, freeze_to, layer_groups, lm_config, transfer_vocab,
)

V, E, H = 40, 8, 12


def small_lm(**kw) -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(lm_config(V, emb_size=E, hidden_size=H, **kw))


def small_classifier(bptt=5, max_len=1000, **kw) -> TextClassifier:
    torch.manual_seed(0)
    return TextClassifier(classifier_config(V, emb_size=E, hidden_size=H, **kw), 3, bptt=bptt, max_len=max_len)


def test_weight_dropout_masks_weight_hh_only_in_training():
    torch.manual_seed(0)
    wd = WeightDropout(torch.nn.LSTM(4, 6, batch_first=True), weight_p=0.5)
    x = torch.randn(2, 3, 4)
    wd.train()
    wd(x)
    used = wd.module.weight_hh_l0
    raw = wd.weight_hh_l0_raw
    assert ((used == 0) & (raw != 0)).any(), "training forward must drop some recurrent weights"
    kept = used != 0
    assert torch.allclose(used[kept], raw[kept] * 2)  # kept weights rescaled by 1/(1-p)
    wd(x)
    assert not torch.equal(wd.module.weight_hh_l0, used), "a fresh mask every forward"
    assert torch.equal(wd.module.weight_ih_l0, wd.module.weight_ih_l0)  # input weights never dropped
    wd.eval()
    a, b = wd(x)[0], wd(x)[0]
    assert torch.equal(a, b) and torch.equal(wd.module.weight_hh_l0, raw)


def test_weight_dropout_state_dict_holds_only_the_raw_weight():
    keys = small_lm().state_dict().keys()
    assert "encoder.rnns.0.weight_hh_l0_raw" in keys
    assert "encoder.rnns.0.module.weight_hh_l0" not in keys


def test_embedding_dropout_zeroes_whole_rows_and_rescales():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 6)
    ed = EmbeddingDropout(emb, embed_p=0.5).train()
    words = torch.arange(50).repeat(2, 1)  # every word twice, in two rows
    out = ed(words)
    dropped = (out[0] == 0).all(dim=1)
    assert 5 < dropped.sum() < 45
    assert torch.equal(dropped, (out[1] == 0).all(dim=1)), "a word is dropped everywhere it occurs"
    assert torch.allclose(out[0][~dropped], emb.weight[~dropped] * 2)
    assert torch.equal(ed.eval()(words)[0], emb.weight)


def test_locked_dropout_mask_is_constant_over_time():
    torch.manual_seed(0)
    x = torch.ones(4, 30, 10)
    out = RNNDropout(0.5).train()(x)
    assert torch.equal(out, out[:, :1].expand_as(out))
    assert (out == 0).any() and (out == 2).any()
    assert torch.equal(RNNDropout(0.5).eval()(x), x)


def test_dropouts_are_the_recipe_defaults_scaled_by_drop_mult():
    lm, clas = lm_config(V, drop_mult=0.5), classifier_config(V)
    for k, v in LM_DROPOUTS.items():
        assert getattr(lm, k) == pytest.approx(v * 0.5)
    for k, v in CLAS_DROPOUTS.items():
        assert getattr(clas, k) == pytest.approx(v * 0.5)  # classifier drop_mult defaults to 0.5


def test_decoder_is_tied_to_the_embedding_and_bias_starts_at_zero():
    lm = small_lm()
    assert lm.decoder.weight is lm.encoder.embed.weight
    assert torch.equal(lm.decoder.bias, torch.zeros(V))
    assert lm.encoder.rnns[-1].module.hidden_size == E  # last layer outputs E so the tie is possible


def test_hidden_state_is_carried_detached_and_reset():
    lm = small_lm().eval()
    x = torch.randint(0, V, (2, 6))
    first = lm(x)[0]
    assert all(not h.requires_grad for pair in lm.encoder.hidden for h in pair)
    assert not torch.allclose(lm(x)[0], first), "the second call starts from the carried state"
    lm.reset()
    assert torch.allclose(lm(x)[0], first)


@pytest.mark.parametrize("make, n_groups", [(small_lm, 4), (small_classifier, 5)])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_freeze_to_leaves_exactly_the_last_n_groups_trainable(make, n_groups, n):
    model = make()
    groups = layer_groups(model)
    assert len(groups) == n_groups
    assert sum(len(g) for g in groups) == len(list(model.parameters())), "every parameter in one group"
    freeze_to(model, -n)
    trainable = [all(p.requires_grad for p in g) for g in groups]
    frozen = [not any(p.requires_grad for p in g) for g in groups]
    assert trainable == [False] * (n_groups - n) + [True] * n
    assert all(t or f for t, f in zip(trainable, frozen))
    freeze_to(model, 0)
    assert all(p.requires_grad for p in model.parameters())


def test_bpt3c_chunked_pooling_equals_pooling_the_whole_sequence():
    whole, chunked = small_classifier(bptt=1000), small_classifier(bptt=7)
    chunked.load_state_dict(whole.state_dict())
    whole.eval(), chunked.eval()
    x = torch.randint(4, V, (3, 40))
    lengths = torch.tensor([40, 33, 9])
    for i, n in enumerate(lengths):
        x[i, n:] = 0
    assert torch.allclose(whole.encode(x, lengths), chunked.encode(x, lengths), atol=1e-6)


def test_bpt3c_keeps_gradients_only_for_the_last_max_len_tokens():
    model = small_classifier(bptt=5, max_len=10).train()
    x = torch.randint(4, V, (2, 40))
    lengths = torch.tensor([40, 40])
    model(x, lengths).sum().backward()
    # the embedding rows of tokens seen only in the first 30 positions get no gradient
    early_only = set(x[:, :30].flatten().tolist()) - set(x[:, 25:].flatten().tolist())
    grads = model.encoder.embed.weight.grad
    assert early_only and all(grads[t].abs().sum() == 0 for t in early_only)


def test_masked_pooling_ignores_extra_padding():
    model = small_classifier().eval()
    x = torch.randint(4, V, (2, 12))
    lengths = torch.tensor([12, 7])
    x[1, 7:] = 0
    padded = torch.cat([x, torch.zeros(2, 9, dtype=torch.long)], dim=1)
    assert torch.allclose(model(x, lengths), model(padded, lengths), atol=1e-6)


def test_concat_pool_is_last_max_mean_of_real_tokens():
    out = torch.tensor([[[1.0], [5.0], [3.0], [100.0]]])
    mask = torch.tensor([[True, True, True, False]])
    pooled = concat_pool(out, mask, torch.tensor([2]))
    assert pooled.tolist() == [[3.0, 5.0, 3.0]]


def test_classifier_head_is_two_batchnorm_dropout_linear_blocks():
    head = small_classifier().head
    kinds = [type(m).__name__ for m in head]
    assert kinds == ["BatchNorm1d", "Dropout", "Linear", "ReLU", "BatchNorm1d", "Dropout", "Linear"]
    assert head[2].in_features == 3 * E and head[2].out_features == 50 and head[6].out_features == 3
    assert head[5].p == 0.1


def test_vocab_transfer_copies_shared_rows_and_mean_initialises_new_ones():
    lm = small_lm()
    old = [f"p{i}" for i in range(V)]
    new = ["p3", "fresh", "p0", "p39", "other"]
    state, copied = transfer_vocab(lm.state_dict(), old, new)
    assert copied == 3
    emb, bias = lm.encoder.embed.weight.detach(), lm.decoder.bias.detach()
    w = state["encoder.embed.weight"]
    assert w.shape == (5, E)
    assert torch.equal(w[0], emb[3]) and torch.equal(w[2], emb[0]) and torch.equal(w[3], emb[39])
    assert torch.allclose(w[1], emb.mean(0)) and torch.allclose(w[4], emb.mean(0))
    assert torch.allclose(state["decoder.bias"][1], bias.mean())
    target = LanguageModel(lm_config(5, emb_size=E, hidden_size=H))
    target.load_state_dict(state)  # shapes fit the new vocabulary
    assert target.decoder.weight is target.encoder.embed.weight


def test_classifier_predictions_are_thread_safe():
    """A model server calls predict from many threads; no state may be shared between calls."""
    from concurrent.futures import ThreadPoolExecutor

    model = small_classifier(bptt=4).eval()
    torch.manual_seed(1)
    batches = [torch.randint(4, V, (3, 10 + i)) for i in range(16)]
    lengths = [torch.tensor([x.size(1)] * 3) for x in batches]
    with torch.no_grad():
        alone = [model(x, n) for x, n in zip(batches, lengths)]
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda args: model(*args), zip(batches, lengths)))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(alone, together))
