"""``stalwart ckpt ...`` through typer's CliRunner, on real checkpoints in tmp_path."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from stalwart import Checkpointer, CheckpointOptions
from stalwart.errors import CheckpointError

pytestmark = pytest.mark.timeout(120)

ENV = {"COLUMNS": "400", "NO_COLOR": "1"}  # wide enough that no cell wraps


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    from stalwart.cli.main import app as main_app

    return main_app


def run(app: typer.Typer, *args: object) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, ["ckpt", *map(str, args)], env=ENV)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r.exit_code, r.stdout, r.stderr


@pytest.fixture
def root(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))
    path = tmp_path / "ck"
    with Checkpointer(path, CheckpointOptions(chunk_bytes=4096)) as ck:
        ck.save(10, {"model": m.state_dict(), "step": 10})
        with torch.no_grad():
            m[1].weight.mul_(1.5)  # type: ignore[operator]
        ck.save(20, {"model": m.state_dict(), "step": 20})
    return path


def test_ls(app: typer.Typer, root: Path) -> None:
    code, out, _ = run(app, "ls", root)
    assert code == 0
    assert "10" in out and "20" in out and "dedup" in out
    code, out, _ = run(app, "ls", root, "--json")
    doc = json.loads(out)
    assert [s["step"] for s in doc["steps"]] == [10, 20]
    s20 = doc["steps"][1]
    assert s20["tensors"] == 4 and s20["bytes_written"] < s20["logical_bytes"]
    assert s20["dedup_ratio"] > 1


def test_missing_root_is_a_short_error(app: typer.Typer, tmp_path: Path) -> None:
    for cmd in ("ls", "inspect", "verify", "gc"):
        code, out, err = run(app, cmd, tmp_path / "nope")
        assert code == 2, cmd
        assert "does not exist" in err and "Traceback" not in out + err


def test_inspect(app: typer.Typer, root: Path) -> None:
    code, out, _ = run(app, "inspect", root, "--step", 10)
    assert code == 0
    assert "model.0.weight" in out and "float32" in out and "(64, 32)" in out
    assert "dedup ratio" in out
    code, out, _ = run(app, "inspect", root, "--limit", 1)
    assert "3 more tensors" in out
    doc = json.loads(run(app, "inspect", root, "--json")[1])
    assert doc["step"] == 20 and len(doc["tensors"]) == 4
    w = next(t for t in doc["tensors"] if t["name"] == "model.0.weight")
    assert w["shape"] == [64, 32] and w["bytes"] == 64 * 32 * 4 and w["chunks"] == 2
    assert doc["totals"]["logical_bytes"] == sum(t["bytes"] for t in doc["tensors"])
    assert doc["totals"]["stored_bytes"] <= doc["totals"]["logical_bytes"]
    code, _, err = run(app, "inspect", root, "--step", 99)
    assert code == 2 and "step 99" in err


def test_verify(app: typer.Typer, root: Path) -> None:
    code, out, _ = run(app, "verify", root)
    assert code == 0 and "step 10: ok" in out and "step 20: ok" in out
    doc = json.loads(run(app, "verify", root, "--step", 20, "--json")[1])
    assert doc["ok"] is True and doc["steps"][0]["chunks_checked"] > 0

    with Checkpointer(root) as ck:
        c = ck.manifest(20).tensors["model.1.weight"].shards[0].chunks[0]
    with open(root / c.pack, "r+b") as f:
        f.seek(c.offset)
        b = f.read(1)
        f.seek(c.offset)
        f.write(bytes([b[0] ^ 1]))
    code, out, _ = run(app, "verify", root)
    assert code == 1
    assert "step 10: ok" in out and "DAMAGED" in out
    assert "model.1.weight" in out and "does not match its hash" in out
    code, out, _ = run(app, "verify", root, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False
    assert [s["ok"] for s in doc["steps"]] == [True, False]
    assert any(c.pack in d for d in doc["steps"][1]["damaged"])


def test_verify_damaged_manifest(app: typer.Typer, root: Path) -> None:
    (root / "manifests" / f"step-{10:020d}.json").write_text("{ not json")
    code, out, err = run(app, "verify", root)
    assert code == 1 and "manifest of step 10" in out and "Traceback" not in out + err
    code, out, _ = run(app, "ls", root)
    assert code == 0 and "damaged manifest" in out
    code, _, err = run(app, "gc", root, "--grace-s", 0)
    assert code == 1 and "without deleting" in err  # damage found: 1 (2 is for usage errors)
    code, out, _ = run(app, "rm", root, 10)  # a damaged step can be cleared away
    assert code == 0 and "deleted step 10" in out
    code, out, _ = run(app, "verify", root)
    assert code == 0
    code, _, err = run(app, "rm", root, 10)
    assert code == 2 and "not a committed checkpoint" in err


def test_damage_in_ls_and_verify_is_told_the_command_lines_way(
    app: typer.Typer, root: Path
) -> None:
    # The damage texts came from the library: "use fallback=True", an argument of a Python
    # call, in the CLI's ls --json and verify table and JSON.
    (root / "manifests" / f"step-{10:020d}.json").write_text("{ not json")
    for args in (("ls", root, "--json"), ("verify", root, "--json"), ("verify", root)):
        _, out, _ = run(app, *args)
        assert "fallback=True" not in out and "ckpt verify ROOT" in " ".join(out.split()), args


def test_rm_frees_the_packs_only_that_step_used_at_once(app: typer.Typer, root: Path) -> None:
    # `ckpt rm` then `ckpt gc` freed nothing for gc's grace (an hour): the step's packs were
    # committed, no save writes them, so they go as retention's do, and a shared one stays.
    packs = {p.name for p in (root / "packs").iterdir()}
    code, out, _ = run(app, "rm", root, 20, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["deleted_packs"] and doc["bytes_freed"] > 0
    left = {p.name for p in (root / "packs").iterdir()}
    assert left == packs - {Path(p).name for p in doc["deleted_packs"]} and left
    code, _, _ = run(app, "verify", root)
    assert code == 0  # step 10 still whole


def test_diff(app: typer.Typer, root: Path, tmp_path: Path) -> None:
    code, out, _ = run(app, "diff", root, 10, 20)
    assert code == 0
    assert "model.1.weight" in out and "changed" in out
    assert "model.0.weight" not in out  # unchanged tensors only in the summary line
    assert "3 unchanged, 1 changed" in out and "step" in out  # the step value changed
    code, out, _ = run(app, "diff", root, 10, 20, "--all")
    assert "model.0.weight" in out
    html = tmp_path / "d.html"
    code, out, err = run(app, "diff", root, 10, 20, "--json", "--html", html)
    doc = json.loads(out)
    assert code == 0 and doc["counts"]["changed"] == 1 and doc["tensors_read"] == 1
    row = next(t for t in doc["tensors"] if t["name"] == "model.1.weight")
    assert row["relative"] == pytest.approx(0.5)
    assert "<svg" in html.read_text() and str(html) in err


def test_export_and_import(app: typer.Typer, root: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out_file = tmp_path / "m.safetensors"
    code, out, _ = run(app, "export", root, out_file, "--step", 10)
    assert code == 0 and "exported step 10" in out
    assert set(load_file(out_file)) == {
        "model.0.weight",
        "model.0.bias",
        "model.1.weight",
        "model.1.bias",
    }
    code, _, err = run(app, "export", root, out_file)
    assert code == 2 and "--overwrite" in err
    assert run(app, "export", root, out_file, "--overwrite")[0] == 0
    pt = tmp_path / "m.pt"
    assert run(app, "export", root, pt, "--format", "torch")[0] == 0
    assert torch.load(pt, weights_only=True)["step"] == 20
    code, _, err = run(app, "export", root, tmp_path / "x", "--format", "npz")
    assert code == 2 and "safetensors" in err

    new_root = tmp_path / "imported"
    code, out, _ = run(app, "import", pt, new_root, "--step", 3)
    assert code == 0 and "(torch)" in out
    code, out, _ = run(app, "import", out_file, new_root, "--step", 4)
    assert code == 0 and "(safetensors)" in out
    assert [s["step"] for s in json.loads(run(app, "ls", new_root, "--json")[1])["steps"]] == [
        3,
        4,
    ]
    code, _, err = run(app, "import", pt, new_root, "--step", 3)
    assert code == 2 and "already exists" in err
    code, out, _ = run(app, "import", pt, new_root, "--step", 3, "--overwrite")
    assert code == 0 and "as step 3" in out  # replaced on purpose
    dcp_dir = tmp_path / "dcp"
    assert run(app, "export", root, dcp_dir, "--format", "dcp")[0] == 0
    code, _, err = run(app, "import", dcp_dir, new_root, "--step", 4)
    assert code == 2 and "pass --overwrite" in err and "overwrite=True" not in err
    assert run(app, "import", dcp_dir, new_root, "--step", 4, "--overwrite")[0] == 0
    junk = tmp_path / "junk.bin"
    rng = random.Random(5)
    # Seeded junk, with the cases random bytes once hit 1 in 256 times: a pickle opcode first.
    for head in (b"", b"\x80", b"\x80\x02", b"\x80\x02\x8a\n"):
        junk.write_bytes(head + rng.randbytes(64))
        code, out, err = run(app, "import", junk, new_root, "--step", 5)
        assert code == 2 and "import accepts" in err and "Traceback" not in out + err, head
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(3)}, legacy, _use_new_zipfile_serialization=False)
    code, out, _ = run(app, "import", legacy, new_root, "--step", 6)
    assert code == 0 and "(torch)" in out


def test_export_format_follows_the_file_name(app: typer.Typer, root: Path, tmp_path: Path) -> None:
    """No --format: the suffix decides; a --format the suffix contradicts is refused, and no
    file is written (a model.pt holding safetensors would fail torch.load later)."""
    pt = tmp_path / "model.pt"
    code, out, _ = run(app, "export", root, pt, "--step", 20)
    assert code == 0 and "as torch" in out
    assert torch.load(pt, weights_only=True)["step"] == 20
    code, out, _ = run(app, "export", root, tmp_path / "model.weights", "--json")
    assert code == 0 and json.loads(out)["format"] == "safetensors"
    wrong = tmp_path / "other.pth"
    code, _, err = run(app, "export", root, wrong, "--format", "safetensors")
    assert code == 2 and "names a torch file" in err and "other.safetensors" in err
    assert not wrong.exists()
    code, _, err = run(app, "export", root, tmp_path / "w.safetensors", "-f", "torch")
    assert code == 2 and "w.pt" in err


def test_import_of_a_file_without_tensors_is_refused(
    app: typer.Typer, root: Path, tmp_path: Path
) -> None:
    """A torch.save of no tensors (an empty dict, a config) names the problem and saves no step."""
    new_root = tmp_path / "imported"
    for i, value in enumerate(({}, {"lr": 0.1, "epochs": [1, 2]})):
        empty = tmp_path / f"empty{i}.pt"
        torch.save(value, empty)
        code, out, err = run(app, "import", empty, new_root, "--step", 1)
        assert code == 2 and "holds no tensors" in err and "Traceback" not in out + err
    assert not new_root.exists()  # nothing created for a refused import


def test_gc(app: typer.Typer, root: Path) -> None:
    code, out, _ = run(app, "gc", root, "--grace-s", 0)
    assert code == 0 and "deleted 0 steps" in out
    code, out, _ = run(app, "gc", root, "--grace-s", 0, "--keep-last", 1)
    # Step 20 shares step 10's pack (unchanged tensors): the step goes, the pack stays.
    assert code == 0 and "deleted 1 steps [10] and 0 packs, freed 0 B" in out
    with Checkpointer(root) as ck:
        assert ck.steps() == [20]
        ck.load(None, 20)
        ck.save(30, {"w": torch.randn(1000)})  # shares nothing with step 20
    packs = sorted((root / "packs").iterdir())
    size = sum(p.stat().st_size for p in packs[:2])
    code, out, _ = run(app, "gc", root, "--grace-s", 0, "--keep-last", 1)
    assert code == 0 and "deleted 1 steps [20] and 2 packs" in out
    assert f"freed {size / 1024:.1f} KiB" in out
    assert [p.name for p in (root / "packs").iterdir()] == [packs[2].name]


def test_bad_storage_option(app: typer.Typer, root: Path) -> None:
    code, _, err = run(app, "ls", root, "--storage-option", "novalue")
    assert code == 2 and "KEY=VALUE" in err


def test_remote_root_with_storage_options(
    app: typer.Typer, s3_server: object, s3_bucket: str
) -> None:
    opts = s3_server.storage_options  # type: ignore[attr-defined]
    url = f"s3://{s3_bucket}/run"
    with Checkpointer(url, CheckpointOptions(chunk_bytes=4096), storage_options=opts) as ck:
        ck.save(1, {"w": torch.randn(3000)})
    flags = [
        f"--storage-option=key={opts['key']}",
        f"--storage-option=secret={opts['secret']}",
        "--storage-option=client_kwargs=" + json.dumps(opts["client_kwargs"]),
    ]
    code, out, _ = run(app, "ls", url, "--json", *flags)
    assert code == 0 and [s["step"] for s in json.loads(out)["steps"]] == [1]
    code, out, _ = run(app, "verify", url, *flags)
    assert code == 0 and "step 1: ok" in out


def test_log_messages_never_reach_stdout(root: Path) -> None:
    # A warning logged while a command runs (any library's) must not corrupt --json output.
    code = (
        "import logging, sys\n"
        "from stalwart.cli import main\n"
        "main._main(verbose=False)\n"
        "logging.getLogger('stalwart.any').warning('a warning while listing')\n"
        "main.app(['ckpt', 'ls', sys.argv[1], '--json'])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=120
    )
    assert json.loads(proc.stdout)["steps"], proc.stdout  # stdout is pure JSON
    assert "a warning while listing" in proc.stderr


def test_a_file_given_as_root_is_named_as_a_file(app: typer.Typer, tmp_path: Path) -> None:
    from stalwart.integrations.lightning_pointer import write_pointer

    weights = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, weights)
    for cmd in ("ls", "inspect", "verify", "gc"):
        code, out, err = run(app, cmd, weights)
        assert code == 2 and "Traceback" not in out + err, cmd
        assert "is a file, not a checkpoint root folder" in err and "does not exist" not in err
        assert f"stalwart ckpt import {weights} ROOT" in err
    # A Lightning pointer file names the root to pass instead.
    pointer = tmp_path / "ckpts" / "last.ckpt"
    write_pointer(str(pointer), {"root": str(tmp_path / "ckpts" / "stalwart"), "step": 3})
    code, _, err = run(app, "ls", pointer)
    assert code == 2 and "Lightning pointer to step 3" in err
    assert str(tmp_path / "ckpts" / "stalwart") in err and "--step 3" in err


def test_damage_hints_name_the_cli_way_not_fallback(
    app: typer.Typer, root: Path, tmp_path: Path
) -> None:
    with Checkpointer(root) as ck:
        c = ck.manifest(20).tensors["model.1.weight"].shards[0].chunks[0]
    with open(root / c.pack, "r+b") as f:
        f.seek(c.offset)
        b = f.read(1)
        f.seek(c.offset)
        f.write(bytes([b[0] ^ 1]))
    code, _, err = run(app, "export", root, tmp_path / "out.safetensors", "--step", 20)
    err = " ".join(err.split())  # the console wraps long lines
    assert code == 1 and "does not match its hash" in err
    # The advice holds for every command (diff and gc have no --step, which it named before).
    assert "fallback=True" not in err and "ckpt verify ROOT" in err and "ckpt rm ROOT N" in err
    code, out, _ = run(app, "verify", root)
    assert code == 1 and "ckpt rm ROOT N" in " ".join(out.split())
    code, _, err = run(app, "diff", root, 10, 20)
    err = " ".join(err.split())
    assert code == 1 and "--step" not in err and "ckpt rm ROOT N" in err, err
    (root / "manifests" / f"step-{10:020d}.json").write_text("{ not json")
    code, _, err = run(app, "inspect", root, "--step", 10)
    err = " ".join(err.split())
    assert code == 1 and "fallback=True" not in err and "ckpt verify ROOT" in err


def test_help_shows_boolean_flags_as_bare_switches(app: typer.Typer) -> None:
    from typer.main import get_command

    def paths(cmd: object, path: tuple[str, ...]) -> list[tuple[str, ...]]:
        subs = getattr(cmd, "commands", {})
        return [path] + [p for n, s in sorted(subs.items()) for p in paths(s, (*path, n))]

    for path in paths(get_command(app), ()):
        r = CliRunner().invoke(app, [*path, "--help"], env=ENV)
        assert r.exit_code == 0, path
        assert "<bool>" not in r.output, (path, r.output)
    r = CliRunner().invoke(app, ["ckpt", "ls", "--help"], env=ENV)
    assert "--json " in r.output and "--help " in r.output


def test_rm_refuses_a_step_a_load_holds_unless_forced(app: typer.Typer, root: Path) -> None:
    from stalwart.checkpoint.durable.lease import Lease, read_leases
    from stalwart.storage import LocalStorage

    store = LocalStorage(root)
    with Lease(store, steps=[10, 20], packs=[], lease_s=600):  # a save deduplicating: no hold
        assert read_leases(store).read_steps == set()
    with Lease(store, steps=[10], packs=[], lease_s=600, reading=True):  # a load in progress
        code, _, err = run(app, "rm", root, 10)
        assert code == 2 and "being read now" in err and "--force" in err
        with pytest.raises(CheckpointError, match="force=True"):
            Checkpointer(root).delete(10)
        assert Checkpointer(root).steps() == [10, 20]  # nothing deleted
        code, out, _ = run(app, "rm", root, 10, "--force")
        assert code == 0 and "deleted step 10" in out
    assert Checkpointer(root).steps() == [20]


def test_ls_shows_a_creation_time_no_calendar_holds_as_a_dash(app: typer.Typer, root: Path) -> None:
    # A version-1 manifest (no checksum) is read as it is; its time is informational.
    path = root / "manifests" / f"step-{10:020d}.json"
    doc = json.loads(path.read_text())
    doc.update(version=1, created_unix=1e20)
    del doc["checksum"]
    path.write_text(json.dumps(doc))
    code, out, _ = run(app, "ls", root)
    assert code == 0 and "—" in out, out  # it raised OverflowError: exit 3, "a bug"


def test_a_file_inside_a_root_given_as_root_names_that_root(app: typer.Typer, root: Path) -> None:
    manifest = root / "manifests" / f"step-{10:020d}.json"
    code, out, err = run(app, "import", manifest, manifest)  # ROOT mistyped as its manifest
    assert code == 2 and f"part of the checkpoint root {root}" in out + err, out + err
    assert "ckpt import" not in out + err  # not: "import that manifest as a step"
