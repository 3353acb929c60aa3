"""Streaming top-k is exact: same values and positions as a full-matrix stable sort."""

from __future__ import annotations

import pytest
import torch

from hf_memory.analysis.streaming_topk import StreamingTopK, topk_reference


def stream(matrix: torch.Tensor, positions: torch.Tensor, k: int, chunk: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    topk = StreamingTopK(matrix.shape[1], k)
    for start in range(0, matrix.shape[0], chunk):
        topk.update(matrix[start: start + chunk], positions[start: start + chunk])
    return topk.result()


def assert_same(got, want):
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize(("rows", "columns", "k", "chunk"), [
    (1, 3, 1, 1), (7, 5, 3, 2), (64, 17, 5, 9), (200, 33, 25, 37), (10, 4, 25, 3),
], ids=lambda v: str(v))
def test_matches_reference_on_random_values(rows, columns, k, chunk):
    matrix = torch.randn(rows, columns)
    positions = torch.arange(rows)
    assert_same(stream(matrix, positions, k, chunk), topk_reference(matrix, positions, k))


@pytest.mark.parametrize("chunk", [1, 4, 13, 100])
def test_ties_go_to_the_smaller_position_whatever_the_chunking(chunk):
    # Few distinct values (including ReLU-like exact zeros, -0.0 and negatives): many ties.
    matrix = torch.tensor([0.0, -0.0, 1.0, -2.5, 3.0])[torch.randint(0, 5, (100, 6))]
    positions = torch.arange(100)
    want = topk_reference(matrix, positions, 10)
    assert_same(stream(matrix, positions, 10, chunk), want)
    for column in range(6):
        for value in want[0][column].unique():
            tied = want[1][column][want[0][column] == value]
            assert torch.equal(tied, tied.sort().values)


def test_rows_may_arrive_in_any_order():
    matrix = torch.randint(-3, 4, (80, 7)).float()
    positions = torch.randperm(80) + 1000
    want = topk_reference(matrix, positions, 6)
    assert_same(stream(matrix, positions, 6, 11), want)


def test_extreme_values_keep_their_order():
    special = torch.tensor([float("-inf"), -3.4e38, -1e-45, 0.0, 1e-45, 3.4e38, float("inf")])
    matrix = special[torch.randperm(7)][:, None].repeat(1, 2)
    positions = torch.arange(7)
    assert_same(stream(matrix, positions, 7, 2), topk_reference(matrix, positions, 7))
    assert torch.equal(stream(matrix, positions, 7, 3)[0][0], special.flip(0))


def test_bad_input_is_a_value_error():
    with pytest.raises(ValueError, match="k must be >= 1"):
        StreamingTopK(3, 0)
    topk = StreamingTopK(3, 2)
    with pytest.raises(ValueError, match=r"chunk must be \[N, 3\]"):
        topk.update(torch.zeros(4, 2), torch.arange(4))
    with pytest.raises(ValueError, match="NaN"):
        topk.update(torch.full((1, 3), float("nan")), torch.arange(1))
