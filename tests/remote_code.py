"""Shared check: a saved model loads with ``trust_remote_code`` offline in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from safetensors.torch import save_file


def assert_remote_code_load_is_exact(model, ids: torch.Tensor, tmp_path: Path,
                                     auto_class: str = "AutoModel") -> str:
    """Save ``model``, load it with ``auto_class`` + ``trust_remote_code`` in a subprocess with
    ``HF_HUB_OFFLINE=1``, and require bit-identical logits on ``ids``. Returns the class name."""
    model.save_pretrained(tmp_path / "ckpt")
    with torch.no_grad():
        logits = model(ids).logits
    save_file({"ids": ids.contiguous(), "logits": logits.contiguous()}, tmp_path / "expected.st")
    script = textwrap.dedent(f"""
        import torch
        torch.set_num_threads({torch.get_num_threads()})
        from safetensors.torch import load_file
        from transformers import {auto_class}
        model = {auto_class}.from_pretrained({str(tmp_path / "ckpt")!r}, trust_remote_code=True)
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        expected = load_file({str(tmp_path / "expected.st")!r})
        with torch.no_grad():
            assert torch.equal(model.eval()(expected["ids"]).logits, expected["logits"])
        print("OK", type(model).__name__)
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout.split("OK", 1)[1].strip()
