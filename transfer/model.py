"""AWD-LSTM (Merity et al. 2017) language model and the ULMFiT classifier (Howard & Ruder 2018).

Shapes: `bs` = batch size, `T` = time steps, `V` = vocab size, `E` = embedding size, `H` = hidden size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "AWDLSTMConfig", "lm_config", "classifier_config", "RNNDropout", "WeightDropout", "EmbeddingDropout",
    "AWDLSTM", "LanguageModel", "TextClassifier", "concat_pool", "layer_groups", "freeze_to",
    "transfer_vocab",
]

# fastai's awd_lstm_lm_config / awd_lstm_clas_config, before drop_mult scaling
LM_DROPOUTS = dict(input_p=0.25, output_p=0.1, weight_p=0.2, embed_p=0.02, hidden_p=0.15)
CLAS_DROPOUTS = dict(input_p=0.4, output_p=0.4, weight_p=0.5, embed_p=0.05, hidden_p=0.3)


@dataclass(frozen=True)
class AWDLSTMConfig:
    vocab_size: int
    emb_size: int = 400  # E; also the last LSTM layer's output size, so the decoder can be tied
    hidden_size: int = 1152  # H of the inner layers
    n_layers: int = 3
    pad_id: int = 0
    input_p: float = 0.25  # locked dropout on the embedding output
    output_p: float = 0.1  # LM: locked dropout before the decoder; classifier: head's first dropout
    weight_p: float = 0.2  # DropConnect on LSTM hidden-to-hidden weights
    embed_p: float = 0.02  # drops whole vocabulary rows
    hidden_p: float = 0.15  # locked dropout between LSTM layers

    def to_dict(self) -> dict:
        return asdict(self)


def _scaled(cfg: AWDLSTMConfig, base: dict, drop_mult: float) -> AWDLSTMConfig:
    return replace(cfg, **{k: v * drop_mult for k, v in base.items()})


def lm_config(vocab_size: int, drop_mult: float = 1.0, **sizes) -> AWDLSTMConfig:
    """Language-model config: fastai's LM dropouts times `drop_mult`."""
    return _scaled(AWDLSTMConfig(vocab_size, **sizes), LM_DROPOUTS, drop_mult)


def classifier_config(vocab_size: int, drop_mult: float = 0.5, **sizes) -> AWDLSTMConfig:
    """Classifier config: fastai's classifier dropouts times `drop_mult` (0.5 by default)."""
    return _scaled(AWDLSTMConfig(vocab_size, **sizes), CLAS_DROPOUTS, drop_mult)


class RNNDropout(nn.Module):
    """Locked (variational) dropout: one mask of shape (bs, 1, features), shared over time."""

    def __init__(self, p: float = 0.5):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        mask = x.new_empty(x.size(0), 1, x.size(2)).bernoulli_(1 - self.p) / (1 - self.p)
        return x * mask


class WeightDropout(nn.Module):
    """DropConnect on an LSTM's `weight_hh_l0`: a fresh mask on the raw weight every training forward."""

    def __init__(self, lstm: nn.LSTM, weight_p: float, layer_name: str = "weight_hh_l0"):
        super().__init__()
        self.module, self.weight_p, self.layer_name = lstm, weight_p, layer_name
        raw = getattr(lstm, layer_name)
        self.register_parameter(f"{layer_name}_raw", nn.Parameter(raw.data))
        # the LSTM keeps a plain tensor under the old name, rewritten before each forward
        del lstm._parameters[layer_name]
        setattr(lstm, layer_name, raw.data.clone())

    def _set_weight(self) -> None:
        raw = getattr(self, f"{self.layer_name}_raw")
        # always a plain tensor: assigning the Parameter itself would register it a second time
        dropping = self.training and self.weight_p > 0
        w = F.dropout(raw, p=self.weight_p, training=True) if dropping else raw * 1.0
        setattr(self.module, self.layer_name, w)  # RNNBase.__setattr__ refreshes its flat weights

    def forward(self, *args):
        self._set_weight()
        return self.module(*args)


