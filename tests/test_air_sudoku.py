"""Offline Sudoku data: solver, generator, rating, augmentations, splits, parsing, CSV loader."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from modeling.air.sudoku_air import (
    BLANK,
    PAD,
    SudokuSpec,
    augment,
    generate_minimal,
    load_sudoku_extreme_csv,
    parse_sudoku,
    rate,
    signature,
    solve,
    split_of,
    sudoku_dataset,
    sudoku_vocab_size,
)

SPECS = {n: SudokuSpec(n) for n in (4, 6, 9)}
COUNTS = {4: 12, 6: 6, 9: 2}
IMPOSSIBLE_4 = ".123....4......."  # no clash, but r1c1 has no candidate


@pytest.fixture(scope="module")
def datasets_by_size():
    return {n: sudoku_dataset(n, COUNTS[n], seed=1) for n in (4, 6, 9)}


def is_valid_solution(grid: np.ndarray, spec: SudokuSpec) -> bool:
    n, br, bc = spec.size, spec.box_rows, spec.box_cols
    board = np.asarray(grid).reshape(n, n)
    units = [board[i] for i in range(n)] + [board[:, j] for j in range(n)]
    units += [
        board[r : r + br, c : c + bc].ravel() for r in range(0, n, br) for c in range(0, n, bc)
    ]
    return all(sorted(unit.tolist()) == list(range(1, n + 1)) for unit in units)


def all_isomorphs_4(puzzle: np.ndarray) -> set[tuple[int, ...]]:
    """Every image of a 4x4 puzzle under the full group, by brute force (3072 elements)."""
    board = np.asarray(puzzle).reshape(4, 4)
    orders = [
        [2 * b + r for b, p in zip(bands, within, strict=True) for r in p]
        for bands in itertools.permutations(range(2))
        for within in itertools.product(itertools.permutations(range(2)), repeat=2)
    ]
    images = set()
    for rows, cols, flip, digits in itertools.product(
        orders, orders, (False, True), itertools.permutations(range(1, 5))
    ):
        moved = board[rows][:, cols]
        moved = moved.T if flip else moved
        images.add(tuple(np.asarray((0, *digits))[moved].ravel().tolist()))
    return images


def test_spec_and_tokens():
    assert (PAD, BLANK) == (0, 1)
    assert [sudoku_vocab_size(n) for n in (4, 6, 9)] == [6, 8, 11]
    assert (SPECS[6].box_rows, SPECS[6].box_cols) == (2, 3)
    with pytest.raises(ValueError, match=r"\(4, 6, 9\)"):
        SudokuSpec(5)


def test_solver_counts_and_backtracks():
    spec = SPECS[4]
    assert solve(np.zeros(16, dtype=np.int8), spec).solutions == 2
    assert solve(np.zeros(16, dtype=np.int8), spec, limit=5).solutions == 5
    puzzle, solution = generate_minimal(SPECS[9], random.Random(3))
    first, second = solve(puzzle, SPECS[9], limit=1), solve(puzzle, SPECS[9], limit=1)
    assert first.backtracks == second.backtracks >= 0
    np.testing.assert_array_equal(first.solution, solution)


@pytest.mark.parametrize("n", [4, 6, 9])
def test_generated_puzzles_unique(datasets_by_size, n):
    spec, ds = SPECS[n], datasets_by_size[n]
    assert len(ds) == COUNTS[n]
    for row in ds:
        puzzle, labels = np.asarray(row["inputs"]) - 1, np.asarray(row["labels"]) - 1
        assert len(puzzle) == n * n and row["size"] == n and row["puzzle_identifiers"] == 0
        result = solve(puzzle, spec, limit=2)
        assert result.solutions == 1
        np.testing.assert_array_equal(result.solution, labels)
        assert is_valid_solution(labels, spec)
        given = puzzle > 0
        assert row["givens"] == given.sum()
        np.testing.assert_array_equal(puzzle[given], labels[given])
        assert row["rating"] >= 0


@pytest.mark.parametrize("n", [4, 6])
def test_minimal(datasets_by_size, n):
    for row in datasets_by_size[n]:
        puzzle = np.asarray(row["inputs"]) - 1
        for i in np.nonzero(puzzle)[0]:
            fewer = puzzle.copy()
            fewer[i] = 0
            assert solve(fewer, SPECS[n]).solutions == 2


@pytest.mark.parametrize("n", [4, 6, 9])
def test_augment_keeps_valid_unique_pairs(n):
    spec = SPECS[n]
    puzzle, solution = generate_minimal(spec, random.Random(n))
    rng = np.random.default_rng(0)
    group = all_isomorphs_4(puzzle) if n == 4 else None
    seen = set()
    for _ in range(20 if n < 9 else 5):
        new_puzzle, new_solution = augment(puzzle, solution, spec, rng)
        seen.add(new_solution.tobytes())
        assert group is None or tuple(new_puzzle.tolist()) in group
        assert is_valid_solution(new_solution, spec)
        given = new_puzzle > 0
        np.testing.assert_array_equal(new_puzzle[given], new_solution[given])
        assert given.sum() == (puzzle > 0).sum()
        result = solve(new_puzzle, spec)
        assert result.solutions == 1
        np.testing.assert_array_equal(result.solution, new_solution)
    assert len(seen) > 1


def test_transpose_is_no_symmetry_for_2x3_boxes():
    spec = SPECS[6]
    _, solution = generate_minimal(spec, random.Random(0))
    assert not is_valid_solution(solution.reshape(6, 6).T.ravel(), spec)


@pytest.mark.parametrize("n", [4, 6, 9])
def test_signature_invariant_under_isomorphism(n):
    spec = SPECS[n]
    puzzle, solution = generate_minimal(spec, random.Random(10 + n))
    other, _ = generate_minimal(spec, random.Random(20 + n))
    rng = np.random.default_rng(1)
    reference = signature(puzzle, spec)
    for _ in range(10):
        assert signature(augment(puzzle, solution, spec, rng)[0], spec) == reference
    if n > 4:
        assert signature(other, spec) != reference


def test_train_test_disjoint_up_to_isomorphism_4x4():
    train = sudoku_dataset(4, 30, "train", seed=2)
    test = sudoku_dataset(4, 30, "test", seed=2, augmentations_per_puzzle=1)
    images = set()
    for row in train:
        images |= all_isomorphs_4(np.asarray(row["inputs"]) - 1)
    test_puzzles = {tuple(np.asarray(row["inputs"]) - 1) for row in test}
    assert len(test_puzzles) > 5 and not images & test_puzzles


def test_train_test_disjoint_9x9(datasets_by_size):
    spec = SPECS[9]
    test = sudoku_dataset(9, 2, "test", seed=1, augmentations_per_puzzle=2)
    assert len(test) == 6
    train_sigs = {signature(np.asarray(r["inputs"]) - 1, spec) for r in datasets_by_size[9]}
    test_sigs = {signature(np.asarray(r["inputs"]) - 1, spec) for r in test}
    assert len(test_sigs) == 2 and not train_sigs & test_sigs
    assert all(split_of(np.asarray(r["inputs"]) - 1, spec) == "test" for r in test)


def test_deterministic():
    first = sudoku_dataset(6, 4, seed=5, augmentations_per_puzzle=1)
    assert first.to_dict() == sudoku_dataset(6, 4, seed=5, augmentations_per_puzzle=1).to_dict()
    assert first.to_dict() != sudoku_dataset(6, 4, seed=6, augmentations_per_puzzle=1).to_dict()


def test_rating_deterministic():
    spec = SPECS[9]
    puzzle, _ = generate_minimal(spec, random.Random(7))
    assert rate(puzzle, spec, seed=3) == rate(puzzle, spec, seed=3)
    assert (
        rate(puzzle, spec, isomorphs=1, seed=0)
        == solve(
            augment(puzzle, puzzle, spec, np.random.default_rng(0))[0], spec, limit=1
        ).backtracks
    )


def test_profile_mixing():
    ds = sudoku_dataset(9, 4, seed=0, hard_fraction=0.5, rating_threshold=10.0, rating_isomorphs=2)
    hard = [r >= 10.0 for r in ds["rating"]]
    assert sum(hard) == 2 and len(hard) == 4
    easy_only = sudoku_dataset(6, 5, seed=0, hard_fraction=0.0, rating_threshold=0.5)
    assert all(r < 0.5 for r in easy_only["rating"])
    with pytest.raises(RuntimeError, match="relax"):
        sudoku_dataset(4, 1, hard_fraction=1.0, rating_threshold=5.0, max_attempts=20)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("1234" * 3, "expected 16 cells"),
        ("12x4" + "." * 12, r"bad symbol 'x' at cell r1c3"),
        ([1] * 15 + [0], r"bad token 0 at cell r4c4"),
        ([1] * 15 + [6], r"bad token 6 at cell r4c4"),
        ([1] * 15, "expected 16 tokens"),
        ("1..1" + "." * 12, r"digit 1 appears twice in row 1 \(cells r1c1 and r1c4\)"),
        ("2..." + "...." + "2..." + "....", r"digit 2 appears twice in column 1"),
        ("3..." + ".3.." + "." * 8, r"digit 3 appears twice in box 1"),
        (IMPOSSIBLE_4, "no solution"),
    ],
)
def test_parse_errors(data, message):
    with pytest.raises(ValueError, match=message):
        parse_sudoku(data, 4)


def test_parse_accepts_strings_and_tokens():
    grid = parse_sudoku("1.3.\n..2.\n0000\n....", 4)
    assert grid.tolist()[:4] == [1, 0, 3, 0]
    np.testing.assert_array_equal(parse_sudoku((grid + 1).tolist(), 4), grid)


def test_csv_loader(tmp_path):
    spec = SPECS[9]
    pairs = [generate_minimal(spec, random.Random(k)) for k in range(2)]
    lines = ["source,question,answer,rating"]
    for k, (puzzle, solution) in enumerate(pairs):
        question = "".join("." if v == 0 else str(v) for v in puzzle)
        lines.append(f"src{k},{question},{''.join(map(str, solution))},{k + 3}")
    (tmp_path / "test.csv").write_text("\n".join(lines) + "\n")
    ds = load_sudoku_extreme_csv(tmp_path, split="test")
    assert ds.column_names == ["inputs", "labels", "puzzle_identifiers", "rating", "givens", "size",
                               "group"]
    assert ds["rating"] == [3.0, 4.0] and ds["size"] == [9, 9] and ds["group"] == [0, 1]
    assert ds["puzzle_identifiers"] == [0, 0]
    for row, (puzzle, solution) in zip(ds, pairs, strict=True):
        assert row["inputs"] == (puzzle.astype(int) + 1).tolist()
        assert row["labels"] == (solution.astype(int) + 1).tolist()
        assert row["givens"] == np.count_nonzero(puzzle)
    source, question, answer, rating = lines[2].split(",")
    broken = f"{source},{question},0{answer[1:]},{rating}"
    (tmp_path / "bad.csv").write_text("\n".join([*lines[:2], broken]) + "\n")
    with pytest.raises(ValueError, match=r"bad.csv:3: bad symbol"):
        load_sudoku_extreme_csv(tmp_path / "bad.csv")
