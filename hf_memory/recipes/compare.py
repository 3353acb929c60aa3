"""One question answered by each way of carrying a persona: plain, visible prompt, CAA, memory.

What the playground page shows (``hf-memory playground``), usable without it: per method the
reply, the bytes the method adds to what the model holds while answering (the prompt's extra KV
cache, the CAA vectors, the banks at the steered layers), the wall time, and for memory the
routing trace — per generated token, the attention mass the steered heads gave the banks rather
than the conversation (:class:`~hf_memory.steering.controller.BankController`).

CAA here is extracted from the persona against the reference text (default: the shipped neutral
text) in the frames ``"{}"``, ``"Honestly, {}"``, ``"About me: {}"`` at a third of the depth and
added from the assistant's turn on; the frames and the layer are the evaluation's for the
embedded model, a guess for other models.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["METHODS", "MethodReply", "compare_methods", "persona_caa"]

METHODS = ("plain", "prompt", "caa", "memory")
CAA_FRAMES = ("{}", "Honestly, {}", "About me: {}")


@dataclass
class MethodReply:
    """One method's answer: ``routing`` (memory only) holds per generated token its text and the
    attention mass on the banks (mean over steered layers and heads)."""

    method: str
    reply: str
    carried_bytes: int
    seconds: float
    routing: list[dict[str, Any]] = field(default_factory=list)


def persona_caa(model, tokenizer, persona: str, reference: str | None = None, *,
                layer: int | None = None, scale: float = 2.0):
    """CAA vectors of ``persona`` against ``reference`` (module docstring)."""
    from hf_memory.banks.neutral_control import neutral_text
    from hf_memory.baselines.caa import CAAVectors

    other = reference or neutral_text()
    layer = model.config.num_hidden_layers // 3 if layer is None else layer
    return CAAVectors.extract(model, tokenizer, [(f.format(persona), f.format(other))
                                                 for f in CAA_FRAMES], layers=[layer],
                              scale=scale)


def compare_methods(model, tokenizer, question: str, *, persona: str,
                    methods: Sequence[str] = METHODS, banks=None, selector=None,
                    layers: Sequence[int] | None = None, strength: float = 1.0,
                    caa_scale: float = 2.0, reference: str | None = None,
                    max_new_tokens: int = 40) -> dict[str, MethodReply]:
    """Answer ``question`` with each of ``methods`` (greedy).

    Memory steers with ``banks`` (default: a bank built from ``persona``, and ``reference`` as a
    reference bank when given) at a ``selector``'s sites or at hand-picked ``layers`` (one is
    needed), with the strength dial at ``strength``.
    """
    from hf_memory.baselines.methods import CAAMethod, PromptMethod, generate_with
    from hf_memory.chat.generation import generate_chat
    from hf_memory.steering.handle import check_strength

    if not isinstance(question, str) or not question.strip():
        raise ValueError("ask a question: the question is empty")
    if not isinstance(persona, str) or not persona.strip():
        raise ValueError("describe a persona: the persona text is empty")
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"methods must be some of {', '.join(METHODS)}, got {list(methods)}")
    check_strength(strength)
    replies = {}
    for name in methods:
        start = time.perf_counter()
        if name == "memory":
            replies[name] = _memory_reply(model, tokenizer, question, persona, reference,
                                          banks, selector, layers, strength, max_new_tokens)
            replies[name].seconds = time.perf_counter() - start
            continue
        if name == "plain":
            method, carried = None, 0
        elif name == "prompt":
            method = PromptMethod(persona, tokenizer=tokenizer)
            carried = method.guidance_kv_bytes(model, tokenizer, question)
        else:
            vectors = persona_caa(model, tokenizer, persona, reference, scale=caa_scale)
            method = CAAMethod(vectors)
            carried = sum(v.numel() * v.element_size() for v in vectors.vectors.values())
        if method is None:
            reply = generate_chat(model, tokenizer, [question], max_new_tokens=max_new_tokens)[0]
        else:
            reply = generate_with(method, model, tokenizer, [question],
                                  max_new_tokens=max_new_tokens)[0]
        replies[name] = MethodReply(name, reply, carried, time.perf_counter() - start)
    return replies


@torch.no_grad()
def _memory_reply(model, tokenizer, question, persona, reference, banks, selector, layers,
                  strength, max_new_tokens) -> MethodReply:
    from hf_memory.banks.bank_set import BankSet
    from hf_memory.chat.generation import chat_messages, encode_chats
    from hf_memory.recipes.shipped import persona_bank
    from hf_memory.steering.controller import BankController
    from hf_memory.steering.handle import steer

    if (selector is None) == (layers is None):
        raise ValueError("memory needs its sites: load a selector (hf-memory selector "
                         "calibrate) or give hand-picked layers, not both")
    if banks is None:
        made = [persona_bank(model, tokenizer, persona)]
        if reference:
            made.append(persona_bank(model, tokenizer, reference, role="reference",
                                     name="reference"))
        banks = BankSet(made, model=model)
    sites = {"selector": selector} if selector is not None else {"layers": list(layers)}
    steered = selector.layers if selector is not None else list(layers)
    carried = sum(bank.nbytes(steered) for bank in banks)
    batch = encode_chats(tokenizer, [chat_messages(question)])
    device = next(model.parameters()).device
    prompt_length = batch.input_ids.shape[1]
    with steer(model, banks, strength=strength, **sites) as handle:
        controller = BankController(handle, prompt_length=prompt_length)
        output = model.generate(**batch.to(device), max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                stopping_criteria=[controller])
    new = output[0, prompt_length:].tolist()
    routing = [{"token": tokenizer.decode([token]),
                "bank_mass": float(1.0 - entry["mass"][0, 0])}
               for token, entry in zip(new, controller.trace, strict=False)]
    reply = tokenizer.decode(new, skip_special_tokens=True).strip()
    return MethodReply("memory", reply, carried, 0.0, routing)
