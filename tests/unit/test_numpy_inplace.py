"""In-place load writes into every layout of numpy array the state may hold (checked by
bytes), and refuses read-only arrays before reading anything."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import stalwart
from stalwart.errors import UnsupportedValueError


def _grid(dtype: str = "float64") -> np.ndarray:
    return np.arange(1, 25, dtype=dtype).reshape(4, 6)


LAYOUTS: dict[str, Callable[[], np.ndarray]] = {
    "c_contiguous": _grid,
    "fortran": lambda: np.asfortranarray(_grid()),
    "transposed": lambda: _grid().T,
    "strided_slice": lambda: _grid()[::2, 1::2],
    "negative_stride": lambda: _grid()[::-1],
    "negative_both": lambda: _grid()[::-1, ::-2],
    "zero_d": lambda: np.array(7.5),
    "big_endian": lambda: _grid().astype(">f8"),
    "big_endian_int": lambda: _grid("int32").astype(">i4")[:, ::-1],
    "record_field": lambda: np.array(
        [(i, float(i) / 2) for i in range(1, 6)], dtype=[("a", "i1"), ("b", "<f8")]
    )["b"],
    "bool_view": lambda: (_grid() % 3 == 0)[:, ::2],
    "empty": lambda: np.zeros((0, 3)),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_load_writes_into_the_callers_array(tmp_path: Path, layout: str) -> None:
    arr = LAYOUTS[layout]()
    saved = arr.copy()  # keeps dtype (byte order included) and values
    ckpt = stalwart.Checkpointer(str(tmp_path / "run"))
    ckpt.save(step=1, state={"x": {"a": arr}})
    arr[...] = 0
    ckpt.load({"x": {"a": arr}})
    assert arr.shape == saved.shape and arr.dtype == saved.dtype
    assert arr.tobytes() == saved.tobytes(), layout  # tobytes is in logical (C) order
    tree = ckpt.load()
    assert (
        np.asarray(tree["x"]["a"]).tobytes()
        == saved.astype(saved.dtype.newbyteorder("=")).tobytes()
    )


def test_training_state_extra_array_is_loaded_in_place(tmp_path: Path) -> None:
    arr = _grid()[::-1, ::2]
    saved = arr.copy()
    ckpt = stalwart.Checkpointer(str(tmp_path / "run"))
    ckpt.save(step=1, state=stalwart.TrainingState(extra={"arr": arr}, rng=False))
    arr[...] = -1
    extra = {"arr": arr}
    ckpt.load(stalwart.TrainingState(extra=extra, rng=False))
    assert arr.tobytes() == saved.tobytes()
    assert np.array_equal(extra["arr"], saved)


def test_read_only_array_is_saved_but_refused_at_load(tmp_path: Path) -> None:
    arr = _grid()
    arr.flags.writeable = False
    ckpt = stalwart.Checkpointer(str(tmp_path / "run"))
    ckpt.save(step=1, state={"frozen": arr, "other": np.zeros(3)})
    other = np.ones(3)
    with pytest.raises(UnsupportedValueError, match=r"'frozen' is read-only.*arr\.copy\(\)"):
        ckpt.load({"frozen": arr, "other": other})
    assert np.array_equal(other, np.ones(3))  # refused before anything was written
    assert np.array_equal(ckpt.load()["frozen"], arr)
