"""The ``hf-memory`` command line: one parser, one module per command group.

``hf-memory --help`` imports no torch: every group imports what it runs inside its handler.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .errors import CLIError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    from hf_memory import __version__

    from .air import add_air_parsers
    from .analysis import add_analyze_ffn_parser
    from .arith import add_arith_parsers
    from .asm import add_asm_parsers
    from .caa import add_caa_parsers
    from .convert import add_convert_parser
    from .evaluation import add_eval_parsers
    from .memory import add_memory_parsers
    from .playground import add_playground_parser
    from .publish import add_publish_parsers
    from .steering import add_steering_parsers

    parser = argparse.ArgumentParser(
        prog="hf-memory",
        description="Memory-centric language-model research with Hugging Face objects.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    add_memory_parsers(commands)
    add_steering_parsers(commands)
    add_caa_parsers(commands)
    add_playground_parser(commands)
    add_analyze_ffn_parser(commands)
    add_air_parsers(commands)
    add_arith_parsers(commands)
    add_asm_parsers(commands)
    add_convert_parser(commands)
    add_eval_parsers(commands)
    add_publish_parsers(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.handler(args)
    except (CLIError, ValueError, OSError) as error:
        print(f"hf-memory {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
