"""``hf-memory arith-train`` and ``hf-memory arith-report``: the ArithTransformer experiments."""

from __future__ import annotations

import argparse

__all__ = ["add_arith_parsers"]


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def _train(args: argparse.Namespace) -> None:
    from modeling.arith import ArithTask
    from modeling.arith.training_arith import TrainConfig, train_arith

    task = ArithTask(held_out_fraction=args.held_out_fraction, two_var_ratio=args.two_var_ratio)
    train = TrainConfig(steps=args.steps, eval_every=args.eval_every,
                        checkpoint_every=args.checkpoint_every, batch_size=args.batch_size,
                        threads=args.threads, bf16=args.bf16, seed=args.seed)
    _, log = train_arith(task=task, train=train, out=args.out)
    final = log.get("final", {})
    for pool, accuracy in sorted(final.get("accuracy", final).items()):
        if isinstance(accuracy, float):
            print(f"{pool:40s} {100 * accuracy:6.2f}%")
    print(f"# wrote {args.out}/log.json")


def _report(args: argparse.Namespace) -> None:
    from eval_harness.arith_plots import write_report

    for path in write_report(args.logs, args.out):
        print(path)


def add_arith_parsers(commands: argparse._SubParsersAction) -> None:
    """Register ``arith-train`` and ``arith-report`` on the ``hf-memory`` parser."""
    train = commands.add_parser(
        "arith-train", help="train the ArithTransformer (variable binding + modular addition)",
        description="Train the paper's 2-layer, 1-head ArithTransformer from scratch, evaluating "
                    "every pool and the progress measures as it goes.")
    train.add_argument("--steps", type=_count, default=30_000)
    train.add_argument("--eval-every", type=_count, default=500, metavar="N")
    train.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                       help="0 keeps only the final checkpoint")
    train.add_argument("--batch-size", type=_count, default=512)
    train.add_argument("--threads", type=_count, default=None, metavar="N")
    train.add_argument("--bf16", action="store_true", help="bf16 autocast for the forward pass")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--held-out-fraction", type=_fraction, default=0.3, metavar="F",
                       help="f: share of addition pairs never trained on (default: 0.3)")
    train.add_argument("--two-var-ratio", type=float, default=1.0, metavar="R",
                       help="r: frequency of 2-var sequences relative to 0-var (default: 1.0)")
    train.add_argument("--out", required=True, metavar="DIR")
    train.set_defaults(handler=_train)

    report = commands.add_parser(
        "arith-report", help="draw the ArithTransformer figures from training logs",
        description="Figures 2, 11, 12 of the paper from one log, figure 3 across logs.")
    report.add_argument("logs", nargs="+", metavar="LOG", help="log.json files or run dirs")
    report.add_argument("--out", required=True, metavar="DIR")
    report.set_defaults(handler=_report)
