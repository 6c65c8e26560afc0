"""The CLI's surface is frozen in tests/golden/cli_surface.json; and it keeps its conventions.

Every command, every option name, its type, default and choices are compared with the golden
file, so that a renamed flag or a changed default is a deliberate decision, not an accident.
After such a decision, regenerate the file with

    STALWART_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_cli_surface.py

and commit it with the change (and README's "Command line" section, if it shows the flag).
"""

from __future__ import annotations

import enum
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.main import get_command
from typer.testing import CliRunner

from stalwart.cli.main import app

pytestmark = pytest.mark.timeout(120)

GOLDEN = Path(__file__).parents[1] / "golden" / "cli_surface.json"
ENV = {"COLUMNS": "200", "NO_COLOR": "1"}


def _type(annotation: Any) -> tuple[str, list[str] | None]:
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "choice", [m.value for m in annotation]
    name = getattr(annotation, "__name__", None)
    return (name if name and "[" not in str(annotation) else str(annotation)), None


def _param(p: Any) -> dict[str, Any]:
    kind, choices = _type(p.type_descriptor.annotation)
    default = p.default
    if isinstance(default, (list, tuple)):
        default = [getattr(d, "value", d) for d in default]
    elif not isinstance(default, (str, int, float, bool, type(None))):
        default = str(getattr(default, "value", default))
    return {
        "kind": type(p).__name__.removeprefix("Typer").lower(),
        "opts": sorted(p.opts + p.secondary_opts),
        "type": kind,
        "default": default,
        "required": p.required,
        "multiple": bool(getattr(p, "multiple", False) or p.nargs == -1),
        **({"choices": choices} if choices else {}),
    }


def surface() -> dict[str, Any]:
    """Every command path -> its parameters, in a JSON-comparable form."""
    out: dict[str, Any] = {}

    def walk(cmd: Any, path: str) -> None:
        out[path] = {p.name: _param(p) for p in cmd.params}
        for name, sub in sorted(getattr(cmd, "commands", {}).items()):
            walk(sub, f"{path} {name}")

    walk(get_command(app), "stalwart")
    return out


def _dump(s: dict[str, Any]) -> str:
    """JSON with one line per parameter, so that a diff of the golden file reads well."""
    cmds = []
    for cmd in sorted(s):
        rows = [
            f"    {json.dumps(n)}: {json.dumps(p, sort_keys=True)}"
            for n, p in sorted(s[cmd].items())
        ]
        cmds.append(
            f"  {json.dumps(cmd)}: {{\n" + ",\n".join(rows) + "\n  }"
            if rows
            else f"  {json.dumps(cmd)}: {{}}"
        )
    return "{\n" + ",\n".join(cmds) + "\n}\n"


def test_cli_surface_matches_golden() -> None:
    now = surface()
    if os.environ.get("STALWART_UPDATE_GOLDEN"):
        GOLDEN.write_text(_dump(now))
    golden = json.loads(GOLDEN.read_text())
    changed = sorted(
        f"{cmd}: {name}"
        for cmd in set(now) | set(golden)
        for name in set(now.get(cmd, {})) | set(golden.get(cmd, {}))
        if now.get(cmd, {}).get(name) != golden.get(cmd, {}).get(name)
    )
    assert not changed and set(now) == set(golden), (
        "the CLI surface changed (command: parameter): "
        + ", ".join(changed or sorted(set(now) ^ set(golden)))
        + ". If that is deliberate, update the golden file with STALWART_UPDATE_GOLDEN=1 "
        ".venv/bin/python -m pytest tests/unit/test_cli_surface.py, keep one flag name per "
        "meaning (see stalwart.cli.conventions), and commit tests/golden/cli_surface.json"
    )


def test_one_flag_per_meaning_and_json_everywhere() -> None:
    meaning: dict[str, set[str]] = {}
    for cmd, params in surface().items():
        leaf = not any(other.startswith(cmd + " ") for other in surface())
        if leaf and cmd != "stalwart run":  # run forwards the worker script's own output
            assert "as_json" in params, f"{cmd} has no --json"
            assert params["as_json"]["opts"] == ["--json"] and params["as_json"]["type"] == "bool"
        for name, p in params.items():
            for opt in p["opts"]:
                if opt.startswith("-") and not opt.startswith("--"):
                    meaning.setdefault(opt, set()).add(name)
    clashes = {opt: names for opt, names in meaning.items() if len(names) > 1}
    assert not clashes, f"one short flag, several meanings: {clashes}"


