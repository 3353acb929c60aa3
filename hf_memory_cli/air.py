"""``hf-memory air-train`` and ``hf-memory air-report``: the AIRSolver experiments."""

from __future__ import annotations

import argparse

from .errors import CLIError
from .types import non_negative, non_negative_int, positive_float, positive_int, unit_interval

__all__ = ["add_air_parsers"]


def _vocab_size(args: argparse.Namespace) -> int:
    from modeling.air import sudoku_vocab_size
    from modeling.air.maze_air import MAZE_VOCAB_SIZE

    return sudoku_vocab_size(args.size) if args.task == "sudoku" else MAZE_VOCAB_SIZE


def _datasets(args: argparse.Namespace):
    from modeling.air import maze_dataset_dict, sudoku_dataset

    if args.task == "sudoku":
        common = dict(seed=args.data_seed, augmentations_per_puzzle=args.augment)
        train = sudoku_dataset(args.size, args.train_puzzles, "train", **common)
        test = sudoku_dataset(args.size, args.test_puzzles, "test", seed=args.data_seed)
        return train, test
    splits = maze_dataset_dict(args.size, args.train_puzzles, args.test_puzzles,
                               seed=args.data_seed, augmentations_per_maze=args.augment)
    return splits["train"], splits["test"]


def _train(args: argparse.Namespace) -> None:
    from hub_cards.air_card import render_air_card
    from modeling.air import AIRConfig, AIRSolver
    from modeling.air.training_air import AIRTrainConfig, train_air

    try:
        train_config = AIRTrainConfig(
            task=args.task, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
            warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
            lr_min_ratio=args.lr_min_ratio, ema_decay=args.ema_decay or None,
            eval_every=args.eval_every, eval_batch_size=args.eval_batch_size, seed=args.seed,
            threads=args.threads, cpu=args.cpu, compile=args.compile)
        config = AIRConfig(
            vocab_size=_vocab_size(args), seq_len=args.size * args.size,
            hidden_size=args.hidden_size, num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            H_cycles=args.H_cycles, L_cycles=args.L_cycles, injection=args.injection,
            level_token=args.level_token, input_operator=args.input_operator,
            single_state=args.single_state, share_weights=not args.two_networks,
            halt_max_steps=args.halt_max_steps, loss_type=args.loss)
        train, test = _datasets(args)
    except ValueError as error:
        raise CLIError(str(error)) from error
    import torch

    torch.manual_seed(args.seed)
    try:
        log = train_air(AIRSolver(config), train, test, train_config, out=args.out,
                        card=render_air_card)
    except (FloatingPointError, ValueError) as error:  # a NaN loss, a batch processes cannot share
        raise CLIError(str(error)) from error
    final = log["final"]["eval"]
    print(f"# {args.steps} steps in {log['final']['wall_time_s']:.0f}s on {len(train)} train / "
          f"{len(test)} held-out puzzles; log: {args.out}/log.json, model: {args.out}/final")
    for name, value in final.items():
        print(f"{name:24s} {value:.4f}" if isinstance(value, float) else f"{name:24s} {value}")


def _report(args: argparse.Namespace) -> None:
    from eval_harness.family.air_plots import write_report

    try:
        paths = write_report(args.run, args.out, puzzles=args.puzzles)
    except (OSError, ValueError, KeyError) as error:
        raise CLIError(f"cannot draw the report: {error}") from error
    for path in paths:
        print(path)


