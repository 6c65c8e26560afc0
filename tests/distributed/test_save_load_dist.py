"""Distributed save and load in real gloo worlds of 1 to 4 CPU processes.

Each test runs module-level bodies from ``ranks.py`` with ``run_ranks`` and then inspects the
checkpoint from the test process, which has no process group: manifests (who wrote what),
pack files, and the consolidated view that ``Checkpointer(root).load()`` gives.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from stalwart.checkpoint import Checkpointer
from stalwart.checkpoint.durable.manifest import Manifest
from stalwart.testing import run_ranks

from . import ranks

pytestmark = pytest.mark.timeout(180)

RUN_TIMEOUT_S = 120
_PACK_RANK = re.compile(r"^packs/step-\d{20}-rank(\d{5})-[0-9a-f]{12}\.pack$")


def _new_root(base: Path) -> Path:
    """A fresh checkpoint root, created by the ranks themselves (concurrently)."""
    return base / "ckpt"


def _writer_ranks(m: Manifest, fqns: list[str] | None = None) -> set[int]:
    """Ranks whose packs hold chunks of ``fqns`` (all tensors when None)."""
    out = set()
    for fqn, e in m.tensors.items():
        if fqns is not None and fqn not in fqns:
            continue
        for s in e.shards:
            for c in s.chunks:
                match = _PACK_RANK.match(c.pack)
                assert match, f"unexpected pack key {c.pack!r}"
                out.add(int(match.group(1)))
    return out


def _covers_once(m: Manifest, fqn: str) -> None:
    e = m.tensors[fqn]
    assert len(e.shards) == 1, f"{fqn}: {len(e.shards)} shards, expected exactly one"
    assert e.shards[0].offsets == (0,) * len(e.shape)
    assert e.shards[0].sizes == e.shape


def _unique_bytes(m: Manifest) -> int:
    """Logical bytes of every tensor in the job, each counted once."""
    total = 0
    for e in m.tensors.values():
        numel = 1
        for d in e.shape:
            numel *= d
        total += numel * torch.empty((), dtype=getattr(torch, e.dtype)).element_size()
    return total


def _check_consolidated(tree: Any, saved_world: int) -> None:
    """``load()`` without a state: full CPU tensors equal to the global originals."""
    for name, g in ranks.global_tensors().items():
        t = tree["model"][name]
        assert type(t) is torch.Tensor, f"{name}: {type(t).__name__}, expected a full tensor"
        torch.testing.assert_close(t, g, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(tree["plain"], ranks.PLAIN, rtol=0, atol=0)
    torch.testing.assert_close(tree["scalar"], ranks.SCALAR, rtol=0, atol=0)
    assert tree["meta"] == ranks.META
    assert sorted(tree["rng"]) == [f"rank{r}" for r in range(saved_world)]
    for r in range(saved_world):
        torch.testing.assert_close(tree["rng"][f"rank{r}"], ranks.rank_value(r), rtol=0, atol=0)


# -- one 4-rank checkpoint, read many ways -------------------------------------------------


@pytest.fixture(scope="module")
def four_rank_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """Step 5 saved by 4 ranks (1-D and 2-D meshes), already reloaded in two layouts."""
    root = _new_root(tmp_path_factory.mktemp("four"))
    results = run_ranks(ranks.save_then_reload, 4, str(root), 5, "four", timeout_s=RUN_TIMEOUT_S)
    return root, results


def test_four_ranks_save_and_reload_same_and_swapped_layouts(
    four_rank_ckpt: tuple[Path, list[Any]],
) -> None:
    # The bodies checked every value in place (same layout, Shard(0)<->Shard(1), 2-D -> 1-D).
    _, results = four_rank_ckpt
    assert [r.step for r in results] == [5] * 4
    assert len({(r.bytes_written, r.bytes_total) for r in results}) == 1, "ranks disagree"


def test_every_rank_writes_its_pack_and_the_manifest_says_world_four(
    four_rank_ckpt: tuple[Path, list[Any]],
) -> None:
    root, _ = four_rank_ckpt
    m = Checkpointer(root).manifest(5)
    assert m.world_size == 4
    assert _writer_ranks(m) == {0, 1, 2, 3}
    assert len(m.packs()) == 4, sorted(m.packs())


def test_replicated_tensors_are_written_once(four_rank_ckpt: tuple[Path, list[Any]]) -> None:
    root, results = four_rank_ckpt
    m = Checkpointer(root).manifest(5)
    for fqn in ("model.rep", "plain", "scalar"):
        _covers_once(m, fqn)
    # [Replicate(), Shard(0)] on 2x2: two distinct row blocks, each written by one rank.
    rs = m.tensors["model.rs"]
    assert [(s.offsets, s.sizes) for s in rs.shards] == [((0, 0), (3, 4)), ((3, 0), (3, 4))]
    # [Shard(0), Shard(1)] on 2x2: four blocks of the uneven 7x5.
    assert len(m.tensors["model.ss"].shards) == 4
    # Uneven Shard(0) of 3 rows on 4 ranks: rank 3's empty box is not recorded.
    assert [s.sizes for s in m.tensors["model.tiny"].shards] == [(1, 4)] * 3
    assert results[0].bytes_written == results[0].bytes_total == _unique_bytes(m)
    assert results[0].bytes_reused == 0


def test_per_rank_values_all_reach_the_manifest(four_rank_ckpt: tuple[Path, list[Any]]) -> None:
    root, _ = four_rank_ckpt
    m = Checkpointer(root).manifest(5)
    for r in range(4):
        _covers_once(m, f"rng.rank{r}")
        assert _writer_ranks(m, [f"rng.rank{r}"]) == {r}, "only its owner holds it"


def test_load_four_rank_checkpoint_on_three_ranks(four_rank_ckpt: tuple[Path, list[Any]]) -> None:
    root, _ = four_rank_ckpt
    steps = run_ranks(ranks.load_into, 3, str(root), "three", 4, timeout_s=RUN_TIMEOUT_S)
    assert steps == [5, 5, 5]


def test_consolidated_load_without_process_group(
    four_rank_ckpt: tuple[Path, list[Any]],
) -> None:
    root, _ = four_rank_ckpt
    assert not torch.distributed.is_initialized()
    with Checkpointer(root) as ck:
        _check_consolidated(ck.load(), saved_world=4)


# -- two ranks: balance, dedup, 2 -> 1 ----------------------------------------------------


def test_two_ranks_balance_replicated_writes_dedup_and_load_on_one(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    root = _new_root(tmp_path)
    results = run_ranks(ranks.save_twice, 2, str(root), timeout_s=RUN_TIMEOUT_S)
    (first, second), _ = results
    ck = Checkpointer(root)
    request.addfinalizer(ck.close)
    m = ck.manifest(1)
    assert m.world_size == 2
    reps = [f"reps.r{i}" for i in range(6)]
    for fqn in [*reps, "rep_dt", "plain", "scalar", "model.rep"]:
        _covers_once(m, fqn)
    # Six equal replicated tensors: each rank writes some of them.
    assert _writer_ranks(m, reps) == {0, 1}
    per_rank = [
        sum(f"rank{r:05d}" in c.pack for f in reps for c in m.tensors[f].shards[0].chunks)
        for r in (0, 1)
    ]
    assert per_rank == [3, 3], per_rank
    assert first.bytes_written == first.bytes_total == _unique_bytes(m)
    # The unchanged state saved again as step 2 writes nothing new.
    assert second.bytes_written == 0 and second.chunks_written == 0
    assert second.bytes_reused == first.bytes_total
    assert ck.manifest(2).packs() == m.packs()

    # 2 -> 1: one rank (a process group of one) reads everything into its DTensors ...
    assert run_ranks(ranks.load_into, 1, str(root), "one", 2, timeout_s=RUN_TIMEOUT_S) == [2]
    # ... and so does a lone process without any process group.
    tree = ck.load()
    _check_consolidated(tree, saved_world=2)
    torch.testing.assert_close(tree["rep_dt"], torch.linspace(0, 1, 40).reshape(8, 5))


# -- faults ------------------------------------------------------------------------------


def test_failed_persist_on_one_rank_fails_every_rank_and_commits_nothing(tmp_path: Path) -> None:
    root = _new_root(tmp_path)
    results = run_ranks(ranks.save_with_failing_rank, 2, str(root), 1, timeout_s=RUN_TIMEOUT_S)
    for rank, ((kind, msg), steps, loaded, injected) in enumerate(results):
        assert kind == "DistributedError", f"rank {rank}: {kind}"
        assert "rank 1" in msg and "injected failure" in msg, msg
        assert steps == [1], f"rank {rank} sees steps {steps}"
        assert loaded == 1
        assert injected == (1 if rank == 1 else 0)
    assert Checkpointer(root).steps() == [1]


def test_rank_killed_mid_save_commits_nothing(tmp_path: Path) -> None:
    root = _new_root(tmp_path)
    results = run_ranks(
        ranks.save_and_die,
        2,
        str(root),
        1,
        timeout_s=RUN_TIMEOUT_S,
        pg_timeout_s=30,
        expect_exit={1: -signal.SIGKILL},
    )
    assert results[1] is None
    assert results[0] != "saved", "rank 0 must not believe a save with a dead peer succeeded"
    with Checkpointer(root) as ck:
        assert ck.steps() == [1]
        assert ck.load()["version"] == 1


def test_damaged_newest_step_all_ranks_fall_back_together(tmp_path: Path) -> None:
    root = _new_root(tmp_path)
    run_ranks(ranks.save_versions, 2, str(root), [1, 2], timeout_s=RUN_TIMEOUT_S)
    ck = Checkpointer(root)
    # Flip one byte of the chunk of w's first row block (read by rank 0 only) in step 2.
    shard = next(s for s in ck.manifest(2).tensors["w"].shards if s.offsets == (0, 0))
    chunk = shard.chunks[0]
    assert chunk.pack not in ck.manifest(1).packs()
    pack = root / chunk.pack
    data = bytearray(pack.read_bytes())
    data[chunk.offset] ^= 0xFF
    pack.write_bytes(bytes(data))

    results = run_ranks(ranks.load_with_fallback, 2, str(root), timeout_s=RUN_TIMEOUT_S)
    # Without fallback: the rank that read the bad chunk says so, the other one is told.
    assert [r[0] for r in results] == ["CorruptCheckpointError", "DistributedError"]
    # With fallback: both ranks skip step 2 and load step 1, together.
    assert [r[1:] for r in results] == [(1, [2]), (1, [2])]


# -- FSDP2 -------------------------------------------------------------------------------


def test_fsdp2_state_dict_saved_on_two_loads_on_one_and_two(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed.fsdp", reason="needs FSDP2 (fully_shard)")
    root = _new_root(tmp_path)
    saved = run_ranks(ranks.fsdp_save, 2, str(root), timeout_s=RUN_TIMEOUT_S)[0]
    assert any(k.startswith("exp_avg.") for k in saved)
    for world in (1, 2):
        loaded = run_ranks(ranks.fsdp_load, world, str(root), timeout_s=RUN_TIMEOUT_S)
        for rank, values in enumerate(loaded):
            assert values.keys() == saved.keys()
            for k, v in saved.items():
                torch.testing.assert_close(
                    values[k], v, rtol=0, atol=0, msg=f"world {world} rank {rank} {k}"
                )


# -- errors outside the persist phase reach every rank ----------------------------------


def test_listing_failure_on_one_rank_fails_every_rank(tmp_path: Path) -> None:
    root = _new_root(tmp_path)
    results = run_ranks(
        ranks.save_with_failing_listing, 2, str(root), 1, timeout_s=RUN_TIMEOUT_S, pg_timeout_s=30
    )
    assert results == ["DistributedError", "DistributedError"], results
    assert Checkpointer(root).steps() == []


def test_a_commit_that_fails_on_rank_0_fails_every_rank_and_commits_nothing(
    tmp_path: Path,
) -> None:
    root = _new_root(tmp_path)
    results = run_ranks(
        ranks.save_with_failing_commit, 2, str(root), timeout_s=RUN_TIMEOUT_S, pg_timeout_s=30
    )
    for message, steps in results:
        assert message.startswith("committing step 2 failed on rank 0: "), results
        assert steps == [1], results


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_load_whose_listing_fails_on_rank_0_fails_every_rank(
    tmp_path: Path, bad_rank: int
) -> None:
    """Rank 0 lists for every rank: its failure reaches the others, named; a failure to list
    on another rank does not matter, since it does not list."""
    root = _new_root(tmp_path)
    results = run_ranks(
        ranks.load_with_failing_listing,
        2,
        str(root),
        bad_rank,
        timeout_s=RUN_TIMEOUT_S,
        pg_timeout_s=30,
    )
    if bad_rank == 1:
        assert results == ["loaded", "loaded"], results
        return
    for r in results:
        assert r.startswith("DistributedError: listing checkpoints failed on rank 0"), results


def test_state_mismatch_on_one_rank_fails_every_rank(tmp_path: Path) -> None:
    root = _new_root(tmp_path)
    results = run_ranks(
        ranks.load_with_mismatch_on, 2, str(root), 1, timeout_s=RUN_TIMEOUT_S, pg_timeout_s=30
    )
    assert results[0] == "DistributedError", results
    assert results[1] in ("StateMismatchError", "DistributedError"), results


def test_lightning_pointer_loads_reuse_one_process_group(tmp_path: Path) -> None:
    # Each pointer load under torch.distributed made a new process group of its rank alone
    # (sockets and all, never destroyed); a run that loads checkpoints often grew without end.
    pytest.importorskip("lightning")
    results = run_ranks(
        ranks.lightning_loads_share_one_group, 2, str(tmp_path), timeout_s=RUN_TIMEOUT_S
    )
    assert results == [(0, 0.0), (0, 1.0)], results
