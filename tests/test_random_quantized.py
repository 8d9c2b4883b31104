"""The direct random writer of quantized checkpoints (nanoplug/bench/random_quantized.py, which
benchmarks/quantize_8b.py runs at the 8B shape) writes the on-disk format the libraries themselves write: on a
tiny model, the same tensor names, dtypes and shapes and the same quantization_config as compressed-tensors'
compressors (llmcompressor's save path) and transformers' Fp8Quantize write (nanoplug/bench/quantize.py), and
the libraries' own dequantization reads it (compressed-tensors' decompressor, transformers' Fp8Dequantize)."""
from __future__ import annotations

import json
from functools import lru_cache

import pytest
import torch

from _checkpoints import scratch_dir
from nanoplug.kernels.quant import int4
from _quant_checkpoints import SHAPE, quantized

pytest.importorskip("compressed_tensors", reason="pip install compressed-tensors (the test extra)")
MODULE = "model.layers.1.mlp.down_proj"


@lru_cache(maxsize=None)
def written(scheme: str):
    """(the library's checkpoint, ours) of `scheme`: the library's is _quant_checkpoints' (written once per
    session for both test files), float32 scales, so ours is written with float32 too."""
    from nanoplug.bench.random_quantized import write_random_quantized

    theirs = quantized(scheme, 128)  # the key test_quant_checkpoints caches it under
    return theirs, write_random_quantized(scratch_dir(f"rq-ours-{scheme}"), scheme, seed=2, dtype=torch.float32,
                                          **SHAPE)


def layout(folder):
    from safetensors import safe_open

    out = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                t = h.get_tensor(k)
                out[k] = (t.dtype, tuple(t.shape))
    return out


def state(folder, module):
    from safetensors.torch import load_file

    out = {}
    for f in folder.glob("*.safetensors"):
        out.update({k.removeprefix(module + "."): v for k, v in load_file(str(f)).items() if k.startswith(module + ".")})
    return out


def qconfig(folder):
    return json.loads((folder / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("scheme", ["w4a16", "w8a8", "fp8_block_ct", "fp8_block"])
def test_same_tensors_and_config_as_the_library_writes(scheme):
    theirs, ours = written(scheme)
    assert layout(ours) == layout(theirs)
    # all of it but the writing library's version (ours names the compressed-tensors it reproduces)
    assert {**qconfig(ours), "version": None} == {**qconfig(theirs), "version": None}


@pytest.mark.parametrize("scheme", ["w4a16", "w8a8", "fp8_block_ct"])
def test_compressed_tensors_decompresses_ours(scheme):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    from nanoplug.kernels.quant.fp8 import dequantize_blocks, dequantize_rows

    _, ours = written(scheme)
    group = next(iter(qconfig(ours)["config_groups"].values()))
    qscheme = QuantizationScheme(targets=group["targets"], weights=group["weights"],
                                 input_activations=group.get("input_activations"))
    t = state(ours, MODULE)
    got = BaseCompressor.load_from_registry(group["format"]).decompress(dict(t), qscheme)["weight"].float()
    if scheme == "w4a16":
        want = int4.dequantize_int4(t["weight_packed"], t["weight_scale"], None, torch.float32)
    elif scheme == "w8a8":
        want = dequantize_rows(t["weight"], t["weight_scale"].view(-1), torch.float32)
    else:
        want = dequantize_blocks(t["weight"], t["weight_scale"], (128, 128), torch.float32)
    assert torch.equal(got, want)
    assert 0.005 < want.std() < 0.05  # about the initializer's spread


def test_transformers_dequantizes_our_fp8_blocks():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from nanoplug.kernels.quant.fp8 import dequantize_blocks

    _, ours = written("fp8_block")
    t = state(ours, MODULE)
    got = Fp8Dequantize(None)._dequantize_one(t["weight"], t["weight_scale_inv"], output_dtype=torch.float32)
    assert torch.equal(got, dequantize_blocks(t["weight"], t["weight_scale_inv"], (128, 128), torch.float32))
    assert 0.005 < got.std() < 0.05
