"""Compile kernels.cpp once per machine into a shared library in the per-user cache.

The library is built for the CPU it runs on (`-march=native`), so the cache key covers the source,
the compiler, the flags and the CPU's model and feature flags: a home folder shared between machines
gets one build per kind of CPU. The build writes a temporary file and renames it into place, so
processes starting together never load half a library. Plain C++ with no torch headers: a build takes
a few seconds, and needs only a C++ compiler (`$CXX`, else c++, g++ or clang++ on PATH).

`NANOPLUG_CPU_MARCH=x86-64-v3` (any `-march` value) builds for that target instead of this CPU: the AVX2+FMA
paths tested and measured on an AVX-512 machine, or `x86-64` for the portable ones (tests/test_cpu_builds.py).
"""
from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

from nanoplug.kernels.cpu.record import RecordingLib

log = logging.getLogger("nanoplug")

SOURCE = pathlib.Path(__file__).with_name("kernels.cpp")
LIBRARY_NAME = "libnanoplug_cpu_kernels.so"
BASE_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math"]
# tried in order: the first that compiles wins (GCC/Clang on x86 and Linux arm64, then Apple clang
# without OpenMP, then plain)
FLAG_VARIANTS = (["-march=native", "-fopenmp"], ["-mcpu=native", "-fopenmp"], ["-march=native"], ["-mcpu=native"], [])
MARCH_ENV = "NANOPLUG_CPU_MARCH"


def flag_variants() -> tuple[list[str], ...]:
    """FLAG_VARIANTS, or those of the target $NANOPLUG_CPU_MARCH names."""
    march = os.environ.get(MARCH_ENV, "").strip()
    return ([f"-march={march}", "-fopenmp"], [f"-march={march}"]) if march else FLAG_VARIANTS
COMPILE_TIMEOUT_S = 300


class KernelsUnavailable(RuntimeError):
    """The kernels cannot be built or loaded here; the message says why and what to do."""


def find_compiler() -> str | None:
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    for name in candidates:
        found = shutil.which(name)
        if found:
            return found
    return None


def _cpu_signature() -> str:
    """The CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith(("model name", "flags", "Features"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def cache_dir() -> pathlib.Path:
    from nanoplug.api.disk_cache import cache_root

    return cache_root() / "cpu_kernels"


def library_path(source: pathlib.Path = SOURCE, name: str = LIBRARY_NAME,
                 variants: tuple[list[str], ...] | None = None) -> pathlib.Path:
    """The built library, compiling it first when this machine has none yet (`source` into `name`,
    with the first of the flag `variants` that compiles: quant_build.py builds its library here too)."""
    variants = flag_variants() if variants is None else variants
    compiler = find_compiler()
    if compiler is None:
        raise KernelsUnavailable("no C++ compiler found: install g++ or clang++ (or set $CXX), "
                                 "or pass cpu={'kernels': False} and attention='sdpa' to run without the C++ kernels")
    code = source.read_bytes()
    key = hashlib.sha256(b"\0".join([code, _compiler_version(compiler).encode(), " ".join(BASE_FLAGS).encode(),
                                     repr(variants).encode(),
                                     platform.machine().encode(), _cpu_signature().encode()])).hexdigest()[:16]
    folder = cache_dir() / key
    target = folder / name
    if target.exists():
        return target
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KernelsUnavailable(f"cannot create {folder}: {exc}; set NANOPLUG_CACHE to a writable folder") from exc
    log.info("compiling nanoplug's CPU kernels for this machine (once, a few seconds) into %s", folder)
    errors = []
    for variant in variants:
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so.tmp")
        os.close(fd)
        cmd = [compiler, *BASE_FLAGS, *variant, str(source), "-o", tmp]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            done = None
            errors.append(f"{' '.join(cmd)}: {exc}")
        if done is not None and done.returncode == 0:
            os.replace(tmp, target)
            if "-fopenmp" not in variant:
                log.warning("nanoplug's CPU kernels were built without OpenMP (%s): they use one thread", compiler)
            return target
        os.unlink(tmp)
        if done is not None:
            errors.append(f"{' '.join(cmd)}:\n{done.stderr.strip()[-1500:]}")
    raise KernelsUnavailable("the C++ compiler could not build nanoplug's CPU kernels; tried:\n" + "\n".join(errors)
                             + "\npass cpu={'kernels': False} and attention='sdpa' to run without them")


class BuiltLibrary:
    """One C++ library built on first use and wrapped (`wrap(path)`), or the reason it cannot run here: each
    kernel module (quant_ops, kquant_ops, int_weights) keeps one."""

    def __init__(self, wrap, source: pathlib.Path, name: str, variants: tuple[list[str], ...] | None):
        self.wrap, self.source, self.name, self.variants = wrap, source, name, variants
        self._loaded = None

    def _load(self):
        if self._loaded is None:
            try:
                self._loaded = self.wrap(library_path(self.source, self.name, self.variants))
            except (KernelsUnavailable, OSError) as exc:
                self._loaded = str(exc)
        return self._loaded

    def unavailable(self) -> str | None:
        """Why the kernels cannot run here (building them if needed), or None."""
        loaded = self._load()
        return loaded if isinstance(loaded, str) else None

    def get(self):
        """The loaded kernels (built on first call); raises KernelsUnavailable with the reason."""
        loaded = self._load()
        if isinstance(loaded, str):
            raise KernelsUnavailable(loaded)
        return loaded


def open_library(path: pathlib.Path, prefix: str, abi_version: int, signatures: dict):
    """The library at `path` opened with ctypes, its `{prefix}_abi_version()` checked against `abi_version` and
    each of `signatures` (name -> (restype, argtypes)) declared: what every kernel module does first."""
    import ctypes

    lib = ctypes.CDLL(str(path))
    getattr(lib, f"{prefix}_abi_version").restype = ctypes.c_int
    if getattr(lib, f"{prefix}_abi_version")() != abi_version:
        raise KernelsUnavailable(f"{path} is a build of another version of the kernels; delete it to rebuild")
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


class IsaKernels:
    """A kernel library whose entry points take an instruction-set path: opened (`open_library`), its calls made
    recordable by a CPU graph capture (`RecordingLib`), the paths of `isas` this CPU runs found through
    `{prefix}_isa_supported(i)`; `best` the last of them (the fastest), `_isa(name)` a path's id for a call."""

    def __init__(self, path: pathlib.Path, prefix: str, abi_version: int, signatures: dict, isas: tuple[str, ...]):
        lib = open_library(path, prefix, abi_version, signatures)
        self._lib, self.path, self._isa_names = RecordingLib(lib, list(signatures)), path, isas
        supported = getattr(lib, f"{prefix}_isa_supported")
        self.isas = [name for i, name in enumerate(isas) if supported(i)]
        self.best = self.isas[-1]

    def _isa(self, isa: str | None) -> int:
        name = self.best if isa is None else isa
        if name not in self.isas:
            raise ValueError(f"kernel path {name!r} does not run on this CPU; it runs {', '.join(self.isas)}")
        return self._isa_names.index(name)
