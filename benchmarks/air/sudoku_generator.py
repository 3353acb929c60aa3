"""Offline Sudoku generator: throughput and hardness of each bucket.

Rows: minimal puzzles of each size (generate + rate), 9x9 puzzles kept by rejection when
``rating >= threshold`` (hard), and ``sudoku_dataset`` with a Sudoku-Extreme-like easy/hard mix
(split filtering included). Prints puzzles/s, mean rating, mean givens and the hard share.
Usage: python -m benchmarks.air.sudoku_generator [--count 40] [--seed 0] [--threshold 10]
"""

from __future__ import annotations

import argparse
import platform
import random
import sys

import numpy as np

from benchmarks.results import ResultLog, add_jsonl_argument
from benchmarks.timing import timed
from modeling.air.sudoku_air import SudokuSpec, generate_minimal, rate, sudoku_dataset


def bucket(size: int, count: int, seed: int, keep) -> tuple[float, list[float], list[int]]:
    """Draw and rate puzzles until ``count`` pass ``keep``: (seconds, ratings, givens)."""
    spec, ratings, givens = SudokuSpec(size), [], []

    def draw() -> None:
        for k in range(10**9):
            if len(ratings) == count:
                break
            puzzle, _ = generate_minimal(spec, random.Random(seed * 10**6 + k))
            rating = rate(puzzle, spec, seed=k)
            if keep(rating):
                ratings.append(rating)
                givens.append(int(np.count_nonzero(puzzle)))

    return timed(draw)[1], ratings, givens


def report(log: ResultLog, name: str, seconds: float, ratings: list[float], givens: list[int],
           threshold: float):
    hard = np.mean([r >= threshold for r in ratings])
    log.write(bucket=name, puzzles_s=len(ratings) / seconds, rating_mean=float(np.mean(ratings)),
              rating_median=float(np.median(ratings)), givens_mean=float(np.mean(givens)),
              hard_share=float(hard))
    print(
        f"{name:<26} {len(ratings) / seconds:>9.2f} {np.mean(ratings):>8.2f} "
        f"{np.median(ratings):>8.2f} {np.mean(givens):>7.2f} {hard:>6.0%}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=40, help="puzzles per row (40)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threshold", type=float, default=10.0, help="hard: rating >= this")
    parser.add_argument("--hard-fraction", type=float, default=0.73, help="mix of the last row")
    add_jsonl_argument(parser, "air")
    args = parser.parse_args()
    if args.count < 1 or not 0.0 <= args.hard_fraction <= 1.0:
        sys.exit("error: --count must be >= 1 and --hard-fraction in [0, 1]")
    t = args.threshold
    log = ResultLog(args.jsonl, "air.sudoku_generator", count=args.count, seed=args.seed,
                    threshold=t)
    print(f"{platform.processor() or platform.machine()}, python {platform.python_version()}")
    print(f"{'bucket':<26} {'puzzles/s':>9} {'rating':>8} {'median':>8} {'givens':>7} {'hard':>6}")
    for size in (4, 6, 9):
        report(log, f"{size}x{size} minimal",
               *bucket(size, args.count, args.seed, lambda r: True), t)
    report(log, f"9x9 hard (>= {t:g})", *bucket(9, args.count, args.seed, lambda r: r >= t), t)
    ds, seconds = timed(lambda: sudoku_dataset(
        9, args.count, seed=args.seed, hard_fraction=args.hard_fraction, rating_threshold=t
    ))
    report(log, f"9x9 dataset mix {args.hard_fraction:.0%}", seconds, ds["rating"], ds["givens"], t)
    ratings = np.asarray(ds["rating"])
    for label, mask in (("easy", ratings < t), ("hard", ratings >= t)):
        mean = ratings[mask].mean() if mask.any() else float("nan")
        print(f"  {label}: {mask.sum()} puzzles, mean rating {mean:.2f}")


if __name__ == "__main__":
    main()
