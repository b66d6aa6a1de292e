"""The push's format against what each engine serves: FP8 bytes and scales go only to FP8 engines, and floats only
to unquantized ones.

Either mismatch loads without an error and serves garbage: SGLang copies pushed floats into its float8 parameters as
they are (no scaling), and an unquantized engine has no ``weight_scale_inv`` to take the scales. So every engine is
asked before the first push to it (``served_weight_dtype``); one that cannot tell is trusted (with a warning
when the push is FP8).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from pipeline.errors import ConfigError

log = logging.getLogger(__name__)


async def check_served_weights(engines: Sequence[Any], fp8: bool) -> None:
    """ConfigError naming the first engine whose served weights are not what the push carries (``fp8``: FP8 bytes
    with block scales; else floats)."""
    asks = [e for e in engines if hasattr(e, "served_weight_dtype")]
    said = await asyncio.gather(*(e.served_weight_dtype() for e in asks))
    for engine, dtype in zip(asks, said):
        name = getattr(engine, "name", repr(engine))
        if dtype is None:
            if fp8:  # a float push to an engine that cannot tell is the ordinary case, not worth a warning
                log.warning("engine %s does not say whether it serves FP8 weights; the push sends FP8 bytes and "
                            "block scales", name)
        elif fp8 and dtype != "fp8":
            raise ConfigError(
                f"engine.weight_dtype = 'fp8', but engine {name} serves unquantized weights: the pushed block "
                "scales would have nowhere to go. Start it on an FP8 checkpoint (python -m pipeline.quant.checkpoint "
                "MODEL_DIR FP8_DIR, then --model-path FP8_DIR), or let sluice launch it (engine.launch = true)")
        elif not fp8 and dtype == "fp8":
            raise ConfigError(
                f"engine {name} serves FP8 weights, but engine.weight_dtype is not 'fp8': the push would write floats "
                "into its float8 parameters unscaled. Set engine.weight_dtype = 'fp8', or serve the model unquantized")
