"""`nanoplug bench`: the throughput workload of BENCHMARK.md (see nanoplug/bench.py), output tokens/s."""
from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    from nanoplug import bench

    p = sub.add_parser("bench", help="the throughput benchmark (256 random requests, Qwen3-0.6B shape)",
                       description=bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder (default: write the random Qwen3-0.6B-shape one)")
    p.add_argument("--attention", default="auto")
    p.add_argument("--prefill-attention", default=None)
    p.add_argument("--kv-cache", default="auto")
    p.add_argument("--num-seqs", type=int, default=bench.NUM_SEQS)
    p.add_argument("--max-input-len", type=int, default=bench.MAX_INPUT_LEN)
    p.add_argument("--max-output-len", type=int, default=bench.MAX_OUTPUT_LEN)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-block-size", type=int, default=256, help="tokens per KV block (page)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs, no torch.compile")
    p.add_argument("--no-overlap", action="store_true",
                   help="run steps one after another (default: the host prepares the next step while the GPU computes)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.set_defaults(func=run)


def run(args) -> int:
    from nanoplug import bench

    options = dict(attention=args.attention, kv_cache=args.kv_cache, max_model_len=args.max_model_len,
                   kv_block_size=args.kv_block_size, tensor_parallel_size=args.tensor_parallel_size, cuda={"enforce_eager": args.enforce_eager},
                   device=args.device, dtype=args.dtype)
    if args.no_overlap:
        options["overlap_steps"] = False
    if args.prefill_attention:
        options["prefill_attention"] = args.prefill_attention
    if args.tensor_parallel_size > 1:
        options["parallel"] = "tensor"
    result = bench.run_bench(args.model, args.num_seqs, args.max_input_len, args.max_output_len, **options)
    for line in result.plugins:
        print(line)
    print(f"start-up {result.startup_seconds:.1f} s; prompt tokens {result.prompt_tokens:,}, "
          f"output tokens {result.output_tokens:,}")
    print(f"Total: {result.output_tokens}tok, Time: {result.seconds:.2f}s, "
          f"Throughput: {result.output_tok_per_s:,.2f} tok/s")
    return 0
