"""What every plugin that runs Triton kernels says about where they can run: triton must import, and the
device must be a CUDA GPU, or a CPU through Triton's interpreter (`TRITON_INTERPRET=1`, which the tests
set before triton is imported). One wording for the reasons, so `nanoplug plugins` reads the same for all."""
from __future__ import annotations

import os
import sys
from types import ModuleType

# why a CPU-only torch build leaves triton unimported: nothing there runs its kernels but the interpreter, and its
# import with the plugins' hundred kernel definitions is a quarter second of a CPU start (`nanoplug generate`)
CPU_BUILD = "not imported: this torch is a CPU-only build"


def import_triton() -> tuple[ModuleType | None, ModuleType | None, str | None]:
    """(triton, triton.language, None), or (None, None, why) where triton is missing or broken, or not imported on
    a CPU-only torch build (CPU_BUILD; imported there when TRITON_INTERPRET=1 is set first or something imported it
    already): a plugin module defines its kernels only when triton imported, and hands `why` to
    `triton_reasons`, never crashing."""
    if "triton" not in sys.modules and not interpreting() and _cpu_only_torch():
        return None, None, CPU_BUILD
    try:
        import triton
        import triton.language as tl
    except Exception as exc:
        return None, None, f"{type(exc).__name__}: {exc}"
    return triton, tl, None


def _cpu_only_torch() -> bool:
    import torch

    return torch.version.cuda is None and torch.version.hip is None


def import_reason(import_error: str | None) -> str | None:
    """The reason a plugin gives for triton's import, None where it imported (or was left unimported on a CPU-only
    build: the device's own reason says what stops it there)."""
    if import_error is None or import_error == CPU_BUILD:
        return None
    return f"triton is not importable ({import_error}); pip install triton"


def interpreting() -> bool:
    """Triton kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def triton_reasons(import_error: str | None, device_type: str) -> list[str]:
    """Why Triton kernels cannot run here (empty when they can). `import_error`: the plugin module's own failed
    `import triton` (type and message), CPU_BUILD where it was not attempted, or None when it imported."""
    reasons = [r for r in [import_reason(import_error)] if r]
    if device_type != "cuda" and not interpreting():
        reasons.append(f"needs CUDA (device is {device_type}); on CPU only with TRITON_INTERPRET=1 set before "
                       "triton is imported, for tests")
    elif import_error == CPU_BUILD:
        reasons.append("its kernels were not defined: TRITON_INTERPRET=1 was set after nanoplug's Triton modules "
                       "were imported; set it before")
    return reasons
