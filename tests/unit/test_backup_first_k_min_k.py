"""An epoch's first backup step honours ``Dynamic(min_k=...)`` (the docstring's promise:
"never commit with fewer contributions than this"), with or without partial contributions."""

from __future__ import annotations

from stalwart.elastic.backup_policy import Dynamic, Static, backup_count


def test_partial_dynamic_starts_one_below_the_members_but_never_below_min_k() -> None:
    assert backup_count(Dynamic(partial=True), 3) == 2
    assert backup_count(Dynamic(min_k=3, partial=True), 3) == 3
    assert backup_count(Dynamic(min_k=5, partial=True), 3) == 3, "never more than the members"
    assert backup_count(Dynamic(min_k=2, partial=True), 1) == 1


def test_the_other_policies_start_where_they_did() -> None:
    assert backup_count(Dynamic(min_k=2), 4) == 4 and backup_count(None, 4) == 4
    assert backup_count(Static(1), 4) == 3 and backup_count(2, 4) == 2
