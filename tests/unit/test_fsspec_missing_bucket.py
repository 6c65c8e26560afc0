"""A bucket that does not exist is an error that names it, also where stalwart lists: it read
as an empty root, so `ckpt ls` and `ckpt gc` on a mistyped bucket exited 0 with nothing."""

from __future__ import annotations

import json
import uuid

import pytest
from typer.testing import CliRunner

from stalwart.cli.main import app
from stalwart.errors import ObjectNotFoundError
from stalwart.storage.fsspec_storage import FsspecStorage
from stalwart.testing.s3_server import S3Server


def test_listing_a_missing_bucket_names_it(s3_server: S3Server, s3_bucket: str) -> None:
    opts = s3_server.storage_options
    typo = f"no-such-{uuid.uuid4().hex[:8]}"
    with pytest.raises(ObjectNotFoundError, match=rf"bucket '{typo}' does not exist \(list\)"):
        FsspecStorage(f"s3://{typo}/run", storage_options=opts).list("manifests/")
    # a missing folder in a bucket that exists is still an empty root
    assert FsspecStorage(f"s3://{s3_bucket}/fresh", storage_options=opts).list("manifests/") == []


@pytest.mark.parametrize("command", [["ls"], ["gc", "--grace-s", "0"]])
def test_ckpt_commands_on_a_missing_bucket_fail(s3_server: S3Server, command: list[str]) -> None:
    so = s3_server.storage_options
    opts = ["-o", f"key={so['key']}", "-o", f"secret={so['secret']}"]
    opts += ["-o", "client_kwargs=" + json.dumps(so["client_kwargs"])]
    root = f"s3://no-such-{uuid.uuid4().hex[:8]}/run"
    res = CliRunner().invoke(app, ["ckpt", command[0], root, *command[1:], *opts])
    assert res.exit_code == 2 and "does not exist" in res.output, res.output
