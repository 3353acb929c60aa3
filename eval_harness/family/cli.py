"""``hf-memory eval air-sudoku``, ``air-maze``, ``arith-splits`` and ``asm-lm``: the tasks of
the project's own model families, their flags, configs and model loading."""

from __future__ import annotations

from ..arguments import add_shared, positive_int
from ..registry import EvalTask, lazy

__all__ = ["TASKS", "load_family"]

_FINGERPRINT = lazy("eval_harness.family.task", "family_fingerprint")
_RENDER = lazy("eval_harness.family.report", "render_family_report")


def load_family(args):
    """``(model, tokenizer)`` of a trained model of the task's family (``--model``, a folder or
    repo id, at ``--revision``), torch seeded first; the tokenizer is the ASM tasks' only."""
    if args.model == "default":
        raise ValueError(f"{args.task} needs --model: a folder or repo id of a trained model")
    import torch

    from .task import load_family_model

    torch.manual_seed(args.seed)
    model = load_family_model(args.model, args.task, revision=args.revision)
    if not args.task.startswith("asm-"):
        return model, None
    from transformers import AutoTokenizer

    try:
        return model, AutoTokenizer.from_pretrained(args.model, revision=args.revision)
    except (OSError, ValueError):
        raise ValueError(f"{args.task} needs the tokenizer saved with the model; "
                         f"{args.model!r} has none") from None


def family_task(name: str, summary: str, add_arguments, build_config, run, render=_RENDER):
    """An :class:`EvalTask` of a model family: ``--revision`` added, the model loaded by
    :func:`load_family` and fingerprinted by its config and weights."""
    def add(parser) -> None:
        add_shared(parser, "--revision")
        add_arguments(parser)

    return EvalTask(name, summary, add, build_config, run, render, load=load_family,
                    fingerprint=_FINGERPRINT)


def _air_task(name: str, summary: str) -> EvalTask:
    def run(model, tokenizer, config, seed):
        from .task import run_air_puzzles

        return run_air_puzzles(model, name, puzzles=config["puzzles"], seed=seed)

    return family_task(
        name, summary,
        lambda parser: parser.add_argument("--puzzles", type=positive_int, default=200,
                                           metavar="N",
                                           help="held-out puzzles to solve (default: 200)"),
        lambda args, out: {"puzzles": args.puzzles, "model": args.model}, run)


def _add_arith(parser) -> None:
    parser.add_argument("--pool-size", type=positive_int, default=1024, metavar="N",
                        help="sequences per pool (default: 1024)")
    parser.add_argument("--held-out-split", choices=("authors", "torch"), default="authors",
                        help="the held-out pairs the model was trained without")


def _run_arith(model, tokenizer, config, seed):
    from .task import run_arith_splits

    return run_arith_splits(model, pool_size=config["pool_size"], seed=seed,
                            held_out_split=config["held_out_split"])


def _run_asm_lm(model, tokenizer, config, seed):
    from .task import run_asm_lm

    return run_asm_lm(model, tokenizer, sentences=config["sentences"], seed=seed)


TASKS = (
    _air_task("air-sudoku", "an AIR model solving held-out Sudoku puzzles"),
    _air_task("air-maze", "an AIR model solving held-out mazes"),
    family_task("arith-splits", "an Arith model's accuracy on its train and held-out pools",
                _add_arith,
                lambda args, out: {"pool_size": args.pool_size,
                                   "held_out_split": args.held_out_split, "model": args.model},
                _run_arith),
    family_task("asm-lm", "an ASM model's language-modelling loss on KJV sentences",
                lambda parser: add_shared(parser, "--sentences"),
                lambda args, out: {"sentences": args.sentences, "model": args.model},
                _run_asm_lm),
)
