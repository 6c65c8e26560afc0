"""Per-rank bodies of the distributed checkpoint tests, run by ``stalwart.testing.run_ranks``.

They live in their own module, at module level, because ``spawn``-ed rank processes import
them by name. Every rank builds the same global tensors from a seed and distributes them, so
each rank knows exactly what it should hold after a load without talking to the others.
Checks inside a body raise ``AssertionError``; ``run_ranks`` reports the rank's traceback.
"""

from __future__ import annotations

import functools
import os
import signal
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from stalwart.checkpoint import Checkpointer
from stalwart.errors import CorruptCheckpointError, DistributedError
from stalwart.storage import LocalStorage
from stalwart.testing import FlakyStorage

SEED = 1234

# Non-tensor leaves saved next to the tensors; loads must give them back unchanged.
META: dict[str, Any] = {
    "step": 7,
    "lr": 0.125,
    "name": "run-a",
    "flags": [True, False, None],
    "pair": (3, "x"),
    "blob": b"\x00\xffok",
    "dtype": torch.bfloat16,
}


def global_tensors() -> dict[str, torch.Tensor]:
    """The job's global DTensor values, identical on every rank (seeded)."""
    g = torch.Generator().manual_seed(SEED)
    return {
        "s0": torch.randn(8, 6, generator=g),  # Shard(0), even on 4 ranks
        "s1": torch.randn(5, 8, generator=g),  # Shard(1)
        "rep": torch.randn(6, 4, generator=g),  # Replicate()
        "uneven": torch.randn(7, 3, generator=g),  # Shard(0): rows 2,2,2,1 on 4 ranks
        "tiny": torch.randn(3, 4, generator=g),  # Shard(0): rank 3 of 4 holds nothing
        "ss": torch.randn(7, 5, generator=g),  # 2x2 mesh [Shard(0), Shard(1)]
        "rs": torch.randn(6, 4, generator=g),  # 2x2 mesh [Replicate(), Shard(0)]
        "bf": torch.randn(3, 10, generator=g).to(torch.bfloat16),  # Shard(1): 3,3,3,1 cols
    }


PLAIN = torch.arange(24, dtype=torch.int64).reshape(4, 6)  # a plain tensor: replicated
SCALAR = torch.tensor(3.5, dtype=torch.float64)  # a 0-dim plain tensor


def rank_value(rank: int) -> torch.Tensor:
    """A value only ``rank`` holds (like its RNG state)."""
    return torch.arange(5, dtype=torch.int32) + 100 * rank


# Layouts: tensor name -> (mesh shape, placements). "S0", "S1", "R" keep them picklable.
LAYOUTS: dict[str, dict[str, tuple[tuple[int, ...], tuple[str, ...]]]] = {
    "four": {
        "s0": ((4,), ("S0",)),
        "s1": ((4,), ("S1",)),
        "rep": ((4,), ("R",)),
        "uneven": ((4,), ("S0",)),
        "tiny": ((4,), ("S0",)),
        "ss": ((2, 2), ("S0", "S1")),
        "rs": ((2, 2), ("R", "S0")),
        "bf": ((4,), ("S1",)),
    },
    # Same world, other placements: Shard(0) <-> Shard(1), 2-D mesh -> 1-D mesh.
    "four_swapped": {
        "s0": ((4,), ("S1",)),
        "s1": ((4,), ("S0",)),
        "rep": ((4,), ("S0",)),
        "uneven": ((4,), ("S1",)),
        "tiny": ((4,), ("R",)),
        "ss": ((4,), ("S0",)),
        "rs": ((4,), ("S1",)),
        "bf": ((4,), ("S0",)),
    },
    "three": {
        "s0": ((3,), ("S0",)),
        "s1": ((3,), ("S1",)),
        "rep": ((3,), ("R",)),
        "uneven": ((3,), ("S0",)),
        "tiny": ((3,), ("S1",)),
        "ss": ((3,), ("S0",)),
        "rs": ((3,), ("S1",)),
        "bf": ((3,), ("S0",)),
    },
    "two": {
        "s0": ((2,), ("S0",)),
        "s1": ((2,), ("S1",)),
        "rep": ((2,), ("R",)),
        "uneven": ((2,), ("S0",)),
        "tiny": ((2,), ("S1",)),
        "ss": ((2,), ("S1",)),
        "rs": ((2,), ("R",)),
        "bf": ((2,), ("S0",)),
    },
    "one": {name: ((1,), ("S0",)) for name in global_tensors()},
}


