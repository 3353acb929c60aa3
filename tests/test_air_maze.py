"""Offline Maze data for the AIRSolver: generator, tie-break, augmentations, splits, metric."""

from __future__ import annotations

import csv
import itertools
from collections import deque

import numpy as np
import pytest

from modeling.air.maze_air import (
    CHARSET,
    GOAL,
    MAZE_VOCAB_SIZE,
    OPEN,
    PAD,
    PATH,
    START,
    WALL,
    default_min_path_length,
    dihedral,
    generate_mazes,
    label_path,
    load_maze_csv,
    maze_dataset,
    maze_dataset_dict,
    parse_maze,
    path_is_valid_and_optimal,
    split_of,
    valid_optimal_accuracy,
)

# Two shortest routes of 8 moves (top-right, left-bottom) and a longer one through the middle.
PLAZA = ["S    ", " ### ", " #   ", " # # ", "    G"]


def text(tokens) -> str:
    return "".join(CHARSET[t - 1] for t in np.asarray(tokens))


def with_path(rows: list[str], cells: list[tuple[int, int]]) -> np.ndarray:
    tokens = parse_maze("".join(rows), len(rows)).copy()
    for r, c in cells:
        tokens[r * len(rows) + c] = PATH
    return tokens


def bfs_moves(inputs: np.ndarray, size: int, allowed: np.ndarray) -> int:
    """Independent BFS: moves from S to G through ``allowed`` cells, -1 if unreachable."""
    start, goal = int(np.flatnonzero(inputs == START)[0]), int(np.flatnonzero(inputs == GOAL)[0])
    dist = {start: 0}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        r, c = divmod(cell, size)
        for rr, cc in ((r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)):
            nb = rr * size + cc
            if 0 <= rr < size and 0 <= cc < size and allowed[nb] and nb not in dist:
                dist[nb] = dist[cell] + 1
                queue.append(nb)
    return dist.get(goal, -1)


def assert_shortest_path(inputs: np.ndarray, labels: np.ndarray, size: int) -> int:
    """Labels = inputs plus PATH on open cells; PATH + S + G is connected and has exactly
    shortest + 1 cells, which makes it a shortest S-G path."""
    inputs, labels = np.asarray(inputs), np.asarray(labels)
    changed = labels != inputs
    assert np.all(labels[changed] == PATH) and np.all(inputs[changed] == OPEN)
    on_path = np.isin(labels, (PATH, START, GOAL))
    shortest = bfs_moves(inputs, size, inputs != WALL)
    assert shortest > 0
    assert bfs_moves(inputs, size, on_path) == shortest
    assert on_path.sum() == shortest + 1
    return shortest


def test_token_contract():
    assert (PAD, WALL, OPEN, START, GOAL, PATH, MAZE_VOCAB_SIZE) == (0, 1, 2, 3, 4, 5, 6)
    assert CHARSET == "# SGo"
    assert default_min_path_length(30) == 111
    assert [default_min_path_length(n) for n in (8, 10, 12)] == [20, 25, 30]


def test_generated_labels_are_shortest_paths_and_deterministic():
    for size in (8, 12):
        mazes = list(itertools.islice(generate_mazes(size, seed=3), 15))
        again = list(itertools.islice(generate_mazes(size, seed=3), 15))
        for maze, twin in zip(mazes, again, strict=True):
            assert np.array_equal(maze.inputs, twin.inputs) and maze.attempt == twin.attempt
            assert (maze.inputs == START).sum() == 1 and (maze.inputs == GOAL).sum() == 1
            assert not np.isin(maze.inputs, (PAD, PATH)).any()
            length = assert_shortest_path(maze.inputs, maze.labels, size)
            assert length == maze.path_length >= default_min_path_length(size)
        assert [m.attempt for m in mazes] == sorted({m.attempt for m in mazes})
    other = next(generate_mazes(8, seed=4))
    assert not np.array_equal(other.inputs, mazes[0].inputs)


def test_larger_grid_and_custom_threshold():
    maze = next(generate_mazes(20, seed=0, min_path_length=45, wall_range=(0.35, 0.42)))
    assert maze.inputs.shape == (400,)
    assert assert_shortest_path(maze.inputs, maze.labels, 20) >= 45
    with pytest.raises(ValueError, match="min_path_length"):
        next(generate_mazes(4, min_path_length=16))
    with pytest.raises(ValueError, match="wall_range"):
        next(generate_mazes(8, wall_range=(0.5, 0.3)))


