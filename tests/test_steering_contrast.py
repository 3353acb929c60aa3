"""Contrast bank sets (``BankSet(..., contrast=True)``): at a steered layer the output is
o_h + s·(o_{h,target} − o_{h,reference}), each mixture one softmax over [history; one bank].
Checked at the steered layer's attention output against the same model steered by each bank
alone (float64, 1e-10), on both mixture paths and in cached decoding; and what a contrast set
refuses."""

from __future__ import annotations

import json

import pytest
import torch

from hf_memory import BankSet, MemoryBank, steer
from hf_memory.banks.bank_set import BankSetFormatError
from tests.test_steering_lse_path import SDPA_FAMILIES, TOL, bank, padded_batch
from tests.tiny_models import tiny_model

pytestmark = pytest.mark.compat  # also run on the oldest supported transformers


def pair(positioned=False):
    return (bank("t", "target", 5, seed=1, gain=1.5, positioned=positioned),
            bank("r", "reference", 3, seed=2, gain=0.7, positioned=positioned))


def as_target(b: MemoryBank) -> MemoryBank:
    return MemoryBank.from_tensors(b.keys, b.values, name=b.name, role="target",
                                   layers=b.layers, gain=b.gain, positions=b.positions)


def attention_output(model, layer, call):
    """The input of ``layer``'s output projection during ``call()``: the attention output."""
    seen = []
    o_proj = model.model.layers[layer].self_attn.o_proj
    hook = o_proj.register_forward_pre_hook(lambda _, args: seen.append(args[0].clone()))
    try:
        call()
    finally:
        hook.remove()
    return torch.cat(seen, dim=1)


@pytest.mark.parametrize("family", SDPA_FAMILIES)
@pytest.mark.parametrize("path", ["auto", "reference"])
@pytest.mark.parametrize("size_normalize", [False, True])
def test_contrast_is_the_difference_of_each_banks_mixture(family, path, size_normalize):
    model = tiny_model(family)
    ids, mask = padded_batch()
    target, reference = pair(positioned=True)
    layer, strength, site = 1, 0.6, dict(layers=[1], layer_gains={1: 0.8})

    def out(banks, s=1.0):
        with steer(model, banks, mixture_path=path, strength=s, **site):
            return attention_output(model, layer, lambda: model(ids, attention_mask=mask))

    plain = attention_output(model, layer, lambda: model(ids, attention_mask=mask))
    alone = [out(BankSet([as_target(b)], size_normalize=size_normalize))
             for b in (target, reference)]
    contrast = out(BankSet([target, reference], size_normalize=size_normalize, contrast=True),
                   strength)
    torch.testing.assert_close(contrast, plain + strength * (alone[0] - alone[1]), **TOL)
    assert (contrast - plain).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_contrast_paths_agree_in_cached_generation_and_on_head_subsets(family, lse_calls):
    model = tiny_model(family)
    ids, mask = padded_batch()
    banks = BankSet(list(pair()), size_normalize=False, contrast=True)
    out = {}
    for path in ("auto", "reference"):
        with steer(model, banks, mixture_path=path, units={1: [0, 3], 2: [1, 2, 3]},
                   strength=0.7):
            out[path] = model.generate(ids, attention_mask=mask, max_new_tokens=5,
                                       do_sample=False, output_scores=True,
                                       return_dict_in_generate=True)
    assert lse_calls, "the fast path did not run"
    assert torch.equal(out["auto"].sequences, out["reference"].sequences)
    for fast, reference in zip(out["auto"].scores, out["reference"].scores, strict=True):
        torch.testing.assert_close(fast, reference, **TOL)


def test_contrast_sets_round_trip_and_older_formats_stay_apart(tmp_path):
    banks = BankSet(list(pair()), gamma=1.3, size_normalize=False, contrast=True)
    banks.save_pretrained(tmp_path / "c")
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    assert (config["format_version"], config["contrast"]) == (2, True)
    loaded = BankSet.from_pretrained(tmp_path / "c")
    assert loaded.contrast and not loaded.size_normalize
    plain_set = BankSet(list(pair()))
    plain_set.save_pretrained(tmp_path / "p")
    assert json.loads((tmp_path / "p" / "config.json").read_text())["format_version"] == 1
    assert not BankSet.from_pretrained(tmp_path / "p").contrast
    config["contrast"] = False  # version 2 that is not a contrast set: edited or corrupt
    (tmp_path / "c" / "config.json").write_text(json.dumps(config))
    with pytest.raises(BankSetFormatError, match="version 2 is a contrast set"):
        BankSet.from_pretrained(tmp_path / "c")


def test_contrast_sets_need_one_target_and_one_reference_over_the_same_layers():
    target, reference = pair()
    with pytest.raises(ValueError, match="one target and one reference bank"):
        BankSet([target], contrast=True)
    with pytest.raises(ValueError, match="one target and one reference bank"):
        BankSet([target, reference, bank("a", "auxiliary", 2, seed=3)], contrast=True)
    short = MemoryBank.from_tensors(reference.keys[:2], reference.values[:2], name="r",
                                    role="reference", layers=(0, 1))
    with pytest.raises(ValueError, match="cover the same layers"):
        BankSet([target, short], contrast=True)


@pytest.mark.parametrize("path", ["auto", "reference"])
def test_a_contrast_row_in_a_shared_batch_is_steered_as_alone(path):
    model = tiny_model("llama")
    ids, mask = padded_batch()
    contrast = BankSet(list(pair()), size_normalize=False, contrast=True)
    rows = [contrast, None, BankSet([bank("t2", "target", 6, seed=7)])]
    with steer(model, rows, mixture_path=path, layers=[1, 2]):
        batch = model(ids, attention_mask=mask).logits
    for row, banks in enumerate(rows):
        if banks is None:
            alone = model(ids[row:row + 1], attention_mask=mask[row:row + 1]).logits
        else:
            with steer(model, banks, mixture_path=path, layers=[1, 2]):
                alone = model(ids[row:row + 1], attention_mask=mask[row:row + 1]).logits
        torch.testing.assert_close(batch[row:row + 1], alone, **TOL)
