"""README's Python snippets and command examples run as written, in a temp dir.

The ```python blocks run one after another in one interpreter (a reader pastes them into one
session); then the ```bash blocks run line by line with ``stalwart`` on PATH, in the same
folder, so the commands see what the snippets saved (``runs/exp1``). The example files the
README names (``events.parquet``, ``leaves.csv``, ``model.pt``) are generated first. The
``s3://bucket/...`` tier writes to a local moto S3 server (``AWS_ENDPOINT_URL``).

A block preceded by ``<!-- readme-test: skip (reason) -->`` is not run (the setup commands,
which create a venv and install packages); nothing else is skipped.
"""

from __future__ import annotations

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


def _example_files(where: Path) -> None:
    """The files the README's commands name, made as a user would have them."""
    import numpy as np
    import pandas as pd
    import torch

    rng = np.random.default_rng(0)
    n = 4000
    events = pd.DataFrame(
        {
            "host": rng.choice([f"h{i}" for i in range(20)], n),
            "gpu": rng.choice(["a100", "h100", "l4"], n),
            "driver": rng.choice(["535", "550"], n),
        }
    )
    bad = (events.host == "h3") & (events.driver == "550")
    fails = bad & (rng.random(n) < 0.9) | (rng.random(n) < 0.02)
    events["status"] = np.where(fails, "xid79", "ok")
    events.to_parquet(where / "events.parquet")
    leaves = pd.DataFrame(
        {
            "region": np.repeat(["eu", "us", "ap"], 40),
            "service": np.tile([f"s{i}" for i in range(40)], 3),
        }
    )
    leaves["forecast"] = 100.0 + rng.normal(0, 1, len(leaves))
    leaves["value"] = leaves.forecast + np.where(leaves.region == "eu", -40.0, 0.0)
    leaves.to_csv(where / "leaves.csv", index=False)
    torch.manual_seed(0)
    torch.save(torch.nn.Linear(64, 64).state_dict(), where / "model.pt")


def test_readme_runs_as_written(tmp_path: Path) -> None:
    from stalwart.testing.s3_server import S3Server

    _example_files(tmp_path)
    bindir = str(Path(sys.executable).parent)
    with S3Server() as s3:
        s3.make_bucket("bucket")
        env = {
            **os.environ,
            "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
            "AWS_ENDPOINT_URL": s3.endpoint_url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
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
                import json

                json.loads(done.stdout)  # --json prints JSON alone on stdout


def test_commands_covered_elsewhere_are_in_the_readme() -> None:
    readme = [shlex.split(c, comments=True) for c in commands()]
    assert all(c in readme for c in COVERED_ELSEWHERE)
