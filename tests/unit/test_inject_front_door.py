"""The small front door of ``stalwart.inject``: what a user calls is exported, the
rest lives in named submodules, and the old paths warn for one release."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from stalwart import inject

MAX_NAMES = 15


def test_front_door_is_small_sorted_and_importable() -> None:
    assert len(inject.__all__) <= MAX_NAMES
    assert inject.__all__ == sorted(inject.__all__)
    for name in inject.__all__:
        assert hasattr(inject, name), name


@pytest.mark.parametrize("name", sorted(inject._MOVED))
def test_old_path_warns_and_returns_the_same_object(name: str) -> None:
    home = importlib.import_module(f"stalwart.inject.{inject._MOVED[name]}")
    with pytest.warns(DeprecationWarning, match=f"stalwart.inject.{name} moved to"):
        old = getattr(inject, name)
    assert old is getattr(home, name)


def test_old_from_import_warns() -> None:
    with pytest.warns(DeprecationWarning, match="inject.bits.layout_of"):
        from stalwart.inject import layout_of  # noqa: F401


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        inject.nothing  # noqa: B018


def test_importing_every_module_uses_no_old_path() -> None:
    """Every submodule (and what shows the package off) imports without a moved name."""
    code = (
        "import importlib, pkgutil, warnings, stalwart.inject as p; "
        "warnings.filterwarnings('error', message='.*moved to', category=DeprecationWarning); "
        "names = [m.name for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.')]; "
        "names += []; "
        "[importlib.import_module(n) for n in names if '__main__' not in n]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