def test_library_choices_match_the_cli_copies() -> None:
    from stalwart.checkpoint.tools.export import FORMATS
    from stalwart.cli import ckpt, pvf
    from stalwart.inject.error_models import _MODELS
    from stalwart.vulnerability.pvf import GROUPINGS
    from stalwart.vulnerability.stats import INTERVALS

    assert tuple(c.value for c in pvf.By) == GROUPINGS
    assert {c.value for c in pvf.Error} == set(_MODELS)
    assert {c.value for c in pvf.Interval} == set(INTERVALS)
    assert {c.value for c in pvf.Dtype} == set(pvf._DTYPES)
    assert {c.value for c in ckpt.Format} == {*FORMATS, "dcp"}


def _invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args), env=ENV)


def test_bad_choice_fails_before_any_work() -> None:
    r = _invoke("pvf", "no-such-model", "--by", "banana")  # the model is never looked up
    assert r.exit_code == 2 and "banana" in r.output and "no-such-model" not in r.output
    r = _invoke("pvf", "no-such-model", "-c", "banana")
    assert r.exit_code == 2 and "unknown criterion" in r.output
    r = _invoke("rca", "nothing.csv", "--label", "x", "--engine", "pandas")
    assert r.exit_code == 2 and "pandas" in r.output


def test_unexpected_error_exits_3_with_a_hint(tmp_path: Path, monkeypatch: Any) -> None:
    # The factory builds; the model fails inside the campaign: not a usage error (a factory's
    # own error is the user's, exit 2: test_pvf_factory_errors_are_the_users_to_fix).
    (tmp_path / "boom_factory.py").write_text(
        "import torch\nfrom torch import nn\n"
        "class Boom(nn.Linear):\n"
        "    calls = 0\n"
        "    def forward(self, x):\n"
        "        Boom.calls += 1\n"
        "        if Boom.calls > 1: raise RuntimeError('kaboom in the model')\n"
        "        return super().forward(x)\n"
        "def make():\n    return Boom(4, 3), torch.randn(8, 4), torch.randint(0, 3, (8,))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    r = _invoke("pvf", "boom_factory:make", "--trials", "1")
    assert r.exit_code == 3, r.output
    assert "kaboom in the model" in r.output and "-v" in r.output
    assert "Traceback" not in r.output
    r = _invoke("-v", "pvf", "boom_factory:make", "--trials", "1")
    assert r.exit_code == 3 and "Traceback" in r.output


def test_version_and_python_m_run_every_command() -> None:
    from importlib.metadata import version

    r = _invoke("--version")
    assert r.exit_code == 0 and version("stalwart") in r.output
    env = {**os.environ, **ENV}
    for cmd in ([], ["ckpt"]):
        out = subprocess.run(
            [sys.executable, "-m", "stalwart", *cmd, "--help"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        for sub in (
            ("demo", "ckpt", "pvf", "protect", "rca", "run")
            if not cmd
            else ("ls", "inspect", "verify", "diff", "export", "import", "gc", "rm")
        ):
            assert sub in out.stdout, (cmd, sub)
    assert "--install-completion" in _invoke("--help").output


def test_ckpt_import_without_step(tmp_path: Path) -> None:
    import torch

    torch.save({"w": torch.arange(4.0)}, tmp_path / "model.pt")
    root = tmp_path / "imported"
    r = _invoke("ckpt", "import", str(tmp_path / "model.pt"), str(root))
    assert r.exit_code == 0 and "as step 0" in r.output, r.output
    r = _invoke("ckpt", "import", str(tmp_path / "model.pt"), str(root), "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["step"] == 1, r.output


def test_typer_app_is_the_one_entry_point() -> None:
    import stalwart.__main__ as entry

    assert entry.app is app and isinstance(app, typer.Typer)


def test_every_command_has_help() -> None:
    for cmd in surface():
        r = _invoke(*cmd.split()[1:], "--help")
        assert r.exit_code == 0 and "Usage" in r.output, (cmd, r.output)


def test_json_of_demo_and_protect(tmp_path: Path) -> None:
    r = _invoke(
        "demo", "--root", str(tmp_path / "demo"), "--steps", "12", "--every", "4",
        "--no-recovery", "--no-pvf", "--no-rca", "--no-elastic", "--json",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["ok"] is True and doc["resume_ok"] is True and doc["resume"]["saves"] > 0
    r = _invoke("protect", "mlp", "--trials", "10", "-p", "sbp", "--json")
    assert r.exit_code == 0, r.output
    assert [x["name"] for x in json.loads(r.stdout)["results"]]


def test_run_leaves_everything_after_the_script_to_the_script() -> None:
    # As torchrun does: an option after the script belongs to it, even one the launcher also
    # knows (a worker's own --timeout or --json was taken by the launcher before).
    run = get_command(app).commands["run"]  # type: ignore[attr-defined]
    line = ["--nproc", "4", "--group-size", "2", "train.py", "--timeout", "5", "--json",
            "--group-size", "3", "--lr", "0.1"]  # fmt: skip
    params = run.make_context("run", list(line)).params  # (click consumes the list)
    assert (params["nproc"], params["group_size"], params["timeout"]) == (4, 2, 10.0)
    assert params["as_json"] is False and params["script"] == Path("train.py")
    assert list(params["args"]) == line[5:]


def test_run_refuses_a_script_that_is_not_a_file(tmp_path: Path) -> None:
    # Before, the launcher started the workers anyway: each died at once ("can't open file"),
    # was respawned, and the run ended in a table of 0 workers with no reason given.
    for script, what in ((tmp_path / "nope.py", "does not exist"), (tmp_path, "is a folder")):
        r = _invoke("run", str(script))
        assert r.exit_code == 2 and what in r.stderr and "check the path" in r.stderr, r.stderr
        assert "Traceback" not in r.output


def test_pvf_factory_errors_are_the_users_to_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A factory's own error, a module that does not import, a name that is not a function:
    # each was exit 3, "this is a bug ... report it". And the console script could not import
    # a module from the folder it ran in, which `python -m stalwart` can.
    (tmp_path / "stalwart_user_models.py").write_text(
        "import torch\nfrom torch import nn\nvalue = 3\n"
        "def raises():\n    raise RuntimeError('boom in factory')\n"
        "def needs(x):\n    return x\n"
        "def ok():\n    return nn.Linear(4, 3), torch.randn(8, 4), torch.randint(0, 3, (8,))\n"
    )
    (tmp_path / "stalwart_user_broken.py").write_text("def fn(:\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    cases = {
        "stalwart_user_models:raises": "failed while building the model (RuntimeError: boom",
        "stalwart_user_models:needs": "failed while building the model (TypeError",
        "stalwart_user_models:value": "is not a function (int)",
        "stalwart_user_models:nothere": "has no 'nothere'",
        "stalwart_user_broken:fn": "failed to import (SyntaxError",
        "stalwart_no_such_module:fn": "run from the folder that holds it",
        ":": "give the model factory as package.module:factory",
    }
    for spec, says in cases.items():
        r = _invoke("pvf", spec, "--trials", "4")
        assert r.exit_code == 2 and says in r.stderr, (spec, r.exit_code, r.output)
    r = _invoke("pvf", "stalwart_user_models:ok", "--trials", "8")
    assert r.exit_code == 0 and "model-level PVF" in r.stdout, r.output


def test_a_negative_seed_is_a_usage_error() -> None:
    # It reached numpy's seeding: exit 3, "ValueError: expected non-negative integer".
    for cmd in (["pvf", "mlp"], ["protect", "digits-cnn"], ["plan"]):
        r = _invoke(*cmd, "--seed", "-1")
        assert r.exit_code == 2 and "--seed" in r.output, (cmd, r.output)


def test_outputs_the_command_could_not_write_are_refused_before_any_work(tmp_path: Path) -> None:
    # They failed at the end with a bare errno ("[Errno 21] Is a directory", "[Errno 17] File
    # exists"), after the whole campaign or analysis had run.
    folder, file = tmp_path / "folder", tmp_path / "file.txt"
    folder.mkdir()
    file.write_text("x")
    cases = [
        (["rca", "log.csv", "-l", "failed", "--json-out", str(folder)], "is a folder"),
        (["rca", "log.csv", "-l", "failed", "--html", str(tmp_path / "no" / "r.html")],
         "create it first"),
        (["ckpt", "diff", str(tmp_path), "1", "2", "--html", str(folder)], "is a folder"),
        (["pvf", "mlp", "--out", str(file)], "is a file"),
        (["pvf", "mlp", "--campaign-dir", str(file)], "is a file"),
        (["protect", "digits-cnn", "--out", str(file)], "is a file"),
        (["plan", "--plot", str(folder)], "is a folder"),
    ]  # fmt: skip
    for args, says in cases:
        r = _invoke(*args)
        assert r.exit_code == 2 and says in " ".join(r.output.split()), (args, r.output)
