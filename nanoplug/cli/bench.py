"""`nanoplug bench`: the throughput workload of BENCHMARK.md (nanoplug/bench/throughput.py), output tokens/s; static
batches against continuous batching; or, with --latency, TTFT, batch-1 decode and prefill
(nanoplug/bench/latency.py)."""
from __future__ import annotations

import argparse

from nanoplug.cli.options import add_speculation_options, speculation_options

# dest -> the flag, for the options that apply to one kind of run only
WORKLOAD_OPTIONS = {"num_seqs": "--num-seqs", "max_input_len": "--max-input-len", "max_output_len": "--max-output-len"}
# (flag, dest, what it sizes) of --latency's sizes; each default is nanoplug/bench/latency.py's dest.upper()
LATENCY_SIZES = [("--latency-prompts", "ttft_prompts", "time-to-first-token prompts"),
                 ("--ttft-prompt-len", "ttft_prompt_len", "tokens of each of them"),
                 ("--decode-prompt-len", "decode_prompt_len", "prompt tokens of the batch-1 decode"),
                 ("--decode-tokens", "decode_tokens", "tokens it generates"),
                 ("--prefill-prompts", "prefill_prompts", "prompts of the prefill run, sent at once"),
                 ("--prefill-prompt-len", "prefill_prompt_len", "tokens of each of them")]
LATENCY_OPTIONS = {dest: flag for flag, dest, _ in LATENCY_SIZES}


def add_parser(sub) -> None:
    from nanoplug.bench import latency as lat, throughput as bench

    p = sub.add_parser("bench", help="the throughput benchmark (256 random requests, Qwen3-0.6B shape), or --latency",
                       description=f"{bench.__doc__}\n{lat.__doc__}",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder (default: write the random Qwen3-0.6B-shape one)")
    p.add_argument("--attention", default="auto")
    p.add_argument("--prefill-attention", default=None)
    p.add_argument("--kv-cache", default="auto")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--static-batches", type=int, metavar="N",
                      help="the workload in static batches of N requests, each sent once the last has finished "
                           "(max_num_seqs=N)")
    mode.add_argument("--compare-static", type=int, metavar="N",
                      help="continuous batching, then static batches of N, on one engine with max_num_seqs=N "
                           "(prefix caching off for both): both throughputs and their ratio")
    mode.add_argument("--latency", action="store_true",
                      help="time to first token, batch-1 decode ms/token and prefill tok/s instead of the workload")
    p.add_argument("--num-seqs", type=int, metavar="N", help=f"workload requests (default {bench.NUM_SEQS})")
    p.add_argument("--max-input-len", type=int, metavar="N",
                   help=f"longest workload prompt (default {bench.MAX_INPUT_LEN}, at least 100)")
    p.add_argument("--max-output-len", type=int, metavar="N",
                   help=f"longest workload answer (default {bench.MAX_OUTPUT_LEN}, at least 100)")
    for flag, dest, text in LATENCY_SIZES:
        p.add_argument(flag, dest=dest, type=int, metavar="N",
                       help=f"--latency: {text} (default {getattr(lat, dest.upper())})")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, metavar="N", default=None,
                   help="sequences run at once (default: the engine's, 256)")
    p.add_argument("--kv-block-size", type=int, default=256, help="tokens per KV block (page)")
    p.add_argument("--num-kv-blocks", type=int, metavar="N", default=None,
                   help="KV blocks on each rank (default: sized from the device's free memory)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs, no fused small-op kernels")
    p.add_argument("--no-overlap", action="store_true",
                   help="run steps one after another (default: the host prepares the next step while the GPU computes)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--quantization", default=None, metavar="FORMAT",
                   help="a weight format by name (fp8: linear weights and an MoE's experts to e4m3 on load; "
                        "default: auto, the checkpoint's own)")
    add_speculation_options(p)
    p.set_defaults(func=run)


def given(args, options: dict[str, str]) -> list[str]:
    return [flag for dest, flag in options.items() if getattr(args, dest) is not None]


