"""A small Llama-style transformer with torchtitan's module names (tok_embeddings, layers.N.attention.wq, ...
feed_forward.w1/w2/w3, norm, output), so torchtitan-style plans apply by name."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Attention", "FeedForward", "LlamaConfig", "TinyLlama", "TransformerBlock"]


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        scores = torch.softmax(q @ k.transpose(-2, -1) / self.head_dim**0.5, dim=-1)
        out = (scores @ v).transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32
    dim: int = 16
    n_heads: int = 4
    hidden_dim: int = 32
    n_layers: int = 2


class TinyLlama(nn.Module):
    """Embedding, `n_layers` pre-norm blocks (attention + SwiGLU feed-forward), final norm and output projection."""

    def __init__(self, config: LlamaConfig | None = None):
        super().__init__()
        self.config = config = config or LlamaConfig()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config.dim, config.n_heads, config.hidden_dim)
                                     for i in range(config.n_layers)})
        self.norm = nn.RMSNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))
