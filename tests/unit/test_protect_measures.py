"""Protections on a replayed fault list: paired outcomes, recovery and cost."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stalwart import inject, models, protect, vulnerability
from stalwart.errors import ConfigError
from stalwart.protect.evaluate import split_inputs


@pytest.fixture(scope="module")
def digits() -> models.ReferenceModel:
    return models.load("digits-cnn")


def test_protections_recover_exponent_flips(digits: models.ReferenceModel, tmp_path) -> None:
    m = digits.model
    split = split_inputs((digits.inputs[0][:160],), digits.labels[:160], 0.5, seed=0)
    cal, x = split.calibration, split.evaluation
    faults = vulnerability.sample_faults(m, 60, seed=0, error=inject.BitFlip(bit=30))
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    ps = [
        protect.ABFT(m, cal),
        protect.SelectiveBitProtection(("sign", "exponent")),
        protect.ParameterScrubber(m, root=tmp_path / "ckpt"),
        protect.ActivationClipping(m, cal),
    ]
    res = {r.name: r for r in protect.evaluate(m, x, faults, ps, repeats=3)}
    base = res["abft"].baseline_failures
    assert base > 5  # exponent-MSB flips break many inputs
    assert res["sbp"].failures == 0 and res["sbp"].recovered == 1.0  # bit 30 is covered
    assert res["scrub"].failures == 0 and res["abft"].failures == 0
    assert res["abft"].p_value < 0.01 and res["abft"].fixed == base
    assert res["sbp"].cost["protected_bits_share"] == pytest.approx(9 / 32)
    assert res["clip"].failures <= base
    with pytest.raises(ConfigError, match="calibrated on 80 of the 80 inputs"):
        protect.evaluate(m, cal, faults, ps, repeats=1)  # scored on its calibration inputs
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
            "sbp,clip",  # comma-separated, and a repeat that runs once
            "-p",
            "sbp",
            "--ber",
            "1e-3",
            "--repeats",
            "1",
            "--calibration-fraction",
            "0",
            "--out",
            str(tmp_path),
        ],
    )
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "protect.json").read_text())
    assert [r["name"] for r in data["results"]] == ["sbp", "clip"]
    assert "data:image/png" in (tmp_path / "report.html").read_text()
    assert data["calibration"]["note"].startswith("in-sample")  # a graph: said, not hidden
    bad = CliRunner().invoke(app, ["protect", "gcn", "-p", "clip,tmr"])
    assert bad.exit_code == 2 and "'tmr': choose from" in bad.output
    graph = CliRunner().invoke(app, ["protect", "gcn", "-p", "clip", "--trials", "5"])
    assert graph.exit_code == 2 and "--calibration-fraction 0" in " ".join(graph.output.split())


def test_split_inputs_is_disjoint_and_complete() -> None:
    dense, ids = torch.randn(101, 4), torch.randint(0, 9, (101, 3))
    dense[:, 0] = torch.arange(101)  # each row carries its own index
    labels = torch.arange(101)
    split = split_inputs((dense, ids), labels, 0.3, seed=3)
    cal, ev = set(split.calibration_index.tolist()), set(split.evaluation_index.tolist())
    assert not cal & ev and cal | ev == set(range(101)) and len(cal) == 30
    assert set(split.calibration[0][:, 0].long().tolist()) == cal
    assert set(split.evaluation[0][:, 0].long().tolist()) == ev
    assert torch.equal(split.labels, split.evaluation_index)  # labels follow their rows
    assert torch.equal(split.evaluation[1], ids[split.evaluation_index])
    with pytest.raises(ConfigError, match="outside"):
        split_inputs((dense,), None, 1.0)
    with pytest.raises(ConfigError, match="dim 0"):
        split_inputs((dense, torch.zeros(7)), None, 0.5)


def test_protect_cli_scores_held_out_inputs(tmp_path) -> None:
    import json

    import typer
    from typer.testing import CliRunner

    from stalwart.cli import protect as protect_cli

    app = typer.Typer()
    protect_cli.register(app)

    @app.callback()
    def _main() -> None:
        pass

    args = ["protect", "digits-cnn", "--trials", "20", "-p", "clip", "-p", "abft", "-p", "sbp"]
    res = CliRunner().invoke(app, [*args, "--calibration-fraction", "0.25", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "protect.json").read_text())
    cal = data["calibration"]
    assert (cal["calibration_samples"], cal["evaluation_samples"]) == (90, 270)
    assert cal["note"].startswith("held out")
    methods = {r["name"]: r["method"] for r in data["results"]}
    assert "90 inputs" in methods["clip"] and "90 inputs" in methods["abft"]
    assert methods["sbp"].startswith("modelled: SECDED")
    basis = {r["name"]: r["basis"] for r in data["results"]}
    assert basis == {"clip": "measured", "abft": "measured", "sbp": "modelled"}
    assert all(0.0 <= r["false_alarm_rate"] <= 1.0 for r in data["results"])
    page = (tmp_path / "report.html").read_text()
    assert "How each result was obtained" in page and "SECDED" in page
    assert "modelled" in page and "false alarms (clean)" in page


def test_sbp_is_measured_secded_per_codeword() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(14, 1, bias=False)
    model = nn.Sequential()
    model.add_module("fc", lin)
    clean = lin.weight.detach().clone()
    sbp = protect.SelectiveBitProtection(("sign", "exponent"))
    assert sbp.per_codeword(torch.float32) == 7  # 7 x 9 protected bits per 64-bit codeword
    exp_mask = (1 << 30) | (1 << 23)  # two exponent bits
    faults = [
        inject.Fault("fc.weight", 0, 1 << 30),  # codeword 0: one protected flip -> corrected
        inject.Fault("fc.weight", 1, 1 << 3),  # mantissa: not protected, stays
        inject.Fault("fc.weight", 7, 1 << 30),  # codeword 1: two protected flips ...
        inject.Fault("fc.weight", 8, 1 << 31),  # ... -> detected, not corrected
        inject.Fault("fc.weight", 13, exp_mask),  # already the codeword-1 words: still 2+
    ]
    assert list(sbp.filter(model, vulnerability.FaultList(faults, 0, "x"))) == faults
    with sbp.attach(model), inject.apply_faults(model, faults), torch.no_grad():
        sbp.after_fault(model)
        w = lin.weight.detach().view(-1)
        assert w[0] == clean.view(-1)[0]  # corrected
        assert w[1] != clean.view(-1)[1]  # mantissa flip untouched
        assert w[7] != clean.view(-1)[7] and w[8] != clean.view(-1)[8]
        assert (sbp.corrected, sbp.uncorrectable) == (1, 1)
    assert torch.equal(lin.weight, clean)  # replay restored every word


def test_a_bit_error_rate_past_one_is_refused_before_any_replay() -> None:
    from typer.testing import CliRunner

    from stalwart.cli.main import app

    res = CliRunner().invoke(app, ["protect", "mlp", "--ber", "1e-6", "--ber", "2"])
    assert res.exit_code == 2 and "not a probability" in res.output
    assert "replayed" not in res.output  # refused at the option, not after the replay
