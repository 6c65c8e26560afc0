"""Protections against silent data corruption, each measured for benefit and cost.

from stalwart import protect
split = protect.split_inputs(inputs, labels, 0.5)          # calibrate on one half, score the other
clip = protect.ActivationClipping(model, split.calibration)   # bounds from clean data
abft = protect.ABFT(model, split.calibration)                 # checksums, repair on alarm
sbp = protect.SelectiveBitProtection(("sign", "exponent"))    # modelled SECDED over them
shadow = protect.ShadowBitProtection(model, ("sign", "exponent"))  # stored shadow + parity
scrub = protect.ParameterScrubber(model, root="ckpt/")        # restore from a checkpoint
results = protect.evaluate(model, split.evaluation, faults, [clip, abft, sbp, shadow, scrub])
"""

from stalwart.protect.abft import ABFT
from stalwart.protect.base import Protection, row_fingerprints
from stalwart.protect.clipping import ActivationClipping
from stalwart.protect.ecc import SelectiveBitProtection
from stalwart.protect.evaluate import (
    InputSplit,
    ProtectionResult,
    ProtectionResults,
    ber_faults,
    ber_sweep,
    evaluate,
    forward_time,
    split_inputs,
)
from stalwart.protect.scrub import ParameterScrubber
from stalwart.protect.shadow import ShadowBitProtection

__all__ = [
    "ABFT",
    "ActivationClipping",
    "InputSplit",
    "ParameterScrubber",
    "Protection",
    "ProtectionResult",
    "ProtectionResults",
    "SelectiveBitProtection",
    "ShadowBitProtection",
    "ber_faults",
    "ber_sweep",
    "evaluate",
    "forward_time",
    "row_fingerprints",
    "split_inputs",
]
