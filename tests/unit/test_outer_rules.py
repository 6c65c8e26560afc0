"""Delayed Nesterov, the outer rule of buffered async DiLoCo with k < N: pure tensor math."""

from __future__ import annotations

import torch

from stalwart.elastic.async_outer import Buffered
from stalwart.elastic.outer_rules import Pending, delayed_nesterov


def _deltas(seed: int, n: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(4, 3, generator=g), torch.randn(5, generator=g)] for _ in range(n)]


def test_a_full_round_every_version_is_torch_nesterov_bit_for_bit() -> None:
    """Mass 1 per version (k = N) is exactly SGD(nesterov=True): sync DiLoCo's step."""
    start = [torch.randn(4, 3), torch.randn(5)]
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    opt = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True)
    mine = [t.clone() for t in start]
    bufs: list[torch.Tensor | None] = [None, None]
    pending = Pending()
    for delta in _deltas(0, 5):
        for p, d in zip(ref, delta, strict=True):
            p.grad = d.clone()
        opt.step()
        assert delayed_nesterov(mine, delta, bufs, pending, mass=1.0, lr=0.7, beta=0.9)
        for a, b in zip(ref, mine, strict=True):
            assert torch.equal(a.detach(), b)
        for p, b in zip(ref, bufs, strict=True):
            assert torch.equal(opt.state[p]["momentum_buffer"], b)
    assert pending.rounds == 5 and pending.acc is None


def test_partial_versions_step_without_momentum_until_a_round_completes() -> None:
    """k=2 of 4 members: mass 1/2 per version, the momentum moves on every second version."""
    lr, beta = 0.5, 0.9
    theta = [torch.zeros(4, 3, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)]
    bufs: list[torch.Tensor | None] = [None, None]
    pending = Pending()
    d1, d2, d3, d4 = ([t.double() for t in d] for d in _deltas(1, 4))
    assert not delayed_nesterov(theta, d1, bufs, pending, mass=0.5, lr=lr, beta=beta)
    assert bufs == [None, None] and pending.mass == 0.5
    assert torch.allclose(theta[0], -lr * 0.5 * d1[0])  # plain SGD, half a round
    assert delayed_nesterov(theta, d2, bufs, pending, mass=0.5, lr=lr, beta=beta)
    m1 = (d1[0] + d2[0]) / 2  # the round's average
    assert torch.allclose(bufs[0], m1)
    want = -lr * 0.5 * (d1[0] + d2[0]) - lr * beta * m1
    assert torch.allclose(theta[0], want)
    delayed_nesterov(theta, d3, bufs, pending, mass=0.5, lr=lr, beta=beta)
    delayed_nesterov(theta, d4, bufs, pending, mass=0.5, lr=lr, beta=beta)
    m2 = beta * m1 + (d3[0] + d4[0]) / 2
    assert torch.allclose(bufs[0], m2)
    want = want - lr * 0.5 * (d3[0] + d4[0]) - lr * beta * m2
    assert torch.allclose(theta[0], want) and pending.rounds == 2


def test_per_sample_step_is_that_of_the_synchronous_rule() -> None:
    """Equal pseudo-gradients: N/k partial versions move θ as far as one round at mass 1."""
    g = [torch.ones(3)]
    sync, delayed = [torch.zeros(3)], [torch.zeros(3)]
    bs: list[torch.Tensor | None] = [None]
    bd: list[torch.Tensor | None] = [None]
    ps, pd = Pending(), Pending()
    for _ in range(4):  # 4 rounds; k=2 of N=3 makes 6 versions of mass 2/3
        delayed_nesterov(sync, g, bs, ps, mass=1.0, lr=0.7, beta=0.9)
    for _ in range(6):
        delayed_nesterov(delayed, g, bd, pd, mass=2 / 3, lr=0.7, beta=0.9)
    assert pd.rounds == 4 and torch.allclose(sync[0], delayed[0])


def test_the_pending_round_survives_a_version_record() -> None:
    pending = Pending()
    theta = [torch.zeros(2)]
    delayed_nesterov(theta, [torch.ones(2)], [None], pending, mass=0.25, lr=1.0, beta=0.9)
    again = Pending.from_state(pending.state_dict())
    assert again.mass == 0.25 and torch.equal(again.acc[0], pending.acc[0])
    assert Pending.from_state(None).acc is None


def test_the_defaults_below_n_and_at_n() -> None:
    assert Buffered(k=2).delayed(3) and not Buffered(k=3).delayed(3)
    assert not Buffered(k=5).delayed(3) and not Buffered().delayed(1)
    assert Buffered(k=3, rule="delayed").delayed(3)
    assert not Buffered(k=2, rule="per-version").delayed(3)
    # compute-aware H by default only at k = N (below, equal phase times leave one out)
    assert Buffered(k=3).compute_aware_for(3) and not Buffered(k=2).compute_aware_for(3)
    assert Buffered(k=2, compute_aware=True).compute_aware_for(3)


def test_a_version_of_more_than_n_contributions_ends_two_rounds() -> None:
    """A member that posted two phases into one buffer: 4 of 3 members' worth after 2/3 of a
    round ends two rounds (the second is this version's own average), and over any mix of
    1-4 contributions a version there is one momentum update per 3 contributions."""
    lr, beta = 0.5, 0.9
    theta = [torch.zeros(4, 3, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)]
    bufs: list[torch.Tensor | None] = [None, None]
    pending = Pending()
    d1, d2 = ([t.double() for t in d] for d in _deltas(2, 2))
    assert delayed_nesterov(theta, d1, bufs, pending, mass=2 / 3, lr=lr, beta=beta) == 0
    assert delayed_nesterov(theta, d2, bufs, pending, mass=4 / 3, lr=lr, beta=beta) == 2
    m1 = (2 / 3 * d1[0] + 1 / 3 * d2[0]) / 1  # round 1: all of d1's mass, a third of d2
    m2 = beta * m1 + d2[0]  # round 2: the rest of d2, one whole round
    assert torch.allclose(bufs[0], m2)
    want = -lr * (2 / 3 * d1[0] + 4 / 3 * d2[0]) - lr * beta * (m1 + m2)
    assert torch.allclose(theta[0], want)
    assert pending.rounds == 2 and pending.acc is None and pending.mass == 0.0
    g = torch.Generator().manual_seed(3)
    pending, bufs, theta = Pending(), [None], [torch.zeros(3)]
    used = rounds = 0
    for n in torch.randint(1, 5, (200,), generator=g).tolist():
        rounds += delayed_nesterov(theta, [torch.ones(3)], bufs, pending, mass=n / 3, lr=0.1,
                                   beta=0.9)  # fmt: skip
        used += n
        assert rounds == used // 3 == pending.rounds
