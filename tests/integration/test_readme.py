"""README's Python snippets and command examples run as written, in a temp dir.

The ```python blocks run one after another in one interpreter (a reader pastes them into one
session); then the ```bash blocks run line by line with ``stalwart`` on PATH, in the same
folder, so the commands see what the snippets saved (``runs/exp1``) and the example files they
wrote (``events.parquet``, ``leaves.csv``, ``model.pt``). The test makes nothing itself, sets no
credentials and starts no server: what the README does not create, its commands do not get.

A block preceded by ``<!-- readme-test: skip (reason) -->`` is not run (the setup commands,
which create a venv and install packages); nothing else is skipped.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow]

README = Path(__file__).resolve().parents[2] / "README.md"
COVERED_ELSEWHERE = [["stalwart", "demo"]]
"""Commands another test already runs whole: ``stalwart demo`` (a minute on 2 cores) runs in
tests/integration/test_demo.py::test_cli_demo, which also checks every section's output."""

FENCE = re.compile(r"(<!-- readme-test: skip[^>]*-->\s*\n)?```(python|bash)\n(.*?)```", re.S)


def blocks(lang: str) -> list[str]:
    """The README's runnable ``lang`` blocks, in order."""
    return [m[3] for m in FENCE.finditer(README.read_text()) if m[2] == lang and not m[1]]


def commands() -> list[str]:
    """Every command of the bash blocks, one per line (trailing comments dropped by bash)."""
    return [ln for b in blocks("bash") for ln in b.splitlines() if ln.strip()]


def test_readme_parses_into_runnable_blocks() -> None:
    assert len(blocks("python")) >= 4 and len(commands()) >= 10
    skipped = [m for m in FENCE.finditer(README.read_text()) if m[1]]
    assert all("pip install" in m[3] for m in skipped), "only the setup blocks may be skipped"


def test_readme_runs_as_written(tmp_path: Path) -> None:
    bindir = str(Path(sys.executable).parent)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
        "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
        "COLUMNS": "160",
        "NO_COLOR": "1",
    }
    script = tmp_path / "readme_snippets.py"
    script.write_text(
        "import sys\n"
        "blocks = [open(p).read() for p in sys.argv[1:]]\n"
        "ns = {'__name__': '__main__'}\n"
        "for i, code in enumerate(blocks, 1):\n"
        "    exec(compile(code, f'README python block {i}', 'exec'), ns)\n"
    )
    paths = []
    for i, code in enumerate(blocks("python"), 1):
        paths.append(tmp_path / f"block{i}.py")
        paths[-1].write_text(code)
    run = subprocess.run(
        [sys.executable, str(script), *map(str, paths)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    for cmd in commands():
        if shlex.split(cmd, comments=True) in COVERED_ELSEWHERE:
            continue
        done = subprocess.run(
            ["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, f"{cmd}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        if shlex.split(cmd, comments=True)[-1:] == ["--json"]:
            json.loads(done.stdout)  # --json prints JSON alone on stdout


def test_commands_covered_elsewhere_are_in_the_readme() -> None:
    readme = [shlex.split(c, comments=True) for c in commands()]
    assert all(c in readme for c in COVERED_ELSEWHERE)
