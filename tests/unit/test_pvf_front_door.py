"""The small front door of ``stalwart.vulnerability``: what a user calls is exported, the
rest lives in named submodules, and the old paths warn for one release."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from stalwart import vulnerability

MAX_NAMES = 15


def test_front_door_is_small_sorted_and_importable() -> None:
    assert len(vulnerability.__all__) <= MAX_NAMES
    assert vulnerability.__all__ == sorted(vulnerability.__all__)
    for name in vulnerability.__all__:
        assert hasattr(vulnerability, name), name


@pytest.mark.parametrize("name", sorted(vulnerability._MOVED))
def test_old_path_warns_and_returns_the_same_object(name: str) -> None:
    home = importlib.import_module(f"stalwart.vulnerability.{vulnerability._MOVED[name]}")
    with pytest.warns(DeprecationWarning, match=f"stalwart.vulnerability.{name} moved to"):
        old = getattr(vulnerability, name)
    assert old is getattr(home, name)


def test_old_from_import_warns() -> None:
    with pytest.warns(DeprecationWarning, match="vulnerability.stats.wilson"):
        from stalwart.vulnerability import wilson  # noqa: F401


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        vulnerability.nothing  # noqa: B018


def test_importing_every_module_uses_no_old_path() -> None:
    """Every submodule (and what shows the package off) imports without a moved name."""
    code = (
        "import importlib, pkgutil, warnings, stalwart.vulnerability as p; "
        "warnings.filterwarnings('error', message='.*moved to', category=DeprecationWarning); "
        "names = [m.name for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.')]; "
        "names += ['stalwart.demos.pvf', 'stalwart.cli.pvf']; "
        "[importlib.import_module(n) for n in names if '__main__' not in n]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
