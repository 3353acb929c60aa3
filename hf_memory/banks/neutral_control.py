"""Neutral control banks: the same recipe as a persona's banks on personality-free text.

What the cost-budgeted search subtracts, so that only a bank's content, not its presence,
scores (the sentences are the shipped ``data/neutral_texts.json``).
"""

from __future__ import annotations

from hf_memory.banks.bank import MemoryBank
from hf_memory.banks.bank_set import BankSet
from hf_memory.data import load_json

__all__ = ["neutral_control", "neutral_like", "neutral_text"]


def neutral_text() -> str:
    """Two personality-free sentences: the text of the neutral control bank / prompt."""
    return " ".join(load_json("neutral_texts.json")["texts"][:2])


def neutral_like(tokenizer, text: str) -> str:
    """Personality-free sentences of at least as many tokens as ``text`` (the shipped neutral
    texts in turn, repeated as needed)."""
    texts = load_json("neutral_texts.json")["texts"]
    def tokens(piece: str) -> int:
        return len(tokenizer(piece, add_special_tokens=False).input_ids)

    wanted, chosen = tokens(text), [texts[0]]
    while tokens(" ".join(chosen)) < wanted:
        chosen.append(texts[len(chosen) % len(texts)])
    return " ".join(chosen)


def neutral_control(model, tokenizer, banks):
    """The neutral control of ``banks``: each bank rebuilt by its own recipe (templates,
    context, kept tokens, placement, layers, role, gain) on neutral text at least as long as
    its own, in a bank set with the same mixture settings. What the budgeted search subtracts,
    so that only a bank's content, not its presence, scores. Banks not built from text have no
    recipe to follow: give ``control_banks`` yourself (or None)."""
    neutral = []
    for bank in banks:
        made = bank.provenance
        if made.get("source") != "text":
            raise ValueError(f"bank {bank.name!r} was not built from text, so there is no recipe "
                             "to build its neutral control from: pass control_banks= (a neutral "
                             "bank set built like it) or control_banks=None")
        neutral.append(MemoryBank.from_text(
            model, tokenizer, neutral_like(tokenizer, made["text"]), role=bank.role,
            name=f"neutral-{bank.name}", templates=[v["template"] for v in made["variants"]],
            layers=bank.layers, keep=made["keep"], context=made["context"], gain=bank.gain,
            placement=made.get("placement", "free")))
    return BankSet(neutral, model=model, gamma=banks.gamma, size_normalize=banks.size_normalize,
                   contrast=banks.contrast, sink_reads_banks=banks.sink_reads_banks)
