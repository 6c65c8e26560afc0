"""Inputs: every default has a source; files and changes are read strictly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stalwart.errors import ConfigError
from stalwart.plan import Costs, Fleet, Job, PlanInputs, read_costs, read_inputs
from stalwart.plan.ladder import TIERS
from stalwart.plan.sources import defaults

BENCH = Path(__file__).resolve().parents[3] / "bench"
KINDS = ("public:", "derived from", "measured here:", "assumption", "stalwart.elastic")


def test_every_default_names_its_source() -> None:
    sources = PlanInputs().sources()
    assert "given" not in sources.values()
    cited = defaults()
    for key, cite in cited.items():
        assert cite.source.startswith(KINDS), (key, cite.source)
        for field in (key,) if key in sources else [f"tiers.{t}.interval_cap_s" for t in TIERS]:
            assert sources[field] == cite.source
        if cite.source.startswith("measured here"):
            script = cite.source.split("bench/")[1].split()[0].rstrip(":")
            assert (BENCH / script).exists(), script


def test_changed_values_and_presets_say_so() -> None:
    sources = PlanInputs(fleet=Fleet.meta_rsc("rsc2")).replace(**{"job.step_s": 2.0}).sources()
    assert sources["job.step_s"] == "given"
    assert "Kokolis" in sources["fleet.node_loss_per_hour"]
    assert sources["tiers.disk.interval_s"] == "chosen by the planner"


def test_read_inputs_from_toml_and_json(tmp_path: Path) -> None:
    toml = tmp_path / "job.toml"
    toml.write_text(
        "[job]\naccelerators = 4096\nstep_s = 2.5\n"
        "[tiers.disk]\ninterval_s = 600\n[costs]\ntorchrun_restart_s = 120\n"
    )
    got = read_inputs(toml)
    assert got.job == Job(accelerators=4096, step_s=2.5)
    assert got.tiers.disk.interval_s == 600 and got.tiers.disk.write_gbps > 0
    assert got.costs.torchrun_restart_s == 120 and got.fleet == Fleet()
    as_json = tmp_path / "job.json"
    as_json.write_text(json.dumps(got.to_dict()))
    assert read_inputs(as_json) == got


def test_read_costs_alone(tmp_path: Path) -> None:
    flat, nested = tmp_path / "flat.json", tmp_path / "nested.toml"
    flat.write_text('{"heal_s": 1.5}')
    nested.write_text("[costs]\nheal_s = 1.5\n")
    assert read_costs(flat) == read_costs(nested) == Costs(heal_s=1.5)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[jobs]\naccelerators = 1\n", "unknown section.*jobs.*use job, fleet"),
        ("[job]\naccelerator = 1\n", r"\[job\]: unknown field.*accelerator"),
        ("[fleet]\nnode_loss_per_hour = -1\n", "Fleet.node_loss_per_hour must be a number >= 0"),
        ('[job]\nstate_gb = "big"\n', "Job.state_gb must be a number"),
        ("[job]\naccelerators = 1000\n", "must divide accelerators"),
        ("[tiers.tape]\nwrite_gbps = 1\n", "unknown tier.*tape"),
        ("[tiers.disk]\ninterval_s = 0\n", "Tier.interval_s must be a number > 0"),
        ("[job\n", "not valid TOML"),
    ],
)
def test_bad_files_name_the_file_section_and_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        read_inputs(path)
    assert "bad.toml" in str(info.value)


def test_missing_or_unknown_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read plan inputs"):
        read_inputs(tmp_path / "nope.toml")
    (tmp_path / "x.yaml").write_text("job: {}")
    with pytest.raises(ConfigError, match=r"give a \.toml or \.json file"):
        read_inputs(tmp_path / "x.yaml")


def test_replace_refuses_unknown_names() -> None:
    with pytest.raises(ConfigError, match=r"no input 'job\.gpus'.*accelerators"):
        PlanInputs().replace(**{"job.gpus": 8})
    with pytest.raises(ConfigError, match=r"no input 'jobs\.accelerators'"):
        PlanInputs().replace(**{"jobs.accelerators": 8})
    # No section: the form of a name and the sections, and the input the user likely meant.
    with pytest.raises(ConfigError, match=r"SECTION\.FIELD.*costs.*Did you mean costs\.resume_s\?"):
        PlanInputs().replace(resume_s=2.0)
    with pytest.raises(ConfigError, match=r"SECTION\.FIELD") as e:
        PlanInputs().replace(foo=1)
    assert "Did you mean" not in str(e.value)
    with pytest.raises(ConfigError, match=r"Did you mean costs\.crash_detect_s\?"):
        PlanInputs().replace(**{"costs.crash_detec_s": 1.0})


def test_records_are_frozen_and_keyword_only() -> None:
    with pytest.raises(TypeError):
        Job(1024)  # type: ignore[misc]
    job = Job()
    with pytest.raises(AttributeError):
        job.accelerators = 8  # type: ignore[misc]
    assert job.replicas == 128 and job.nodes == 2048
