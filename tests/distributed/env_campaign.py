"""A campaign factory whose module reads the environment when it is imported, as a user's
model module may (a variant, a path). The rank imports it after adopting its caller's
environment, so a variable set after the forkserver started must be seen here."""

from __future__ import annotations

import os
from typing import Any

from . import campaign_models as cm

SEEN_AT_IMPORT = os.environ.get("STALWART_TEST_MODEL_VARIANT")


def make() -> Any:
    if SEEN_AT_IMPORT != "b":
        raise RuntimeError(f"STALWART_TEST_MODEL_VARIANT was {SEEN_AT_IMPORT!r} at import")
    return cm.tiny()
