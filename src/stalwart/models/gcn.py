"""A two-layer GCN on a generated stochastic block-model graph (4 classes x 150 nodes).

Graph inputs are fault targets: the normalized adjacency ``D^-1/2 (A + I) D^-1/2`` is a
dense buffer (``adj``), so edge-weight faults are buffer faults (:func:`edge_elements`
restricts them to the graph's edges); node features pass through ``features`` (an
``nn.Identity``), so activation faults there corrupt one node's input features (``sample``
is the node). Adjacency *indices* of a sparse (COO/CSR) graph are out of scope: this
graph is dense, and its values are what a fault hits. Nodes exchange messages, so one
node's fault reaches others: campaigns must use ``independent_samples=False``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stalwart.models.base import ReferenceModel, register

__all__ = ["GCN", "edge_elements", "sbm_graph"]


class GCN(nn.Module):
    """``forward(x (N, F))`` returns class scores per node, (N, classes)."""

    def __init__(
        self, adj: torch.Tensor, features: int = 32, hidden: int = 16, classes: int = 4
    ) -> None:
        super().__init__()
        self.register_buffer("adj", adj)
        self.features = nn.Identity()  # a hook point: node-feature faults are its outputs
        self.lin1 = nn.Linear(features, hidden)
        self.lin2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.adj @ self.lin1(self.features(x)))
        return self.adj @ self.lin2(h)


def edge_elements(adj: torch.Tensor) -> torch.Tensor:
    """Flat indices of the adjacency's stored edges (nonzero entries, self-loops included):
    pass as ``sample_faults(..., elements={"adj": edge_elements(model.adj)})`` so faults hit
    edge weights, not the zeros between unconnected nodes."""
    return adj.reshape(-1).nonzero().flatten()


def sbm_graph(
    classes: int = 4, per_class: int = 150, p_in: float = 0.05, p_out: float = 0.004, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalized adjacency (N, N), noisy 32-dim features and labels of an SBM graph."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(classes).repeat_interleave(per_class)
    same = y[:, None] == y[None, :]
    a = (torch.rand(len(y), len(y), generator=g) < torch.where(same, p_in, p_out)).float()
    a = torch.triu(a, 1)
    a = a + a.T + torch.eye(len(y))
    d = a.sum(1).rsqrt()
    means = torch.randn(classes, 32, generator=g)
    x = means[y] + 2.0 * torch.randn(len(y), 32, generator=g)
    return d[:, None] * a * d[None, :], x, y


@register("gcn")
def gcn(train: bool = True) -> ReferenceModel:
    """The GCN trained on 20 labelled nodes per class; accuracy over all 600 nodes."""
    torch.manual_seed(0)
    adj, x, y = sbm_graph()
    model = GCN(adj)
    if train:
        g = torch.Generator().manual_seed(1)
        mask = torch.zeros(len(y), dtype=torch.bool)
        for c in range(4):
            idx = (y == c).nonzero().flatten()
            mask[idx[torch.randperm(len(idx), generator=g)[:20]]] = True
        opt = torch.optim.Adam(model.parameters(), lr=0.02, weight_decay=5e-4)
        for _ in range(150):
            opt.zero_grad()
            F.cross_entropy(model(x)[mask], y[mask]).backward()
            opt.step()
    return ReferenceModel(
        "gcn", model.eval(), (x,), y, ("top1", "deviation"), "accuracy", independent_samples=False
    )
