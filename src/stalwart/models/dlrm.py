"""A small DLRM on synthetic click-through data: 8 embedding tables (EmbeddingBag, dim 16),
13 dense features, bottom MLP 13->64->16, dot interaction (36 pairs), top MLP 52->64->32->1."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stalwart.models.base import ReferenceModel, register

__all__ = ["CARDINALITIES", "DLRM", "ctr_data"]

CARDINALITIES = (1000, 500, 200, 100, 50, 1000, 300, 20)


class DLRM(nn.Module):
    """``forward(dense (B, 13), ids (B, 8))`` returns one click logit per input, (B,)."""

    li: torch.Tensor
    lj: torch.Tensor

    def __init__(self, cards: tuple[int, ...] = CARDINALITIES, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.ModuleList(nn.EmbeddingBag(c, dim, mode="sum") for c in cards)
        self.bottom = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, dim), nn.ReLU())
        n = len(cards) + 1
        li, lj = torch.triu_indices(n, n, offset=1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)
        pairs = n * (n - 1) // 2
        self.top = nn.Sequential(
            nn.Linear(pairs + dim, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1)
        )

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        vecs = [x] + [e(ids[:, t : t + 1]) for t, e in enumerate(self.emb)]
        t = torch.stack(vecs, dim=1)  # (B, 9, dim)
        z = torch.bmm(t, t.transpose(1, 2))[:, self.li, self.lj]  # (B, 36)
        return self.top(torch.cat([x, z], dim=1)).squeeze(1)


def ctr_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense features, categorical ids and 0/1 clicks from an additive-plus-pairwise logit."""
    g = torch.Generator().manual_seed(seed)
    w = torch.Generator().manual_seed(1234)  # the generator's fixed "true" model
    effects = [torch.randn(c, generator=w) * 0.8 for c in CARDINALITIES]
    wd = torch.randn(13, generator=w) * 0.3
    pair = torch.randn(CARDINALITIES[0] % 50 + 50, CARDINALITIES[4], generator=w) * 0.5
    dense = torch.randn(n, 13, generator=g)
    # Zipf-like ids: a few rows are read often, most rarely
    ids = torch.stack(
        [(torch.rand(n, generator=g) ** 3 * c).long().clamp_max(c - 1) for c in CARDINALITIES], 1
    )
    logit = sum(e[ids[:, i]] for i, e in enumerate(effects)) + dense @ wd
    logit = logit + pair[ids[:, 0] % pair.shape[0], ids[:, 4]] - 1.0
    clicks = (torch.rand(n, generator=g) < torch.sigmoid(logit)).long()
    return dense, ids, clicks


@register("dlrm")
def dlrm(train: bool = True) -> ReferenceModel:
    """The mini-DLRM trained 3 epochs on 16,384 synthetic impressions; AUC on 4,096."""
    torch.manual_seed(0)
    model = DLRM()
    if train:
        dense, ids, y = ctr_data(16384, seed=1)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(2)
        for _ in range(3):
            for idx in torch.randperm(len(y), generator=g).split(256):
                opt.zero_grad()
                F.binary_cross_entropy_with_logits(
                    model(dense[idx], ids[idx]), y[idx].float()
                ).backward()
                opt.step()
    dense, ids, y = ctr_data(4096, seed=3)
    return ReferenceModel(
        "dlrm", model.eval(), (dense, ids), y, ("decision", "ctr>0.01", "auc-drop>0.001"), "auc"
    )
