"""`kvserve` command line. Each subcommand lives in its own module and registers itself here."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> module exposing `register(subparsers)`; the module sets `func` on its parser.
SUBCOMMANDS = {
    "generate": "kvserve.entrypoints.offline",
    "chat": "kvserve.entrypoints.offline",
    "serve": "kvserve.entrypoints.serve",
    "router": "kvserve.entrypoints.router",
    "bench": "kvserve.bench.cli",
    "plan": "kvserve.plan.cli",
    "eval": "kvserve.eval.cli",
    "build-kernel": "kvserve.entrypoints.build_kernel",
    "top": "kvserve.entrypoints.top",
}


class UserError(Exception):
    """An error to print as one line, with a non-zero exit, instead of a traceback."""


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, level.upper(), logging.INFO),
                        format="%(levelname)s %(asctime)s [%(name)s] %(message)s", datefmt="%m-%d %H:%M:%S")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="LLM inference and serving around the KV cache")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--version", action="version", version=f"kvserve {_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in dict.fromkeys(SUBCOMMANDS.values()):
        importlib.import_module(module).register(subparsers)
    return parser


def _version() -> str:
    from kvserve import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # `serve --data-parallel-size` passes them on
    setup_logging(args.log_level)
    from kvserve.engine.llm_engine import CapacityError
    from kvserve.model.config import UnsupportedModelError
    from kvserve.model.loader import ModelLoadError

    try:
        return args.func(args) or 0
    except (UserError, ModelLoadError, UnsupportedModelError, CapacityError, ValueError, FileNotFoundError) as exc:
        message = " ".join(str(exc).split())  # one line, whatever the exception's text
        print(f"kvserve {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # `python -m kvserve.cli`: run the imported module's main, not this __main__ copy, so that the
    # UserError subcommands raise (kvserve.cli.UserError) is the class main() catches.
    from kvserve.cli import main as _main

    sys.exit(_main())