def test_tie_break_is_up_right_down_left():
    # Two shortest paths from S to G; the walk takes the first neighbour one step closer.
    labels, length = label_path(parse_maze("S   #   G", 3), 3)
    assert length == 4 and text(labels) == "Soo #o  G"  # right before down
    labels, _ = label_path(parse_maze("  G # S  ", 3), 3)
    assert text(labels) == "ooGo# S  "  # up before right
    labels, _ = label_path(parse_maze("G   #   S", 3), 3)
    assert text(labels) == "Goo #o  S"  # up before left
    labels, _ = label_path(parse_maze("".join(PLAZA), 5), 5)
    assert text(labels)[:10] == "Soooo ###o"


def test_dihedral_group_and_augmented_labels():
    maze = next(generate_mazes(10, seed=1))
    images = [dihedral(maze.inputs, 10, t) for t in range(8)]
    assert len({image.tobytes() for image in images}) == 8
    assert np.array_equal(dihedral(images[1], 10, 3), maze.inputs)  # rot90 then rot270
    for t in range(8):
        inputs, labels = dihedral(maze.inputs, 10, t), dihedral(maze.labels, 10, t)
        assert assert_shortest_path(inputs, labels, 10) == maze.path_length
        assert path_is_valid_and_optimal(inputs, labels, 10)
    # The image of the labelled path need not be the tie-break path of the image.
    inputs = parse_maze("S   #   G", 3)
    labels, _ = label_path(inputs, 3)
    turned, turned_labels = dihedral(inputs, 3, 2), dihedral(labels, 3, 2)
    assert text(turned_labels) == "G  o# ooS"
    assert text(label_path(turned, 3)[0]) == "Goo #o  S"
    assert path_is_valid_and_optimal(turned, turned_labels, 3)


def test_splits_are_disjoint_up_to_isomorphism():
    maze = next(generate_mazes(8, seed=2))
    assert len({split_of(dihedral(maze.inputs, 8, t), 8) for t in range(8)}) == 1
    train = maze_dataset(8, 40, "train", seed=5, augmentations_per_maze=3)
    test = maze_dataset(8, 30, "test", seed=5, augmentations_per_maze=3)
    both = maze_dataset_dict(8, 40, 30, seed=5, augmentations_per_maze=3)
    assert both["train"][:] == train[:] and both["test"][:] == test[:]
    train_images = {
        dihedral(np.asarray(x, dtype=np.int8), 8, t).tobytes()
        for x in train["inputs"]
        for t in range(8)
    }
    assert not any(np.asarray(x, dtype=np.int8).tobytes() in train_images for x in test["inputs"])
    assert all(split_of(np.asarray(x), 8) == "test" for x in test["inputs"])


def test_maze_dataset_columns_and_determinism():
    data = maze_dataset(10, 6, seed=1, augmentations_per_maze=2)
    assert data.column_names == ["inputs", "labels", "puzzle_identifiers", "path_length", "size"]
    assert len(data) == 18
    assert set(data["puzzle_identifiers"]) == {0} and set(data["size"]) == {10}
    for row in data:
        assert len(row["inputs"]) == len(row["labels"]) == 100
        assert assert_shortest_path(row["inputs"], row["labels"], 10) == row["path_length"] >= 25
    assert maze_dataset(10, 6, seed=1, augmentations_per_maze=2)[:] == data[:]
    assert maze_dataset(10, 6, seed=2)["inputs"] != data["inputs"][::3]
    originals = data["inputs"][::3]
    for k in range(6):  # each maze is followed by two distinct non-identity images of itself
        block = [np.asarray(x, dtype=np.int8) for x in data["inputs"][3 * k : 3 * k + 3]]
        images = {dihedral(block[0], 10, t).tobytes() for t in range(1, 8)}
        assert block[1].tobytes() in images and block[2].tobytes() in images
        assert block[1].tobytes() != block[2].tobytes()
    assert len({tuple(x) for x in originals}) == 6
    with pytest.raises(ValueError, match="augmentations_per_maze"):
        maze_dataset(8, 1, augmentations_per_maze=8)
    with pytest.raises(ValueError, match="split"):
        maze_dataset(8, 1, split="valid")
    with pytest.raises(RuntimeError, match="max_attempts"):
        maze_dataset(8, 5, max_attempts=100)


