"""``stalwart plan`` with an inputs or costs file that is not UTF-8: a usage error naming the
file and what to do (exit 2), not an unexpected error."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from stalwart.cli.main import app

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}


@pytest.mark.parametrize(("option", "name", "body"), [
    ("--inputs", "latin1.toml", b"[job]\nstep_s = 5\n# caf\xe9\n"),
    ("--costs", "latin1.json", b'{"torchrun_restart_s": 60, "note": "caf\xe9"}'),
])  # fmt: skip
def test_non_utf8_file_is_a_usage_error(
    tmp_path: Path, option: str, name: str, body: bytes
) -> None:
    path = tmp_path / name
    path.write_bytes(body)
    r = CliRunner().invoke(app, ["plan", "--no-simulate", option, str(path)], env=ENV)
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert name in text and "not UTF-8 text" in text and "save it as UTF-8" in text
    assert "unexpected" not in text and "bug" not in text