def _placements(spec: tuple[str, ...]) -> list[Placement]:
    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in spec]


@functools.cache
def _mesh(shape: tuple[int, ...]) -> DeviceMesh:
    return init_device_mesh("cpu", shape)


def build_state(rank: int, layout: str, *, zeros: bool = False) -> dict[str, Any]:
    """The job's state on ``rank`` in ``layout``; ``zeros`` gives a same-shaped load target."""
    model: dict[str, torch.Tensor] = {}
    for name, g in global_tensors().items():
        shape, spec = LAYOUTS[layout][name]
        src = torch.zeros_like(g) if zeros else g
        if name == "s0" and spec == ("S0",) and g.shape[0] % shape[0] == 0:
            # Built from local shards (the other constructor), as a trainer would.
            local = src.chunk(shape[0])[_mesh(shape).get_local_rank()].clone()
            model[name] = DTensor.from_local(local, _mesh(shape), [Shard(0)], run_check=False)
        else:
            model[name] = distribute_tensor(src, _mesh(shape), _placements(spec))
    return {
        "model": model,
        "plain": torch.zeros_like(PLAIN) if zeros else PLAIN.clone(),
        "scalar": torch.zeros_like(SCALAR) if zeros else SCALAR.clone(),
        "meta": dict(META),
        "rng": {f"rank{rank}": torch.zeros(5, dtype=torch.int32) if zeros else rank_value(rank)},
    }


def _same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


def check_loaded(
    tree: Any, state: dict[str, Any], rank: int, layout: str, saved_world: int
) -> None:
    """Check a load into ``build_state(rank, layout, zeros=True)``: every value, in place."""
    for name, g in global_tensors().items():
        t = state["model"][name]
        assert tree["model"][name] is t, f"{name}: load did not return the target tensor"
        shape, spec = LAYOUTS[layout][name]
        expected = distribute_tensor(g, _mesh(shape), _placements(spec)).to_local()
        _same(t.to_local(), expected, f"rank {rank} {name} in layout {layout}")
    _same(state["plain"], PLAIN, "plain")
    _same(state["scalar"], SCALAR, "scalar")
    assert tree["meta"] == META, f"meta: {tree['meta']!r} != {META!r}"
    _same(state["rng"][f"rank{rank}"], rank_value(rank), f"rank {rank}'s own value")
    assert sorted(tree["rng"]) == [f"rank{r}" for r in range(saved_world)], sorted(tree["rng"])
    for r in range(saved_world):
        _same(tree["rng"][f"rank{r}"], rank_value(r), f"rank {r}'s value seen on rank {rank}")


# -- bodies ------------------------------------------------------------------------------


def save_then_reload(rank: int, world: int, root: str, step: int, layout: str) -> Any:
    """Save ``layout``'s state, then load it back into the same and a swapped layout."""
    with Checkpointer(root) as ck:
        result = ck.save(step, build_state(rank, layout))
        for target in (layout, f"{layout}_swapped"):
            if target not in LAYOUTS:
                continue
            state = build_state(rank, target, zeros=True)
            tree = ck.load(state)
            assert ck.last_load is not None and ck.last_load.step == step
            check_loaded(tree, state, rank, target, saved_world=world)
    return result


def load_into(rank: int, world: int, root: str, layout: str, saved_world: int) -> int:
    """Load the newest step into ``layout`` (a world size that may differ from the save's)."""
    with Checkpointer(root) as ck:
        state = build_state(rank, layout, zeros=True)
        tree = ck.load(state)
        check_loaded(tree, state, rank, layout, saved_world)
        assert ck.last_load is not None
        return ck.last_load.step


def replicated_state() -> dict[str, torch.Tensor]:
    """Several equal-sized plain (replicated) tensors, the same on every rank."""
    g = torch.Generator().manual_seed(SEED + 1)
    return {f"r{i}": torch.randn(64, 16, generator=g) for i in range(6)}


def save_twice(rank: int, world: int, root: str) -> Any:
    """Save layout "two" plus replicated tensors at steps 1 and 2 (unchanged: dedup)."""
    with Checkpointer(root) as ck:
        state = build_state(rank, "two")
        state["reps"] = replicated_state()
        state["rep_dt"] = distribute_tensor(
            torch.linspace(0, 1, 40).reshape(8, 5), _mesh((world,)), [Replicate()]
        )
        first = ck.save(1, state)
        second = ck.save(2, state)
    return first, second


