"""`nanoplug chat`: an interactive conversation; the model's answers stream, the history is kept.

/reset forgets the conversation, /exit (or end of input, Ctrl-D) quits. When the conversation
outgrows the context, the oldest turns are dropped.
"""
from __future__ import annotations

import argparse
import sys

from nanoplug.cli.options import (OptionError, add_engine_options, add_sampling_options, build_llm, command_line_text,
                                  sampling_params)
from nanoplug.errors import RequestError

EXIT_COMMANDS = ("/exit", "/quit", "/bye")
HELP = "type a message and press Enter; /reset clears the conversation, /exit or Ctrl-D quits"


def add_parser(sub) -> None:
    parser = sub.add_parser("chat", help="talk with the model interactively",
                            description="Chat with the model (the embedded default model unless --model). " + HELP)
    parser.add_argument("--system", default=None, help="a system message (else the chat template's default)")
    add_sampling_options(parser, max_tokens=256)
    add_engine_options(parser)
    parser.set_defaults(func=run)


def read_message(interactive: bool) -> str | None:
    """The user's next line, or None at end of input; input that is not UTF-8 is a one-line error."""
    try:
        if interactive:
            try:
                return input(">>> ")
            except EOFError:
                print()
                return None
        line = sys.stdin.readline()
    except UnicodeDecodeError as exc:
        raise OptionError(f"the input is not valid UTF-8 text ({exc.reason} at byte {exc.start}); "
                          "convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from exc
    return None if line == "" else line.rstrip("\n")


def prompt_ids(llm, history: list[dict[str, str]], room: int) -> list[int]:
    """The templated conversation, oldest exchanges dropped until `room` new tokens fit."""
    ids = llm.chat_prompt_ids(history)
    while len(ids) + room > llm.config.max_model_len:
        first_user = next((i for i, m in enumerate(history) if m["role"] == "user"), None)
        if first_user is None or first_user == len(history) - 1:
            raise RequestError(
                f"the message alone needs {len(ids)} tokens, more than --max-model-len {llm.config.max_model_len} "
                f"leaves with --max-tokens {room}; shorten it or raise --max-model-len"
            )
        del history[first_user:first_user + 2]  # the oldest user turn and its answer
        ids = llm.chat_prompt_ids(history)
    return ids


def run(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    if args.system is not None:
        command_line_text("--system", args.system)
    llm = build_llm(args)
    interactive = sys.stdin.isatty()
    system = [{"role": "system", "content": args.system}] if args.system else []
    history = list(system)
    if interactive:
        print(f"nanoplug chat with {llm.config.model}: {HELP}", file=sys.stderr)
    try:
        while (message := read_message(interactive)) is not None:
            command = message.strip().lower()
            if command in EXIT_COMMANDS:
                break
            if command == "/reset":
                history = list(system)
                print("(conversation cleared)", file=sys.stderr)
                continue
            if not command:
                continue
            history.append({"role": "user", "content": message})
            try:
                ids = prompt_ids(llm, history, params.max_tokens)
            except RequestError as exc:
                history.pop()
                print(f"nanoplug: error: {exc}", file=sys.stderr)
                continue
            answer = []
            for delta in llm.stream(ids, params):
                answer.append(delta.text)
                sys.stdout.write(delta.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            sys.stdout.flush()
            history.append({"role": "assistant", "content": "".join(answer).strip()})
    finally:
        llm.close()
    return 0
