"""A decoder-only transformer language model of the kind torchtitan and nanoGPT train, small
enough for CPU runs: pre-norm blocks of causal self-attention and a SwiGLU feed-forward,
RMSNorm, learned positions, the output layer tied to the embedding."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} must be a multiple of heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, dim = x.shape
        q, k, v = (t.view(n, length, self.heads, dim // self.heads).transpose(1, 2)
                   for t in self.qkv(x).split(dim, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(n, length, dim))


class SwiGLU(nn.Module):
    """LLaMA's feed-forward: w2(silu(w1 x) * w3 x), hidden 8/3 of dim rounded up to 16."""

    def __init__(self, dim: int):
        super().__init__()
        hidden = 16 * math.ceil(8 * dim / 3 / 16)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = CausalSelfAttention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.ffn = SwiGLU(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class DecoderLM(nn.Module):
    """N x L token ids (L <= context) -> N x L x vocab logits of the next token. Weights are
    drawn as GPT-2's: normal(0, 0.02), the residual projections scaled by 1/sqrt(2 layers).
    The blocks are an nn.ModuleDict, as torchtitan keeps them (FSDP2 units by name)."""

    def __init__(self, vocab: int, context: int = 64, dim: int = 96, layers: int = 4,
                 heads: int = 4):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(context, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads) for i in range(layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.output.weight = self.embedding.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                scale = 1 / math.sqrt(2 * layers) if name.endswith(("out.weight", "w2.weight")) else 1.0
                nn.init.normal_(p, std=0.02 * scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > self.position.num_embeddings:
            raise ValueError(f"sequences of {ids.shape[1]} tokens exceed the context of "
                             f"{self.position.num_embeddings}")
        x = self.embedding(ids) + self.position(torch.arange(ids.shape[1], device=ids.device))
        for block in self.layers.values():
            x = block(x)
        return self.output(self.norm(x))
