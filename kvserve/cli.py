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


class _Parser(argparse.ArgumentParser):
    """No abbreviated flags, on every subcommand (nested subparsers take this class): `serve
    --data-parallel-size` passes its own argv on to the replicas, which must read it as it was meant."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvserve", description="LLM inference and serving around the KV cache")
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
    from kvserve.engine.errors import FatalEngineError
    from kvserve.engine.llm_engine import CapacityError
    from kvserve.model.config import UnsupportedModelError
    from kvserve.model.loader import ModelLoadError

    try:
        return args.func(args) or 0
    except (UserError, ModelLoadError, UnsupportedModelError, CapacityError, ValueError, FatalEngineError) as exc:
        return _one_line(args.command, str(exc))
    except OSError as exc:  # an output path that is a directory, a full disk, an address in use
        where = f" ({exc.filename})" if exc.filename else ""
        return _one_line(args.command, f"{exc.strerror or exc}{where}")
    except KeyboardInterrupt:
        return 130


def _one_line(command: str, text: str) -> int:
    message = " ".join(text.split())  # one line, whatever the exception's text
    print(f"kvserve {command}: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    # `python -m kvserve.cli`: run the imported module's main, not this __main__ copy, so that the
    # UserError subcommands raise (kvserve.cli.UserError) is the class main() catches.
    from kvserve.cli import main as _main

    sys.exit(_main())
