"""Property test of the reader: damaged manifests and packs never load as wrong data.

Hypothesis drives the damage engine of ``bench/fuzz_manifest.py`` (bit flips, truncation,
structural edits, resealed edits, targeted numbers, deep nesting, shard and pack damage) on
a real two-step checkpoint. For every case: no raw exception from verify or load (only
stalwart errors), a load that succeeds returns exactly the saved data, verify and load
agree, and ``fallback=True`` reaches the intact step. Seeded (derandomized) and bounded:
a few hundred cases, plus a few hundred resealed mix-ups of tensors (see
``test_resealed_mixups_never_load_another_tensors_bytes``). The long run (>= 10,000 cases)
is ``bench/fuzz_manifest.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.fuzz_manifest import Fixture, build_fixture, mix_case, mutate, run_case
from stalwart.checkpoint.durable.manifest import Manifest

CASES = 300


class DrawChooser:
    """The fuzzer's choices drawn from hypothesis (so failures shrink and replay)."""

    def __init__(self, data: st.DataObject) -> None:
        self.data = data

    def integer(self, lo: int, hi: int) -> int:
        """An int in ``[lo, hi]``."""
        return self.data.draw(st.integers(lo, hi))


@pytest.fixture(scope="module")
def fixture(tmp_path_factory: pytest.TempPathFactory) -> Fixture:
    return build_fixture(tmp_path_factory.mktemp("fuzz") / "ck")


@settings(
    max_examples=CASES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_damage_is_refused_or_loads_exactly(fixture: Fixture, data: st.DataObject) -> None:
    case = mutate(fixture, DrawChooser(data))
    outcome = run_case(fixture, case)
    ok = (
        ("loaded", "refused", "rewritten")
        if case.kind.startswith("mix-")
        else ("loaded", "refused")
    )
    assert outcome in ok, f"{case.kind} (resealed={case.resealed}): {outcome}"


@settings(
    max_examples=CASES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_resealed_mixups_never_load_another_tensors_bytes(
    fixture: Fixture, data: st.DataObject
) -> None:
    """Resealed manifests (checksum recomputed) whose tensors are mixed up: a skeleton leaf
    naming another entry, swapped entry names, chunk references re-pointed at other chunks,
    dtype, shape and offset edits, alias records. Loaded without a target and into a zeroed
    copy of the state: refused, exactly the saved data, or exactly what the re-sealed
    manifest states (``rewritten``) — never bytes the manifest does not give that path."""
    case = mix_case(fixture, DrawChooser(data))
    outcome = run_case(fixture, case)
    assert outcome in ("loaded", "refused", "rewritten"), f"{case.kind}: {outcome}"
    if case.kind == "mix-leaf":  # a leaf naming another entry is refused at parse
        assert outcome in ("refused", "loaded"), outcome


@settings(max_examples=CASES, derandomize=True, deadline=None, database=None)
@given(blob=st.binary(max_size=512) | st.from_regex(rb'\A\{"format":.*\}\Z'))
def test_arbitrary_bytes_never_escape_as_a_raw_exception(blob: bytes) -> None:
    try:
        Manifest.from_bytes(blob)
    except ValueError as e:  # CorruptCheckpointError is a ValueError; check it is ours
        assert type(e).__module__ == "stalwart.errors", repr(e)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=CASES, derandomize=True, deadline=None, database=None)
@given(doc=JSON)
def test_arbitrary_json_in_any_field_is_refused_cleanly(doc: object) -> None:
    base = {"format": "stalwart.checkpoint", "version": 1, "step": 0, "tensors": {}}
    for field in ("tensors", "skeleton", "metadata", "stats", "world_size", "created_unix"):
        text = json.dumps(base | {"skeleton": {"k": "none"}, field: doc})
        try:
            Manifest.from_bytes(text.encode())
        except ValueError as e:
            assert type(e).__module__ == "stalwart.errors", repr(e)


V1 = Path(__file__).resolve().parents[1] / "golden" / "v1" / "manifests"


@settings(max_examples=CASES, derandomize=True, deadline=None, database=None)
@given(data=st.data())
def test_damaged_v1_manifests_are_refused_cleanly(data: st.DataObject) -> None:
    # Version 1 has no checksum, so some damage parses; none may escape as a raw error.
    blob = bytearray((V1 / "step-00000000000000000042.json").read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] = data.draw(st.integers(0, 255))
    try:
        Manifest.from_bytes(bytes(blob))
    except ValueError as e:
        assert type(e).__module__ == "stalwart.errors", repr(e)
