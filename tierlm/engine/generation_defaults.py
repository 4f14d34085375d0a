"""A model's recommended sampling settings, from its generation_config.json.

Why: model makers publish the settings their model was tuned to answer with (Qwen2.5:
temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05), and vLLM applies them to
requests that leave those fields unset (`--generation-config auto`, its default). A server that
ignored them would answer the same request differently from vLLM. Only the fields vLLM takes
are read; `do_sample` is ignored, as vLLM ignores it. A value SamplingParams would refuse is
left out with a warning naming it, so a bad file never turns every request into a 400.
"""
from __future__ import annotations

import logging
import math
from typing import Any

from tierlm.errors import TierlmError
from tierlm.sampling_params import SamplingParams

log = logging.getLogger(__name__)

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(gen: dict[str, Any], source: str = "generation_config.json") -> dict[str, float | int]:
    """The sampling fields `gen` sets, each checked as a request's would be."""
    out: dict[str, float | int] = {}
    for key in SAMPLING_KEYS:
        value = gen.get(key)
        if value is None:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key == "top_k" and isinstance(value, float) and value.is_integer():
            value = int(value)
        if not number or (isinstance(value, float) and not math.isfinite(value)) or \
                (key == "top_k" and not isinstance(value, int)):
            log.warning("%s: %s = %r is not a usable number; requests keep tierlm's default for it", source, key, value)
            continue
        try:
            SamplingParams(**{key: value})
        except TierlmError as e:
            log.warning("%s: %s = %r is out of range (%s); requests keep tierlm's default for it", source, key, value, e)
            continue
        out[key] = value
    return out


def apply_defaults(fields: dict[str, Any], defaults: dict[str, float | int]) -> dict[str, Any]:
    """`fields` (a request's sampling fields, None where the request left one unset) with the
    model's defaults in those left unset."""
    return {**fields, **{k: v for k, v in defaults.items() if fields.get(k) is None}}
