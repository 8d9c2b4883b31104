"""Write the random Qwen3-8B-shape checkpoints the quantized-weight figures are measured on (issue 35, item 5):
bf16, int4 W4A16 (compressed-tensors pack-quantized, symmetric groups of 128: llmcompressor's W4A16 preset) and
fp8 block-scaled (quant_method "fp8", e4m3 with float32 weight_scale_inv per [128, 128] block: Qwen3-8B-FP8's
layout), each drawn directly in its format (nanoplug/bench/random_quantized.py, on the GPU where there is one):
seconds a file, not the minutes of quantizing 16 GB of bf16. tests/test_random_quantized.py checks on a tiny
model that the files are what compressed-tensors and transformers write and read. The same folders can be served
by vLLM or SGLang for a comparison.

    python3 benchmarks/quantize_8b.py                        # /tmp/quant_8b/{bf16,w4a16,fp8_block}
    python3 benchmarks/quantize_8b.py --schemes w4a16 --layers 8 --out DIR
    python3 benchmarks/quantize_8b.py --tiny                 # a tiny model of the same vocabulary (smoke test)

(benchmarks/quantize.py quantizes a given bf16 checkpoint through the libraries themselves instead.)
Prints each folder, its size and the seconds it took.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPE = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
             num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
             rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960)
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
SCHEMES = ("bf16", "w4a16", "fp8_block")
WORK = Path("/tmp/quant_8b")


def write_all(out: Path, schemes: list[str], layers: int | None = None, tiny: bool = False,
              device: str | None = None) -> dict[str, Path]:
    """scheme -> its folder under `out`, each written where missing."""
    import torch

    from nanoplug.bench.random_quantized import write_random_quantized

    shape = {**SHAPE, **(TINY if tiny else {})}
    if layers is not None:
        shape["num_hidden_layers"] = layers
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out.mkdir(parents=True, exist_ok=True)
    name = f"qwen3-{shape['hidden_size']}h-{shape['num_hidden_layers']}l"
    folders = {}
    for scheme in schemes:
        t = time.perf_counter()
        folders[scheme] = write_random_quantized(out / f"{name}-{scheme}", scheme, seed=0, device=device, **shape)
        size = sum(f.stat().st_size for f in folders[scheme].glob("*.safetensors"))
        print(f"{scheme}: {folders[scheme]} {size / 1e9:.2f} GB ({time.perf_counter() - t:.0f} s)", flush=True)
    return folders


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", default=",".join(SCHEMES), help=f"of {', '.join(SCHEMES)}")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 36)")
    parser.add_argument("--out", type=Path, default=WORK)
    parser.add_argument("--device", default=None, help="where the tensors are drawn (default: cuda if present)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same vocabulary (smoke test)")
    args = parser.parse_args()
    write_all(args.out, args.schemes.split(","), args.layers, args.tiny, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