def run(args) -> int:
    from nanoplug.bench import throughput as bench
    from nanoplug.errors import ConfigError

    options = dict(attention=args.attention, kv_cache=args.kv_cache, max_model_len=args.max_model_len,
                   kv_block_size=args.kv_block_size, tensor_parallel_size=args.tensor_parallel_size, cuda={"enforce_eager": args.enforce_eager},
                   device=args.device, dtype=args.dtype)
    if args.no_overlap:
        options["overlap_steps"] = False
    if args.quantization is not None:
        options["quantization"] = args.quantization
    options.update(speculation_options(args))
    if args.prefill_attention:
        options["prefill_attention"] = args.prefill_attention
    if args.tensor_parallel_size > 1:
        options["parallel"] = "tensor"
    if args.max_num_seqs is not None:
        options["max_num_seqs"] = args.max_num_seqs
    if args.num_kv_blocks is not None:
        options["num_kv_blocks"] = args.num_kv_blocks
    if args.latency and given(args, WORKLOAD_OPTIONS):
        raise ConfigError(f"{', '.join(given(args, WORKLOAD_OPTIONS))} size the throughput workload, which --latency "
                          f"does not run; size the latency prompts with {', '.join(LATENCY_OPTIONS.values())}")
    if not args.latency and given(args, LATENCY_OPTIONS):
        raise ConfigError(f"{', '.join(given(args, LATENCY_OPTIONS))} size the latency prompts; add --latency")
    if args.latency:
        return print_latency(args, options)
    sizes = [default if value is None else value for value, default in
             [(args.num_seqs, bench.NUM_SEQS), (args.max_input_len, bench.MAX_INPUT_LEN),
              (args.max_output_len, bench.MAX_OUTPUT_LEN)]]
    if args.compare_static is not None:
        comparison = bench.run_static_comparison(args.model, args.compare_static, *sizes, **options)
        print_header(comparison.continuous)
        print_throughput(comparison.continuous, labelled=True)
        print_throughput(comparison.static, labelled=True)
        print(f"continuous / static batches of {args.compare_static}: {comparison.ratio:.2f}x")
        return 0
    result = bench.run_bench(args.model, *sizes, static_batch=args.static_batches, **options)
    print_header(result)
    print_throughput(result, labelled=args.static_batches is not None or args.max_num_seqs is not None)
    return 0


def print_header(result) -> None:
    for line in result.plugins:
        print(line)
    if result.engine:
        print(result.engine)
    print(f"start-up {result.startup_seconds:.1f} s; prompt tokens {result.prompt_tokens:,}, "
          f"output tokens {result.output_tokens:,}")


def print_throughput(result, labelled: bool) -> None:
    """nano-vllm's line (benchmarks/gpu_tp.py reads it), after how the requests were batched when that was asked."""
    batching = f"static batches of {result.static_batch}" if result.static_batch else "continuous batching"
    label = f"{batching}, max_num_seqs {result.max_num_seqs}: " if labelled else ""
    print(f"{label}Total: {result.output_tokens}tok, Time: {result.seconds:.2f}s, "
          f"Throughput: {result.output_tok_per_s:,.2f} tok/s")


def print_latency(args, options: dict) -> int:
    from nanoplug.bench.latency import run_latency

    sizes = {dest: getattr(args, dest) for dest in LATENCY_OPTIONS if getattr(args, dest) is not None}
    r = run_latency(args.model, **sizes, **options)
    for line in r.plugins:
        print(line)
    if r.engine:
        print(r.engine)
    print(f"start-up {r.startup_seconds:.1f} s; latency on an idle engine, no prefix-cache hits:")
    print(f"  time to first token, {r.ttft_prompt_len}-token prompt: median {r.ttft_median_ms:.2f} ms "
          f"(min {min(r.ttft_ms):.2f}, max {max(r.ttft_ms):.2f}) over {len(r.ttft_ms)} prompts")
    print(f"  batch-1 decode, {r.decode_prompt_len}-token prompt: {r.decode_ms_per_token:.3f} ms/token "
          f"over {r.decode_tokens} tokens")
    print(f"  prefill, {r.prefill_prompts} x {r.prefill_prompt_len}-token prompts: {r.prefill_tok_per_s:,.0f} tok/s "
          f"({r.prefill_seconds:.2f} s)")
    return 0