def add_air_parsers(commands: argparse._SubParsersAction) -> None:
    """Register ``air-train`` and ``air-report`` on the ``hf-memory`` parser."""
    train = commands.add_parser(
        "air-train", help="train an AIRSolver on offline Sudoku or Maze puzzles",
        description="Generate train/held-out puzzles (disjoint up to isomorphism), train the "
                    "shared two-state recurrent solver with the HRM recipe (AdamATan2, warmup, "
                    "ACT carry across batches) and evaluate exact accuracy; writes OUT/log.json "
                    "and OUT/final (a save_pretrained directory). The defaults are the tiny "
                    "4x4-Sudoku CPU recipe measured in BENCHMARKS.md, not the paper's sizes.")
    train.add_argument("--out", required=True, metavar="DIR", help="output directory")
    train.add_argument("--task", choices=("sudoku", "maze"), default="sudoku")
    train.add_argument("--size", type=positive_int, default=4,
                       help="board side: Sudoku 4, 6 or 9; maze side, e.g. 10 or 30 (default 4)")
    train.add_argument("--train-puzzles", type=positive_int, default=3000, metavar="N")
    train.add_argument("--test-puzzles", type=positive_int, default=500, metavar="N")
    train.add_argument("--augment", type=non_negative_int, default=0, metavar="K",
                       help="augmented copies per training puzzle (default 0)")
    train.add_argument("--data-seed", type=int, default=0, metavar="S")
    train.add_argument("--hidden-size", type=positive_int, default=128, metavar="D")
    train.add_argument("--layers", type=positive_int, default=2, metavar="N")
    train.add_argument("--heads", type=positive_int, default=4, metavar="H")
    train.add_argument("--H-cycles", type=positive_int, default=2, metavar="N")
    train.add_argument("--L-cycles", type=positive_int, default=2, metavar="N")
    train.add_argument("--injection", default="Lx_H", help="e.g. Lx_H (default), Lx_Hx, L2x_H2x")
    # validated by AIRConfig, which names the accepted values (no model import for --help)
    train.add_argument("--level-token", default=None,
                       help="addition, prepend_strip or prepend_no_strip (default: none)")
    train.add_argument("--input-operator", default="add",
                       help="add (default), linear, nonlinear, sign_flip or hadamard")
    train.add_argument("--single-state", action="store_true", help="appendix-D ablation")
    train.add_argument("--two-networks", action="store_true",
                       help="HRM-style baseline: separate L and H networks")
    train.add_argument("--halt-max-steps", type=positive_int, default=4, metavar="N")
    train.add_argument("--loss", choices=("stablemax", "softmax"), default="stablemax",
                       help="cross-entropy: stablemax (the paper's, default) or softmax")
    train.add_argument("--steps", type=positive_int, default=2000, metavar="N")
    train.add_argument("--batch-size", type=positive_int, default=64, metavar="N")
    train.add_argument("--lr", type=positive_float, default=1e-3)
    train.add_argument("--warmup-steps", type=non_negative_int, default=100, metavar="N")
    train.add_argument("--weight-decay", type=non_negative, default=0.1)
    train.add_argument("--lr-min-ratio", type=non_negative, default=0.1, metavar="R",
                       help="cosine-decay the lr to R x lr after warmup (default 0.1; 1: constant)")
    train.add_argument("--ema-decay", type=unit_interval, default=0.995, metavar="D",
                       help="evaluate and save the parameter EMA (default 0.995; 0: off)")
    train.add_argument("--eval-every", type=positive_int, default=250, metavar="N")
    train.add_argument("--eval-batch-size", type=positive_int, default=512, metavar="N")
    train.add_argument("--seed", type=int, default=0, metavar="S")
    train.add_argument("--threads", type=positive_int, default=None, metavar="N",
                       help="torch threads (use 1 on a shared machine)")
    train.add_argument("--cpu", action="store_true", help="train on the CPU even with a GPU")
    train.add_argument("--compile", action="store_true",
                       help="torch.compile the recurrent block(s): same function up to rounding, "
                            "1.25x per step on a 2-core CPU after a compilation at the start")
    train.set_defaults(handler=_train)

    report = commands.add_parser(
        "air-report", help="draw the AIRSolver figures from a training run",
        description="Training curves from RUN/log.json, and from RUN/final the decoded z_H / z_L "
                    "rollouts (the paper's figures 2-3) and content change per sub-step under "
                    "freezing (figure 6) on held-out puzzles.")
    report.add_argument("run", metavar="RUN", help="an air-train output directory")
    report.add_argument("--out", required=True, metavar="DIR")
    report.add_argument("--puzzles", type=positive_int, default=64, metavar="N",
                        help="held-out puzzles for the rollout statistics (default 64)")
    report.set_defaults(handler=_report)
