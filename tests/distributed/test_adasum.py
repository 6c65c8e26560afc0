"""Adasum: the operator's properties, the distributed tree on 2-5 gloo ranks against the
one-process reference (bit for bit, the same bytes on every rank), the DDP comm hook, and the
elastic job with ``reduce="adasum"`` (fixed world, and ``stalwart run`` with a worker killed
inside the reduction)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stalwart.elastic import Job, read_events
from stalwart.elastic.events import EventKind
from stalwart.elastic.reduce import adasum_pair, adasum_reference
from stalwart.errors import ConfigError
from stalwart.testing import Kill, KillSchedule, run_ranks

from . import adasum_ranks

pytestmark = pytest.mark.timeout(180)

WORKER = Path(adasum_ranks.__file__)


# -- the operator (no processes) -------------------------------------------------------------


def test_orthogonal_gradients_add() -> None:
    a, b = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, -2.0, 0.5])
    assert torch.equal(adasum_pair(a, b), a + b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_equal_gradients_give_themselves_back(dtype: torch.dtype) -> None:
    a = torch.randn(6, 5, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = adasum_pair(a, a.clone())
    assert out.dtype == dtype and torch.equal(out, a)


def test_parallel_gradients_of_different_length() -> None:
    a = torch.tensor([1.0, 2.0, -1.0])
    # a·b = 2|a|²: a's coefficient is 1, b's is 1/4, so the result is 3/4 b = 1.5 a
    torch.testing.assert_close(adasum_pair(a, 2 * a), 1.5 * a)


def test_commutative_bit_for_bit_and_computed_in_float64() -> None:
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    assert torch.equal(adasum_pair(a, b), adasum_pair(b, a))
    a64, b64 = a.double(), b.double()
    dot = a64 @ b64
    exact = a64 + b64 - dot / (2 * (a64 @ a64)) * a64 - dot / (2 * (b64 @ b64)) * b64
    assert torch.equal(adasum_pair(a, b), exact.float())


def test_zero_norm_sides() -> None:
    b = torch.tensor([1.0, -2.0])
    assert torch.equal(adasum_pair(torch.zeros(2), b), b)
    assert torch.equal(adasum_pair(b, torch.zeros(2)), b)
    assert torch.equal(adasum_pair(torch.zeros(2), torch.zeros(2)), torch.zeros(2))
    with pytest.raises(ConfigError, match="same tensor"):
        adasum_pair(torch.zeros(2), torch.zeros(3))


def test_reference_tree_shapes() -> None:
    g = [torch.randn(4, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    pair = lambda x, y: adasum_pair(x, y)  # noqa: E731
    expected = {
        1: g[0],
        2: pair(g[0], g[1]),
        3: pair(pair(g[0], g[1]), g[2]),
        4: pair(pair(g[0], g[1]), pair(g[2], g[3])),
        5: pair(pair(pair(g[0], g[1]), pair(g[2], g[3])), g[4]),
    }
    for n, want in expected.items():
        (got,) = adasum_reference([[t] for t in g[:n]])
        assert torch.equal(got, want), n


# -- the distributed reduction ----------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_distributed_equals_reference_on_every_rank(world_size: int) -> None:
    results = run_ranks(adasum_ranks.distributed_adasum, world_size, timeout_s=120)
    reference = adasum_reference([adasum_ranks.inputs(r) for r in range(world_size)])
    for rank, out in enumerate(results):
        assert [t.dtype for t in out] == [t.dtype for t in reference]
        assert all(torch.equal(a, b) for a, b in zip(out, reference, strict=True)), rank
    # every rank contributed ones * (rank + 1): parallel vectors do not grow with the world
    assert reference[3].max() <= world_size


def test_ddp_comm_hook_trains_a_tiny_model() -> None:
    steps = 25
    results = run_ranks(adasum_ranks.ddp_hook_trains, 3, steps, timeout_s=150)
    assert all(r["mismatches"] == 0 for r in results), [r["mismatches"] for r in results]
    assert all(torch.equal(r["params"], results[0]["params"]) for r in results)
    losses = results[0]["losses"]
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5]), losses


# -- the elastic job ----------------------------------------------------------------------


def test_job_rejects_an_unknown_reduction() -> None:
    model = torch.nn.Linear(2, 1)
    job = Job(model)
    with pytest.raises(ConfigError, match="adasum"):
        job.data_parallel(model, reduce="median")
    job.close()


def test_fixed_world_job_with_adasum_keeps_parity() -> None:
    results = run_ranks(adasum_ranks.fixed_world_job, 3, 12, timeout_s=150)
    assert {r["step"] for r in results} == {12}
    assert len({r["digest"] for r in results}) == 1
    assert all(r["first_grads_are_adasum"] for r in results)


def test_elastic_adasum_survives_a_kill_inside_the_reduction(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("STALWART_ELASTIC_STORE", None)
    env.update(KillSchedule((Kill(worker=2, step=6, where="collective", delay_s=0.001),)).to_env())
    cmd = [sys.executable, "-m", "stalwart", "run", "--nproc", "3", "--max-restarts", "2",
           "--events", str(tmp_path / "events"), "--timeout", "20", str(WORKER),
           "--steps", "20", "--verify-every", "2", "--out", str(tmp_path / "out")]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, f"stalwart run failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    events = read_events(tmp_path / "events")
    assert any(e["kind"] == EventKind.FAULT_DETECTED for lines in events.values() for e in lines)
    by_step: dict[int, set[str]] = {}
    for lines in events.values():
        for e in lines:
            if e["kind"] == EventKind.STEP and e.get("digest"):
                by_step.setdefault(e["step"], set()).add(e["digest"])
    assert by_step and all(len(d) == 1 for d in by_step.values()), by_step
    finals = [torch.load(p) for p in sorted((tmp_path / "out").glob("final-*.pt"))]
    assert len(finals) >= 2 and {f["step"] for f in finals} == {20}
    assert len({f["digest"] for f in finals}) == 1, "bit parity at the end"
