"""`nanoplug serve`: an OpenAI-compatible HTTP server (the embedded default model unless --model)."""
from __future__ import annotations

import argparse
import os

from nanoplug.cli.options import OptionError, _first_problem, add_engine_options, model_path, speculation_options


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over the OpenAI HTTP API, with a chat page at /",
                       description="Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions, "
                       "/v1/models), with /health, Prometheus /metrics and a chat page at /.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one and prints it)")
    p.add_argument("--api-key", default=os.environ.get("NANOPLUG_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $NANOPLUG_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model as given)")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="requests queued beyond --max-num-seqs before new ones get 503 + Retry-After (default: 1024)")
    p.add_argument("--metrics-require-key", action="store_true", help="put /metrics behind --api-key too")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20,
                   help="larger request bodies get 413 before they are read (default: 4 MiB)")
    p.add_argument("--max-header-bytes", type=int, default=64 << 10,
                   help="request line and headers at most, else 431 (default: 64 KiB)")
    p.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="seconds for a request's headers to arrive, else 408 (default: 10)")
    p.add_argument("--max-prompts", type=int, default=1024, help="prompts in one completions request (default: 1024)")
    p.add_argument("--restart-engine", type=int, default=0, metavar="N",
                   help="restart a dead engine up to N times (default: 0, the server exits with code 1 so that its "
                   "supervisor restarts it)")
    p.add_argument("--single-process", action="store_true",
                   help="step the engine core in a thread of the server's process (default: a process of its own)")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="N engine processes behind this front end, one per GPU (or sharing them), on the CPU each with "
                   "its share of the cores (default: 1)")
    p.add_argument("--data-parallel-routing", choices=["prefix", "round_robin"], default="prefix",
                   help="how requests are spread over the replicas: prefix (to the replica whose cache holds the "
                   "prompt's first blocks, else the least loaded; the default) or round_robin")
    p.add_argument("--lora", "--lora-modules", action="append", default=[], metavar="NAME=PATH", dest="lora_modules",
                   help="serve the PEFT LoRA folder PATH per request under the model name NAME (repeat for more; "
                   "requests pick one by their `model`, and share each step with the base model's)")
    p.add_argument("--allow-runtime-lora", action="store_true",
                   help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes; off by default, "
                   "as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    p.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help="per-request adapter slots (default: the --lora count, plus 4 with --allow-runtime-lora)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="largest rank of an adapter loaded at run time (default: 16)")
    add_engine_options(p)
    p.add_argument("--max-num-seqs", type=int, default=256, help="requests in one batch at most (default: 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384, help="tokens in one step at most")
    p.add_argument("--kv-block-size", type=int, default=256, help="tokens per KV block (default: 256)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="fixed number of KV blocks (default: sized from memory)")
    p.add_argument("--cpu-kv-cache-gb", type=float, default=None, help="KV-cache memory on CPU (default: 4)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of GPU memory the engine may use (default: 0.9)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs, no fused small-op kernels")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--structured-output", default="auto",
                   help="constrained-decoding backend for response_format, guided_* and tool calls: xgrammar, "
                   "llguidance (default: auto)")
    p.set_defaults(func=run)


def engine_config(args: argparse.Namespace):
    from pydantic import ValidationError

    from nanoplug.config import EngineConfig
    from nanoplug.engine.platform_options import validate_platform_options
    from nanoplug.engine.registry import default_registry
    from nanoplug.checkpoint.source import resolve_model_path

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise OptionError(f"--device {args.device}: torch sees no CUDA GPU here; use --device cpu (or auto)")
    options = dict(attention=args.attention, kv_cache=args.kv_cache, device=args.device, dtype=args.dtype,
                   max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, kv_block_size=args.kv_block_size,
                   num_kv_blocks=args.num_kv_blocks, tensor_parallel_size=args.tensor_parallel_size, seed=args.seed,
                   structured_output=args.structured_output)
    if args.tensor_parallel_size > 1:
        options["parallel"] = "tensor"
    options.update(speculation_options(args))
    served = lora_modules(args.lora_modules)
    if served:
        options["adapters"] = [{"path": path, "name": name, "merge": False} for name, path in served.items()]
    max_loras = args.max_loras if args.max_loras is not None else len(served) + (4 if args.allow_runtime_lora else 0)
    if max_loras < len(served):
        raise OptionError(f"--max-loras {max_loras}: fewer slots than the {len(served)} --lora adapters given")
    options["max_loras"], options["max_lora_rank"] = max_loras, args.max_lora_rank
    options = {k: v for k, v in options.items() if v is not None}  # unset: the engine's own default
    cpu = {"kv_cache_gb": args.cpu_kv_cache_gb} if args.cpu_kv_cache_gb is not None else {}
    cuda = {k: v for k, v in (("memory_utilization", args.gpu_memory_utilization),
                              ("enforce_eager", args.enforce_eager or None)) if v is not None}
    if cpu:
        options["cpu"] = cpu
    if cuda:
        options["cuda"] = cuda
    try:
        config = EngineConfig(model=resolve_model_path(model_path(args)), **options)
        validate_platform_options(default_registry(), config)  # --gpu-memory-utilization 2 fails here, not later
        return config
    except ValidationError as exc:
        raise OptionError(_first_problem(exc)) from exc


def lora_modules(values: list[str]) -> dict[str, str]:
    """`--lora NAME=PATH ...` as {name: path}, refusing a malformed or repeated name."""
    served: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise OptionError(f"--lora {value!r}: give NAME=PATH, e.g. --lora sql=/models/sql-lora")
        if name in served:
            raise OptionError(f"--lora: the name {name!r} is given twice; give each adapter its own name")
        served[name] = path
    return served


def run(args: argparse.Namespace) -> int:
    try:
        import fastapi, msgspec, prometheus_client, sse_starlette, uvicorn  # noqa: F401,E401
    except ImportError as exc:
        raise OptionError(f"nanoplug serve needs {exc.name}: pip install 'nanoplug[serve]'") from exc
    from nanoplug.checkpoint.default_model import DEFAULT_MODEL_NAME
    from nanoplug.server.app import ServerSettings
    from nanoplug.server.launch import serve

    if args.max_waiting < 0:
        raise OptionError("--max-waiting must be 0 or more")
    if args.header_timeout <= 0:
        raise OptionError("--header-timeout must be more than 0 seconds")
    for flag in ("max_body_bytes", "max_prompts", "max_header_bytes"):
        if getattr(args, flag) < 1:
            raise OptionError(f"--{flag.replace('_', '-')} must be 1 or more")
    if args.restart_engine < 0:
        raise OptionError("--restart-engine must be 0 or more")
    if not 0 <= args.port <= 65535:
        raise OptionError(f"--port {args.port}: ports lie in 0..65535 (0: any free one)")
    config = engine_config(args)
    name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    adapters = lora_modules(args.lora_modules)
    if name in adapters:
        raise OptionError(f"--lora {name}=...: that is the base model's name; give the adapter another")
    settings = ServerSettings(model_name=name, adapters=adapters, allow_runtime_lora=args.allow_runtime_lora, api_key=args.api_key or None, max_waiting=args.max_waiting,
                              max_body_bytes=args.max_body_bytes, max_prompts=args.max_prompts,
                              metrics_require_key=args.metrics_require_key, restart_engine=args.restart_engine,
                              max_header_bytes=args.max_header_bytes, header_timeout_s=args.header_timeout)
    if args.data_parallel_size < 1:
        raise OptionError("--data-parallel-size must be 1 or more")
    if args.data_parallel_size > 1:
        if args.single_process:
            raise OptionError("--data-parallel-size runs engine processes; leave out --single-process")
        from nanoplug.server.replicas import Replicas

        engine = Replicas(config, args.data_parallel_size, args.data_parallel_routing)
    elif args.single_process:
        from nanoplug.server.engine_loop import EngineLoop

        engine = EngineLoop(config)
    else:
        from nanoplug.server.engine_process import EngineProcess

        engine = EngineProcess(config)
    return serve(engine, settings, host=args.host, port=args.port, access_log=args.access_log,
                 log_level="info" if args.verbose else "warning")
