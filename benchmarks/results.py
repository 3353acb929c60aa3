"""Result rows as JSON lines, the source of the benchmark pages.

Each benchmark appends its rows to ``--jsonl PATH`` (default ``benchmarks/out/<subject>.jsonl``,
git-ignored), a row at a time so a cut run keeps what it measured. Every row carries the
benchmark's name, its figures, and where and when they were taken: the machine, torch's version,
the git commit and the date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"


def add_jsonl_argument(parser: argparse.ArgumentParser, subject: str) -> None:
    """``--jsonl PATH`` (``--json``, its older spelling, too); default
    ``benchmarks/out/<subject>.jsonl``."""
    parser.add_argument("--jsonl", "--json", type=Path, default=OUT / f"{subject}.jsonl",
                        help="append every result row here, one JSON object a line "
                             f"(default: benchmarks/out/{subject}.jsonl)")


def machine() -> str:
    """The machine in words: the GPU's name where CUDA is there, else the CPU and its cores,
    with torch's threads."""
    cpu = platform.processor() or platform.machine()
    where = f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    return f"{torch.cuda.get_device_name()}; {where}" if torch.cuda.is_available() else where


def git_commit() -> str | None:
    """The checked-out commit (``+dirty`` with uncommitted changes), or None outside git."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                                capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, text=True, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+dirty" if dirty.strip() else "")


class ResultLog:
    """Appends rows of one benchmark to a JSON-lines file, each stamped alike; ``context``
    (the run's settings) goes into every row."""

    def __init__(self, path: Path, benchmark: str, **context):
        self.path, self.benchmark, self.context = Path(path), benchmark, context
        self.stamp = {"machine": machine(), "torch": torch.__version__, "commit": git_commit(),
                      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                          timespec="seconds")}

    def write(self, **figures) -> None:
        """Append one row: the benchmark's name, the context, ``figures``, then the stamp."""
        row = {"benchmark": self.benchmark, **self.context, **figures, **self.stamp}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as handle:
            handle.write(json.dumps(row, default=_plain) + "\n")


def _plain(value):
    """A tensor's or a NumPy value's Python form (``tolist``), else its text: a figure of a type
    JSON lacks never loses a run's rows."""
    return value.tolist() if hasattr(value, "tolist") else str(value)
