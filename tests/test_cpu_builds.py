"""The C++ float kernels built for other targets than this CPU pass the op tests of the native build on the same
inputs against the same torch references (test_cpu_kernels.py's, collected again here on each build): the
AVX2+FMA build (`-march=x86-64-v3`, what an AVX2 laptop or EPYC compiles: 6 x 16 GEMM tiles, F16C) and the
portable one (`-march=x86-64`, SSE2: the generic vector code, the scalar float16 conversion). The quantized
kernels choose their path at run time and test_quant_kernels.py runs each one this CPU has."""
from __future__ import annotations

import platform

import pytest
import torch

from nanoplug.kernels.cpu import build
from nanoplug.kernels.cpu.ops import CpuKernels
from test_cpu_kernels import (test_argmax_takes_the_first_maximum, test_linear_through_the_packed_weight,  # noqa: F401
                              test_paged_decode_matches_gathered_attention, test_paged_decode_refuses_what_it_does_not_serve,
                              test_rms_norm_and_add_rms_norm, test_rms_norm_of_head_views,
                              test_rope_in_place_on_the_qkv_views, test_silu_and_mul,
                              test_the_decode_kernel_reads_a_float16_cache)

pytestmark = pytest.mark.slow  # two builds of kernels.cpp (about 10 s each, once per machine)
TARGETS = {"x86-64-v3": 16, "x86-64": 16}  # -march -> the GEMM's panel width


@pytest.fixture(scope="module", params=list(TARGETS))
def kernels(request):
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"x86 targets; this machine is {platform.machine()}")
    assert build.find_compiler() is not None, "these tests need a C++ compiler (g++ or clang++)"
    path = build.library_path(build.SOURCE, build.LIBRARY_NAME, ([f"-march={request.param}", "-fopenmp"],))
    ops = CpuKernels(path)
    ops.target = request.param
    return ops


def test_the_build_is_for_its_target(kernels):
    """Its GEMM tiles are the target's (AVX2: 16-column panels, where AVX-512's 48 would spill)."""
    width = TARGETS[kernels.target]
    assert kernels.pack_weight(torch.zeros(width + 1, 8)).numel() == 2 * width * 8
