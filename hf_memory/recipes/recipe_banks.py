"""A persona's banks by each recipe of :data:`~hf_memory.recipes.persona_recipes.RECIPES` (what
:func:`~hf_memory.recipes.persona.calibrate_persona` and the voice band build)."""

from __future__ import annotations

from collections.abc import Sequence

from hf_memory.banks.bank import MemoryBank
from hf_memory.banks.bank_set import BankSet
from hf_memory.recipes.persona_recipes import RECIPES

__all__ = ["exemplar_text", "persona_banks"]


def exemplar_text(text: str, exemplars: Sequence[str]) -> str:
    """The persona text followed by example replies in its voice."""
    return text.rstrip() + "\n\nHow I reply:\n" + "\n".join(e.strip() for e in exemplars)


def persona_banks(model, tokenizer, text: str, *, recipe: str = "prompt_like",
                  exemplars: Sequence[str] = (), counter_exemplars: Sequence[str] = (),
                  name: str = "persona", sink_reads_banks: bool = False) -> BankSet:
    """The bank set of ``recipe`` (:data:`RECIPES`) for ``text`` (and ``exemplars``, which the
    ``exemplars`` and ``contrast`` recipes need; ``counter_exemplars``, replies without the
    persona, which ``contrast`` needs), as a system message, every layer, bank gain 1.
    ``sink_reads_banks``: whether the conversation's first token reads the banks
    (:class:`~hf_memory.banks.bank_set.BankSet`; False by default: a visible prompt comes after
    it; True: what persona banks did before 2026-12-07, and shipped personas without the key)."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {sorted(RECIPES)}, got {recipe!r}")
    spec = RECIPES[recipe]
    contrast = spec.get("contrast", False)

    def bank(examples: Sequence[str], argument: str, what: str, role: str,
             bank_name: str) -> MemoryBank:
        body = text
        if spec["exemplars"]:
            examples = [e for e in examples if isinstance(e, str) and e.strip()]
            if not examples:
                raise ValueError(f"the {recipe} recipe needs {what} ({argument}=[...])")
            body = exemplar_text(text, examples)
        return MemoryBank.from_text(model, tokenizer, body, role=role, name=bank_name,
                                    template="{text}", context="system",
                                    placement=spec["placement"])

    banks = [bank(exemplars, "exemplars", "example replies", "target", name)]
    if contrast:
        banks.append(bank(counter_exemplars, "counter_exemplars", "replies without the persona",
                          "reference", f"{name}-counter"))
    return BankSet(banks, model=model, size_normalize=spec["size_normalize"], contrast=contrast,
                   sink_reads_banks=sink_reads_banks)
