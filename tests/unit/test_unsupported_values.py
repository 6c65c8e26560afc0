"""Values the format cannot hold are refused at save with the leaf's name and a way out,
before anything is written."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import stalwart
from stalwart.errors import UnsupportedValueError
from stalwart.tree import flatten


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantize_per_tensor is deprecated, still in use
        return torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)


def _nested() -> torch.Tensor:
    return torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged)


def _complex32() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ComplexHalf is experimental
        return torch.zeros(2, dtype=torch.complex32)


CASES: list[tuple[str, Any, str]] = [
    ("meta", lambda: torch.empty(3, device="meta"), "to_empty"),
    ("sparse_coo", lambda: torch.eye(3).to_sparse(), "to_dense()"),
    ("sparse_csr", lambda: torch.eye(3).to_sparse_csr(), "to_dense()"),
    ("nested", _nested, "unbind()"),
    ("quantized", _quantized, "dequantize()"),
    ("complex32", _complex32, "torch.complex64"),
    ("uint16", lambda: torch.zeros(2, dtype=torch.uint16), ".view(torch.int16)"),
    ("np_object", lambda: np.array([1, "a", None], dtype=object), "np.asarray"),
    ("np_float128", lambda: np.zeros(3, dtype=np.longdouble), "astype(np.float64)"),
    ("np_str", lambda: np.array(["a", "bc"]), "list of str"),
    ("np_datetime", lambda: np.array(["2026-01-01"], dtype="datetime64[s]"), "int64"),
    ("np_uint32", lambda: np.zeros(3, dtype=np.uint32), "view"),
    ("np_record", lambda: np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]), "field"),
]


@pytest.mark.parametrize(("name", "make", "hint"), CASES, ids=[c[0] for c in CASES])
def test_save_refuses_with_name_and_fix(tmp_path: Path, name: str, make: Any, hint: str) -> None:
    if name == "np_float128" and np.dtype(np.longdouble).itemsize == 8:
        pytest.skip("long double is float64 on this platform")
    state = {"model": {"layer": {name: make()}}, "ok": torch.ones(2)}
    ckpt = stalwart.Checkpointer(str(tmp_path / "run"))
    with pytest.raises(UnsupportedValueError) as info:
        ckpt.save(step=1, state=state)
    msg = str(info.value)
    assert f"model.layer.{name}" in msg, msg
    assert hint in msg, msg
    assert ckpt.steps() == []


def test_long_double_scalar_is_refused_not_recursed() -> None:
    if np.dtype(np.longdouble).itemsize == 8:
        pytest.skip("long double is float64 on this platform")
    with pytest.raises(UnsupportedValueError, match=r"'x'.*longdouble"):
        flatten({"x": np.longdouble(1)})


def test_supported_values_still_flatten() -> None:
    flat = flatten(
        {
            "bf16": torch.zeros(2, dtype=torch.bfloat16),
            "fp8": torch.zeros(2, dtype=torch.float8_e4m3fn),
            "bool": np.zeros(2, dtype=bool),
            "c128": np.zeros(2, dtype=np.complex128),
            "scalar": np.float32(1.5),
        }
    )
    assert sorted(flat.leaves) == ["bf16", "bool", "c128", "fp8"]
