"""Protections against silent data corruption, each measured for benefit and cost.

from stalwart import protect
clip = protect.ActivationClipping(model, inputs)          # bounds from clean data
abft = protect.ABFT(model, inputs)                        # checksums, repair on alarm
sbp = protect.SelectiveBitProtection(("sign", "exponent"))
scrub = protect.ParameterScrubber(model, root="ckpt/")    # restore from a checkpoint
results = protect.evaluate(model, inputs, faults, [clip, abft, sbp, scrub])
"""

from stalwart.protect.abft import ABFT
from stalwart.protect.base import Protection
from stalwart.protect.clipping import ActivationClipping
from stalwart.protect.ecc import SelectiveBitProtection
from stalwart.protect.evaluate import (
    ProtectionResult,
    ber_faults,
    ber_sweep,
    evaluate,
    forward_time,
)
from stalwart.protect.scrub import ParameterScrubber

__all__ = [
    "ABFT",
    "ActivationClipping",
    "ParameterScrubber",
    "Protection",
    "ProtectionResult",
    "SelectiveBitProtection",
    "ber_faults",
    "ber_sweep",
    "evaluate",
    "forward_time",
]
