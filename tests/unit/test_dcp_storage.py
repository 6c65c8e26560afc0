"""StalwartWriter/StalwartReader under dcp.save/load in one process; export, import, FQN state."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from stalwart import Checkpointer, TrainingState
from stalwart.checkpoint.durable.manifest import ChunkRef
from stalwart.errors import ConfigError, CorruptCheckpointError
from stalwart.integrations.dcp import (
    StalwartReader,
    StalwartWriter,
    export_dcp,
    import_dcp,
    parse_checkpoint_id,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Opaque:
    """A value only a trusted pickle can bring back."""

    def __init__(self, x: int) -> None:
        self.x = x


def _state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "extra": {"step": 3, "name": "run", "lrs": [0.1, 0.2], "t": (1, 2)},
        "bf16": torch.randn(5, 7).to(torch.bfloat16),
        "scalar": torch.tensor(2.5),
    }


def _zeros_like(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _zeros_like(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_zeros_like(v) for v in tree]
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    return None if not isinstance(tree, (int, float, str)) else type(tree)()


def _str_keys(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {str(k): _str_keys(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_str_keys(v) for v in tree]
    return tree


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    else:
        assert a == b


def test_checkpoint_id_names_the_step() -> None:
    assert parse_checkpoint_id(7) == (None, 7)
    assert parse_checkpoint_id("step-100") == (None, 100)
    assert parse_checkpoint_id("runs/x/step-12/") == ("runs/x", 12)
    with pytest.raises(ConfigError, match="names no step"):
        parse_checkpoint_id("runs/final")
    assert not StalwartWriter.validate_checkpoint_id("latest")


def test_dcp_save_and_load_round_trip_bit_identical(tmp_path: Path) -> None:
    state = _state()
    dcp.save(state, checkpoint_id=tmp_path / "step-5", storage_writer=StalwartWriter())
    target = _zeros_like(state)
    dcp.load(target, checkpoint_id=tmp_path / "step-5", storage_reader=StalwartReader())
    _assert_same(state, target)
    ck = Checkpointer(tmp_path)
    assert ck.steps() == [5] and ck.verify(5).ok
    native = ck.load(None, 5)  # the same step read by stalwart itself, nested as saved
    _assert_same(state["model"], native["model"])
    assert native["extra"]["lrs"] == [0.1, 0.2] and native["optim"]["param_groups"][0]["lr"] == 0.1


def test_incremental_save_writes_only_changed_chunks(tmp_path: Path) -> None:
    from stalwart import CheckpointOptions

    writer = StalwartWriter(tmp_path, options=CheckpointOptions(chunk_bytes=64 << 10))
    state = {f"layer{i}": torch.randn(64 << 10) for i in range(10)}  # 10 x 256 KiB
    dcp.save(state, checkpoint_id=1, storage_writer=writer)
    state["layer3"].add_(1.0)  # one layer in ten changes
    dcp.save(state, checkpoint_id=2, storage_writer=writer)
    stats = Checkpointer(tmp_path).manifest(2).stats
    assert stats["bytes_total"] == 10 * (256 << 10)
    assert stats["bytes_written"] == 256 << 10
    target = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(target, storage_reader=StalwartReader(tmp_path))  # the newest step
    _assert_same(state, target)


def test_load_verifies_every_chunk(tmp_path: Path) -> None:
    state = {"w": torch.randn(1000)}
    dcp.save(state, checkpoint_id=1, storage_writer=StalwartWriter(tmp_path))
    ref: ChunkRef = Checkpointer(tmp_path).manifest(1).tensors["w"].shards[0].chunks[0]
    pack = tmp_path / ref.pack
    data = bytearray(pack.read_bytes())
    data[ref.offset + 17] ^= 0x04
    pack.write_bytes(bytes(data))
    target = {"w": torch.zeros(1000)}
    with pytest.raises(BaseException, match="does not match its hash"):
        dcp.load(target, storage_reader=StalwartReader(tmp_path, step=1))
    assert torch.count_nonzero(target["w"]) == 0  # nothing damaged landed


def test_native_checkpoint_loads_through_dcp_with_resharded_request(tmp_path: Path) -> None:
    w = torch.randn(6, 4)
    Checkpointer(tmp_path).save(2, {"w": w, "n": 4})
    target: dict[str, Any] = {"w": torch.zeros(6, 4), "n": 0}
    dcp.load(target, storage_reader=StalwartReader(tmp_path))
    assert torch.equal(target["w"], w) and target["n"] == 4


def test_pickled_values_need_trust_to_load(tmp_path: Path) -> None:
    dcp.save(
        {"obj": Opaque(3), "w": torch.ones(2)},
        checkpoint_id=1,
        storage_writer=StalwartWriter(tmp_path),
    )
    with pytest.raises(BaseException, match="trust_pickle=True"):
        dcp.load({"obj": None, "w": torch.zeros(2)}, storage_reader=StalwartReader(tmp_path))
    target: dict[str, Any] = {"obj": None, "w": torch.zeros(2)}
    dcp.load(target, storage_reader=StalwartReader(tmp_path, trust_pickle=True))
    assert isinstance(target["obj"], Opaque) and target["obj"].x == 3


def test_export_to_dcp_folder_and_import_back(tmp_path: Path) -> None:
    state = _state(1)
    Checkpointer(tmp_path / "root").save(4, state)
    r = export_dcp(tmp_path / "root", tmp_path / "dcp")
    assert r.step == 4 and r.tensors == len(Checkpointer(tmp_path / "root").manifest(4).tensors)
    target = _zeros_like(state)
    target["extra"]["t"] = [0, 0]  # DCP keeps a tuple as one value; the export made it a list
    dcp.load(target, storage_reader=FileSystemReader(tmp_path / "dcp"), no_dist=True)
    state["extra"]["t"] = [1, 2]
    _assert_same(state, target)
    imp = import_dcp(tmp_path / "dcp", tmp_path / "back", 9, batch_bytes=1024)
    assert imp.tensors == r.tensors
    # DCP names every dict key by str(key): optimizer state {0: ...} comes back as {"0": ...}
    _assert_same(_str_keys(state), Checkpointer(tmp_path / "back").load(None, 9))


def test_import_from_fsspec_url_streams_and_dedups(tmp_path: Path) -> None:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    state = {"a": torch.randn(300, 10), "b": torch.randn(50), "epoch": 2}
    dcp.save(state, storage_writer=FsspecWriter("memory://h8dcp/ckpt"), no_dist=True)
    first = import_dcp("memory://h8dcp/ckpt", tmp_path, 1, batch_bytes=100)
    again = import_dcp("memory://h8dcp/ckpt", tmp_path, 2, batch_bytes=100)
    assert first.bytes_written > 0 and again.bytes_written == 0  # same bytes: all reused
    got = Checkpointer(tmp_path).load(None, 2)
    _assert_same(state, got)


def test_import_refuses_metadata_that_runs_code(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(2)}, storage_writer=FileSystemWriter(tmp_path / "d"), no_dist=True)

    class Evil:
        def __reduce__(self) -> Any:
            import os

            return (os.system, ("true",))

    (tmp_path / "d" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(ConfigError, match="trust_pickle"):
        import_dcp(tmp_path / "d", tmp_path / "root", 1)
    (tmp_path / "d" / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(CorruptCheckpointError):
        import_dcp(tmp_path / "d", tmp_path / "root", 1)


def test_import_refuses_opaque_values_unless_trusted(tmp_path: Path) -> None:
    buf = io.BytesIO()
    dcp.save(
        {"obj": Opaque(5), "w": torch.ones(3)},
        storage_writer=FileSystemWriter(tmp_path / "d"),
        no_dist=True,
    )
    with pytest.raises(ConfigError, match="trust_pickle=True"):
        import_dcp(tmp_path / "d", tmp_path / "root", 1)
    import_dcp(tmp_path / "d", tmp_path / "root", 1, trust_pickle=True)
    target: dict[str, Any] = {"obj": None, "w": torch.zeros(3)}
    dcp.load(target, storage_reader=StalwartReader(tmp_path / "root", trust_pickle=True))
    assert target["obj"].x == 5 and buf.tell() == 0


def _two_parts() -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    parts: list[nn.Module] = [
        nn.ModuleDict({"embed": nn.Linear(4, 8)}),
        nn.ModuleDict({"head": nn.Linear(8, 2)}),
    ]
    opts: list[torch.optim.Optimizer] = [torch.optim.Adam(p.parameters(), lr=0.01) for p in parts]
    x = torch.randn(5, 4)
    parts[1]["head"](parts[0]["embed"](x)).sum().backward()
    for o in opts:
        o.step()
    return parts, opts


def test_training_state_keys_optimizer_state_by_fqn_across_parts(tmp_path: Path) -> None:
    parts, opts = _two_parts()
    ts = TrainingState(model=parts, optimizer=opts, rng=False, fqn_optimizer_state=True)
    sd = ts.state_dict()
    assert "state.embed.weight.exp_avg" in sd["optimizer"]
    assert "state.head.weight.exp_avg" in sd["optimizer"]  # by index, both would be state.0
    assert {"embed.weight", "head.bias"} <= set(sd["model"])
    ck = Checkpointer(tmp_path)
    ck.save(1, {"train": ts})
    fresh_parts, _ = _two_parts()
    for p in fresh_parts:
        for t in p.parameters():
            t.data.zero_()
    fresh_opts = [torch.optim.Adam(p.parameters(), lr=0.01) for p in fresh_parts]
    ts2 = TrainingState(
        model=fresh_parts, optimizer=fresh_opts, rng=False, fqn_optimizer_state=True
    )
    ck.load({"train": ts2}, 1)
    for a, b in zip(parts, fresh_parts, strict=True):
        _assert_same(a.state_dict(), b.state_dict())
    for a, b in zip(opts, fresh_opts, strict=True):
        _assert_same(a.state_dict(), b.state_dict())
    # The same state through DCP and stalwart's StorageWriter.
    dcp.save({"train": ts}, checkpoint_id=2, storage_writer=StalwartWriter(tmp_path))
    assert (
        "train.optimizer.state.head.weight.exp_avg_sq" in Checkpointer(tmp_path).manifest(2).tensors
    )


def test_cli_exports_a_step_to_dcp_and_imports_it_back(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from stalwart.cli.main import app

    state = {"model": {"w": torch.randn(4, 3)}, "epoch": 2}
    Checkpointer(tmp_path / "r").save(3, state)
    runner = CliRunner()
    r = runner.invoke(
        app, ["ckpt", "export", str(tmp_path / "r"), str(tmp_path / "d"), "--format", "dcp"]
    )
    assert r.exit_code == 0, r.output
    assert (tmp_path / "d" / ".metadata").is_file()
    r = runner.invoke(
        app, ["ckpt", "import", str(tmp_path / "d"), str(tmp_path / "r2"), "--step", "8"]
    )
    assert r.exit_code == 0 and "(dcp)" in r.output, r.output
    _assert_same(state, Checkpointer(tmp_path / "r2").load(None, 8))


def test_reader_of_a_missing_root_says_so_and_creates_nothing(tmp_path: Path) -> None:
    with pytest.raises(BaseException, match="no committed checkpoint"):
        dcp.load({"w": torch.zeros(1)}, storage_reader=StalwartReader(tmp_path / "nope"))
    assert not (tmp_path / "nope").exists()


def test_one_reader_and_writer_serve_several_roots_by_checkpoint_id(tmp_path: Path) -> None:
    writer, reader = StalwartWriter(), StalwartReader()
    for name, value in (("a", 1.0), ("b", 2.0)):
        dcp.save(
            {"w": torch.full((3,), value)},
            checkpoint_id=tmp_path / name / "step-1",
            storage_writer=writer,
        )
    for name, value in (("a", 1.0), ("b", 2.0)):
        target = {"w": torch.zeros(3)}
        dcp.load(target, checkpoint_id=tmp_path / name / "step-1", storage_reader=reader)
        assert torch.equal(target["w"], torch.full((3,), value))
    writer.close()
    reader.close()


class _RacedWriter(StalwartWriter):
    """A writer whose commit another process's ``rm`` and ``gc --grace-s 0`` run just before."""

    def finish(self, metadata: Any, results: Any) -> None:
        assert self._root is not None
        with Checkpointer(self._root.store.url) as other:
            other.delete(1)  # the step this save deduplicates against: only a save, not a read
            report = other.gc(grace_s=0)
        self.raced = report
        super().finish(metadata, results)


