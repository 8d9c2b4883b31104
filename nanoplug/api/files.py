"""Reading files a user hands over (checkpoints, adapters) so that any failure names the file and the fix."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nanoplug.api.errors import ModelLoadError


def read_json(file: Path, fix: str) -> Any:
    """The parsed JSON of `file`; any failure to read or parse it is a ModelLoadError naming the file and `fix`."""
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{str(file)!r} is not valid JSON ({exc}); {fix}") from exc
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"{str(file)!r} is not UTF-8 text ({exc.reason} at byte {exc.start}); {fix}") from exc
    except OSError as exc:
        raise ModelLoadError(f"{str(file)!r} cannot be read ({exc.strerror or exc}); {fix}") from exc
