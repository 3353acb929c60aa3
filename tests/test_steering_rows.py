"""Per-row banks in one batch: each row exactly as alone under its own bank set, plain rows
bit-identical to the plain model, left padding and different prompt lengths."""

from __future__ import annotations

import pytest
import torch

from hf_memory import BankSet, MemoryBank, steer, steered_generate
from tests.test_memory_inception import TOL, D, assert_restored, random_bank
from tests.tiny_models import tiny_model

pytestmark = pytest.mark.compat  # also run on the oldest supported transformers

LENGTHS = (5, 8, 6, 3, 7)
NEW_TOKENS = 8


def left_padded(lengths=LENGTHS, seed=2):
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 97, (n,), generator=generator) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):], mask[i, width - len(prompt):] = prompt, 1
    return prompts, ids, mask


def row_sets():
    one = BankSet([random_bank("a", "target", 4, seed=1, gain=2.0)])
    two = [random_bank("b", "target", 6, seed=2), random_bank("c", "reference", 3, seed=3)]
    late = [random_bank("d", "target", 5, seed=4, layers=(1, 2), gain=3.0)]
    return [one, None, two, one, late]


def assert_rows_as_uniform(model, rows, steered_by):
    """Steer the left-padded batch per row with ``rows``: plain rows must equal the plain model
    bit for bit, and row i the batch steered as a whole by ``steered_by(rows[i])`` (a context
    manager). Returns the per-row logits, the plain ones and, per steered row, the uniform ones."""
    _, ids, mask = left_padded()
    plain = model(ids, attention_mask=mask).logits
    with steer(model, rows):
        mixed = model(ids, attention_mask=mask).logits
    uniform = {}
    for i, row in enumerate(rows):
        if row is None:
            assert torch.equal(mixed[i], plain[i])
            continue
        with steered_by(row):
            uniform[i] = model(ids, attention_mask=mask).logits[i]
        torch.testing.assert_close(mixed[i], uniform[i], **TOL)
    return mixed, plain, uniform


# not gemma2: in a float64 model its stock eager attention casts the padding mask's float64
# minimum to float32 (-inf), so the plain model itself returns NaN on left-padded rows
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "mistral", "granite", "olmo2",
                                    "phi3", "gemma3_text"])
def test_each_row_equals_its_banks_over_the_batch_and_plain_rows_are_bit_identical(family):
    model = tiny_model(family)
    rows = row_sets()
    _, plain, uniform = assert_rows_as_uniform(model, rows, lambda banks: steer(model, banks))
    for i, logits in uniform.items():
        assert not torch.equal(logits, plain[i])
    assert_restored(model)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_generated_rows_equal_each_row_generated_alone(family):
    model = tiny_model(family)
    prompts, ids, mask = left_padded()
    rows = row_sets()
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    with steer(model, rows):
        batched = model.generate(ids, attention_mask=mask, **kwargs)
    via_custom = model.generate(ids, attention_mask=mask, custom_generate=steered_generate,
                                banks=rows, **kwargs)
    assert torch.equal(via_custom, batched)
    for i, (prompt, banks) in enumerate(zip(prompts, rows, strict=True)):
        if banks is None:
            alone = model.generate(prompt[None], **kwargs)
        else:
            with steer(model, banks):
                alone = model.generate(prompt[None], **kwargs)
        assert torch.equal(batched[i, -NEW_TOKENS:], alone[0, -NEW_TOKENS:]), f"row {i}"
    assert_restored(model)


def test_all_plain_rows_are_the_plain_model():
    model = tiny_model("llama")
    _, ids, mask = left_padded()
    plain = model(ids, attention_mask=mask).logits
    with steer(model, [None] * len(LENGTHS)):
        assert torch.equal(model(ids, attention_mask=mask).logits, plain)
    assert_restored(model)


def test_bad_per_row_input_is_one_clear_error_and_nothing_is_left_behind():
    model = tiny_model("llama")
    _, ids, mask = left_padded()
    rows = row_sets()
    with pytest.raises(ValueError, match="5 bank sets \\(or None\\) for a batch of 4 rows"), \
            steer(model, rows):
        model(ids[:4], attention_mask=mask[:4])
    with pytest.raises(ValueError, match="5 bank sets \\(or None\\) for a batch of 10 rows"), \
            steer(model, rows):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=True,
                       pad_token_id=0, num_return_sequences=2)
    foreign = MemoryBank.from_tensors(torch.zeros(1, 3, 2, D), torch.zeros(1, 3, 2, D),
                                      name="t", layers=(0,))
    with pytest.raises(ValueError, match="banks of batch row 2: .*3 KV heads"):
        steer(model, [rows[0], None, [foreign]])
    with pytest.raises(ValueError, match="not a mixture"):
        steer(model, [random_bank("a", "target", 2), None])
    with pytest.raises(ValueError, match="per-row banks record no routing"):
        steer(model, rows, trace_only=True)
    assert_restored(model)


def test_rows_given_as_handles_keep_their_own_sites_and_gains():
    model = tiny_model("llama")
    _, ids, mask = left_padded()
    bank = [random_bank("a", "target", 4, seed=1)]
    first = steer(model, bank, layers=[0], layer_gains={0: 2.0}, active=False)
    last = steer(model, bank, layers=[2], active=False)
    rows = [first, None, last, first, last]
    mixed, plain, _ = assert_rows_as_uniform(model, rows, lambda handle: handle.applied())
    assert not torch.equal(mixed[0], plain[0]) and not torch.equal(mixed[2], plain[2])
    with steer(model, rows):  # the caller's handles outlive the batch steering
        last.remove()
        with pytest.raises(RuntimeError, match="removed while its batch is steered"):
            model(ids, attention_mask=mask)
    with pytest.raises(ValueError, match="batch row 2: its steering handle is removed"):
        steer(model, rows)
    first.remove()
    assert_restored(model)
