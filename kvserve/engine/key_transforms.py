"""Start-up, third part: the key transforms a KV format asks for, calibrated through the runner.

A format with `center_keys` (int4) caches keys minus a per-head centre (key_centering.py); one
with `fit_key_basis` (fp8_e4m3) caches them in a fitted basis (key_basis.py). Both are learnt
from one calibration prefill that the engine's ModelRunner runs over the still empty pool
(calibration.py), and set on the model before the first request.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from kvserve.engine.key_basis import calibrate_key_bases
from kvserve.engine.key_centering import calibrate_key_centers
from kvserve.engine.model_runner import ModelRunner

logger = logging.getLogger("kvserve")


def calibrate_key_transforms(runner: ModelRunner, max_model_len: int, model_file: Path | None) -> None:
    """Set the key centres and/or bases the runner's KV format needs on its model (nothing for a
    format that needs neither); logs each calibration. Centres first: the basis is fitted to
    the centred keys."""
    model, kv_format = runner.model, runner.kv_cache.format
    if kv_format.center_keys:
        start = time.monotonic()
        model.set_key_centers(calibrate_key_centers(runner, max_model_len, model_file))
        logger.info("Calibrated %s key centres in %.1f s", kv_format.name, time.monotonic() - start)
    if kv_format.fit_key_basis:
        start = time.monotonic()
        bases, share = calibrate_key_bases(runner, max_model_len, model_file)
        model.set_key_bases(bases)
        logger.info("Fitted %s key bases in %.1f s: modelled score error %.2fx of a Hadamard rotation's",
                    kv_format.name, time.monotonic() - start, share)
