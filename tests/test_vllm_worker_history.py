"""The vLLM worker's per-pass history bookkeeping, without vLLM: which cache blocks a group of
steered requests reads and which of their positions each query sees.

(The worker inside vLLM, against transformers, is tested in ``tests_vllm``.)
"""

from __future__ import annotations

from unittest import mock

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hf_memory_vllm import worker
from hf_memory_vllm.worker import WIDTH_STEP, _Group

NO_WINDOW = 10**9  # a window wider than any history: the general path, binding nowhere


def group(lengths: list[int], block_size: int, decoding: bool, seed: int) -> _Group:
    blocks = max(-(-n // block_size) for n in lengths) + 2  # vLLM's table: wider than needed
    table = torch.randperm(8 * blocks * len(lengths), generator=torch.Generator().manual_seed(
        seed))[:blocks * len(lengths)].view(len(lengths), blocks)
    rows = list(range(len(lengths))) if decoding else list(range(lengths[0] - 1, lengths[0]))
    return _Group(sites={}, rows=rows, lengths=lengths, table=table, block_size=block_size,
                  decoding=decoding, device=torch.device("cpu"), heads=4, kv_heads=2, head_dim=8,
                  dtype=torch.float64)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 70), min_size=1, max_size=6),
       block_size=st.sampled_from([1, 4, 16, 32, 128]), seed=st.integers(0, 99))
def test_decoding_without_a_window_reads_each_rows_first_blocks_as_the_general_path(
        lengths, block_size, seed):
    """Decoding with no sliding window takes a shortcut (the first blocks of each row, seen up
    to its length); it equals the general path with a window that binds nowhere."""
    decoding = group(lengths, block_size, decoding=True, seed=seed)
    blocks, seen = decoding._visible(None)
    want_blocks, want_seen = decoding._visible(NO_WINDOW)
    assert torch.equal(blocks, want_blocks) and torch.equal(seen, want_seen)
    assert seen.sum(-1).flatten().tolist() == lengths  # every row sees exactly its own keys
    width = seen.shape[-1] // blocks.shape[1]
    if blocks.shape[1] > 1:  # several blocks a row: each read whole
        assert width == block_size
    else:  # one block a row: as far as the furthest row, in steps, within the block
        assert width == min(block_size, -(-max(lengths) // WIDTH_STEP) * WIDTH_STEP)


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 128), window=st.sampled_from([None, 8, 40]),
       block_size=st.sampled_from([32, 128]), decoding=st.booleans())
def test_a_block_read_in_part_sees_what_the_whole_block_would(length, window, block_size,
                                                              decoding):
    """Where each row reads one block, only its first positions are read; the bias over them is
    the whole block's bias cut there, and the whole block sees nothing past them."""
    blocks, width, bias = group([length], block_size, decoding, seed=3).history(window, True)
    assume(len(blocks) == 1)
    with mock.patch.object(worker, "WIDTH_STEP", 10**9):  # every block read whole
        whole_blocks, whole_width, whole = group([length], block_size, decoding,
                                                 seed=3).history(window, True)
    assert torch.equal(blocks, whole_blocks) and whole_width == block_size
    start = 0 if window is None else max(length - window, 0) // block_size * block_size
    assert width == min(block_size, -(-(length - start) // WIDTH_STEP) * WIDTH_STEP)
    torch.testing.assert_close(bias, whole[..., :width], rtol=0, atol=0)
    assert torch.isinf(whole[..., width:]).all()  # nothing seen past the positions read


@given(length=st.integers(2, 70), window=st.integers(1, 80), block_size=st.sampled_from([1, 4]))
def test_a_window_hides_what_lies_behind_it(length, window, block_size):
    """With a sliding window the one decoding query sees its last ``window`` keys only."""
    blocks, seen = group([length], block_size, decoding=True, seed=0)._visible(window)
    first_block = max(length - window, 0) // block_size
    positions = first_block * block_size + torch.arange(seen.shape[-1])
    want = (positions < length) & (positions >= length - window)
    assert torch.equal(seen.flatten(), want)


def test_history_flattens_the_blocks_row_after_row_and_makes_the_bias_once():
    """``history`` hands out the blocks as one flat index (row after row) and caches them with
    the bias per window and normalisation."""
    decoding = group([5, 9], 4, decoding=True, seed=1)
    blocks, width, bias = decoding.history(None, size_normalize=True)
    assert torch.equal(blocks, decoding.table[:, :3].flatten())
    assert bias.shape == (2 * 2, 2, 12)  # [KVH·n, G, S]
    assert torch.isinf(bias[0, 0, 5:]).all() and torch.isfinite(bias[0, 0, :5]).all()
    torch.testing.assert_close(bias[1, 0, :9], torch.full((9,), -torch.log(torch.tensor(9.0))
                                                          .item(), dtype=torch.float64))
    assert decoding.history(None, size_normalize=True)[0] is blocks
