"""`nanoplug generate "PROMPT"`: stream one completion to stdout (the embedded default model unless --model)."""
from __future__ import annotations

import argparse
import sys

from nanoplug.cli.options import (OptionError, add_engine_options, add_sampling_options, build_llm, command_line_text,
                                  read_stdin, sampling_params)


def add_parser(sub) -> None:
    parser = sub.add_parser("generate", help="stream a completion of one prompt",
                            description="Stream a completion of PROMPT to stdout.")
    parser.add_argument("prompt", nargs="?", default=None, help="the text to continue (read from stdin when omitted)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template, as a user turn")
    parser.add_argument("--system", default=None, help="with --chat: a system message (else the template's default)")
    parser.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    add_sampling_options(parser, max_tokens=64)
    add_engine_options(parser)
    parser.add_argument("--lora", action="append", default=[], metavar="DIR",
                        help="a PEFT LoRA folder to merge into the weights at load (repeat to stack several, in order)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.prompt is None and sys.stdin.isatty():
        raise OptionError("no prompt given; pass it as an argument: nanoplug generate \"The capital of France is\"")
    prompt = command_line_text("the prompt", args.prompt) if args.prompt is not None else read_stdin("the prompt")
    if args.system is not None:
        command_line_text("--system", args.system)
    if not prompt.strip():
        raise OptionError("the prompt is empty; pass it as an argument: nanoplug generate \"The capital of France is\"")
    params = sampling_params(args)
    llm = build_llm(args)
    try:
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            request = llm.chat_prompt_ids(messages + [{"role": "user", "content": prompt}])
        else:
            request = prompt
        if args.echo:
            sys.stdout.write(prompt)
        for delta in llm.stream(request, params):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
    finally:
        llm.close()
    return 0
