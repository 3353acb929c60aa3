"""Offline Maze data for the AIRSolver: generator, labelled shortest paths, augmentations, splits.

The Hub's ``sapientinc/maze-30x30-hard-1k`` (Lehnert et al.'s Searchformer mazes filtered to a
shortest path longer than 110 moves) is unreachable here, so we generate equivalent mazes with the
same recipe; :func:`load_maze_csv` reads the real CSVs into the same columns.

Grids are flat row-major token arrays of ``size * size`` cells over HRM's charset ``"# SGo"``:
``PAD = 0``, ``WALL = 1`` (``#``), ``OPEN = 2`` (space), ``START = 3`` (``S``), ``GOAL = 4``
(``G``), ``PATH = 5`` (``o``). Inputs hold WALL/OPEN/START/GOAL; labels are the same grid with
the labelled shortest path's cells (S and G excluded) set to PATH.

Generation (:func:`generate_mazes`): every cell is a wall with probability ``p`` drawn per maze
uniformly from ``wall_range``; start and goal are a uniformly random ordered pair of distinct
open cells; the maze is kept only if the goal is reachable in at least ``min_path_length`` moves.
That is exact rejection sampling of Lehnert et al.'s distribution (walls 30-50%, random S and
G) conditioned on a long path. The default ``wall_range`` is their (0.3, 0.5): long shortest
paths need tortuous corridors, which appear just below the site-percolation threshold (~41%
walls), so accepted mazes average ~37% walls at 30x30 (~34-36% at 8-12) without narrowing the
range. Acceptance is ~1.5e-5 for 30x30 with > 110 moves and ~1e-3 for the small defaults, so
rejection must be cheap: a batch of grids is flooded at once, bit-packed along the batch axis,
and only starts with a cell at distance ``>= min_path_length`` get a goal drawn.

Labelled path (the tie-break among equal-length shortest paths): take BFS distances from the
goal and walk from the start, always moving to the first neighbour, in the fixed order up,
right, down, left, whose distance is one less. A dihedral image of a maze is labelled with the
image of that path, which is still a shortest path but need not be the one this tie-break picks
on the transformed grid; :func:`path_is_valid_and_optimal` accepts any shortest path.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import os
from collections import deque
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

__all__ = [
    "CHARSET",
    "GOAL",
    "MAZE_VOCAB_SIZE",
    "OPEN",
    "PAD",
    "PATH",
    "START",
    "WALL",
    "Maze",
    "canonical_form",
    "default_min_path_length",
    "dihedral",
    "generate_mazes",
    "label_path",
    "load_maze_csv",
    "maze_dataset",
    "maze_dataset_dict",
    "parse_maze",
    "path_is_valid_and_optimal",
    "shortest_distances",
    "split_of",
    "valid_optimal_accuracy",
]

PAD, WALL, OPEN, START, GOAL, PATH = range(6)
MAZE_VOCAB_SIZE = 6
CHARSET = "# SGo"
_TOKEN_OF = {ch: i + 1 for i, ch in enumerate(CHARSET)}
_COLUMNS = ("inputs", "labels", "puzzle_identifiers", "path_length", "size")
_BATCH = 4096  # grids flooded together, a multiple of 8 (part of the seed -> maze mapping)


class Maze(NamedTuple):
    """One generated maze: flat ``inputs`` / ``labels`` tokens (int8), the shortest-path length in
    moves, and ``attempt``, the index of the (grid, start, goal) draw that was accepted."""

    inputs: np.ndarray
    labels: np.ndarray
    path_length: int
    attempt: int


def default_min_path_length(size: int) -> int:
    """``111 * size // 30`` from 30x30 up (111 at 30: the hard set's "longer than 110"),
    ``5 * size // 2`` below (8 -> 20, 10 -> 25, 12 -> 30: cheap on a CPU)."""
    return 111 * size // 30 if size >= 30 else 5 * size // 2


def _neighbours(i: int, n: int) -> tuple[int, ...]:
    """Neighbours of flat cell ``i`` in the fixed order up, right, down, left."""
    r, c = divmod(i, n)
    out = []
    if r > 0:
        out.append(i - n)
    if c < n - 1:
        out.append(i + 1)
    if r < n - 1:
        out.append(i + n)
    if c > 0:
        out.append(i - 1)
    return tuple(out)


