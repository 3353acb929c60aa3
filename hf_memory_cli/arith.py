"""``hf-memory arith-train`` and ``hf-memory arith-report``: the ArithTransformer experiments."""

from __future__ import annotations

import argparse

from .errors import CLIError
from .types import (
    device,
    non_negative,
    non_negative_int,
    positive_float,
    positive_int,
    unit_interval,
)

__all__ = ["add_arith_parsers"]


def _train(args: argparse.Namespace) -> None:
    from modeling.arith import ArithConfig, ArithTask, TrainConfig, train_arith

    try:
        task = ArithTask(held_out_fraction=args.held_out_fraction,
                         two_var_ratio=args.two_var_ratio, one_var_ratio=args.one_var_ratio,
                         held_out_split=args.held_out_split, split_seed=args.split_seed)
        config = ArithConfig(hidden_size=args.hidden_size, head_dim=args.head_dim,
                             intermediate_size=args.intermediate_size,
                             num_attention_heads=args.heads)
        train = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                            eval_every=args.eval_every, eval_pool_size=args.pool_size,
                            final_pool_size=args.final_pool_size,
                            checkpoint_every=args.checkpoint_every, seed=args.seed,
                            threads=args.threads, bf16=args.bf16, device=args.device)
    except ValueError as error:
        raise CLIError(str(error)) from error
    _, log = train_arith(config, task, train, out=args.out)
    final = log["final"]
    print(f"# {train.steps} steps in {final['wall_time_s']:.0f}s; final accuracy by pool "
          f"({final['pool_size']} sequences each); log: {args.out}/log.json")
    for pool, accuracy in final["accuracy"].items():
        print(f"{pool:24s} {100 * accuracy:6.2f}%")


def _report(args: argparse.Namespace) -> None:
    from eval_harness.family.arith_plots import write_report

    try:
        paths = write_report(args.logs, args.out)
    except (OSError, ValueError, KeyError) as error:
        raise CLIError(f"cannot draw the report: {error}") from error
    for path in paths:
        print(path)
        if path.suffix == ".md":
            print(path.read_text())


def add_arith_parsers(commands: argparse._SubParsersAction) -> None:
    """Register ``arith-train`` and ``arith-report`` on the ``hf-memory`` parser."""
    train = commands.add_parser(
        "arith-train", help="train the ArithTransformer (variable binding + modular addition)",
        description="Train the paper's 2-layer, 1-head ArithTransformer from scratch, evaluating "
                    "every pool and the progress measures as it goes; writes OUT/log.json, "
                    "checkpoints and OUT/final (a save_pretrained directory).")
    train.add_argument("--out", required=True, metavar="DIR", help="output directory")
    train.add_argument("--steps", type=positive_int, default=30_000, metavar="N")
    train.add_argument("--batch-size", type=positive_int, default=512, metavar="N")
    train.add_argument("--lr", type=positive_float, default=1e-3)
    train.add_argument("--eval-every", type=positive_int, default=500, metavar="N",
                       help="evaluate pools and progress measures every N steps (default 500)")
    train.add_argument("--pool-size", type=positive_int, default=1024, metavar="N",
                       help="sequences per evaluation pool during training (default 1024)")
    train.add_argument("--final-pool-size", type=positive_int, default=8192, metavar="N")
    train.add_argument("--checkpoint-every", type=non_negative_int, default=0, metavar="N",
                       help="save a checkpoint every N steps (default 0: final only)")
    train.add_argument("--held-out-fraction", type=unit_interval, default=0.3, metavar="F",
                       help="share of addition pairs never trained on (default 0.3; the "
                            "paper's f is 1 - F)")
    train.add_argument("--two-var-ratio", type=non_negative, default=10 / 12, metavar="R",
                       help="r: frequency of 2-var sequences relative to 0-var (default 10/12, "
                            "the authors' mix 12 : 20 : 10)")
    train.add_argument("--one-var-ratio", type=non_negative, default=20 / 12, metavar="R",
                       help="frequency of 1-var sequences relative to 0-var (default 20/12)")
    train.add_argument("--held-out-split", choices=("authors", "torch"), default="authors",
                       help="held-out pair recipe: 'authors' (random.Random(seed).sample of the "
                            "training pairs, their code) or 'torch' (our first version)")
    train.add_argument("--split-seed", type=int, default=None, metavar="S",
                       help="seed of the held-out pair choice (default 42 for 'authors', 0 for "
                            "'torch')")
    train.add_argument("--seed", type=int, default=0, metavar="S")
    train.add_argument("--hidden-size", type=positive_int, default=128, metavar="D")
    train.add_argument("--head-dim", type=positive_int, default=128, metavar="D")
    train.add_argument("--intermediate-size", type=positive_int, default=512, metavar="D")
    train.add_argument("--heads", type=positive_int, default=1, metavar="H")
    train.add_argument("--threads", type=positive_int, default=None, metavar="N",
                       help="torch threads (use 1 on a shared machine)")
    train.add_argument("--bf16", action="store_true",
                       help="bf16 autocast for the forward pass (slower on CPUs without bf16)")
    train.add_argument("--device", type=device, default="cpu", help="torch device (default cpu)")
    train.set_defaults(handler=_train)

    report = commands.add_parser(
        "arith-report", help="draw the ArithTransformer figures from training logs",
        description="Figures 2, 11, 12 of the paper from the first log (11 from its final "
                    "checkpoint), figure 3 across logs that sweep f or r.")
    report.add_argument("logs", nargs="+", metavar="LOG", help="log.json files or run dirs")
    report.add_argument("--out", required=True, metavar="DIR")
    report.set_defaults(handler=_report)
