"""The authors' prebuilt dataset folders and their one-copy-per-base-puzzle sampling."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from modeling.air import PuzzleFolderError, load_puzzle_folder, sudoku_dataset
from modeling.air.sudoku_air import SudokuSpec, augment, generate_minimal
from modeling.air.training_air import AIRTrainConfig, _group_batches


def _write_folder(root, groups: int = 3, copies: int = 4, size: int = 4):
    """A folder as the authors' build script writes it: groups of a base puzzle + its copies."""
    spec = SudokuSpec(size)
    rng = np.random.default_rng(0)
    inputs, labels, bases = [], [], []
    for g in range(groups):
        puzzle, solution = generate_minimal(spec, random.Random(g))
        bases.append((puzzle, solution))
        inputs.append(puzzle + 1)
        labels.append(solution + 1)
        for _ in range(copies - 1):
            p, s = augment(puzzle, solution, spec, rng)
            inputs.append(p + 1)
            labels.append(s + 1)
    folder = root / "train"
    folder.mkdir(parents=True)
    count = groups * copies
    arrays = {"inputs": np.array(inputs, dtype=np.int32),
              "labels": np.array(labels, dtype=np.int32),
              "puzzle_identifiers": np.zeros(count, dtype=np.int32),
              "puzzle_indices": np.arange(count + 1, dtype=np.int32),
              "group_indices": np.arange(0, count + 1, copies, dtype=np.int32)}
    for name, array in arrays.items():
        np.save(folder / f"all__{name}.npy", array)
    (folder / "dataset.json").write_text(json.dumps({
        "seq_len": size * size, "vocab_size": size + 2, "pad_id": 0, "ignore_label_id": 0,
        "blank_identifier_id": 0, "num_puzzle_identifiers": 1, "total_groups": groups,
        "mean_puzzle_examples": 1.0, "sets": ["all"]}))
    return arrays


def test_a_folder_reads_into_our_columns_with_its_groups(tmp_path):
    arrays = _write_folder(tmp_path)
    data = load_puzzle_folder(tmp_path)
    assert data.column_names == ["inputs", "labels", "puzzle_identifiers", "group", "size"]
    assert data["inputs"] == arrays["inputs"].tolist()
    assert data["labels"] == arrays["labels"].tolist()
    assert data["group"] == [0] * 4 + [1] * 4 + [2] * 4 and set(data["size"]) == {4}


@pytest.mark.parametrize("damage, message", [
    (lambda f: (f / "dataset.json").unlink(), "holds no dataset.json"),
    (lambda f: (f / "dataset.json").write_text("{"), "not valid JSON"),
    (lambda f: (f / "all__labels.npy").unlink(), "lacks all__labels.npy"),
    (lambda f: (f / "all__inputs.npy").write_bytes(b"not an array"), "not a readable .npy"),
    (lambda f: np.save(f / "all__group_indices.npy", np.array([0, 5, 3, 12])),
     "group_indices must rise"),
    (lambda f: np.save(f / "all__puzzle_indices.npy", np.arange(12)), "puzzle_indices must rise"),
    (lambda f: np.save(f / "all__labels.npy", np.zeros((12, 9), dtype=np.int32)),
     r"must both be \[examples, seq_len=16\]"),
])
def test_a_damaged_folder_gets_one_clear_error(tmp_path, damage, message):
    _write_folder(tmp_path)
    damage(tmp_path / "train")
    with pytest.raises(PuzzleFolderError, match=message):
        load_puzzle_folder(tmp_path)


def test_group_sampling_draws_one_copy_of_every_base_puzzle_per_epoch():
    groups = torch.tensor([0] * 5 + [1] * 2 + [2] * 7 + [3] * 1 + [4] * 3 + [5] * 4)
    batches = _group_batches(groups, batch_size=3, generator=torch.Generator().manual_seed(0))
    seen = []
    for _ in range(100):  # 6 groups in batches of 3: two batches per epoch
        epoch = torch.cat([next(batches), next(batches)])
        assert sorted(groups[epoch].tolist()) == [0, 1, 2, 3, 4, 5]
        seen.append(epoch)
    # every member of a group is drawn, about equally often
    counts = torch.bincount(torch.cat(seen), minlength=len(groups))
    assert bool((counts > 0).all())
    assert int(counts[7:14].sum()) == 100 and int(counts[7:14].min()) >= 5  # group 2: 7 rows


def test_generated_sudoku_rows_carry_their_base_puzzle_and_a_rating_floor():
    data = sudoku_dataset(4, 3, augmentations_per_puzzle=2, seed=1)
    assert data["group"] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    floor = sorted(sudoku_dataset(4, 6, seed=2)["rating"])[3]
    assert min(sudoku_dataset(4, 3, seed=2, min_rating=floor)["rating"]) >= floor


def test_group_sampling_needs_groups():
    with pytest.raises(ValueError, match="sampling must be one of"):
        AIRTrainConfig(sampling="puzzle")


def test_training_reads_an_authors_folder_one_copy_per_base_puzzle(tmp_path):
    from modeling.air import AIRConfig, AIRSolver
    from modeling.air.training_air import train_air

    _write_folder(tmp_path, groups=8, copies=3)
    data = load_puzzle_folder(tmp_path)
    torch.manual_seed(0)
    model = AIRSolver(AIRConfig(vocab_size=6, seq_len=16, hidden_size=32, num_hidden_layers=1,
                                num_attention_heads=2, halt_max_steps=2))
    drawn = []
    model.register_forward_hook(lambda _m, args, _o: drawn.append(args[0].clone()))
    config = AIRTrainConfig(steps=4, batch_size=4, lr=1e-3, warmup_steps=1, eval_every=0,
                            progress=False, threads=1, cpu=True, sampling="group")
    log = train_air(model, data, None, config)
    assert len(log["history"]) == 1 and log["train_size"] == 24
    rows = {tuple(row) for row in data["inputs"]}
    group_of = {tuple(row): g for row, g in zip(data["inputs"], data["group"], strict=True)}
    first_epoch = [group_of[tuple(row.tolist())] for batch in drawn[:2] for row in batch]
    assert all(tuple(row.tolist()) in rows for batch in drawn for row in batch)
    assert sorted(first_epoch) == list(range(8))  # each base puzzle once in the epoch
    with pytest.raises(ValueError, match="needs a 'group' column"):
        train_air(model, data.remove_columns("group"), None, config)
