"""Offline Sudoku data for the AIRSolver: generator, solver, rating, augmentations, splits.

The Hub's ``sapientinc/sudoku-extreme`` is unreachable here, so we generate equivalent data:
random minimal puzzles with a unique solution, a hardness rating, the papers' augmentations and a
train/test split that is disjoint up to isomorphism. :func:`load_sudoku_extreme_csv` reads the
real CSVs into the same columns for users who have them.

Grids are flat ``numpy`` arrays of ``n * n`` digits, row-major, ``0`` for an empty cell. Tokens
(the model's vocabulary): ``PAD = 0``, ``BLANK = 1``, digit ``d`` is token ``d + 1``; so the token
of a grid cell is ``grid + 1`` and the vocabulary has ``n + 2`` entries.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import os
import random
from dataclasses import dataclass
from functools import cache

import numpy as np

__all__ = [
    "BLANK",
    "PAD",
    "SIZES",
    "SolveResult",
    "SudokuSpec",
    "augment",
    "generate_minimal",
    "load_sudoku_extreme_csv",
    "parse_sudoku",
    "random_solution",
    "rate",
    "signature",
    "solve",
    "split_of",
    "sudoku_dataset",
    "sudoku_vocab_size",
]

PAD = 0
BLANK = 1
SIZES = (4, 6, 9)
_BOXES = {4: (2, 2), 6: (2, 3), 9: (3, 3)}
_COLUMNS = ("inputs", "labels", "puzzle_identifiers", "rating", "givens", "size", "group")


def sudoku_vocab_size(n: int) -> int:
    """Vocabulary size for an ``n x n`` board: PAD, BLANK and ``n`` digits."""
    return SudokuSpec(n).size + 2


@dataclass(frozen=True)
class SudokuSpec:
    """Board geometry: ``size`` 4 (2x2 boxes), 6 (boxes of 2 rows x 3 columns) or 9 (3x3)."""

    size: int

    def __post_init__(self) -> None:
        if self.size not in _BOXES:
            raise ValueError(f"size must be one of {SIZES}, got {self.size!r}")

    @property
    def box_rows(self) -> int:
        return _BOXES[self.size][0]

    @property
    def box_cols(self) -> int:
        return _BOXES[self.size][1]

    @property
    def cells(self) -> int:
        return self.size * self.size


@cache
def _tables(n: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """Per-cell row, column and box index, and the popcount of every candidate mask."""
    spec = SudokuSpec(n)
    rows = [i // n for i in range(n * n)]
    cols = [i % n for i in range(n * n)]
    boxes = [
        (r // spec.box_rows) * (n // spec.box_cols) + c // spec.box_cols
        for r, c in zip(rows, cols, strict=True)
    ]
    return rows, cols, boxes, [bin(m).count("1") for m in range(1 << n)]


@dataclass(frozen=True)
class SolveResult:
    """Outcome of :func:`solve`: solutions found (capped at the limit), the first one, and the
    dead ends (a cell with no candidate left) met by the search before it stopped."""

    solutions: int
    solution: np.ndarray | None
    backtracks: int


def _search(
    grid: list[int],
    n: int,
    limit: int,
    banned: dict[int, int] | None = None,
    rng: random.Random | None = None,
) -> tuple[int, list[int] | None, int]:
    """Bitmask DFS: fewest-candidate cell first (ties: lowest index), digits ascending (or in
    ``rng``'s random order). ``banned`` maps cells to digit masks they may not take. Stops after
    ``limit`` solutions; returns (solutions, first solution, dead ends)."""
    row_of, col_of, box_of, pop = _tables(n)
    full = (1 << n) - 1
    rows, cols, boxes = [0] * n, [0] * n, [0] * n
    for i, v in enumerate(grid):
        if v:
            bit = 1 << (v - 1)
            if (rows[row_of[i]] | cols[col_of[i]] | boxes[box_of[i]]) & bit:
                return 0, None, 0
            rows[row_of[i]] |= bit
            cols[col_of[i]] |= bit
            boxes[box_of[i]] |= bit
    cells = list(grid)
    banned = banned or {}
    state = [0, None, 0]  # solutions, first solution, dead ends

    def dfs(empty: list[int]) -> None:
        if not empty:
            state[0] += 1
            if state[1] is None:
                state[1] = list(cells)
            return
        best, best_count, best_mask = -1, n + 1, 0
        for i in empty:
            mask = full & ~(rows[row_of[i]] | cols[col_of[i]] | boxes[box_of[i]])
            if i in banned:
                mask &= ~banned[i]
            count = pop[mask]
            if count < best_count:
                best, best_count, best_mask = i, count, mask
                if count == 0:
                    break
        if best_count == 0:
            state[2] += 1
            return
        rest = [i for i in empty if i != best]
        r, c, b = row_of[best], col_of[best], box_of[best]
        digits = [d for d in range(n) if best_mask >> d & 1]
        if rng is not None:
            rng.shuffle(digits)
        for d in digits:
            bit = 1 << d
            rows[r] |= bit
            cols[c] |= bit
            boxes[b] |= bit
            cells[best] = d + 1
            dfs(rest)
            rows[r] &= ~bit
            cols[c] &= ~bit
            boxes[b] &= ~bit
            if state[0] >= limit:
                break
        cells[best] = 0

    dfs([i for i, v in enumerate(grid) if not v])
    return state[0], state[1], state[2]


def solve(puzzle: np.ndarray, spec: SudokuSpec, limit: int = 2) -> SolveResult:
    """Solve ``puzzle`` with the fixed deterministic procedure, stopping after ``limit``
    solutions (``limit=2`` decides uniqueness; ``limit=1`` gives the rating's backtracks)."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    count, first, dead = _search([int(v) for v in puzzle], spec.size, limit)
    solution = None if first is None else np.asarray(first, dtype=np.int8)
    return SolveResult(count, solution, dead)


def random_solution(spec: SudokuSpec, rng: random.Random) -> np.ndarray:
    """A random full grid: the DFS on an empty board with digits tried in random order."""
    _, grid, _ = _search([0] * spec.cells, spec.size, 1, rng=rng)
    return np.asarray(grid, dtype=np.int8)


def generate_minimal(spec: SudokuSpec, rng: random.Random) -> tuple[np.ndarray, np.ndarray]:
    """A random minimal puzzle and its solution: remove givens of a random full grid in random
    order, keeping each removal only when the solution stays unique. One pass is minimal because
    removing givens never removes solutions."""
    solution = random_solution(spec, rng)
    puzzle = [int(v) for v in solution]
    order = list(range(spec.cells))
    rng.shuffle(order)
    for i in order:
        digit, puzzle[i] = puzzle[i], 0
        if _search(puzzle, spec.size, 1, banned={i: 1 << (digit - 1)})[0]:
            puzzle[i] = digit
    return np.asarray(puzzle, dtype=np.int8), solution


def _transform(spec: SudokuSpec, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A random isomorphism as (cell gather index, digit map): permute bands, stacks, rows
    within bands, columns within stacks, transpose (square boxes only), relabel digits."""
    n, br, bc = spec.size, spec.box_rows, spec.box_cols
    row_order = [b * br + r for b in rng.permutation(n // br) for r in rng.permutation(br)]
    col_order = [s * bc + c for s in rng.permutation(n // bc) for c in rng.permutation(bc)]
    index = np.asarray(row_order)[:, None] * n + np.asarray(col_order)[None, :]
    if br == bc and rng.random() < 0.5:
        index = index.T
    digits = np.concatenate([[0], 1 + rng.permutation(n)]).astype(np.int8)
    return index.reshape(-1), digits


def augment(
    puzzle: np.ndarray, solution: np.ndarray, spec: SudokuSpec, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Apply one random isomorphism (see :func:`_transform`) to both puzzle and solution.

    The transpose is drawn only for square boxes: with 2x3 boxes it maps boxes to 3x2 regions,
    which is not a Sudoku symmetry."""
    index, digits = _transform(spec, rng)
    return digits[np.asarray(puzzle)[index]], digits[np.asarray(solution)[index]]


def rate(puzzle: np.ndarray, spec: SudokuSpec, isomorphs: int = 8, seed: int = 0) -> float:
    """Hardness: dead ends of the fixed :func:`solve` procedure (to the first solution),
    averaged over ``isomorphs`` random isomorphs drawn from ``seed``.

    A proxy for Sudoku-Extreme's ``rating`` (theirs came from a different solver), so the two
    scales differ; averaging over isomorphs removes most of the dependence on cell order."""
    rng = np.random.default_rng(seed)
    total = 0
    for _ in range(isomorphs):
        index, digits = _transform(spec, rng)
        total += _search([int(v) for v in digits[np.asarray(puzzle)[index]]], spec.size, 1)[2]
    return total / isomorphs


@cache
def _all_geometries(n: int) -> np.ndarray:
    """Every cell gather index of the geometric group, ``[G, n * n]`` (128 for 4, 3456 for 6)."""
    spec = SudokuSpec(n)
    br, bc = spec.box_rows, spec.box_cols

    def orders(block: int) -> list[list[int]]:
        within = list(itertools.permutations(range(block)))
        return [
            [b * block + r for b, p in zip(bands, perms, strict=True) for r in p]
            for bands in itertools.permutations(range(n // block))
            for perms in itertools.product(within, repeat=n // block)
        ]

    rows, cols = np.asarray(orders(br)), np.asarray(orders(bc))
    index = rows[:, None, :, None] * n + cols[None, :, None, :]  # [R, C, n, n]
    index = index.reshape(-1, n, n)
    if br == bc:
        index = np.concatenate([index, index.transpose(0, 2, 1)])
    return index.reshape(len(index), -1)


def _canonical(puzzle: np.ndarray, n: int) -> bytes:
    """Exact canonical form under the whole group: over every geometry, relabel digits by first
    appearance, and keep the lexicographically smallest grid."""
    grids = np.asarray(puzzle, dtype=np.int64)[_all_geometries(n)]
    cells = grids.shape[1]
    first = np.stack(
        [np.where((grids == d).any(1), (grids == d).argmax(1), cells + d) for d in range(1, n + 1)],
        axis=1,
    )
    labels = np.zeros((len(grids), n + 1), dtype=np.int64)
    np.put_along_axis(labels, 1 + np.argsort(first, axis=1), np.arange(1, n + 1)[None], axis=1)
    relabelled = np.take_along_axis(labels, grids, axis=1)
    return relabelled[np.lexsort(relabelled.T[::-1])[0]].astype(np.int8).tobytes()


def _invariants(puzzle: np.ndarray, spec: SudokuSpec) -> tuple:
    """Isomorphism-invariant statistics of the givens (not a complete invariant): the band and
    stack structure of row/column given counts, the box count matrix up to band/stack
    permutation, the digit frequencies, and per given its (row, column) counts as an unordered
    pair, its box count and its digit's frequency."""
    n, br, bc = spec.size, spec.box_rows, spec.box_cols
    grid = np.asarray(puzzle, dtype=np.int64).reshape(n, n)
    given = grid > 0
    row_n, col_n = given.sum(1).tolist(), given.sum(0).tolist()
    boxes = given.reshape(n // br, br, n // bc, bc).sum((1, 3))
    freq = np.bincount(grid[given], minlength=n + 1).tolist()
    bands = tuple(sorted(tuple(sorted(row_n[b * br : (b + 1) * br])) for b in range(n // br)))
    stacks = tuple(sorted(tuple(sorted(col_n[s * bc : (s + 1) * bc])) for s in range(n // bc)))
    views = [boxes] + ([boxes.T] if br == bc else [])
    box_form = min(
        tuple(view[list(p)][:, list(q)].ravel().tolist())
        for view in views
        for p in itertools.permutations(range(view.shape[0]))
        for q in itertools.permutations(range(view.shape[1]))
    )
    box_n, digits = boxes.tolist(), grid.tolist()
    cells = sorted(
        (*sorted((row_n[i], col_n[j])), box_n[i // br][j // bc], freq[digits[i][j]])
        for i, j in zip(*np.nonzero(given), strict=True)
    )
    lines = tuple(sorted([bands, stacks])) if br == bc else (bands, stacks)
    return lines, box_form, tuple(sorted(freq[1:])), tuple(cells)


def signature(puzzle: np.ndarray, spec: SudokuSpec) -> str:
    """A hex digest that is equal for isomorphic puzzles: of the exact canonical form for 4x4 and
    6x6, of :func:`_invariants` for 9x9 (so distinct 9x9 classes may share one)."""
    if spec.size < 9:
        data = _canonical(puzzle, spec.size)
    else:
        data = repr(_invariants(puzzle, spec)).encode()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def split_of(puzzle: np.ndarray, spec: SudokuSpec, test_fraction: float = 0.5) -> str:
    """``"test"`` or ``"train"`` from a hash of :func:`signature`: isomorphs share a split."""
    value = int(signature(puzzle, spec)[:16], 16) / 2**64
    return "test" if value < test_fraction else "train"


def _rows(puzzle: np.ndarray, solution: np.ndarray, rating: float, n: int, group: int) -> dict:
    return {
        "inputs": (np.asarray(puzzle, dtype=np.int64) + 1).tolist(),
        "labels": (np.asarray(solution, dtype=np.int64) + 1).tolist(),
        "puzzle_identifiers": 0,
        "rating": float(rating),
        "givens": int(np.count_nonzero(puzzle)),
        "size": n,
        "group": group,
    }


def _features():
    import datasets

    tokens = datasets.Sequence(datasets.Value("int64"))
    return datasets.Features(
        inputs=tokens,
        labels=tokens,
        puzzle_identifiers=datasets.Value("int64"),
        rating=datasets.Value("float64"),
        givens=datasets.Value("int64"),
        size=datasets.Value("int64"),
        group=datasets.Value("int64"),
    )


def sudoku_dataset(
    size: int,
    num_puzzles: int,
    split: str = "train",
    seed: int = 0,
    hard_fraction: float | None = None,
    rating_threshold: float = 10.0,
    augmentations_per_puzzle: int = 0,
    test_fraction: float = 0.5,
    rating_isomorphs: int = 8,
    max_attempts: int | None = None,
    min_rating: float | None = None,
):
    """A ``datasets.Dataset`` of generated minimal puzzles, deterministic in its arguments.

    Puzzle ``k`` of the stream is drawn from ``(seed, size, k)`` and kept only if
    :func:`split_of` puts it in ``split``; train and test calls with the same ``seed`` and
    ``test_fraction`` are therefore disjoint up to isomorphism. With ``hard_fraction`` set, a
    ``round(hard_fraction * num_puzzles)`` share has ``rating >= rating_threshold`` and the rest
    is below, each bucket filled by rejection and the result shuffled: a proxy of
    Sudoku-Extreme's profile (~27% easy, ~73% hard), on :func:`rate`'s scale, not theirs (at the
    default threshold about three quarters of random minimal 9x9 puzzles are hard). Each
    puzzle is followed by ``augmentations_per_puzzle`` random isomorphs (same rating).
    ``min_rating`` keeps only puzzles rated at least that (the authors' ``min_difficulty``).

    Columns: ``inputs`` / ``labels`` (``n * n`` tokens; BLANK for empty cells), ``rating``,
    ``givens``, ``size``, ``puzzle_identifiers`` (0), ``group`` (the base puzzle of a row and
    its augmentations). Raises ``RuntimeError`` after
    ``max_attempts`` draws (default ``1000 + 200 * num_puzzles``).
    """
    import datasets
    from tqdm.auto import tqdm

    spec = SudokuSpec(size)
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if num_puzzles < 0 or augmentations_per_puzzle < 0:
        raise ValueError("num_puzzles and augmentations_per_puzzle must be >= 0")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if hard_fraction is not None and not 0.0 <= hard_fraction <= 1.0:
        raise ValueError(f"hard_fraction must be in [0, 1], got {hard_fraction}")
    if hard_fraction is None:
        quota = {None: num_puzzles}
    else:
        n_hard = round(hard_fraction * num_puzzles)
        quota = {True: n_hard, False: num_puzzles - n_hard}
    attempts = max_attempts if max_attempts is not None else 1000 + 200 * num_puzzles
    kept: list[tuple[int, np.ndarray, np.ndarray, float]] = []
    with tqdm(total=num_puzzles, desc=f"sudoku {size}x{size} {split}", disable=None) as bar:
        for k in itertools.count():
            if len(kept) == num_puzzles:
                break
            if k >= attempts:
                raise RuntimeError(
                    f"only {len(kept)} of {num_puzzles} puzzles after {attempts} draws; relax "
                    "hard_fraction / rating_threshold or raise max_attempts"
                )
            seeds = np.random.SeedSequence([seed, size, k]).generate_state(2)
            puzzle, solution = generate_minimal(spec, random.Random(int(seeds[0])))
            if split_of(puzzle, spec, test_fraction) != split:
                continue
            rating = rate(puzzle, spec, rating_isomorphs, int(seeds[1]))
            if min_rating is not None and rating < min_rating:
                continue
            bucket = None if hard_fraction is None else rating >= rating_threshold
            if quota[bucket] > 0:
                quota[bucket] -= 1
                kept.append((k, puzzle, solution, rating))
                bar.update()
    order = np.random.default_rng([seed, size]).permutation(len(kept))
    rows = []
    for group, (k, puzzle, solution, rating) in enumerate(kept[i] for i in order):
        rows.append(_rows(puzzle, solution, rating, size, group))
        rng = np.random.default_rng([seed, size, k, 1])
        for _ in range(augmentations_per_puzzle):
            rows.append(_rows(*augment(puzzle, solution, spec, rng), rating, size, group))
    columns = {name: [row[name] for row in rows] for name in _COLUMNS}
    return datasets.Dataset.from_dict(columns, features=_features())


def _conflict(grid: np.ndarray, spec: SudokuSpec) -> str | None:
    """Describe the first repeated digit in a row, column or box (1-indexed), if any."""
    n = spec.size
    row_of, col_of, box_of, _ = _tables(n)
    for kind, unit_of in (("row", row_of), ("column", col_of), ("box", box_of)):
        seen: dict[tuple[int, int], int] = {}
        for i, v in enumerate(grid):
            if v:
                key = (unit_of[i], int(v))
                if key in seen:
                    a, b = seen[key], i
                    return (
                        f"digit {v} appears twice in {kind} {unit_of[i] + 1} "
                        f"(cells r{a // n + 1}c{a % n + 1} and r{b // n + 1}c{b % n + 1})"
                    )
                seen[key] = i
    return None


def parse_sudoku(data: str | list[int] | np.ndarray, size: int) -> np.ndarray:
    """Validate a puzzle and return its grid (``0`` for empty cells).

    ``data`` is a string of digits with ``.`` or ``0`` for blanks (whitespace ignored), or a
    sequence of tokens (BLANK or ``d + 1``). Raises ``ValueError`` naming the problem: wrong
    length, a bad symbol or token, a repeated digit in a row/column/box, or no solution."""
    spec = SudokuSpec(size)
    n = spec.size
    if isinstance(data, str):
        text = "".join(data.split())
        if len(text) != spec.cells:
            raise ValueError(f"expected {spec.cells} cells for a {n}x{n} board, got {len(text)}")
        symbols = {".": 0, "0": 0, **{str(d): d for d in range(1, n + 1)}}
        for i, ch in enumerate(text):
            if ch not in symbols:
                raise ValueError(
                    f"bad symbol {ch!r} at cell r{i // n + 1}c{i % n + 1}; use '.', '0' or 1-{n}"
                )
        grid = np.asarray([symbols[ch] for ch in text], dtype=np.int8)
    else:
        tokens = np.asarray(data)
        if tokens.ndim != 1 or len(tokens) != spec.cells:
            raise ValueError(f"expected {spec.cells} tokens for a {n}x{n} board, got {tokens.size}")
        bad = np.nonzero((tokens < BLANK) | (tokens > n + 1))[0]
        if len(bad):
            i = int(bad[0])
            raise ValueError(
                f"bad token {int(tokens[i])} at cell r{i // n + 1}c{i % n + 1}; "
                f"tokens are BLANK={BLANK} or digit+1 in 2..{n + 1}"
            )
        grid = (tokens - 1).astype(np.int8)
    problem = _conflict(grid, spec)
    if problem:
        raise ValueError(f"contradictory givens: {problem}")
    if solve(grid, spec, limit=1).solutions == 0:
        raise ValueError("the puzzle has no solution")
    return grid


def load_sudoku_extreme_csv(path_or_dir: str | os.PathLike, split: str = "train"):
    """Read a ``sapientinc/sudoku-extreme`` CSV (``source,question,answer,rating``; ``.`` for
    blanks) into :func:`sudoku_dataset`'s columns. A directory means ``<dir>/<split>.csv``.

    Rows are checked for length, symbols and agreement of givens with the answer, not solved.
    """
    import datasets

    path = os.fspath(path_or_dir)
    if os.path.isdir(path):
        path = os.path.join(path, f"{split}.csv")
    rows = []
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {"question", "answer", "rating"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: missing CSV columns {sorted(missing)}")
        for line, record in enumerate(reader, start=2):
            question = record["question"].replace(".", "0")
            answer = record["answer"]
            if len(question) != 81 or len(answer) != 81:
                raise ValueError(f"{path}:{line}: question and answer must have 81 cells")
            if not (question.isdigit() and answer.isdigit()) or "0" in answer:
                raise ValueError(f"{path}:{line}: bad symbol in question or answer")
            puzzle = np.frombuffer(question.encode(), dtype=np.uint8) - ord("0")
            solution = np.frombuffer(answer.encode(), dtype=np.uint8) - ord("0")
            if np.any((puzzle > 0) & (puzzle != solution)):
                raise ValueError(f"{path}:{line}: a given disagrees with the answer")
            rows.append(_rows(puzzle, solution, float(record["rating"]), 9, len(rows)))
    columns = {name: [row[name] for row in rows] for name in _COLUMNS}
    return datasets.Dataset.from_dict(columns, features=_features())
