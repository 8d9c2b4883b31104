"""`nanoplug <command>`: one module per command in this folder, each with `add_parser(sub)` and `run(args)`."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS = {
    "generate": "nanoplug.cli.generate",
    "chat": "nanoplug.cli.chat",
    "plugins": "nanoplug.cli.plugins",
    "compare": "nanoplug.cli.compare",
    "bench": "nanoplug.cli.bench",
    "serve": "nanoplug.cli.serve",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoplug", description="A lightweight LLM inference engine of plugins.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log plugin choices and progress details")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue  # a command whose module is not in this build
        mod.add_parser(sub)
    return parser


def unknown_plugin(args: argparse.Namespace) -> str | None:
    """Why a plugin named on the command line is certainly unknown (`--attention`, `--kv-cache`; compare
    takes comma-separated lists), or None: checked against registry.toml, nothing imported."""
    from nanoplug.engine.plugin_names import unknown_name

    for kind in ("attention", "kv_cache"):
        value = getattr(args, kind, None)
        for name in value.split(",") if isinstance(value, str) else ():
            why = unknown_name(kind, name.strip()) if name.strip() else None
            if why:
                return why
    return None


def one_line(exc: BaseException) -> str:
    """An error's message on one line (a wrapped library message may span several)."""
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    """Run one command. Every NanoplugError (and a value pydantic refuses) is one line on stderr,
    `nanoplug: error: ...`, with exit code 2; Ctrl-C exits with 130. Anything else is a bug: a traceback."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    unknown = unknown_plugin(args)
    if unknown:  # refused before the engine (and torch) load: at once
        print(f"nanoplug: error: {unknown}", file=sys.stderr)
        return 2
    from pydantic import ValidationError

    from nanoplug.errors import NanoplugError

    try:
        return int(args.func(args) or 0)
    except (NanoplugError, ValidationError) as exc:
        print(f"nanoplug: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
