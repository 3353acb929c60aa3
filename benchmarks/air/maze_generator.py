"""Offline Maze generator for the AIRSolver: throughput, acceptance rate and path lengths.

For 30x30 with shortest path > 110 moves (the Maze-30x30-hard recipe) and the small CPU sizes
(8x8, 10x10, 12x12 at their default thresholds), draws ``--count`` accepted mazes from
``generate_mazes`` and prints mazes/s, (grid, start, goal) draws/s, the acceptance rate, and the
mean / min / max shortest-path length and wall fraction of the accepted mazes.
Usage: python -m benchmarks.air.maze_generator [--count 20] [--seed 0] [--sizes 30,12,10,8]
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform

import numpy as np

from benchmarks.results import ResultLog, add_jsonl_argument
from benchmarks.timing import timed
from modeling.air.maze_air import WALL, default_min_path_length, generate_mazes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=20, help="accepted mazes per size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sizes", default="30,12,10,8", help="comma-separated grid sizes")
    add_jsonl_argument(parser, "air")
    args = parser.parse_args()
    log = ResultLog(args.jsonl, "air.maze_generator", count=args.count, seed=args.seed)
    print(
        f"# machine: {platform.machine()}, {os.cpu_count()} CPUs, numpy {np.__version__}; "
        f"{args.count} mazes per size, seed {args.seed}, walls drawn in [0.3, 0.5]"
    )
    print("size  min_len  mazes/s  draws/s  acceptance  path mean [min-max]  walls mean")
    for size in (int(s) for s in args.sizes.split(",")):
        min_len = default_min_path_length(size)
        mazes, elapsed = timed(
            lambda s=size: list(itertools.islice(generate_mazes(s, seed=args.seed), args.count)))
        draws = mazes[-1].attempt + 1
        lengths = np.array([m.path_length for m in mazes])
        walls = np.mean([np.mean(m.inputs == WALL) for m in mazes])
        print(
            f"{size:4d}  {min_len:7d}  {len(mazes) / elapsed:7.2f}  {draws / elapsed:7.0f}  "
            f"{len(mazes) / draws:10.2e}  {lengths.mean():9.1f} [{lengths.min()}-{lengths.max()}]"
            f"  {walls:10.3f}"
        )
        log.write(size=size, min_path_length=min_len, mazes_s=len(mazes) / elapsed,
                  draws_s=draws / elapsed, acceptance=len(mazes) / draws,
                  path_mean=float(lengths.mean()), path_min=int(lengths.min()),
                  path_max=int(lengths.max()), walls_mean=float(walls))


if __name__ == "__main__":
    main()
