"""A saved model folder is self-contained: its code imports only the folder, the standard
library and what a Hub user has installed (torch, transformers, safetensors, optionally triton)."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
import torch

from modeling.air import AIRConfig, AIRSolver
from modeling.arith import ArithConfig, ArithTransformer
from modeling.asm import ASMConfig, ASMForCausalLM

pytestmark = pytest.mark.compat  # also run on the oldest supported transformers

ALLOWED = {"torch", "transformers", "safetensors", "triton"}


def _models():
    torch.manual_seed(0)
    yield "asm", ASMForCausalLM(ASMConfig(vocab_size=32, hidden_size=24, num_hidden_layers=1,
                                          num_attention_heads=3, num_slots=4,
                                          slot_space_dim=6))
    yield "air", AIRSolver(AIRConfig(vocab_size=6, seq_len=16, hidden_size=16,
                                     num_hidden_layers=1, num_attention_heads=2))
    yield "arith", ArithTransformer(ArithConfig(hidden_size=16, head_dim=8,
                                                intermediate_size=16))


def _imports(path: Path) -> list[tuple[int, str]]:
    """(relative level, module) for every import statement in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(0, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module or ""))
    return found


@pytest.mark.parametrize("family, model", list(_models()), ids=lambda v: v if isinstance(v, str)
                         else "")
def test_saved_code_reaches_nothing_outside_the_folder(family, model, tmp_path):
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    code = sorted(tmp_path.glob("*.py"))
    assert config["auto_map"] and code, family
    mapped = {ref.split(".")[0] for ref in config["auto_map"].values()}
    assert mapped <= {p.stem for p in code}
    assert (tmp_path / "model.safetensors").is_file()
    for path in code:
        for level, module in _imports(path):
            top = module.split(".")[0]
            if level:
                assert level == 1 and (tmp_path / f"{top}.py").is_file(), (path.name, module)
            else:
                assert top in ALLOWED or top in sys.stdlib_module_names or top == "__future__", (
                    f"{path.name} imports {module}, which a Hub user may not have")
