"""Starter calibration pairs for a user's own persona: the model's replies with and without it.

The target reply of each triple is the model's own greedy reply to an everyday prompt with the
persona's text as a visible system prompt; the reference reply is its reply without it (or with
the reference text). A user edits them, then calibrates on them: memory learns to do what the
visible prompt did, without the prompt's tokens in the context.
"""

from __future__ import annotations

from collections.abc import Sequence

from hf_memory.baselines.methods import PromptMethod, generate_with
from hf_memory.chat.generation import generate_chat
from hf_memory.recipes.calibration_data import everyday_questions
from hf_memory.selection.pairs import RECOMMENDED_PAIRS

__all__ = ["starter_pairs"]


def starter_pairs(model, tokenizer, target_text: str, reference_text: str | None = None, *,
                  prompts: Sequence[str] | None = None, count: int = RECOMMENDED_PAIRS,
                  max_new_tokens: int = 40) -> list[tuple[str, str, str]]:
    """Triples for a user to edit: the model's greedy replies to ``prompts`` (default: the
    calibration data's everyday questions) with ``target_text`` as a visible system prompt, and
    with ``reference_text`` (or plain, without one). Pairs whose replies come out the same are
    dropped (they measure nothing)."""
    prompts = list(prompts if prompts is not None else everyday_questions()[:count])
    if not prompts:
        raise ValueError("starter pairs need at least one prompt")
    target = generate_with(PromptMethod(target_text, tokenizer=tokenizer), model, tokenizer,
                           prompts, max_new_tokens=max_new_tokens)
    reference = (generate_with(PromptMethod(reference_text, tokenizer=tokenizer), model,
                               tokenizer, prompts, max_new_tokens=max_new_tokens)
                 if reference_text else
                 generate_chat(model, tokenizer, prompts, max_new_tokens=max_new_tokens))
    return [(p, t, r) for p, t, r in zip(prompts, target, reference, strict=True)
            if t.strip() and r.strip() and t.strip() != r.strip()]