def test_metric_hand_made_cases():
    inputs = parse_maze("".join(PLAZA), 5)
    label, _ = label_path(inputs, 5)
    top_right = [(0, 1), (0, 2), (0, 3), (0, 4), (1, 4), (2, 4), (3, 4)]
    left_bottom = [(1, 0), (2, 0), (3, 0), (4, 0), (4, 1), (4, 2), (4, 3)]
    longer = top_right[:6] + [(2, 3), (2, 2), (3, 2), (4, 2), (4, 3)]
    assert np.array_equal(label, with_path(PLAZA, top_right))
    assert path_is_valid_and_optimal(inputs, label, 5)
    assert path_is_valid_and_optimal(inputs, with_path(PLAZA, left_bottom), 5)
    assert not path_is_valid_and_optimal(inputs, with_path(PLAZA, longer), 5)
    through_wall = with_path(PLAZA, [(1, 0), (1, 1), (1, 2), (1, 3), (1, 4), (2, 4), (3, 4)])
    assert not path_is_valid_and_optimal(inputs, through_wall, 5)
    assert not path_is_valid_and_optimal(inputs, with_path(PLAZA, top_right[:3] + top_right[4:]), 5)
    assert not path_is_valid_and_optimal(inputs, with_path(PLAZA, top_right + [(3, 2)]), 5)
    assert not path_is_valid_and_optimal(inputs, with_path(PLAZA, top_right + left_bottom), 5)
    undecided = label.copy()
    undecided[label == OPEN] = PAD
    assert not path_is_valid_and_optimal(inputs, undecided, 5)
    assert not path_is_valid_and_optimal(inputs, inputs, 5)
    moved_goal = label.copy()
    moved_goal[24], moved_goal[23] = PATH, GOAL
    assert not path_is_valid_and_optimal(inputs, moved_goal, 5)
    adjacent = parse_maze("SG  ", 2)
    assert path_is_valid_and_optimal(adjacent, adjacent, 2)
    batch = [label, with_path(PLAZA, left_bottom), with_path(PLAZA, longer), inputs]
    assert valid_optimal_accuracy([inputs] * 4, np.stack(batch), 5) == 0.5
    assert valid_optimal_accuracy([], [], 5) == 0.0


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("S  G", "expected 9 cells"),
        ("S  #x#  G", "bad symbol 'x' at row 2, column 2"),
        ([3, 2, 2, 1, 0, 1, 2, 2, 4], "bad token 0 at row 2, column 2"),
        ([3, 2, 2, 1, 6, 1, 2, 2, 4], "bad token 6"),
        ([3, 2, 4], "expected 9 tokens"),
        ("SS  #   G", "exactly one start 'S', found 2"),
        ("S   #    ", "exactly one goal 'G', found 0"),
        ("SG  #   G", "exactly one goal 'G', found 2"),
        ("S #### #G", "unreachable"),
    ],
)
def test_parse_maze_rejects_malformed(data, message):
    with pytest.raises(ValueError, match=message):
        parse_maze(data, 3)


def test_parse_maze_accepts_text_and_tokens():
    tokens = parse_maze("S #\n# o\n  G", 3)
    assert tokens.tolist() == [START, OPEN, WALL, WALL, OPEN, PATH, OPEN, OPEN, GOAL]
    assert np.array_equal(parse_maze(tokens.tolist(), 3), tokens)
    assert np.array_equal(parse_maze(np.asarray(tokens, dtype=np.int64), 3), tokens)


def test_load_maze_csv(tmp_path):
    mazes = list(itertools.islice(generate_mazes(8, seed=7), 3))
    path = tmp_path / "test.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["source", "question", "answer", "rating"])
        for maze in mazes:
            writer.writerow(["lehnert", text(maze.inputs), text(maze.labels), 0])
    data = load_maze_csv(tmp_path, split="test")
    assert data.column_names == ["inputs", "labels", "puzzle_identifiers", "path_length", "size"]
    assert data["inputs"] == [m.inputs.tolist() for m in mazes]
    assert data["labels"] == [m.labels.tolist() for m in mazes]
    assert data["path_length"] == [m.path_length for m in mazes] and set(data["size"]) == {8}
    assert load_maze_csv(path)["inputs"] == data["inputs"]
    bad = tmp_path / "bad.csv"
    question = text(mazes[0].inputs)
    bad.write_text(f"source,question,answer,rating\nx,{question},{question},0\n")
    with pytest.raises(ValueError, match="bad.csv:2: the answer is not a shortest path"):
        load_maze_csv(bad)
    bad.write_text(f"source,question,answer,rating\nx,{question[:-1]}x,a,0\n")
    with pytest.raises(ValueError, match="bad.csv:2: bad symbol"):
        load_maze_csv(bad)
