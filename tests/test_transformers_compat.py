"""The one compatibility point for transformers' cache name (``past_key_values`` before 5.24,
``cache`` from 5.24 on): it agrees with the installed library, and nothing else spells the name."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from transformers import LlamaModel

from hf_memory.models.transformers_compat import (
    CACHE_NAME,
    LEGACY_CACHE_NAME,
    cache_from_kwargs,
    cache_kwargs,
    output_cache,
)
from modeling.asm import ASMCache, ASMConfig, ASMForCausalLM, modeling_asm
from tests.tiny_models import tiny_model

pytestmark = pytest.mark.compat  # also run on the oldest supported transformers

ROOT = Path(__file__).resolve().parents[1]
# The places allowed to spell the cache names: hf_memory's compatibility point and the ASM
# family's own (its folder is copied to Hub repos alone and may not import hf_memory).
COMPAT_POINTS = {ROOT / "hf_memory" / "models" / "transformers_compat.py",
                 ROOT / "modeling" / "asm" / "modeling_asm.py"}
SOURCE_DIRS = ("hf_memory", "hf_memory_vllm", "hf_memory_cli", "modeling", "hub_cards",
               "eval_harness", "benchmarks", "experiments", "tests")


def test_the_detected_name_is_the_installed_forward_keyword():
    assert CACHE_NAME in inspect.signature(LlamaModel.forward).parameters
    assert modeling_asm.CACHE_NAME == CACHE_NAME


def test_a_stock_model_decodes_through_the_helpers_exactly():
    model = tiny_model("llama")
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    full = model(ids).logits
    out = model(ids[:, :6], use_cache=True)
    cache = output_cache(out)
    assert cache is not None and cache.get_seq_length() == 6
    for i in range(6, 9):
        step = model(ids[:, i:i + 1], **cache_kwargs(cache), use_cache=True).logits
        torch.testing.assert_close(step[:, 0], full[:, i], rtol=0, atol=1e-12)


def test_cache_from_kwargs_reads_either_name():
    sentinel = object()
    assert cache_from_kwargs({CACHE_NAME: sentinel}) is sentinel
    assert cache_from_kwargs({LEGACY_CACHE_NAME: sentinel}) is sentinel
    assert cache_from_kwargs({"input_ids": None}) is None
    assert output_cache(object()) is None


def test_asm_takes_its_cache_under_either_name_and_refuses_both():
    config = ASMConfig(vocab_size=37, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_slots=4, slot_space_dim=4)
    torch.manual_seed(0)
    model = ASMForCausalLM(config).eval()
    ids = torch.randint(1, 37, (1, 7))
    full = model(ids).logits
    for name in {CACHE_NAME, LEGACY_CACHE_NAME}:
        cache = output_cache(model(ids[:, :5], use_cache=True))
        assert isinstance(cache, ASMCache)
        step = model(ids[:, 5:], **{name: cache}, use_cache=True).logits
        torch.testing.assert_close(step, full[:, 5:], rtol=1e-5, atol=1e-5)
    cache = ASMCache(config)
    with pytest.raises(ValueError, match="not both"):
        model(ids, cache=cache, past_key_values=cache)
    with pytest.raises(ValueError, match="must be an ASMCache"):
        model(ids, **cache_kwargs(object()))


def test_no_other_module_spells_a_cache_name():
    offenders = []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path in COMPAT_POINTS or path == Path(__file__).resolve():
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if "past_key_values" in line:
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "use hf_memory.models.transformers_compat:\n" + "\n".join(offenders)
