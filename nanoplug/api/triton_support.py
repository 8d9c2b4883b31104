"""What every plugin that runs Triton kernels says about where they can run: triton must import, and the
device must be a CUDA GPU, or a CPU through Triton's interpreter (`TRITON_INTERPRET=1`, which the tests
set before triton is imported). One wording for the reasons, so `nanoplug plugins` reads the same for all."""
from __future__ import annotations

import os
from types import ModuleType


def import_triton() -> tuple[ModuleType | None, ModuleType | None, str | None]:
    """(triton, triton.language, None), or (None, None, why) where triton is missing or broken: a plugin module
    defines its kernels only when triton imported, and hands `why` to `triton_reasons`, never crashing."""
    try:
        import triton
        import triton.language as tl
    except Exception as exc:
        return None, None, f"{type(exc).__name__}: {exc}"
    return triton, tl, None


def interpreting() -> bool:
    """Triton kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def triton_reasons(import_error: str | None, device_type: str) -> list[str]:
    """Why Triton kernels cannot run here (empty when they can). `import_error`: the plugin module's own failed
    `import triton` (type and message), or None when it imported."""
    reasons = []
    if import_error is not None:
        reasons.append(f"triton is not importable ({import_error}); pip install triton")
    if device_type != "cuda" and not interpreting():
        reasons.append(f"needs CUDA (device is {device_type}); on CPU only with TRITON_INTERPRET=1 set before "
                       "triton is imported, for tests")
    return reasons
