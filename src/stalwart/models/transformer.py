"""A small transformer classifier on a synthetic sequence task: which of tokens 0-3 is
the most frequent in a sequence of 16 tokens (vocabulary 16). One pre-norm block with
2-head self-attention written out in plain ops (so ``torch.fx`` traces it), mean pooling."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stalwart.models.base import ReferenceModel, register

__all__ = ["TinyTransformer", "count_task"]

LENGTH, VOCAB, DIM, HEADS = 16, 16, 32, 2


class TinyTransformer(nn.Module):
    """``forward(tokens (B, 16))`` returns class scores (B, 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(LENGTH, DIM) * 0.1)
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.ff1 = nn.Linear(DIM, 2 * DIM)
        self.ff2 = nn.Linear(2 * DIM, DIM)
        self.head = nn.Linear(DIM, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        shape = (tokens.shape[0], LENGTH, HEADS, DIM // HEADS)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / (DIM // HEADS) ** 0.5, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(tokens.shape[0], LENGTH, DIM))
        x = x + self.ff2(F.gelu(self.ff1(self.norm2(x))))
        return self.head(x.mean(1))


def count_task(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences and the most frequent of tokens 0-3 (ties to the lowest)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    counts = torch.stack([(tokens == t).sum(1) for t in range(4)], 1)
    return tokens, counts.argmax(1)


@register("transformer")
def transformer(train: bool = True) -> ReferenceModel:
    """The tiny transformer trained on 8,192 sequences; accuracy on 512."""
    torch.manual_seed(0)
    model = TinyTransformer()
    if train:
        x, y = count_task(8192, seed=1)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(2)
        for _ in range(5):
            for idx in torch.randperm(len(y), generator=g).split(128):
                opt.zero_grad()
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
    x, y = count_task(512, seed=3)
    return ReferenceModel("transformer", model.eval(), (x,), y, ("top1", "deviation"), "accuracy")