def shortest_distances(grid: Sequence[int] | np.ndarray, size: int, source: int) -> list[int]:
    """BFS move counts from flat cell ``source`` through non-wall cells (-1: unreachable)."""
    passable = (np.asarray(grid) != WALL).tolist()
    dist = [-1] * (size * size)
    dist[source] = 0
    queue = deque([source])
    while queue:
        cell = queue.popleft()
        step = dist[cell] + 1
        for nb in _neighbours(cell, size):
            if passable[nb] and dist[nb] < 0:
                dist[nb] = step
                queue.append(nb)
    return dist


def label_path(inputs: np.ndarray, size: int) -> tuple[np.ndarray, int]:
    """The labels for ``inputs`` (the module's tie-break path set to PATH) and its length in
    moves. The goal must be reachable."""
    inputs = np.asarray(inputs)
    start, goal = int(np.flatnonzero(inputs == START)[0]), int(np.flatnonzero(inputs == GOAL)[0])
    dist = shortest_distances(inputs, size, goal)
    labels = inputs.astype(np.int8).copy()
    cell = start
    while dist[cell] > 1:
        cell = next(nb for nb in _neighbours(cell, size) if dist[nb] == dist[cell] - 1)
        labels[cell] = PATH
    return labels, dist[start]


def dihedral(grid: np.ndarray, size: int, t: int) -> np.ndarray:
    """Transform ``t`` in 0..7 of the dihedral group on a flat grid, HRM's order: identity,
    rotations by 90/180/270 degrees (counter-clockwise), flip left-right, flip up-down,
    transpose, anti-transpose."""
    g = np.asarray(grid).reshape(size, size)
    out = (
        g,
        np.rot90(g, 1),
        np.rot90(g, 2),
        np.rot90(g, 3),
        np.fliplr(g),
        np.flipud(g),
        g.T,
        np.fliplr(np.rot90(g, 1)),
    )[t]
    return np.ascontiguousarray(out).reshape(-1)


def canonical_form(inputs: np.ndarray, size: int) -> bytes:
    """The lexicographically smallest of the 8 dihedral images of an input grid, as bytes."""
    grid = np.asarray(inputs, dtype=np.int8)
    return min(dihedral(grid, size, t).tobytes() for t in range(8))


def split_of(inputs: np.ndarray, size: int, test_fraction: float = 0.5) -> str:
    """``"test"`` or ``"train"`` from a hash of :func:`canonical_form`: isomorphs share a split."""
    return _split_of_canonical(canonical_form(inputs, size), test_fraction)


def _split_of_canonical(canon: bytes, test_fraction: float) -> str:
    digest = hashlib.blake2b(canon, digest_size=8).digest()
    return "test" if int.from_bytes(digest, "big") / 2**64 < test_fraction else "train"


def _far_starts(rng: np.random.Generator, size: int, min_len: int, wall_range: tuple):
    """Draw ``_BATCH`` grids and starts; flood them together (bit-packed along the batch) for
    ``min_len`` steps. Returns the open masks ``(n*n, B)``, the starts and the indices of the
    grids whose start has a cell at distance ``>= min_len`` (a frontier still non-empty)."""
    cells, batch = size * size, np.arange(_BATCH)
    threshold = np.round(rng.uniform(*wall_range, size=_BATCH) * 2**16)  # p in steps of 2**-16
    open_ = rng.integers(0, 2**16, size=(cells, _BATCH), dtype=np.uint16) >= threshold
    # Start: the first open cell among uniform draws (rejection), so uniform over open cells.
    draws = rng.integers(0, cells, size=(8, _BATCH))
    hits = open_[draws, batch]
    starts = draws[hits.argmax(axis=0), batch]
    for b in np.flatnonzero(~hits.any(axis=0) & open_.any(axis=0)):
        while not open_[starts[b], b]:
            starts[b] = rng.integers(cells)
    seeded = np.zeros_like(open_)
    seeded[starts, batch] = open_[starts, batch]

    width = size + 2  # a wall border, so the four shifts below are offsets on flat cells

    def pack(mask: np.ndarray) -> np.ndarray:  # (n*n, B) bool -> ((n+2)**2, B/8) uint8
        framed = np.zeros((width, width, _BATCH), dtype=bool)
        framed[1:-1, 1:-1] = mask.reshape(size, size, _BATCH)
        return np.packbits(framed.reshape(width * width, _BATCH), axis=-1, bitorder="little")

    ids = batch.reshape(-1, 8)  # the grids behind each byte of the packed masks
    todo, front = pack(open_ & ~seeded), pack(seeded)  # open cells not reached yet; frontier
    spare = np.zeros_like(front)  # its border rows stay zero
    for step in range(1, min_len + 1):
        core = spare[width:-width]
        np.bitwise_or(front[: -2 * width], front[2 * width :], out=core)
        core |= front[width - 1 : -width - 1]
        core |= front[width + 1 : -width + 1]
        core &= todo[width:-width]
        todo[width:-width] ^= core
        front, spare = spare, front
        if step % 8 == 0 or step == min_len:  # drop the bytes whose 8 floods have all stopped
            alive = np.bitwise_or.reduce(front, axis=0)
            keep = alive != 0
            todo, front, spare = todo[:, keep], front[:, keep], spare[:, keep]
            ids, alive = ids[keep], alive[keep]
    bits = np.unpackbits(alive[:, None], axis=1, bitorder="little").astype(bool)
    return open_, starts, ids[bits]


