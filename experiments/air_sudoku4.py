"""A tiny AIRSolver learns 4×4 Sudoku on the CPU: held-out exact accuracy over training.

Trains one model per ``--injection`` variant (default: the paper's ``Lx_H``) on the same
generated puzzles and seed, evaluating on held-out puzzles (disjoint from training up to
isomorphism) every ``--eval-every`` steps, and prints the step and wall time at which each run
first reached ``--target`` exact accuracy. Figures go in BENCHMARKS.md with the machine named.

    .venv/bin/python -m experiments.air_sudoku4 --threads 2
    .venv/bin/python -m experiments.air_sudoku4 --injection Lx_H Lx_Hx --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch

from modeling.air import AIRConfig, AIRSolver, sudoku_dataset
from modeling.air.training_air import AIRTrainConfig, train_air


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--injection", nargs="+", default=["Lx_H"])
    parser.add_argument("--train-puzzles", type=int, default=3000)
    parser.add_argument("--test-puzzles", type=int, default=500)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--eval-every", type=int, default=125)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--loss", default="stablemax", choices=("stablemax", "softmax"))
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--lr-min-ratio", type=float, default=0.1,
                        help="cosine decay of the lr after warmup to this fraction")
    parser.add_argument("--ema-decay", type=float, default=0.995,
                        help="evaluate the parameter EMA (0 disables it)")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    start = time.perf_counter()
    train = sudoku_dataset(4, args.train_puzzles, "train", seed=args.seed)
    test = sudoku_dataset(4, args.test_puzzles, "test", seed=args.seed)
    print(f"# data: {len(train)} train / {len(test)} held-out 4x4 minimal puzzles in "
          f"{time.perf_counter() - start:.1f}s; torch threads {torch.get_num_threads()}")
    for injection in args.injection:
        torch.manual_seed(args.seed)
        model = AIRSolver(AIRConfig(
            vocab_size=6, seq_len=16, hidden_size=args.hidden_size, num_hidden_layers=2,
            num_attention_heads=4, halt_max_steps=4, injection=injection, loss_type=args.loss))
        config = AIRTrainConfig(steps=args.steps, batch_size=64, lr=args.lr, warmup_steps=100,
                                lr_min_ratio=args.lr_min_ratio, weight_decay=0.1,
                                ema_decay=args.ema_decay or None, eval_every=args.eval_every,
                                seed=args.seed, progress=False)
        log = train_air(model, train, test, config)
        reached = next((entry for entry in log["history"]
                        if entry["eval"]["exact_accuracy"] >= args.target), None)
        for entry in log["history"]:
            print(f"{injection:8s} step {entry['step']:5d} {entry['wall_time_s']:7.1f}s "
                  f"lm_loss {entry['lm_loss']:.3f} held-out exact "
                  f"{entry['eval']['exact_accuracy']:.3f} token "
                  f"{entry['eval']['token_accuracy']:.3f}")
        final = log["final"]
        summary = (f"first >= {args.target:.0%} at step {reached['step']} "
                   f"({reached['wall_time_s']:.0f}s)" if reached else
                   f"never reached {args.target:.0%}")
        print(f"== {injection}: final held-out exact {final['eval']['exact_accuracy']:.3f} "
              f"after {final['step']} steps ({final['wall_time_s']:.0f}s); {summary}")


if __name__ == "__main__":
    main()
