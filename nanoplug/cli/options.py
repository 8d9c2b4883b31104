"""Options that `generate` and `chat` share: which model and plugins, how to sample, and building the engine.

Bad input becomes a NanoplugError (one line on stderr, exit code 2, see nanoplug/cli/__init__.py).
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from nanoplug.errors import ModelLoadError, NanoplugError

log = logging.getLogger("nanoplug.cli")


class OptionError(NanoplugError, ValueError):
    """A command-line value the engine refuses (e.g. a negative temperature)."""


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", default=None, metavar="DIR_OR_ID",
                        help="checkpoint folder or Hugging Face id (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--attention", default="auto", help="attention backend, e.g. sdpa, manual, flash (default: auto)")
    parser.add_argument("--kv-cache", default="auto", help="KV-cache store, e.g. torch, triton (default: auto)")
    parser.add_argument("--device", default="auto", help="auto (a GPU if present), cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt plus answer, in tokens (default: 4096, or the model's limit if lower)")
    parser.add_argument("--float32", action="store_true",
                        help="dequantize a quantized checkpoint (the default model's GGUF, a .gguf file) to float32 "
                             "weights instead of computing with its blocks: the reference, slower and 5x the memory")
    add_speculation_options(parser)


def add_speculation_options(parser: argparse.ArgumentParser) -> None:
    """Speculative decoding: a speculator by name, its drafts per step, its own options."""
    parser.add_argument("--speculator", default=None,
                        help="propose draft tokens the model verifies in one step: ngram, draft or eagle "
                             "(the last two with --speculator-option model=DIR; default: none)")
    parser.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                        help="drafts per sequence and step at most (default: 4)")
    parser.add_argument("--speculator-option", action="append", default=[], metavar="KEY=VALUE",
                        help="an option of the speculator, e.g. prompt_lookup_max=5 (repeatable)")
    parser.add_argument("--no-adaptive-speculation", action="store_true",
                        help="always ask K drafts (default: adapt K to acceptance and batch size)")


def speculation_options(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields the speculation options give (none when no --speculator)."""
    if getattr(args, "speculator", None) is None:
        extra = [f for f, v in (("--num-speculative-tokens", getattr(args, "num_speculative_tokens", None)),
                                ("--speculator-option", getattr(args, "speculator_option", None))) if v]
        if extra:
            raise OptionError(f"{', '.join(extra)} need --speculator (e.g. --speculator ngram)")
        return {}
    options: dict[str, Any] = {"speculator": args.speculator, "adaptive_speculation": not args.no_adaptive_speculation}
    if args.num_speculative_tokens is not None:
        options["num_speculative_tokens"] = args.num_speculative_tokens
    values = {}
    for item in args.speculator_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise OptionError(f"--speculator-option {item!r}: write KEY=VALUE, e.g. prompt_lookup_max=5")
        values[key] = int(value) if value.lstrip("-").isdigit() else value
    if values:
        options["speculator_options"] = values
    return options


def add_sampling_options(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", "-n", type=int, default=max_tokens, help=f"new tokens at most (default: {max_tokens})")
    parser.add_argument("--temperature", "-t", type=float, default=0.0, help="0 is greedy (the default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0, off)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (default: 0, off)")
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")


def sampling_params(args: argparse.Namespace, **extra: Any):
    from pydantic import ValidationError

    from nanoplug import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              max_tokens=args.max_tokens, seed=args.seed, **extra)
    except ValidationError as exc:
        raise OptionError(_first_problem(exc)) from exc


def command_line_text(what: str, text: str) -> str:
    """`text` from the command line, refused when it is not valid UTF-8 (Python keeps such bytes as lone
    surrogates, which no tokenizer takes)."""
    from nanoplug.engine.requests import lone_surrogate

    bad = lone_surrogate(text)
    if bad:
        raise OptionError(f"{what} is not valid UTF-8 text: it has {bad}; convert it to UTF-8 "
                          "(e.g. iconv -f latin1 -t utf-8) and try again")
    return text


def read_stdin(what: str) -> str:
    """All of stdin as text, refused in one line when it is not valid UTF-8."""
    try:
        return sys.stdin.read()
    except UnicodeDecodeError as exc:
        raise OptionError(f"{what} on stdin is not valid UTF-8 text ({exc.reason}: byte 0x{exc.object[exc.start]:02x} "
                          f"at byte {exc.start}); convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from exc


def _first_problem(exc: Any) -> str:
    err = exc.errors()[0]
    if len(err.get("loc", ())) > 1 and err["type"] == "platform_option":
        return err["msg"]  # names the platform and its option itself
    field = "--" + str(err["loc"][0]).replace("_", "-") if err.get("loc") else "an option"
    return f"{field}: {err['msg']}"


def model_path(args: argparse.Namespace) -> str:
    """The --model value, or the embedded default model (converted once, then read from the cache)."""
    if args.model:
        return args.model
    from nanoplug.checkpoint.default_model import DefaultModelError, default_model_path

    try:
        path = default_model_path(progress=True, float32=getattr(args, "float32", False))
    except DefaultModelError as exc:
        raise ModelLoadError(str(exc)) from exc
    log.info("default model: %s", path)
    return str(path)


def build_llm(args: argparse.Namespace):
    """The engine the options describe; with -v, one line per plugin kind on stderr."""
    import torch
    from pydantic import ValidationError

    from nanoplug import LLM

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise OptionError(f"--device {args.device}: torch sees no CUDA GPU here; use --device cpu (or auto)")
    options = dict(attention=args.attention, kv_cache=args.kv_cache, device=args.device, dtype=args.dtype)
    if args.max_model_len is not None:
        options["max_model_len"] = args.max_model_len
    if args.seed is not None:
        options["seed"] = args.seed
    if getattr(args, "float32", False):
        options["quantization"] = None
    if getattr(args, "lora", None):  # `generate --lora DIR`: PEFT LoRA folders merged at load
        options["adapters"] = list(args.lora)
    options.update(speculation_options(args))
    try:
        llm = LLM(model_path(args), **options)
    except ValidationError as exc:
        raise OptionError(_first_problem(exc)) from exc
    if getattr(args, "verbose", False):
        # the registry logs why for each "auto" choice; this line sums up every kind, named or auto
        chosen = " ".join(f"{kind}={llm.choices[kind].name}"
                          for kind in ("model", "attention", "prefill_attention", "kv_cache", "parallel", "platform"))
        dtype = str(llm.dtype).replace("torch.", "")
        fmt = llm.choices["weight_format"]
        weights = f"{fmt.cls.quant_method} blocks" if fmt.cls.kept_types else dtype if fmt.name == "dense" else fmt.name
        print(f"nanoplug: {llm.config.model} on {llm.device} ({dtype}); plugins: {chosen}; weights: {weights}",
              file=sys.stderr)
    return llm
