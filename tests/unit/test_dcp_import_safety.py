"""Importing a DCP folder runs none of its pickles unless the caller opts in (issue 9, item 3)."""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from stalwart import Checkpointer
from stalwart.checkpoint.tools.export import import_file
from stalwart.errors import ConfigError, CorruptCheckpointError

pytestmark = pytest.mark.timeout(120)


class _Payload:
    """Unpickles into a shell command that creates ``marker`` (what an attacker would ship)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch '{self.marker}'",))


def _dcp(folder: Path, state: dict[str, Any]) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return folder


def _state() -> dict[str, Any]:
    return {"w": torch.arange(12.0).reshape(3, 4), "step": 7, "name": "run", "lr": [0.1, 0.2]}


def test_plain_dcp_imports_without_any_opt_in(tmp_path: Path) -> None:
    src = _dcp(tmp_path / "dcp", _state())
    with Checkpointer(tmp_path / "ck") as ck:
        r = import_file(src, ck, step=1)
        back = ck.load(None, 1)
    assert r.kind == "dcp" and back["step"] == 7 and back["name"] == "run"
    assert back["lr"] == [0.1, 0.2] and torch.equal(back["w"], _state()["w"])


def test_crafted_metadata_runs_nothing(tmp_path: Path) -> None:
    src = _dcp(tmp_path / "dcp", _state())
    marker = tmp_path / "pwned"
    (src / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with Checkpointer(tmp_path / "ck") as ck:
        with pytest.raises(ConfigError, match=r"posix\.system.*trust_pickle=True.*--trust-pickle"):
            import_file(src, ck, step=1)
        assert ck.steps() == []
    assert not marker.exists()


def test_crafted_value_runs_nothing_unless_trusted(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    src = _dcp(tmp_path / "dcp", {**_state(), "extra": _Payload(marker)})
    assert not marker.exists()
    with Checkpointer(tmp_path / "ck") as ck:
        with pytest.raises(ConfigError, match=r"'extra'.*--trust-pickle"):
            import_file(src, ck, step=1)
        assert ck.steps() == [] and not marker.exists()
        import_file(src, ck, step=1, trust_pickle=True)  # the opt-in does what it says
    assert marker.exists()


def test_data_file_outside_the_folder_is_refused(tmp_path: Path) -> None:
    src = _dcp(tmp_path / "dcp", _state())
    with open(src / ".metadata", "rb") as f:
        md = pickle.load(f)
    for info in md.storage_data.values():
        info.relative_path = "../elsewhere.distcp"
    with open(src / ".metadata", "wb") as f:
        pickle.dump(md, f)
    refused = pytest.raises(CorruptCheckpointError, match="outside")
    with Checkpointer(tmp_path / "ck") as ck, refused:
        import_file(src, ck, step=1)


def test_cli_refuses_then_accepts_with_trust_pickle(tmp_path: Path) -> None:
    from stalwart.cli.main import app

    marker = tmp_path / "pwned"
    src = _dcp(tmp_path / "dcp", {**_state(), "extra": _Payload(marker)})
    root = tmp_path / "ck"
    env = {"NO_COLOR": "1", "COLUMNS": "200", "TERM": "dumb"}
    args = ["ckpt", "import", str(src), str(root), "--step", "3"]
    r = CliRunner().invoke(app, args, env=env)
    assert r.exit_code != 0 and "--trust-pickle" in r.output and not marker.exists()
    r = CliRunner().invoke(app, [*args, "--trust-pickle"], env=env)
    assert r.exit_code == 0, r.output
    assert marker.exists()