def generate_mazes(
    size: int,
    seed: int = 0,
    min_path_length: int | None = None,
    wall_range: tuple[float, float] = (0.3, 0.5),
    max_attempts: int | None = None,
) -> Iterator[Maze]:
    """A deterministic stream of accepted mazes (see the module docstring), endless unless
    ``max_attempts`` (grid, start, goal) draws bound it.

    ``min_path_length`` defaults to :func:`default_min_path_length`. The acceptance rate of the
    stream so far is ``k / (maze.attempt + 1)`` after ``k`` mazes."""
    min_len = default_min_path_length(size) if min_path_length is None else min_path_length
    if size < 2 or not 1 <= min_len < size * size:
        raise ValueError(f"need size >= 2, 1 <= min_path_length < size**2; got {size}, {min_len}")
    if not 0.0 <= wall_range[0] <= wall_range[1] < 1.0:
        raise ValueError(f"wall_range must satisfy 0 <= low <= high < 1, got {wall_range}")
    for batch in itertools.count():
        if max_attempts is not None and batch * _BATCH >= max_attempts:
            return
        rng = np.random.default_rng([seed, size, min_len, batch])
        open_, starts, far = _far_starts(rng, size, min_len, wall_range)
        for b in far:
            cells = np.flatnonzero(open_[:, b])
            start = int(starts[b])
            goal = int(cells[rng.integers(len(cells) - 1)])
            goal = int(cells[-1]) if goal == start else goal  # uniform over the other open cells
            inputs = np.where(open_[:, b], OPEN, WALL).astype(np.int8)
            inputs[start], inputs[goal] = START, GOAL
            attempt = batch * _BATCH + int(b)
            if max_attempts is not None and attempt >= max_attempts:
                return
            if shortest_distances(inputs, size, goal)[start] >= min_len:
                labels, length = label_path(inputs, size)
                yield Maze(inputs, labels, length, attempt)


def _row(inputs: np.ndarray, labels: np.ndarray, length: int, size: int) -> dict:
    return {
        "inputs": np.asarray(inputs, dtype=np.int64).tolist(),
        "labels": np.asarray(labels, dtype=np.int64).tolist(),
        "puzzle_identifiers": 0,
        "path_length": int(length),
        "size": size,
    }


def _dataset(rows: list[dict]):
    import datasets

    tokens = datasets.Sequence(datasets.Value("int64"))
    features = datasets.Features(
        inputs=tokens,
        labels=tokens,
        puzzle_identifiers=datasets.Value("int64"),
        path_length=datasets.Value("int64"),
        size=datasets.Value("int64"),
    )
    return datasets.Dataset.from_dict(
        {name: [row[name] for row in rows] for name in _COLUMNS}, features=features
    )


