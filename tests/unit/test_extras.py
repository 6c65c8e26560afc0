"""Dependencies by need: with only the core installed, checkpoints and ``stalwart ckpt`` work,
and the root-cause and PVF entry points say which extra to install.

"Not installed" is simulated in a child process by a meta-path finder that refuses to import
the optional engines, so the test runs in the full development environment.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import stalwart
from stalwart.errors import MissingDependencyError, StalwartError, require

BLOCKED = ("duckdb", "sklearn", "matplotlib", "scipy", "pyeclib")

_BLOCKER = f"""
import importlib.abc, importlib.machinery, sys

class _NotInstalled(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    # A spec without origin whose loader refuses: `import x` fails as if x were absent,
    # while importlib.util.find_spec (torch._dynamo probes optional modules with it) works.
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {BLOCKED!r}:
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {{spec.name!r}}", name=spec.name)

    def exec_module(self, module):
        raise AssertionError("unreachable")

sys.meta_path.insert(0, _NotInstalled())
"""


def _run(body: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    code = _BLOCKER + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=240
    )


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return _run(
        f"""
        sys.argv = ["stalwart", *{args!r}]
        from stalwart.cli.main import app
        app()
        """,
        cwd,
    )


def test_require_names_the_extra() -> None:
    assert require("json", "rca", "x").dumps([1]) == "[1]"
    with pytest.raises(MissingDependencyError) as info:
        require("duckdb_that_is_not_there", "rca", "stalwart.diagnose")
    assert isinstance(info.value, ImportError) and isinstance(info.value, StalwartError)
    assert "stalwart.diagnose needs duckdb_that_is_not_there" in str(info.value)
    assert "pip install 'stalwart[rca]'" in str(info.value)


def test_core_alone_checkpoints_and_extras_fail_clearly(tmp_path: Path) -> None:
    proc = _run(
        f"""
        import json, torch
        import stalwart
        import stalwart.cli.main
        heavy = {{*{BLOCKED!r}, "pyarrow", "pyspark", "s3fs", "pandas", "polars"}}
        loaded = sorted(m for m in sys.modules if m.partition(".")[0] in heavy)

        model = torch.nn.Linear(4, 3)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        ckpt = stalwart.Checkpointer("run")
        ckpt.save(step=1, state=stalwart.TrainingState(model=model, optimizer=opt))
        want = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.zero_()
        ckpt.load(stalwart.TrainingState(model=model, optimizer=opt))

        errors = {{}}
        def attempt(name, fn):
            try:
                fn()
                errors[name] = None
            except stalwart.errors.MissingDependencyError as e:
                errors[name] = str(e)

        def rca():
            from stalwart import diagnose
            diagnose.analyze("events.csv", label="status != 'ok'")

        def pvf():
            from stalwart import vulnerability
            opts = vulnerability.PVFOptions(stop=vulnerability.FixedTrials(4))
            vulnerability.pvf(model.eval(), torch.randn(8, 4), "top1", opts)

        def digits():
            from stalwart import models
            models.load("digits-cnn")

        attempt("rca", rca)
        attempt("pvf", pvf)
        attempt("digits", digits)
        print(json.dumps({{"loaded": loaded, "equal": bool(torch.equal(model.weight, want)),
                          "steps": ckpt.steps(), "errors": errors}}))
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["loaded"] == []
    assert out["equal"] and out["steps"] == [1]
    assert "stalwart.diagnose needs DuckDB" in out["errors"]["rca"]
    assert "pip install 'stalwart[rca]'" in out["errors"]["rca"]
    assert "needs SciPy" in out["errors"]["pvf"]
    assert "pip install 'stalwart[sdc]'" in out["errors"]["pvf"]
    assert "needs scikit-learn" in out["errors"]["digits"]
    assert "pip install 'stalwart[sdc]'" in out["errors"]["digits"]


@pytest.fixture
def committed(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    ckpt = stalwart.Checkpointer(str(root))
    for step in (1, 2):
        ckpt.save(step=step, state={"w": torch.full((64,), float(step)), "n": step})
    return root


def test_cli_ckpt_works_with_core_alone(committed: Path) -> None:
    ls = _cli(["ckpt", "ls", str(committed)], committed.parent)
    assert ls.returncode == 0, ls.stdout + ls.stderr
    assert "Traceback" not in ls.stderr
    verify = _cli(["ckpt", "verify", str(committed)], committed.parent)
    assert verify.returncode == 0, verify.stdout + verify.stderr


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        (["rca", "events.csv", "--label", "status != 'ok'"], "pip install 'stalwart[rca]'"),
        (["pvf", "digits-cnn", "--trials", "4"], "pip install 'stalwart[sdc]'"),
        (["demo", "--root", "demo"], "pip install 'stalwart[sdc]'"),
    ],
)
def test_cli_without_an_extra_says_what_to_install(
    tmp_path: Path, args: list[str], hint: str
) -> None:
    (tmp_path / "events.csv").write_text("status,host\nok,a\nfail,b\n")
    proc = _cli(args, tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    text = " ".join((proc.stdout + proc.stderr).split())  # rich wraps long lines
    assert hint in text, text
    assert "Traceback" not in text
    assert not (tmp_path / "demo").exists()  # the demo refuses before it starts


def test_reed_solomon_without_pyeclib_names_the_ec_extra(tmp_path: Path) -> None:
    proc = _run(
        """
        from stalwart.checkpoint.memory.erasure_codec import ReedSolomonCodec, XorCodec
        from stalwart.errors import MissingDependencyError
        XorCodec(4)  # m = 1 needs nothing
        try:
            ReedSolomonCodec(4, 2)
        except MissingDependencyError as e:
            print("MISSING:", e)
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'stalwart[ec]'" in proc.stdout, proc.stdout