def _versioned(rank: int, world: int, version: int) -> dict[str, Any]:
    """A small sharded + replicated state whose values depend on ``version``."""
    g = torch.Generator().manual_seed(SEED + 10 * version)
    w = torch.randn(8, 4, generator=g)
    return {
        "w": distribute_tensor(w, _mesh((world,)), [Shard(0)]),
        "b": torch.randn(16, generator=g),
        "version": version,
    }


def _expect_version(tree: Any, state: dict[str, Any], rank: int, world: int, version: int) -> None:
    want = _versioned(rank, world, version)
    _same(state["w"].to_local(), want["w"].to_local(), f"rank {rank} w")
    _same(state["b"], want["b"], f"rank {rank} b")
    assert tree["version"] == version, tree["version"]


def _zeros_like_state(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "w": distribute_tensor(
            torch.zeros(state["w"].shape), state["w"].device_mesh, state["w"].placements
        ),
        "b": torch.zeros_like(state["b"]),
        "version": 0,
    }


def save_versions(rank: int, world: int, root: str, versions: list[int]) -> None:
    """Save ``_versioned(v)`` as step ``v`` for each version."""
    with Checkpointer(root) as ck:
        for v in versions:
            ck.save(v, _versioned(rank, world, v))


def _fail_pack_writes_on(bad_rank: int, rank: int, op: str, key: str) -> bool:
    return rank == bad_rank and op == "write" and key.startswith("packs/")


def _step_1_then_flaky(rank: int, world: int, root: str, fail: Any, bad_rank: int) -> Any:
    """Save step 1 on ``root``; then the same root through a store failing where
    ``fail(bad_rank, rank, op, key)`` says."""
    with Checkpointer(root) as ck:
        ck.save(1, _versioned(rank, world, 1))
    return FlakyStorage(LocalStorage(root), fail_on=functools.partial(fail, bad_rank, rank))


def save_with_failing_rank(rank: int, world: int, root: str, bad_rank: int) -> Any:
    """Step 1 saves; step 2's pack write fails on ``bad_rank``; step 1 must still load."""
    flaky = _step_1_then_flaky(rank, world, root, _fail_pack_writes_on, bad_rank)
    with Checkpointer(flaky) as ck:
        try:
            ck.save(2, _versioned(rank, world, 2))
            outcome = ("saved", "")
        except DistributedError as e:
            outcome = ("DistributedError", str(e))
        steps = ck.steps()
        state = _zeros_like_state(_versioned(rank, world, 1))
        tree = ck.load(state)
        _expect_version(tree, state, rank, world, 1)
        assert ck.last_load is not None
        return outcome, steps, ck.last_load.step, flaky.failures["write"]


def _fail_manifest_write_on(bad_rank: int, rank: int, op: str, key: str) -> bool:
    return rank == bad_rank and op == "write" and key.startswith("manifests/")


def save_with_failing_commit(rank: int, world: int, root: str) -> tuple[str, list[int]]:
    """Step 1 saves; step 2's manifest write (the commit, rank 0's alone) fails."""
    flaky = _step_1_then_flaky(rank, world, root, _fail_manifest_write_on, 0)
    with Checkpointer(flaky) as ck:
        try:
            ck.save(2, _versioned(rank, world, 2))
            outcome = "saved"
        except DistributedError as e:
            outcome = str(e)
        return outcome, ck.steps()


def _kill_on_pack_write(bad_rank: int, rank: int, op: str, key: str) -> bool:
    if rank == bad_rank and op == "write" and key.startswith("packs/"):
        os.kill(os.getpid(), signal.SIGKILL)  # a crash in the middle of a save
    return False


def save_and_die(rank: int, world: int, root: str, bad_rank: int) -> str:
    """Step 1 saves; ``bad_rank`` is SIGKILLed while writing step 2's pack."""
    store = _step_1_then_flaky(rank, world, root, _kill_on_pack_write, bad_rank)
    with Checkpointer(store) as ck:
        try:
            ck.save(2, _versioned(rank, world, 2))
        except Exception as e:  # the survivor learns of the death from gloo or from us
            return type(e).__name__
    return "saved"


