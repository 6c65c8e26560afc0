"""export_dcp of steps whose top level is not a mapping: a list, or one bare tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from stalwart import Checkpointer
from stalwart.integrations.dcp import export_dcp, import_dcp

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.timeout(120),
]


def test_a_list_at_the_top_level_exports_under_state(tmp_path: Path) -> None:
    saved = [torch.randn(3, 2), torch.arange(5, dtype=torch.int16)]
    Checkpointer(tmp_path / "root").save(1, saved)  # stalwart names them "0" and "1"
    r = export_dcp(tmp_path / "root", tmp_path / "dcp", step=1)  # was: no stalwart name "state.0"
    assert (r.tensors, r.bytes_total) == (2, 3 * 2 * 4 + 5 * 2)
    target = {"state": [torch.zeros(3, 2), torch.zeros(5, dtype=torch.int16)]}
    dcp.load(target, storage_reader=FileSystemReader(tmp_path / "dcp"), no_dist=True)
    assert all(torch.equal(a, b) for a, b in zip(target["state"], saved, strict=True))


def test_a_bare_tensor_exports_as_state_and_imports_back(tmp_path: Path) -> None:
    saved = torch.randn(4, 4, dtype=torch.float64)
    Checkpointer(tmp_path / "root").save(2, saved)  # its stalwart name is ""
    export_dcp(tmp_path / "root", tmp_path / "dcp", step=2)  # was: no stalwart name "state"
    target = {"state": torch.zeros(4, 4, dtype=torch.float64)}
    dcp.load(target, storage_reader=FileSystemReader(tmp_path / "dcp"), no_dist=True)
    assert torch.equal(target["state"], saved)
    import_dcp(tmp_path / "dcp", tmp_path / "back", 3)
    assert torch.equal(Checkpointer(tmp_path / "back").load(None, 3)["state"], saved)
