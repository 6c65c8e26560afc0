"""GNN graph inputs as targets: node features and edge weights of the reference GCN."""

from __future__ import annotations

import torch

from stalwart import inject, vulnerability
from stalwart.models.gcn import GCN, edge_elements, sbm_graph


def _gcn() -> tuple[GCN, torch.Tensor]:
    torch.manual_seed(0)
    adj, x, _ = sbm_graph(per_class=30)
    return GCN(adj).eval(), x


def test_edge_weight_faults_hit_edges_only_and_undo() -> None:
    model, x = _gcn()
    golden, adj0 = model(x), model.adj.clone()
    edges = edge_elements(model.adj)
    faults = vulnerability.sample_faults(
        model, 40, targets="adj", buffers=True, elements={"adj": edges}, seed=1
    )
    assert {f.index for f in faults} <= set(edges.tolist())
    assert faults.population == {"adj": len(edges) * 32}
    with inject.apply_faults(model, faults.faults[:1]) as inj:
        (change,) = inj.changes
        assert model.adj.reshape(-1)[change.index] != adj0.reshape(-1)[change.index]
    assert torch.equal(model.adj.view(torch.int32), adj0.view(torch.int32))
    res = vulnerability.run_campaign(
        model, x, faults, ["top1", "dev>0.05"], independent_samples=False
    )
    naive = vulnerability.run_campaign(
        model, x, faults, ["top1", "dev>0.05"], independent_samples=False, engine="naive"
    )
    assert (res.failed["top1"] == naive.failed["top1"]).all()
    assert res.failed["top1"].any()  # exponent flips in edge weights do change answers
    assert torch.equal(model(x), golden)


def test_node_feature_faults_reach_neighbours() -> None:
    model, x = _gcn()
    golden = model(x)
    node = 5
    fault = inject.Fault("features", index=3, mask=1 << 30, kind="activation", sample=node)
    with inject.activation_faults(model, [fault]):
        out = model(x)
    changed = (out != golden).any(1).nonzero().flatten().tolist()
    neighbours = model.adj[node].nonzero().flatten().tolist()
    assert node in changed and set(changed) - {node}  # message passing spreads the fault
    assert set(changed) <= set((model.adj @ model.adj)[node].nonzero().flatten().tolist())
    assert neighbours
    assert torch.equal(model(x), golden)
    faults = vulnerability.sample_activation_faults(model, (x,), 30, modules="features", seed=0)
    res = vulnerability.run_campaign(model, x, faults, "top1", independent_samples=False)
    report = vulnerability.estimate(res, "tensor")
    assert report.table.column("group").to_pylist() == ["features"]
    assert res.failed["top1"].any()
