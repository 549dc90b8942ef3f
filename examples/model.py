"""A compact GPT-style language model in plain PyTorch, and synthetic token data."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab_size: int = 256, seq_len: int = 32, d_model: int = 128, n_heads: int = 4,
                 n_layers: int = 2):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def example_inputs(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A synthetic batch (tokens, targets) for tracing the step (see spmdzero.aot)."""
        vocab, seq = self.tok.num_embeddings, self.pos.num_embeddings
        tokens = torch.randint(0, vocab, (batch_size, seq + 1))
        return tokens[:, :-1], tokens[:, 1:]

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class SyntheticTokens(torch.utils.data.Dataset):
    """Sequences from a fixed random bigram rule, so a model can learn them: each token is
    followed by one of two successors drawn from a table."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        successors = torch.randint(0, vocab_size, (vocab_size, 2), generator=g)
        seqs = torch.empty(num_samples, seq_len + 1, dtype=torch.long)
        seqs[:, 0] = torch.randint(0, vocab_size, (num_samples,), generator=g)
        choice = torch.randint(0, 2, (num_samples, seq_len), generator=g)
        for t in range(seq_len):
            seqs[:, t + 1] = successors[seqs[:, t], choice[:, t]]
        self.inputs, self.targets = seqs[:, :-1], seqs[:, 1:]

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i):
        return self.inputs[i], self.targets[i]
