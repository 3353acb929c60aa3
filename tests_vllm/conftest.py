"""The embedded model with two bank sets, their shipped selectors and a registry, for every test.

These tests need vLLM, which pins its own transformers: they run in ``.venv-vllm`` (``make
test-vllm``), never in the main environment.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_memory import BankSet
from hf_memory_vllm import write_registry


@pytest.fixture(scope="session")
def embedded(tmp_path_factory):
    from hf_memory import load_default_model
    from hf_memory.models.default_model import ensure_default_model_cached
    from hf_memory.recipes.shipped import persona_bank, shipped_selector

    root = tmp_path_factory.mktemp("embedded")
    model, tokenizer = load_default_model(dtype=torch.float32)
    artifacts = {}
    for name, direction, text in (
            ("anxious", "N+", "I am anxious and I worry about everything."),
            ("calm", "N-", "I am calm and relaxed, and nothing worries me.")):
        BankSet([persona_bank(model, tokenizer, text)], model=model).save_pretrained(root / name)
        shipped_selector(direction, model=model).save_pretrained(root / f"{name}-selector")
        artifacts[name] = (root / name, root / f"{name}-selector")
    registry = write_registry(root / "registry.json", model, artifacts)
    return model, tokenizer, Path(ensure_default_model_cached()), registry, root
