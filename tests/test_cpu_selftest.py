"""The C++ kernels' Python-free self-test (nanoplug/kernels/cpu/selftest.cpp: the GEMM, norms, decode attention
and the quantized GEMM on each path and activation mode against plain loops), built for this machine and, where
Debian's cross compiler and qemu-user are installed (.ci/run installs them), for aarch64 with NEON and the
dot-product extension, run under emulation: the Arm build of the same code the engine calls."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from nanoplug.kernels.cpu import build

pytestmark = pytest.mark.slow  # a build of the three sources (the aarch64 one under emulation: about a minute)
SOURCES = [str(build.SOURCE.with_name(name)) for name in ("kernels.cpp", "quant.cpp", "selftest.cpp")]
FLAGS = ["-O2", "-std=c++17", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]


def run_selftest(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "passed: 0 failed" in done.stdout, done.stdout + done.stderr
    return done.stdout


def test_the_selftest_passes_on_this_machine(tmp_path):
    compiler = build.find_compiler()
    assert compiler is not None, "this test needs a C++ compiler (g++ or clang++)"
    binary = tmp_path / "selftest"
    subprocess.run([compiler, *FLAGS, "-march=native", *SOURCES, "-o", str(binary)], check=True, timeout=300)
    out = run_selftest([str(binary)])
    assert "portable path, int8x2 activations" in out


def test_the_aarch64_build_passes_under_emulation(tmp_path):
    cross, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
    if not (cross and qemu):
        pytest.skip("needs Debian's g++-aarch64-linux-gnu and qemu-user (apt-get install g++-aarch64-linux-gnu qemu-user)")
    binary = tmp_path / "selftest-aarch64"
    subprocess.run([cross, *FLAGS, "-march=armv8.2-a+dotprod", *SOURCES, "-o", str(binary)], check=True, timeout=300)
    out = run_selftest([qemu, "-L", "/usr/aarch64-linux-gnu", str(binary)])
    assert "avx2 path" not in out and "portable path, int8x2 activations" in out
    assert "neon_dot path, int8x2 activations" in out  # qemu's default CPU has the dot-product extension
