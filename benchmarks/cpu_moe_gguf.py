"""A mixture-of-experts GGUF on the CPU: its experts kept in their blocks (a layer per expert, the default) against
the same file dequantized to float32 (`quantization=None`): resident weight bytes, batch-1 decode and a batch of
prompts, greedy, in one process, alternately.

The file is a random Qwen3-MoE written as llama.cpp's converter writes it (tests/_gguf_arches.py, the test suite's
writer), its experts and attention in Q8_0 (gguf-py's quantizer), at a shape a 2-core machine runs in seconds.

    python benchmarks/cpu_moe_gguf.py
    python benchmarks/cpu_moe_gguf.py --hidden 1024 --experts 64 --layers 8
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the converter-shaped GGUF writer of the test suite
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from cpu_gguf import commit, cpu_name  # noqa: E402

from nanoplug import LLM, SamplingParams  # noqa: E402


def write_file(args, folder: Path) -> Path:
    from _gguf_arches import tokenizer_fields, write_gguf
    from nanoplug.bench.checkpoints import write_random_checkpoint
    from nanoplug.checkpoint.default_model import GGUF_NAME, default_model_path

    out = folder / f"qwen3moe-{args.hidden}h-{args.layers}l-{args.experts}e.gguf"
    if out.exists():
        return out
    ckpt = write_random_checkpoint(folder / "hf", "Qwen3MoeForCausalLM", seed=0, tokenizer=False, vocab_size=49152,
                                   bos_token_id=None, eos_token_id=0, pad_token_id=None, tie_word_embeddings=False,
                                   hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=16,
                                   num_key_value_heads=4, head_dim=args.hidden // 16, num_experts=args.experts,
                                   num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_size,
                                   intermediate_size=4 * args.hidden, norm_topk_prob=True)
    types = {p: "Q8_0" for p in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "attn_q", "attn_k", "attn_v",
                                 "attn_output")}
    return write_gguf(ckpt, out, tokenizer_fields(default_model_path() / GGUF_NAME), types)


def weight_bytes(llm) -> int:
    model = llm.engine.worker.model
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def timed(llm, prompts: list[list[int]], tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--expert-size", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--folder", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "nanoplug-moe-gguf"))
    args = ap.parse_args()
    torch.manual_seed(0)
    path = write_file(args, Path(args.folder))
    options = dict(device="cpu", kv_block_size=16, max_model_len=512, cpu={"kv_cache_gb": 0.5},
                   enable_prefix_caching=False)
    engines = {"experts kept (Q8_0)": LLM(str(path), **options),
               "dequantized (float32)": LLM(str(path), quantization=None, **options)}
    one = [[int(i) for i in torch.randint(100, 40000, (64,))]]
    many = [[int(i) for i in torch.randint(100, 40000, (64,))] for _ in range(args.batch)]
    best: dict[str, list[float]] = {name: [float("inf")] * 2 for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            timed(llm, one, 2)  # warm: the decode steps of both batch sizes recorded (or found eager) first
            timed(llm, many, 2)
            b1 = (timed(llm, one, args.tokens) - timed(llm, one, 1)) / (args.tokens - 1)
            bn = timed(llm, many, args.tokens)
            best[name] = [min(best[name][0], b1), min(best[name][1], bn)]
    print(f"{path.name}: hidden {args.hidden}, {args.layers} layers, {args.experts} experts (top {args.top_k}, "
          f"{args.expert_size} wide); {cpu_name()}; commit {commit()}; best of {args.rounds}")
    print(f"{'engine':24s} {'weights MiB':>12s} {'batch-1 decode ms/token':>24s} {f'{args.batch} prompts tok/s':>18s}")
    for name, llm in engines.items():
        b1, bn = best[name]
        print(f"{name:24s} {weight_bytes(llm) / 2**20:12.1f} {b1 * 1e3:24.2f} {args.batch * args.tokens / bn:18.1f}")
    for llm in engines.values():
        llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
