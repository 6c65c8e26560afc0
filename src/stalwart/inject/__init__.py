"""Fault injection: error models on real storage bits, targets, and exact undo.

    from stalwart import inject
    with inject.bitflip(model, "fc1.weight", index=123, bit=30):
        out = model(x)                       # restored bit for bit on exit

Error models act on the stored words of fp64/fp32/fp16/bf16/fp8 (e4m3, e5m2) and integer
tensors (:mod:`.bits`); faults are concrete, replayable records (:class:`Fault`).

The rest lives in named submodules: storage layouts in :mod:`.bits` (``layout_of``,
``supported_dtypes``), target selection in :mod:`.targets` (``select_tensors``,
``resolve``), the activation hooks in :mod:`.activations`, ``Change`` in :mod:`.injector`.
"""

from stalwart.inject.activations import activation_faults
from stalwart.inject.error_models import (
    BitFlip,
    BurstFlip,
    ErrorModel,
    Fault,
    MultiBitFlip,
    RandomValue,
    StuckAt,
    error_model,
)
from stalwart.inject.injector import (
    Injection,
    apply_faults,
    ber,
    bitflip,
    random_value,
    stuck_at,
)
from stalwart.moved import moved_getattr

__all__ = [
    "BitFlip",
    "BurstFlip",
    "ErrorModel",
    "Fault",
    "Injection",
    "MultiBitFlip",
    "RandomValue",
    "StuckAt",
    "activation_faults",
    "apply_faults",
    "ber",
    "bitflip",
    "error_model",
    "random_value",
    "stuck_at",
]

_MOVED = {
    "ActivationInjector": "activations",
    **dict.fromkeys(["BitLayout", "layout_of", "raw_view", "supported_dtypes"], "bits"),
    "Change": "injector",
    "draw_ber": "error_models",
    **dict.fromkeys(
        ["module_of", "resolve", "rows_read", "select_modules", "select_tensors"], "targets"
    ),
}
"""Names this package exported before the smaller front door -> their submodule."""


__getattr__ = moved_getattr(
    __name__,
    {name: f"{__name__}.{module}" for name, module in _MOVED.items()},
    message="{package}.{name} moved to {where}.{name}; import it from there "
    "(the old path goes away in the next release)",
)
