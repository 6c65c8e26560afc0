"""The planner's inputs as one bundle (:class:`PlanInputs`), changed by dotted name and read
from files.

:func:`read_inputs` reads a TOML or JSON file with the sections ``[job]``, ``[fleet]``,
``[tiers.memory]``, ``[tiers.disk]``, ``[tiers.remote]`` and ``[costs]``, each optional, whose
fields are those of :mod:`stalwart.plan.inputs`' records; :func:`read_costs` reads a file of
:class:`~stalwart.plan.inputs.Costs` fields alone (as a probe of this machine would write).
Every mistake is a :class:`~stalwart.errors.ConfigError` naming the file, section and field.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.errors import ConfigError
from stalwart.plan.inputs import Costs, Fleet, Job, Tier, Tiers
from stalwart.plan.sources import META_RSC, defaults

__all__ = ["PlanInputs", "read_costs", "read_inputs"]


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """Everything the planner needs; :meth:`replace` changes fields by dotted name."""

    job: Job = field(default_factory=Job)
    fleet: Fleet = field(default_factory=Fleet)
    tiers: Tiers = field(default_factory=Tiers)
    costs: Costs = field(default_factory=Costs)

    def replace(self, **changes: Any) -> PlanInputs:
        """A copy with fields changed: ``replace(**{"job.accelerators": 1024})``."""
        tree = self.to_dict()
        for dotted, value in changes.items():
            _set(tree, dotted, value)
        return _build(tree, "the given values")

    def to_dict(self) -> dict[str, Any]:
        """The inputs as nested plain values (the layout :func:`read_inputs` reads)."""
        return dataclasses.asdict(self)

    def sources(self) -> dict[str, str]:
        """Every input, dotted, -> where its value comes from: the source of a default, the
        report behind a :class:`Fleet` preset, "default" for structural defaults (a tier
        without parity), "chosen by the planner" for an unset interval, else "given"."""
        cited = defaults()
        base = dict(_flatten(PlanInputs().to_dict()))
        preset = next((c for c in ("rsc1", "rsc2") if self.fleet == Fleet.meta_rsc(c)), None)
        out: dict[str, str] = {}
        for dotted, value in _flatten(self.to_dict()):
            default = _flatten_default(dotted, cited)
            if preset and dotted.startswith("fleet.") and dotted.endswith("_per_hour"):
                out[dotted] = f"public: {META_RSC}: r_f of {preset.upper()}, node failures only"
            elif default is not None and default.value == value:
                out[dotted] = default.source
            elif value is None and dotted.endswith(".interval_s"):
                out[dotted] = "chosen by the planner"
            elif default is None and base.get(dotted) == value:
                out[dotted] = "default"
            else:
                out[dotted] = "given"
        return out


def _flatten(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for key, value in tree.items():
        if isinstance(value, dict):
            items += _flatten(value, f"{prefix}{key}.")
        else:
            items.append((f"{prefix}{key}", value))
    return items


def _flatten_default(dotted: str, cited: dict[str, Any]) -> Any:
    if dotted in cited:
        return cited[dotted]
    if dotted.startswith("tiers.") and dotted.endswith(".interval_cap_s"):
        return cited["tiers.interval_cap_s"]
    return None


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *path, leaf = dotted.split(".")
    node = tree
    for part in path:
        if not isinstance(node.get(part), dict):
            raise ConfigError(f"no input {dotted!r}; known sections: {_sections()}")
        node = node[part]
    if leaf not in node or isinstance(node[leaf], dict):
        known = ", ".join(sorted(k for k, v in node.items() if not isinstance(v, dict)))
        names = _leaves(tree)
        close = [d for d in names if d.endswith("." + leaf)]  # the section left out
        close += difflib.get_close_matches(dotted, names, n=3, cutoff=0.8)
        hint = f" Did you mean {' or '.join(list(dict.fromkeys(close))[:3])}?" if close else ""
        if not known:  # no section given: name the form an input takes
            raise ConfigError(
                f"no input {dotted!r}: an input is SECTION.FIELD (e.g. costs.crash_detect_s), "
                f"with SECTION one of {_sections()}.{hint}"
            )
        raise ConfigError(f"no input {dotted!r}; the fields there are: {known}.{hint}")
    node[leaf] = value


def _leaves(tree: dict[str, Any], prefix: str = "") -> list[str]:
    """Every input's dotted name in ``tree``."""
    out: list[str] = []
    for k, v in tree.items():
        out += _leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [prefix + k]
    return out


