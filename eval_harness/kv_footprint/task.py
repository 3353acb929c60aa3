"""KV footprint (memory-inception paper, eq. 10 and figure 2): guidance as banks vs as prompt."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hf_memory import BankSet, MemoryBank, PromptMethod, Selector, kv_footprint

from ..bigfive.task import CALIBRATION_PROMPTS, FACTORS, TRAITS

__all__ = ["run_kv_footprint"]

PROBE_PROMPT = "How do you feel about your exam tomorrow?"


def run_kv_footprint(model, tokenizer, *, traits: Sequence[str] = FACTORS, top_layers: int = 5,
                     template: str = "{text}") -> dict[str, Any]:
    """For each trait's descriptor: bytes of its banks at the selected layers vs the bytes the
    same descriptor occupies in the KV cache as a visible system prompt."""
    rows = []
    for trait in traits:
        target, opposite = TRAITS[trait]
        banks = BankSet([
            MemoryBank.from_text(model, tokenizer, target, role="target", name=f"{trait}+",
                                 template=template),
            MemoryBank.from_text(model, tokenizer, opposite, role="reference", name=f"{trait}-",
                                 template=template),
        ], model=model)
        selector = Selector.calibrate(model, tokenizer, banks, list(CALIBRATION_PROMPTS),
                                      top_layers=top_layers, progress=False)
        visible = PromptMethod(target, tokenizer=tokenizer).guidance_kv_bytes(
            model, tokenizer, PROBE_PROMPT)
        descriptor = tokenizer(target, return_tensors="pt", add_special_tokens=False).input_ids
        for label, bank_set in (("target bank", BankSet([banks[f"{trait}+"]], model=model)),
                                ("target + reference banks", banks)):
            fp = kv_footprint(model, bank_set, descriptor, layers=selector.layers)
            rows.append({"trait": trait, "banks": label, "layers": selector.layers,
                         **fp.as_dict(), "system_prompt_kv_bytes": visible,
                         "system_prompt_ratio": visible / fp.bank_bytes})
    return {"rows": rows}
