"""The CLI's JSON is strict JSON: a NaN or infinity (sbp's modelled overhead) is ``null``, on
stdout (``--json``) and in the files a command writes (``protect.json``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import typer
from typer.testing import CliRunner

from stalwart.cli import protect as protect_cli
from stalwart.cli.conventions import json_text


def _strict(text: str) -> Any:
    def refuse(token: str) -> None:
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def test_json_text_writes_non_finite_numbers_as_null() -> None:
    obj = {
        "a": math.nan,
        "b": [math.inf, -math.inf, 1.5, (np.float32("nan"), np.float64(2.0))],
        "c": {"d": np.float32(0.5), "e": True, "f": 3, "g": None, "h": Path("x")},
    }
    back = _strict(json_text(obj))
    assert back == {
        "a": None,
        "b": [None, None, 1.5, [None, 2.0]],
        "c": {"d": 0.5, "e": True, "f": 3, "g": None, "h": "x"},
    }


def test_protect_json_and_protect_file_are_strict_json(tmp_path: Path) -> None:
    app = typer.Typer()
    protect_cli.register(app)

    @app.callback()
    def _main() -> None:
        pass

    args = ["protect", "mlp", "--trials", "40", "-p", "sbp", "--json", "--out", str(tmp_path)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    for doc in (_strict(res.stdout), _strict((tmp_path / "protect.json").read_text())):
        (sbp,) = doc["results"]
        assert sbp["name"] == "sbp" and sbp["basis"] == "modelled"
        assert sbp["overhead"] is None  # modelled: no runtime was measured