def load_with_fallback(rank: int, world: int, root: str) -> Any:
    """Load the newest step without, then with, fallback; the newest is damaged."""
    with Checkpointer(root) as ck:
        state = _zeros_like_state(_versioned(rank, world, 1))
        try:
            ck.load(state)
            strict_error = "none"
        except (CorruptCheckpointError, DistributedError) as e:
            strict_error = type(e).__name__
        state = _zeros_like_state(_versioned(rank, world, 1))
        tree = ck.load(state, fallback=True)
        assert ck.last_load is not None
        _expect_version(tree, state, rank, world, ck.last_load.step)
        return strict_error, ck.last_load.step, [s for s, _ in ck.last_load.skipped]


# -- FSDP2 -------------------------------------------------------------------------------


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _fsdp_trained(world: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A fully_shard-ed MLP after one Adam step (so the optimizer has state)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = _mlp()
    fully_shard(model, mesh=_mesh((world,)))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
    model(x).square().sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _full(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters and Adam moments, by name (collective)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    out = {f"param.{k}": v.full_tensor() for k, v in msd.items()}
    for k, s in osd["state"].items():
        out[f"exp_avg.{k}"] = s["exp_avg"].full_tensor()
    return out


def fsdp_save(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    """Save an FSDP2 model and optimizer through get_state_dict; return the full values."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _fsdp_trained(world, seed=0)
    msd, osd = get_state_dict(model, opt)
    with Checkpointer(root) as ck:
        ck.save(1, {"model": msd, "optim": osd})
    return _full(model, opt)


def fsdp_load(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    """Load into a differently initialised FSDP2 model with set_state_dict; return values."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _fsdp_trained(world, seed=1)
    msd, osd = get_state_dict(model, opt)
    with Checkpointer(root) as ck:
        ck.load({"model": msd, "optim": osd})
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    return _full(model, opt)


# -- failures outside the persist phase --------------------------------------------------


def _fail_list_on(bad_rank: int, rank: int, op: str, key: str) -> bool:
    return rank == bad_rank and op == "list"


def save_with_failing_listing(rank: int, world: int, root: str, bad_rank: int) -> str:
    """Save while listing the store fails on ``bad_rank``; return what this rank raised."""
    store = FlakyStorage(
        LocalStorage(root), fail_on=functools.partial(_fail_list_on, bad_rank, rank)
    )
    with Checkpointer(store) as ck:
        try:
            ck.save(1, _versioned(rank, world, 1))
        except Exception as e:
            return type(e).__name__
    return "saved"


def load_with_failing_listing(rank: int, world: int, root: str, bad_rank: int) -> str:
    """Save, then load while listing the store fails on ``bad_rank``; what this rank raised."""
    store = _step_1_then_flaky(rank, world, root, _fail_list_on, bad_rank)
    with Checkpointer(store) as ck:
        try:
            ck.load(_zeros_like_state(_versioned(rank, world, 1)))
        except Exception as e:
            return f"{type(e).__name__}: {e}"
    return "loaded"


def load_with_mismatch_on(rank: int, world: int, root: str, bad_rank: int) -> str:
    """Load where only ``bad_rank``'s state has a key the checkpoint lacks."""
    with Checkpointer(root) as ck:
        ck.save(1, _versioned(rank, world, 1))
        state = _zeros_like_state(_versioned(rank, world, 1))
        if rank == bad_rank:
            state["extra"] = torch.zeros(2)
        try:
            ck.load(state)
        except Exception as e:
            return type(e).__name__
    return "loaded"


def lightning_loads_share_one_group(rank: int, world: int, base: str) -> tuple[int, float]:
    """Each rank saves a Lightning checkpoint of its own and loads its pointer 5 times: the
    process groups made by the loads (one a process), and the value loaded."""
    from torch.distributed.distributed_c10d import _world

    from stalwart.integrations.lightning import StalwartCheckpointIO, read_checkpoint

    io = StalwartCheckpointIO(root=os.path.join(base, f"root{rank}"))
    path = os.path.join(base, f"rank{rank}.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.full((3,), float(rank))}, "epoch": 1}, path)
    io.teardown()
    before = len(_world.pg_map)
    for _ in range(5):
        got = read_checkpoint(path)
    return len(_world.pg_map) - before, float(got["state_dict"]["w"][0])