class EmbeddingDropout(nn.Module):
    """Drops whole rows of the embedding matrix (whole words) and rescales the rest by 1/(1-p)."""

    def __init__(self, emb: nn.Embedding, embed_p: float):
        super().__init__()
        self.emb, self.embed_p = emb, embed_p

    def forward(self, words: torch.Tensor) -> torch.Tensor:
        w = self.emb.weight
        if self.training and self.embed_p != 0:
            mask = w.new_empty(w.size(0), 1).bernoulli_(1 - self.embed_p) / (1 - self.embed_p)
            w = w * mask
        return F.embedding(words, w, self.emb.padding_idx)


class AWDLSTM(nn.Module):
    """The encoder: embedding -> 3 weight-dropped LSTMs, hidden state carried between calls."""

    def __init__(self, cfg: AWDLSTMConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.emb_size, padding_idx=cfg.pad_id)
        self.embed.weight.data.uniform_(-0.1, 0.1)
        self.embed.weight.data[cfg.pad_id].zero_()
        self.embed_dp = EmbeddingDropout(self.embed, cfg.embed_p)
        sizes = [cfg.emb_size] + [cfg.hidden_size] * (cfg.n_layers - 1) + [cfg.emb_size]
        self.rnns = nn.ModuleList(
            WeightDropout(nn.LSTM(sizes[i], sizes[i + 1], batch_first=True), cfg.weight_p)
            for i in range(cfg.n_layers)
        )
        self.input_dp = RNNDropout(cfg.input_p)
        self.hidden_dps = nn.ModuleList(RNNDropout(cfg.hidden_p) for _ in range(cfg.n_layers - 1))
        self.hidden: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def reset(self) -> None:
        """Forget the carried state (epoch boundaries, new documents)."""
        self.hidden = None

    def _init_hidden(self, bs: int, like: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(like.new_zeros(1, bs, rnn.module.hidden_size), like.new_zeros(1, bs, rnn.module.hidden_size))
                for rnn in self.rnns]

    def step(self, x: torch.Tensor, hidden: list[tuple[torch.Tensor, torch.Tensor]] | None,
             ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """x: (bs, T) token ids, state in -> (last layer's output (bs, T, E), detached state out).

        Keeps no state on the module, so concurrent callers (a model server's threads) cannot mix states.
        """
        out = self.input_dp(self.embed_dp(x))
        if hidden is None or hidden[0][0].size(1) != x.size(0):
            hidden = self._init_hidden(x.size(0), out)
        new_hidden = []
        for i, rnn in enumerate(self.rnns):
            out, h = rnn(out, hidden[i])
            new_hidden.append((h[0].detach(), h[1].detach()))  # truncated BPTT
            if i < len(self.hidden_dps):
                out = self.hidden_dps[i](out)
        return out, new_hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Stateful form for language modelling: the state is carried across calls until `reset()`."""
        out, self.hidden = self.step(x, self.hidden)
        return out


class LanguageModel(nn.Module):
    """AWD-LSTM encoder + a decoder tied to the embedding (the same Parameter)."""

    def __init__(self, cfg: AWDLSTMConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = AWDLSTM(cfg)
        self.output_dp = RNNDropout(cfg.output_p)
        self.decoder = nn.Linear(cfg.emb_size, cfg.vocab_size)
        self.decoder.weight = self.encoder.embed.weight
        nn.init.zeros_(self.decoder.bias)

    def reset(self) -> None:
        self.encoder.reset()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (logits (bs, T, V), raw last-layer output, dropped output); the last two feed TAR and AR."""
        raw = self.encoder(x)
        dropped = self.output_dp(raw)
        return self.decoder(dropped), raw, dropped


def concat_pool(out: torch.Tensor, mask: torch.Tensor, last_idx: torch.Tensor) -> torch.Tensor:
    """Masked `[h_T, max, mean]` over time. out (bs, T, E); mask (bs, T) True on real tokens; last_idx (bs,)."""
    m = mask.unsqueeze(-1)
    last = out[torch.arange(out.size(0), device=out.device), last_idx]
    mx = out.masked_fill(~m, float("-inf")).max(dim=1).values
    mean = (out * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)
    return torch.cat([last, mx, mean], dim=1)


def _lin_bn_drop(n_in: int, n_out: int, p: float, act: bool) -> list[nn.Module]:
    layers: list[nn.Module] = [nn.BatchNorm1d(n_in), nn.Dropout(p), nn.Linear(n_in, n_out)]
    return layers + [nn.ReLU(inplace=True)] if act else layers


class TextClassifier(nn.Module):
    """BPT3C encoder + concat pooling + two BatchNorm-Dropout-Linear blocks."""

    def __init__(self, cfg: AWDLSTMConfig, n_classes: int, bptt: int = 70, max_len: int = 1440,
                 head_hidden: int = 50):
        super().__init__()
        self.cfg, self.n_classes, self.bptt, self.max_len = cfg, n_classes, bptt, max_len
        self.encoder = AWDLSTM(cfg)
        self.head = nn.Sequential(*_lin_bn_drop(3 * cfg.emb_size, head_hidden, cfg.output_p, act=True),
                                  *_lin_bn_drop(head_hidden, n_classes, 0.1, act=False))

    def encode(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Right-padded x (bs, T) -> pooled features (bs, 3E), reading bptt-sized chunks with carried state.

        Only each document's last `max_len` tokens are pooled; chunks that hold none of them run without
        gradients (BPT3C). Right padding keeps real-token outputs independent of how much padding follows.
        """
        T = x.size(1)
        window_start = (lengths - self.max_len).clamp(min=0)
        outs, positions, hidden = [], [], None
        for i in range(0, T, self.bptt):
            j = min(i + self.bptt, T)
            needed = bool(((window_start < j) & (lengths > i)).any())
            with torch.set_grad_enabled(needed and torch.is_grad_enabled()):
                o, hidden = self.encoder.step(x[:, i:j], hidden)
            if needed:
                outs.append(o)
                positions.append(torch.arange(i, j, device=x.device))
        out, pos = torch.cat(outs, dim=1), torch.cat(positions)
        mask = (pos[None, :] >= window_start[:, None]) & (pos[None, :] < lengths[:, None])
        last_idx = torch.searchsorted(pos, (lengths - 1).contiguous())
        return concat_pool(out.float(), mask, last_idx)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.head(self.encode(x, lengths))


def layer_groups(model: nn.Module) -> list[list[nn.Parameter]]:
    """Parameter groups for discriminative LRs, lowest first.

    LM: [rnn1, rnn2, rnn3, embedding + decoder]; classifier: [embedding, rnn1, rnn2, rnn3, head].
    """
    rnns = [list(r.parameters()) for r in model.encoder.rnns]
    if isinstance(model, LanguageModel):  # decoder.weight is the embedding: listed once
        return rnns + [list(model.encoder.embed.parameters()) + [model.decoder.bias]]
    if isinstance(model, TextClassifier):
        return [list(model.encoder.embed.parameters())] + rnns + [list(model.head.parameters())]
    raise TypeError(f"no layer groups for {type(model).__name__}")


def freeze_to(model: nn.Module, n: int) -> None:
    """Make exactly the groups from index `n` on trainable (n=-2: the last two groups)."""
    groups = layer_groups(model)
    n = n % len(groups) if n < 0 else n
    for i, group in enumerate(groups):
        for p in group:
            p.requires_grad_(i >= n)


def transfer_vocab(state: dict[str, torch.Tensor], old_pieces: list[str], new_pieces: list[str],
                   ) -> tuple[dict[str, torch.Tensor], int]:
    """Re-index embedding-shaped tensors from `old_pieces` to `new_pieces`.

    Pieces in both vocabularies keep their rows; new pieces get the mean row. Returns (state, rows copied).
    """
    old_index = {p: i for i, p in enumerate(old_pieces)}
    pairs = [(new, old_index[p]) for new, p in enumerate(new_pieces) if p in old_index]
    new_idx = torch.tensor([n for n, _ in pairs], dtype=torch.long)
    old_idx = torch.tensor([o for _, o in pairs], dtype=torch.long)
    out = dict(state)
    for key, t in state.items():
        if t.dim() >= 1 and t.size(0) == len(old_pieces) and key.endswith(("embed.weight", "emb.weight", "decoder.weight",
                                                                             "decoder.bias")):
            fresh = t.mean(dim=0, keepdim=True).expand(len(new_pieces), *t.shape[1:]).clone()
            if len(pairs):
                fresh[new_idx] = t[old_idx]
            out[key] = fresh
    return out, len(pairs)
