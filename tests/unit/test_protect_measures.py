"""Protections on a replayed fault list: paired outcomes, recovery and cost."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stalwart import inject, models, protect, vulnerability


@pytest.fixture(scope="module")
def digits() -> models.ReferenceModel:
    return models.load("digits-cnn")


def test_protections_recover_exponent_flips(digits: models.ReferenceModel, tmp_path) -> None:
    m, x = digits.model, (digits.inputs[0][:80],)
    faults = vulnerability.sample_faults(m, 60, seed=0, error=inject.BitFlip(bit=30))
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    ps = [
        protect.ABFT(m, x),
        protect.SelectiveBitProtection(("sign", "exponent")),
        protect.ParameterScrubber(m, root=tmp_path / "ckpt"),
        protect.ActivationClipping(m, x),
    ]
    res = {r.name: r for r in protect.evaluate(m, x, faults, ps, repeats=3)}
    base = res["abft"].baseline_failures
    assert base > 5  # exponent-MSB flips break many inputs
    assert res["sbp"].failures == 0 and res["sbp"].recovered == 1.0  # bit 30 is covered
    assert res["scrub"].failures == 0 and res["abft"].failures == 0
    assert res["abft"].p_value < 0.01 and res["abft"].fixed == base
    assert res["sbp"].cost["protected_bits_share"] == pytest.approx(9 / 32)
    assert res["clip"].failures <= base
    for n, p in m.named_parameters():  # protections and replays leave the model clean
        assert torch.equal(p, before[n]), n


def test_abft_has_no_false_alarms_and_checks_embedding_bag() -> None:
    torch.manual_seed(0)
    emb = nn.EmbeddingBag(50, 8, mode="sum")
    model = nn.Sequential()
    model.add_module("emb", emb)
    model.eval()
    ids = torch.randint(0, 50, (40, 3))
    abft = protect.ABFT(model, (ids,))
    with abft.attach(model), torch.no_grad():
        model(ids)
        assert abft.alarms == 0
        row = int(ids[0, 0])
        with inject.bitflip(emb, "weight", index=(row, 2), bit=29):
            out = model(ids)
        assert abft.alarms == 1 and abft.repairs == 1
    assert torch.allclose(out, emb(ids))


def test_ber_sweep_and_clipping(digits: models.ReferenceModel) -> None:
    m = digits.model
    clip = protect.ActivationClipping(m, digits.inputs)
    sweep = protect.ber_sweep(m, digits.evaluate, [1e-4], [clip], repeats=2)
    none, clipped = sum(sweep["none"][1e-4]) / 2, sum(sweep["clip"][1e-4]) / 2
    assert clipped > none  # clipping recovers accuracy lost to flipped exponents
    assert digits.evaluate() == digits.quality  # the sweep restored every bit


def test_protect_cli(tmp_path) -> None:
    import json

    import typer
    from typer.testing import CliRunner

    from stalwart.cli import protect as protect_cli

    app = typer.Typer()
    protect_cli.register(app)

    @app.callback()
    def _main() -> None:
        pass

    res = CliRunner().invoke(
        app,
        [
            "protect",
            "gcn",
            "--trials",
            "40",
            "--bit",
            "30",
            "-p",
            "sbp",
            "-p",
            "clip",
            "--ber",
            "1e-3",
            "--repeats",
            "1",
            "--out",
            str(tmp_path),
        ],
    )
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "protect.json").read_text())
    assert [r["name"] for r in data["results"]] == ["sbp", "clip"]
    assert "data:image/png" in (tmp_path / "report.html").read_text()
    bad = CliRunner().invoke(app, ["protect", "gcn", "-p", "tmr"])
    assert bad.exit_code == 2 and "choose from" in bad.output