def _collect(
    size: int,
    quotas: dict[str, int],
    seed: int,
    min_path_length: int | None,
    augmentations_per_maze: int,
    test_fraction: float,
    wall_range: tuple[float, float],
    max_attempts: int | None,
) -> dict:
    """Fill each split's quota from one :func:`generate_mazes` stream (see :func:`maze_dataset`)."""
    from tqdm.auto import tqdm

    if any(split not in ("train", "test") for split in quotas):
        raise ValueError(f"split must be 'train' or 'test', got {sorted(quotas)}")
    if min(quotas.values()) < 0 or not 0 <= augmentations_per_maze <= 7:
        raise ValueError("need num_mazes >= 0 and 0 <= augmentations_per_maze <= 7")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    rows: dict[str, list[dict]] = {split: [] for split in quotas}
    seen: dict[str, set[bytes]] = {split: set() for split in quotas}
    stream = generate_mazes(size, seed, min_path_length, wall_range, max_attempts)
    desc = f"maze {size}x{size} {'+'.join(quotas)}"
    with tqdm(total=sum(quotas.values()), desc=desc, disable=None) as bar:
        while any(len(seen[split]) < quotas[split] for split in quotas):
            maze = next(stream, None)
            if maze is None:
                raise RuntimeError(
                    f"quotas {quotas} not met after {max_attempts} draws; lower "
                    "min_path_length or raise max_attempts"
                )
            canon = canonical_form(maze.inputs, size)
            split = _split_of_canonical(canon, test_fraction)
            if split not in quotas or len(seen[split]) == quotas[split] or canon in seen[split]:
                continue
            seen[split].add(canon)
            rows[split].append(_row(maze.inputs, maze.labels, maze.path_length, size))
            rng = np.random.default_rng([seed, size, maze.attempt, 1])
            for t in rng.permutation(np.arange(1, 8))[:augmentations_per_maze]:
                image, label = dihedral(maze.inputs, size, t), dihedral(maze.labels, size, t)
                rows[split].append(_row(image, label, maze.path_length, size))
            bar.update()
    return {split: _dataset(split_rows) for split, split_rows in rows.items()}


def maze_dataset(
    size: int,
    num_mazes: int,
    split: str = "train",
    seed: int = 0,
    min_path_length: int | None = None,
    augmentations_per_maze: int = 0,
    test_fraction: float = 0.5,
    wall_range: tuple[float, float] = (0.3, 0.5),
    max_attempts: int | None = None,
):
    """A ``datasets.Dataset`` of generated mazes, deterministic in its arguments.

    Mazes come from :func:`generate_mazes` and are kept if :func:`split_of` puts them in
    ``split`` and no isomorph was kept before; train and test calls with the same ``seed`` and
    ``test_fraction`` are therefore disjoint up to the dihedral group. Each maze is followed by
    ``augmentations_per_maze`` (at most 7) distinct random non-identity dihedral images, input
    and label transformed alike. Columns: ``inputs``, ``labels`` (``size * size`` tokens),
    ``puzzle_identifiers`` (0), ``path_length`` (moves), ``size``. Raises ``RuntimeError`` after
    ``max_attempts`` (grid, start, goal) draws; unlimited by default.

    Cost on one x86 core: ~1 s per stream maze at 30x30 with > 110 moves, ~1-3 ms at the small
    defaults; a split keeps about its fraction of the stream, so build both splits at once with
    :func:`maze_dataset_dict`."""
    quotas = {split: num_mazes}
    return _collect(
        size,
        quotas,
        seed,
        min_path_length,
        augmentations_per_maze,
        test_fraction,
        wall_range,
        max_attempts,
    )[split]


def maze_dataset_dict(
    size: int,
    num_train: int,
    num_test: int,
    seed: int = 0,
    min_path_length: int | None = None,
    augmentations_per_maze: int = 0,
    test_fraction: float = 0.5,
    wall_range: tuple[float, float] = (0.3, 0.5),
    max_attempts: int | None = None,
):
    """``DatasetDict(train=..., test=...)`` equal to the two :func:`maze_dataset` calls, from one
    pass over the stream (half the generation time of two calls at ``test_fraction=0.5``).
    ``augmentations_per_maze`` applies to both splits."""
    import datasets

    quotas = {"train": num_train, "test": num_test}
    return datasets.DatasetDict(
        _collect(
            size,
            quotas,
            seed,
            min_path_length,
            augmentations_per_maze,
            test_fraction,
            wall_range,
            max_attempts,
        )
    )


