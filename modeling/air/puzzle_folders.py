"""The AIR/HRM authors' prebuilt dataset folders, read into our columns.

Their build scripts write one folder per split::

    <root>/<split>/dataset.json               metadata: seq_len, vocab_size, pad_id, sets, ...
    <root>/<split>/<set>__inputs.npy          [examples, seq_len] tokens
    <root>/<split>/<set>__labels.npy          [examples, seq_len] tokens
    <root>/<split>/<set>__puzzle_identifiers.npy   [puzzles]
    <root>/<split>/<set>__puzzle_indices.npy       [puzzles + 1] example ranges
    <root>/<split>/<set>__group_indices.npy        [groups + 1] puzzle ranges

A *group* is one base puzzle, its *puzzles* are the base puzzle and its augmented copies, and a
puzzle owns one or more examples. Their Sudoku and maze tokens are ours (``PAD = 0``, Sudoku
``BLANK = 1``, digit ``d`` → ``d + 1``), so rows are read as they are. The ``group`` column lets
training draw one augmented copy per base puzzle per epoch, as their sampler does
(``AIRTrainConfig(sampling="group")``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

__all__ = ["PuzzleFolderError", "load_puzzle_folder"]

_ARRAYS = ("inputs", "labels", "puzzle_identifiers", "puzzle_indices", "group_indices")


class PuzzleFolderError(ValueError):
    """A dataset folder does not have the authors' layout or is inconsistent."""


def _array(folder: Path, set_name: str, name: str) -> np.ndarray:
    path = folder / f"{set_name}__{name}.npy"
    try:
        return np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise PuzzleFolderError(f"{folder} lacks {path.name}") from None
    except ValueError as error:
        raise PuzzleFolderError(f"{path} is not a readable .npy array: {error}") from None


def load_puzzle_folder(root: str | os.PathLike, split: str = "train", set_name: str | None = None):
    """A ``datasets.Dataset`` of one split of an authors' dataset folder.

    Columns: ``inputs``, ``labels``, ``puzzle_identifiers`` (per example, from its puzzle),
    ``group`` (the base puzzle of each example) and ``size`` (the board side, √seq_len).
    ``set_name`` defaults to the metadata's only set (``"all"`` in their builds).
    """
    import datasets

    folder = Path(root) / split
    try:
        metadata = json.loads((folder / "dataset.json").read_text())
    except FileNotFoundError:
        raise PuzzleFolderError(f"{folder} holds no dataset.json (expected "
                                f"<root>/<split>/dataset.json)") from None
    except ValueError as error:
        raise PuzzleFolderError(f"{folder / 'dataset.json'} is not valid JSON: {error}") from None
    sets = metadata.get("sets") or []
    if set_name is None:
        if len(sets) != 1:
            raise PuzzleFolderError(f"{folder} lists sets {sets}; pass set_name")
        set_name = sets[0]
    arrays = {name: _array(folder, set_name, name) for name in _ARRAYS}
    inputs, labels = arrays["inputs"], arrays["labels"]
    puzzles, groups = arrays["puzzle_indices"], arrays["group_indices"]
    seq_len = metadata.get("seq_len", inputs.shape[-1] if inputs.ndim == 2 else None)
    if inputs.ndim != 2 or inputs.shape != labels.shape or inputs.shape[1] != seq_len:
        raise PuzzleFolderError(f"{folder}: inputs {inputs.shape} and labels {labels.shape} must "
                                f"both be [examples, seq_len={seq_len}]")
    if (puzzles.ndim != 1 or puzzles[0] != 0 or puzzles[-1] != len(inputs)
            or np.any(np.diff(puzzles) <= 0)):
        raise PuzzleFolderError(f"{folder}: puzzle_indices must rise from 0 to the example "
                                f"count {len(inputs)}")
    if (groups.ndim != 1 or groups[0] != 0 or groups[-1] != len(puzzles) - 1
            or np.any(np.diff(groups) <= 0)):
        raise PuzzleFolderError(f"{folder}: group_indices must rise from 0 to the puzzle count "
                                f"{len(puzzles) - 1}")
    if len(arrays["puzzle_identifiers"]) != len(puzzles) - 1:
        raise PuzzleFolderError(f"{folder}: one puzzle identifier per puzzle expected")
    side = int(round(seq_len ** 0.5))
    if side * side != seq_len:
        raise PuzzleFolderError(f"{folder}: seq_len {seq_len} is not a square board")
    examples_per_puzzle = np.diff(puzzles)
    puzzle_of_example = np.repeat(np.arange(len(puzzles) - 1), examples_per_puzzle)
    group_of_puzzle = np.repeat(np.arange(len(groups) - 1), np.diff(groups))
    identifiers = datasets.Value("int64")
    tokens = datasets.Sequence(identifiers)
    features = datasets.Features(inputs=tokens, labels=tokens, puzzle_identifiers=identifiers,
                                 group=identifiers, size=identifiers)
    return datasets.Dataset.from_dict({
        "inputs": inputs.astype(np.int64),
        "labels": labels.astype(np.int64),
        "puzzle_identifiers": arrays["puzzle_identifiers"][puzzle_of_example].astype(np.int64),
        "group": group_of_puzzle[puzzle_of_example].astype(np.int64),
        "size": np.full(len(inputs), side, dtype=np.int64),
    }, features=features)