def _sections() -> str:
    return "job, fleet, tiers.memory, tiers.disk, tiers.remote, costs"


def _build(tree: dict[str, Any], where: str) -> PlanInputs:
    """PlanInputs from nested plain values, naming ``where`` and the field in errors."""
    unknown = set(tree) - {"job", "fleet", "tiers", "costs"}
    if unknown:
        raise ConfigError(f"{where}: unknown section(s) {sorted(unknown)}; use {_sections()}")
    tiers = tree.get("tiers", {})
    _mapping(tiers, f"{where} [tiers]")
    bad = set(tiers) - {"memory", "disk", "remote"}
    if bad:
        raise ConfigError(f"{where}: unknown tier(s) {sorted(bad)}; use memory, disk, remote")
    base = Tiers()
    built = {n: _make(Tier, {**dataclasses.asdict(getattr(base, n)), **tiers[n]}, f"{where} "
                      f"[tiers.{n}]") for n in tiers}  # fmt: skip
    return PlanInputs(
        job=_make(Job, tree.get("job", {}), f"{where} [job]"),
        fleet=_make(Fleet, tree.get("fleet", {}), f"{where} [fleet]"),
        tiers=dataclasses.replace(base, **built),
        costs=_make(Costs, tree.get("costs", {}), f"{where} [costs]"),
    )


def _mapping(value: Any, where: str) -> None:
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a table of fields, got {type(value).__name__}")


def _make(cls: Any, values: Any, where: str) -> Any:
    _mapping(values, where)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - names
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(names)}")
    try:
        return cls(**values)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    except TypeError as e:  # a value of the wrong type that a comparison refused
        raise ConfigError(f"{where}: {e}") from None


def _load(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read plan inputs {str(p)!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{p} is not UTF-8 text (byte {e.start}: {e.object[e.start : e.start + 1]!r}); "
            "save it as UTF-8 (e.g. `iconv -f latin1 -t utf-8`) and run again"
        ) from None
    if p.suffix.lower() not in (".toml", ".json"):
        raise ConfigError(f"{p}: give a .toml or .json file")
    try:
        data: Any = _toml().loads(text) if p.suffix.lower() == ".toml" else json.loads(text)
    except ValueError as e:  # TOMLDecodeError and JSONDecodeError are ValueErrors
        raise ConfigError(f"{p} is not valid {p.suffix[1:].upper()}: {e}") from None
    _mapping(data, str(p))
    return data


def _toml() -> Any:
    """tomllib (Python >= 3.11), or tomli where it is installed on 3.10."""
    try:
        import tomllib

        return tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli
        except ImportError:
            raise ConfigError(
                "reading TOML needs Python >= 3.11 or `pip install tomli`; or give a .json file"
            ) from None
        return tomli


def read_inputs(path: str | Path) -> PlanInputs:
    """Inputs from a TOML or JSON file; sections and fields left out keep their defaults.

    Raises:
        ConfigError: the file is missing or malformed, or a section, field or value is bad
            (the message names the file, the section and the field).
    """
    return _build(_load(path), str(path))


def read_costs(path: str | Path) -> Costs:
    """:class:`Costs` from a TOML or JSON file of its fields (top level, or under ``costs``)."""
    data = _load(path)
    return _make(Costs, data.get("costs", data), f"{path} [costs]")
