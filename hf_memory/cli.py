"""The ``hf-memory`` command line: ``hf-memory --help`` lists the subcommands."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

__all__ = ["build_parser", "main"]

DEMO_PROMPTS = (
    "What is the capital of France?",
    "Give me one tip for staying focused while studying.",
)


class CLIError(Exception):
    """A user-facing failure: printed as one line, exit status 2."""


def _demo(args: argparse.Namespace) -> None:
    import_start = time.perf_counter()
    import transformers  # noqa: F401  (imported here so the load time below is the load alone)

    from .chat import generate_chat
    from .default_model import DefaultModelUnavailableError, load_default_model

    start = time.perf_counter()
    try:
        model, tokenizer = load_default_model()
    except DefaultModelUnavailableError as error:
        raise CLIError(str(error)) from error
    loaded = time.perf_counter()
    prompts = args.prompt or list(DEMO_PROMPTS)
    try:
        answers = generate_chat(model, tokenizer, prompts, max_new_tokens=args.max_new_tokens)
    except ValueError as error:
        raise CLIError(str(error)) from error
    done = time.perf_counter()
    print(f"# {model.name_or_path} ({model.config.model_type}, "
          f"{model.config.num_hidden_layers} layers) loaded in {loaded - start:.1f}s "
          f"(imports {start - import_start:.1f}s)")
    for prompt, answer in zip(prompts, answers, strict=True):
        print(f"\nUser: {prompt}\nAssistant: {answer}")
    print(f"\n# {len(prompts)} answers in {done - loaded:.1f}s")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="hf-memory",
        description="Memory-centric language-model research with Hugging Face objects.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="<command>", required=True)

    demo = commands.add_parser(
        "demo", help="load the embedded SmolLM2-135M-Instruct and answer chat prompts",
        description="Load the embedded default model and answer chat prompts (greedy).",
    )
    demo.add_argument("--prompt", action="append", metavar="TEXT",
                      help="a prompt to answer (repeatable; default: two built-in prompts)")
    demo.add_argument("--max-new-tokens", type=_positive_int, default=48, metavar="N",
                      help="tokens to generate per answer (default: 48)")
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.handler(args)
    except CLIError as error:
        print(f"hf-memory {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
