"""Export of trees whose tensors share memory in other layouts (a weight and its transpose)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stalwart import Checkpointer
from stalwart.checkpoint.tools.export import export_step, unshared

pytestmark = pytest.mark.timeout(60)


def test_unshared_copies_a_transposed_view_into_contiguous_memory() -> None:
    w = torch.arange(12.0).reshape(3, 4)
    out = unshared({"w": w, "w_t": w.t(), "row": w[1]})
    assert all(t.is_contiguous() for t in out.values())
    ptrs = [t.untyped_storage().data_ptr() for t in out.values()]
    assert len(set(ptrs)) == len(ptrs)  # each tensor has memory of its own
    assert torch.equal(out["w_t"], w.t()) and torch.equal(out["row"], w[1])


@pytest.mark.parametrize("order", [("w", "w_t"), ("w_t", "w")])
def test_safetensors_export_of_a_tensor_and_its_transpose(
    tmp_path: Path, order: tuple[str, str]
) -> None:
    from safetensors.torch import load_file

    w = torch.arange(12.0).reshape(3, 4)
    views = {"w": w, "w_t": w.t()}
    with Checkpointer(tmp_path / "root") as ck:
        ck.save(1, {name: views[name] for name in order})
        result = export_step(ck, tmp_path / "model.safetensors")
    assert result.tensors == 2
    flat = load_file(result.path)
    assert flat.keys() == {"w", "w_t"}
    assert torch.equal(flat["w"], w) and torch.equal(flat["w_t"], w.t())
