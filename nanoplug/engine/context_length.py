"""The longest context a checkpoint was trained for, and `max_model_len` checked against it.

Positions past it were never trained: the rotary tables extrapolate and the outputs quietly degrade.
Like vLLM, an explicit `max_model_len` above it is refused unless NANOPLUG_ALLOW_LONG_MAX_MODEL_LEN=1
(then it only warns); the default (4096) is lowered to a smaller model's limit without a word.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from nanoplug.errors import ConfigError

log = logging.getLogger("nanoplug")
ALLOW_LONG = "NANOPLUG_ALLOW_LONG_MAX_MODEL_LEN"
# config.json keys that bound the context, as vLLM reads them (the smallest one given wins)
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
               "max_sequence_length", "max_seq_length", "seq_len")


def model_context_length(hf_config: Any) -> tuple[int, str] | None:
    """(length, how it was derived) from the checkpoint's config, or None when it states no limit."""
    found = [(value, f"{key}={value}") for key in LENGTH_KEYS
             if isinstance(value := getattr(hf_config, key, None), int) and not isinstance(value, bool) and value > 0]
    if not found:
        return None
    length, why = min(found)
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    rope = rope if isinstance(rope, dict) else {}
    rope_type, factor = rope.get("rope_type", rope.get("type", "default")), rope.get("factor")
    if rope_type not in ("default", "su", "longrope", "llama3") and isinstance(factor, (int, float)) and factor > 1:
        original = rope.get("original_max_position_embeddings")
        if rope_type == "yarn" and isinstance(original, int):
            length, why = original, f"original_max_position_embeddings={original}"
        length = int(length * factor)  # a scaled rope (yarn, linear, dynamic) stretches the trained range
        why += f" times the {rope_type} rope factor {factor:g}"
    return length, why


def checked_max_model_len(asked: int, explicit: bool, hf_config: Any, where: str) -> int:
    """The max_model_len to use: `asked`, or the model's limit when `asked` is the default and too long.

    `where` names the config file in messages. Raises ConfigError for an explicit value past the limit."""
    limit = model_context_length(hf_config)
    if limit is None or asked <= limit[0]:
        return asked
    length, derived = limit
    if not explicit:
        log.info("max_model_len %d (the default) lowered to the model's %s", asked, derived)
        return length
    msg = (f"max_model_len {asked} is more than this model's context length {length} ({derived} in {where}); "
           "positions past it were never trained and give wrong outputs")
    if os.environ.get(ALLOW_LONG, "").strip().lower() in ("1", "true", "yes", "on"):
        log.warning("%s; running anyway, as %s is set", msg, ALLOW_LONG)
        return asked
    raise ConfigError(f"{msg}. Pass max_model_len={length} or less (or leave it out), or set {ALLOW_LONG}=1 "
                      "to run longer anyway")
