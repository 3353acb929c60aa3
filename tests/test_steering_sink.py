"""Bank sets the first token does not read (``BankSet(..., sink_reads_banks=False)``): a steered
pass equals, row by row, the same row with its first token computed plain and the rest steered on
top of that cache (float64, every family, both mixture paths, left padding, contrast sets, per-row
batches, cached decoding); the flag saves, loads and is refused where it is not served."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from hf_memory import BankSet, steer
from hf_memory.banks.bank_set import BankSetFormatError
from hf_memory.models.transformers_compat import cache_kwargs
from hf_memory.steering.sink import sink_queries
from tests.test_steering_lse_path import TOL, bank, padded_batch
from tests.tiny_models import FAMILIES, tiny_model

pytestmark = pytest.mark.compat  # also run on the oldest supported transformers


def banks(sink_reads_banks, contrast=False):
    made = [bank("t", "target", 5, seed=1, gain=1.5, positioned=True),
            bank("r", "reference", 3, seed=2, gain=0.7, positioned=True)]
    return BankSet(made if contrast else made[:1], size_normalize=False, contrast=contrast,
                   sink_reads_banks=sink_reads_banks)


def first_token_plain(model, ids, mask, bank_set, **steering):
    """The real positions of each row (``[rows' real tokens, vocab]``): its first real token run
    plain into a cache, the rest steered on top of it, at the positions the padded batch gives
    them: no query of the steered pass is the sink, so what the sink reads cannot matter."""
    rows = []
    for row in range(ids.shape[0]):
        first = int(mask[row].nonzero()[0])
        real = ids[row:row + 1, first:]
        positions = torch.arange(first, ids.shape[1])[None]
        cache = DynamicCache()
        head = model(real[:, :1], position_ids=positions[:, :1], **cache_kwargs(cache)).logits
        with steer(model, bank_set, **steering):
            tail = model(real[:, 1:], position_ids=positions[:, 1:],
                         **cache_kwargs(cache)).logits
        rows.append(torch.cat([head, tail], dim=1)[0])
    return torch.cat(rows)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("path", ["auto", "reference"])
def test_the_first_token_keeps_the_plain_output_and_the_rest_is_steered_on_it(family, path):
    model = tiny_model(family)
    ids, mask = padded_batch()
    site = dict(layers=[0, 1, 2], layer_gains={0: 0.5, 1: 1.0, 2: 2.0}, mixture_path=path)
    with steer(model, banks(False), **site):
        shielded = model(ids, attention_mask=mask).logits
    expected = first_token_plain(model, ids, mask, banks(True), **site)
    real = mask.bool()
    torch.testing.assert_close(shielded[real], expected, **TOL)
    with steer(model, banks(True), **site):
        read = model(ids, attention_mask=mask).logits
    assert (read[real] - expected).abs().max() > 1e-3  # the sink's reading matters here


@pytest.mark.parametrize("path", ["auto", "reference"])
def test_contrast_sets_head_subsets_and_the_dial_keep_the_first_token_plain(path):
    model = tiny_model("qwen3")
    ids, mask = padded_batch()
    site = dict(units={1: [0, 3], 2: [1, 2, 3]}, strength=0.6, mixture_path=path)
    with steer(model, banks(False, contrast=True), **site):
        shielded = model(ids, attention_mask=mask).logits
    expected = first_token_plain(model, ids, mask, banks(True, contrast=True), **site)
    torch.testing.assert_close(shielded[mask.bool()], expected, **TOL)


def test_a_batch_without_padding_and_a_one_token_prompt_keep_the_first_token_plain():
    model = tiny_model("llama")
    ids = padded_batch()[0][:, :4]
    plain = model(ids).logits
    with steer(model, banks(False), layers=[0, 1, 2]):
        shielded = model(ids).logits
        alone = model(ids[:, :1]).logits  # no mask and one query: the sink alone
    torch.testing.assert_close(shielded[:, 0], plain[:, 0], **TOL)
    torch.testing.assert_close(alone[:, 0], plain[:, 0], **TOL)
    assert (shielded[:, 1:] - plain[:, 1:]).abs().max() > 1e-3


@pytest.mark.parametrize("path", ["auto", "reference"])
def test_shielded_and_reading_rows_in_one_batch_are_each_steered_as_alone(path):
    model = tiny_model("llama")
    ids, mask = padded_batch()
    rows = [banks(False), None, banks(True)]
    with steer(model, rows, mixture_path=path, layers=[0, 1, 2]):
        batch = model(ids, attention_mask=mask).logits
    for row, bank_set in enumerate(rows):
        one, one_mask = ids[row:row + 1], mask[row:row + 1]
        if bank_set is None:
            alone = model(one, attention_mask=one_mask).logits
        else:
            with steer(model, bank_set, mixture_path=path, layers=[0, 1, 2]):
                alone = model(one, attention_mask=one_mask).logits
        torch.testing.assert_close(batch[row:row + 1], alone, **TOL)


def test_cached_generation_reads_the_banks_from_the_second_token_on():
    model = tiny_model("qwen2")
    ids, mask = padded_batch()
    generated = {}
    for path in ("auto", "reference"):
        with steer(model, banks(False), layers=[1, 2], mixture_path=path):
            generated[path] = model.generate(ids, attention_mask=mask, max_new_tokens=4,
                                             do_sample=False, output_scores=True,
                                             return_dict_in_generate=True)
    assert torch.equal(generated["auto"].sequences, generated["reference"].sequences)
    for fast, reference in zip(generated["auto"].scores, generated["reference"].scores,
                               strict=True):
        torch.testing.assert_close(fast, reference, **TOL)
    whole = torch.cat([mask, torch.ones(3, 4, dtype=mask.dtype)], 1)
    with steer(model, banks(False), layers=[1, 2]):  # the positions generate() gives the rows
        full = model(generated["auto"].sequences, attention_mask=whole,
                     position_ids=(whole.cumsum(-1) - 1).clamp(min=0))
    for step, scores in enumerate(generated["auto"].scores):  # decoding = one steered pass
        expected = full.logits[:, ids.shape[1] - 1 + step].to(scores.dtype)  # scores: float32
        torch.testing.assert_close(scores, expected, rtol=1e-6, atol=1e-6)


def test_the_flag_round_trips_and_older_formats_stay_apart(tmp_path):
    for contrast in (False, True):
        shielded = banks(False, contrast=contrast)
        shielded.save_pretrained(tmp_path / f"s{contrast}")
        config = json.loads((tmp_path / f"s{contrast}" / "config.json").read_text())
        assert (config["format_version"], config["sink_reads_banks"]) == (3, False)
        loaded = BankSet.from_pretrained(tmp_path / f"s{contrast}")
        assert loaded.sink_reads_banks is False and loaded.contrast is contrast
    banks(True).save_pretrained(tmp_path / "r")
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["format_version"] == 1 and "sink_reads_banks" not in config
    assert BankSet.from_pretrained(tmp_path / "r").sink_reads_banks is True
    for version, flag in ((1, False), (3, True), (3, "no")):  # edited or corrupt
        config.update(format_version=version, sink_reads_banks=flag)
        (tmp_path / "r" / "config.json").write_text(json.dumps(config))
        with pytest.raises(BankSetFormatError, match="version 3 is a set the first token does"):
            BankSet.from_pretrained(tmp_path / "r")
    with pytest.raises(ValueError, match="sink_reads_banks must be True or False, got 0"):
        BankSet([bank("t", "target", 2, seed=1)], sink_reads_banks=0)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_sink_queries_are_the_rows_first_real_tokens_in_the_chunk(data):
    """Left padding of any length, a chunk of any length after any cached prefix: the sink
    queries are exactly the first real tokens that fall in the chunk."""
    batch = data.draw(st.integers(1, 4))
    length = data.draw(st.integers(1, 12))
    cached = data.draw(st.integers(0, length - 1))
    pads = data.draw(st.lists(st.integers(0, length - 1), min_size=batch, max_size=batch))
    keys = torch.arange(length)
    queries = torch.arange(cached, length)
    visible = ((keys[None, None, :] <= queries[None, :, None])
               & (keys[None, None, :] >= torch.tensor(pads)[:, None, None]))[:, None]
    found = sink_queries(visible, batch, length - cached, length, torch.device("cpu"))
    expected = sorted((b, pad - cached) for b, pad in enumerate(pads) if pad >= cached)
    got = [] if found is None else sorted(zip(found[0].tolist(), found[1].tolist(), strict=True))
    assert got == expected
    if pads == [0] * batch:  # no padding: the model passes no mask at all
        found = sink_queries(None, batch, length - cached, length, torch.device("cpu"))
        got = [] if found is None else sorted(zip(*(t.tolist() for t in found), strict=True))
        assert got == ([(b, 0) for b in range(batch)] if cached == 0 else [])
