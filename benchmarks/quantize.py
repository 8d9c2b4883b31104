"""Write the quantized checkpoints the GPU figures are measured on (issue 35, item 5), with the libraries that
define their formats (nanoplug/bench/quantize.py): a random bf16 Qwen3 of the 8B shape (gpu_gguf.py's), its
int4 W4A16 (compressed-tensors pack-quantized, groups of 128, symmetric: what llmcompressor's W4A16 preset
writes) and its fp8 block-scaled copy (quant_method "fp8", [128, 128] weight_scale_inv, by transformers'
Fp8Quantize). The same folders can be served by vLLM or SGLang for a comparison.

    python3 benchmarks/quantize.py                  # the 8B shape under /tmp/gpu_gguf (about 10 minutes, 48 GB RAM)
    python3 benchmarks/quantize.py --tiny           # a tiny model of the same vocabulary (seconds; a smoke test)
    python3 benchmarks/quantize.py --schemes w4a16,fp8_block,awq --layers 8

Prints each folder and its size.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import gpu_gguf  # noqa: E402  (its 8B shape and plain checkpoint writer)

DEFAULT_SCHEMES = ("w4a16", "fp8_block")


def quantized_folders(layers: int, schemes: list[str]) -> dict[str, Path]:
    """The plain checkpoint ("bf16") and each scheme's, written where missing."""
    import torch

    from nanoplug.bench.quantize import write_quantized_checkpoint

    plain = gpu_gguf.write_checkpoint(layers)
    folders = {"bf16": plain}
    for scheme in schemes:
        t = time.perf_counter()
        folders[scheme] = write_quantized_checkpoint(plain, plain.parent / f"{plain.name}-{scheme}", scheme,
                                                     group_size=128, dtype=torch.bfloat16)
        print(f"{scheme}: {folders[scheme]} ({time.perf_counter() - t:.0f} s)", flush=True)
    return folders


def tiny(args) -> None:
    gpu_gguf.SHAPE.update(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1)
    args.layers = min(args.layers, 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=gpu_gguf.SHAPE["num_hidden_layers"])
    parser.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES),
                        help="of nanoplug.bench.quantize.SCHEMES: w4a16, w4a16_asym, w8a8, fp8_channel, fp8_block_ct, "
                             "fp8_block, awq, gptq")
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same vocabulary (smoke test)")
    args = parser.parse_args()
    if args.tiny:
        tiny(args)
    gpu_gguf.WORK.mkdir(parents=True, exist_ok=True)
    for name, folder in quantized_folders(args.layers, args.schemes.split(",")).items():
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        print(f"{name}: {folder} {size / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
