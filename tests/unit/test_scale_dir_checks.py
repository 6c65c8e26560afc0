"""``python -m stalwart.vulnerability.scale`` with a ``--dir`` it cannot use: a clear message and
exit 2 (bad input), not a traceback and exit 1 ("a worker failed")."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.vulnerability.scale.__main__ import main

pytestmark = pytest.mark.timeout(120)

MODEL = "tests.distributed.campaign_models:tiny"


def test_dir_that_is_a_file_is_refused_up_front(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("hi\n")
    args = [MODEL, "--dir", str(afile), "--trials", "20", "--workers", "1", "--backend", "local"]
    assert main(args) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "is a file; give a folder" in err and "Traceback" not in err
    assert afile.read_text() == "hi\n"


def test_dir_under_a_file_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "afile").write_text("hi\n")
    inside = tmp_path / "afile" / "camp"  # the folder cannot be made: OSError from the disk
    args = [MODEL, "--dir", str(inside), "--trials", "20", "--workers", "1", "--backend", "local"]
    assert main(args) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "check that --dir" in err and "is a folder you can write" in err