def parse_maze(data: str | Sequence[int] | np.ndarray, size: int) -> np.ndarray:
    """Validate a maze and return its flat int8 tokens.

    ``data`` is HRM's string form over ``"# SGo"`` (``o`` optional, newlines ignored) or a
    sequence of tokens (WALL..PATH). Raises ``ValueError`` naming the problem: wrong length, a bad
    symbol or token, not exactly one S and one G, or a goal unreachable from the start."""
    cells = size * size
    if isinstance(data, str):
        text = data.replace("\n", "").replace("\r", "")
        if len(text) != cells:
            raise ValueError(f"expected {cells} cells for a {size}x{size} maze, got {len(text)}")
        for i, ch in enumerate(text):
            if ch not in _TOKEN_OF:
                raise ValueError(
                    f"bad symbol {ch!r} at row {i // size + 1}, column {i % size + 1}; "
                    f"use one of {CHARSET!r}"
                )
        tokens = np.asarray([_TOKEN_OF[ch] for ch in text], dtype=np.int8)
    else:
        raw = np.asarray(data)
        if raw.ndim != 1 or raw.size != cells:
            raise ValueError(f"expected {cells} tokens for a {size}x{size} maze, got {raw.size}")
        bad = np.flatnonzero((raw < WALL) | (raw > PATH))
        if len(bad):
            i = int(bad[0])
            raise ValueError(
                f"bad token {int(raw[i])} at row {i // size + 1}, column {i % size + 1}; "
                f"tokens are WALL={WALL}..PATH={PATH}"
            )
        tokens = raw.astype(np.int8)
    for token, name in ((START, "start 'S'"), (GOAL, "goal 'G'")):
        count = int(np.count_nonzero(tokens == token))
        if count != 1:
            raise ValueError(f"expected exactly one {name}, found {count}")
    start, goal = int(np.flatnonzero(tokens == START)[0]), int(np.flatnonzero(tokens == GOAL)[0])
    if shortest_distances(tokens, size, start)[goal] < 0:
        raise ValueError("the goal is unreachable from the start")
    return tokens


def path_is_valid_and_optimal(
    inputs: Sequence[int] | np.ndarray, prediction: Sequence[int] | np.ndarray, size: int
) -> bool:
    """Whether ``prediction`` solves the maze ``inputs`` with *a* shortest path.

    True iff the prediction keeps every WALL/START/GOAL of the input, marks each other cell OPEN
    or PATH, and its PATH cells plus S and G form one simple 4-connected path from S to G (no
    stray PATH cells) whose number of moves equals the BFS shortest distance."""
    inputs, pred = np.asarray(inputs).reshape(-1), np.asarray(prediction).reshape(-1)
    if pred.size != inputs.size:
        return False
    fixed = np.isin(inputs, (WALL, START, GOAL))
    if np.any(pred[fixed] != inputs[fixed]) or not np.all(np.isin(pred[~fixed], (OPEN, PATH))):
        return False
    on_path = np.isin(pred, (PATH, START, GOAL)).tolist()
    start, goal = int(np.flatnonzero(inputs == START)[0]), int(np.flatnonzero(inputs == GOAL)[0])
    prev, cell, moves = -1, start, 0
    while cell != goal:
        nxt = [nb for nb in _neighbours(cell, size) if on_path[nb] and nb != prev]
        if len(nxt) != 1:  # a dead end or a branch; revisits are impossible after this check
            return False
        prev, cell, moves = cell, nxt[0], moves + 1
    return sum(on_path) == moves + 1 and moves == shortest_distances(inputs, size, start)[goal]


def valid_optimal_accuracy(inputs, predictions, size: int) -> float:
    """Mean of :func:`path_is_valid_and_optimal` over rows of ``inputs`` and ``predictions``
    (lists, arrays or CPU tensors of shape ``(batch, size * size)``); 0.0 for an empty batch."""
    inputs, predictions = np.asarray(inputs), np.asarray(predictions)
    if len(inputs) == 0:
        return 0.0
    pairs = zip(inputs, predictions, strict=True)  # ValueError on a length mismatch
    return float(np.mean([path_is_valid_and_optimal(x, y, size) for x, y in pairs]))


def load_maze_csv(path_or_dir: str | os.PathLike, split: str = "train"):
    """Read a ``sapientinc/maze-30x30-hard-1k`` CSV (``source,question,answer,rating``; question
    and answer are ``size * size`` characters over ``"# SGo"``) into :func:`maze_dataset`'s
    columns. A directory means ``<dir>/<split>.csv``. Each row is checked with
    :func:`parse_maze` and the answer must be the question plus a valid shortest path."""
    path = os.fspath(path_or_dir)
    if os.path.isdir(path):
        path = os.path.join(path, f"{split}.csv")
    rows = []
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {"question", "answer"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: missing CSV columns {sorted(missing)}")
        for line, record in enumerate(reader, start=2):
            size = int(round(len(record["question"]) ** 0.5))
            try:
                inputs = parse_maze(record["question"], size)
                labels = parse_maze(record["answer"], size)
            except ValueError as err:
                raise ValueError(f"{path}:{line}: {err}") from None
            if not path_is_valid_and_optimal(inputs, labels, size):
                raise ValueError(f"{path}:{line}: the answer is not a shortest path of its maze")
            length = int(np.count_nonzero(labels == PATH)) + 1
            rows.append(_row(inputs, labels, length, size))
    return _dataset(rows)