def test_rm_and_gc_during_a_dcp_save_leave_its_step_whole(tmp_path: Path) -> None:
    frozen = torch.arange(8192, dtype=torch.float32)  # shared by both steps: deduplicated
    state = {"frozen": frozen, "w": torch.randn(8192)}
    dcp.save(state, checkpoint_id=1, storage_writer=StalwartWriter(tmp_path))
    state = {"frozen": frozen.clone(), "w": torch.randn(8192)}
    writer = _RacedWriter(tmp_path)
    dcp.save(state, checkpoint_id=2, storage_writer=writer)
    assert writer.raced.deleted_packs == []  # step 2's new pack and step 1's, both leased
    ck = Checkpointer(tmp_path)
    assert ck.steps() == [2] and ck.verify(2).ok
    assert ck.storage.list("leases/") == []  # the lease ended with the commit
    target = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(target, checkpoint_id=2, storage_reader=StalwartReader(tmp_path))
    _assert_same(state, target)
    assert ck.gc(grace_s=0).deleted_packs == [] and ck.verify(2).ok  # step 2 uses both packs


def test_a_dcp_save_still_applies_retention_after_its_lease(tmp_path: Path) -> None:
    from stalwart import CheckpointOptions
    from stalwart.checkpoint.policy import KeepLast

    writer = StalwartWriter(tmp_path, options=CheckpointOptions(keep=KeepLast(2)))
    for step in range(1, 5):
        dcp.save({"w": torch.full((64,), float(step))}, checkpoint_id=step, storage_writer=writer)
    assert Checkpointer(tmp_path).steps() == [3, 4]
