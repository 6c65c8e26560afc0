"""Fault injection: error models on real storage bits, targets, and exact undo.

    from stalwart import inject
    with inject.bitflip(model, "fc1.weight", index=123, bit=30):
        out = model(x)                       # restored bit for bit on exit

Error models act on the stored words of fp64/fp32/fp16/bf16/fp8 (e4m3, e5m2) and integer
tensors (:mod:`.bits`); faults are concrete, replayable records (:class:`Fault`).
"""

from stalwart.inject.activations import ActivationInjector, activation_faults
from stalwart.inject.bits import BitLayout, layout_of, raw_view, supported_dtypes
from stalwart.inject.error_models import (
    BitFlip,
    BurstFlip,
    ErrorModel,
    Fault,
    MultiBitFlip,
    RandomValue,
    StuckAt,
    draw_ber,
    error_model,
)
from stalwart.inject.injector import (
    Change,
    Injection,
    apply_faults,
    ber,
    bitflip,
    random_value,
    stuck_at,
)
from stalwart.inject.targets import module_of, resolve, rows_read, select_modules, select_tensors

__all__ = [
    "ActivationInjector",
    "BitFlip",
    "BitLayout",
    "BurstFlip",
    "Change",
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
    "draw_ber",
    "error_model",
    "layout_of",
    "module_of",
    "random_value",
    "raw_view",
    "resolve",
    "rows_read",
    "select_modules",
    "select_tensors",
    "stuck_at",
    "supported_dtypes",
]
