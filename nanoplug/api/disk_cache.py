"""Where nanoplug and its plugins keep what they build once per machine (kernels, converted models)."""
from __future__ import annotations

import os
import pathlib


def cache_root() -> pathlib.Path:
    """Return the per-user cache root (``$NANOPLUG_CACHE``, ``$XDG_CACHE_HOME/nanoplug`` or ``~/.cache/nanoplug``)."""
    env = os.environ.get("NANOPLUG_CACHE")
    if env:
        return pathlib.Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return pathlib.Path(xdg).expanduser() / "nanoplug"
    return pathlib.Path.home() / ".cache" / "nanoplug"
