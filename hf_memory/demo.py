"""The main job (``hf-memory demo``): plain vs visible prompt vs memory-steered answers.

Builds a persona bank from a short descriptor on the embedded model, answers a few prompts three
ways, and prints them side by side with the KV bytes each way of carrying the descriptor costs.
Torch-dependent modules are imported inside :func:`run_demo`, so the CLI's ``--help`` stays fast.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .kv_accounting import KVFootprint

__all__ = ["DEFAULT_LAYERS", "DEFAULT_PERSONA", "DEFAULT_PROMPTS", "DEFAULT_REFERENCE",
           "DemoResult", "format_demo", "parse_layers", "run_demo"]

DEFAULT_PERSONA = ("I am extremely anxious. I worry constantly, feel nervous and tense, and always "
                   "fear that something will go wrong.")
DEFAULT_REFERENCE = ("I am completely calm. I feel relaxed, secure and at ease, and I never worry "
                     "about anything.")
DEFAULT_PROMPTS = (
    "How do you feel about your exam tomorrow?",
    "What are your plans for the weekend?",
)
DEFAULT_LAYERS = "18-22"  # five layers: 30/5 = 6x less KV than the visible descriptor
DEFAULT_GAIN = 2.0


def parse_layers(spec: str) -> list[int]:
    """``"18-22"`` → [18, …, 22]; ``"3,5,9-10"`` → [3, 5, 9, 10]."""
    layers: set[int] = set()
    try:
        for part in spec.split(","):
            low, _, high = part.strip().partition("-")
            layers.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise ValueError(f"layers must look like '18-22' or '3,5,9-10', got {spec!r}") from None
    if not layers:
        raise ValueError(f"no layers in {spec!r}")
    return sorted(layers)


@dataclass
class DemoResult:
    """Answers per method and the KV accounting of the descriptor."""

    prompts: list[str]
    answers: dict[str, list[str]]
    footprint: KVFootprint
    seconds: dict[str, float]


def run_demo(
    model,
    tokenizer,
    *,
    persona: str = DEFAULT_PERSONA,
    reference: str | None = None,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    layers: Sequence[int] = tuple(parse_layers(DEFAULT_LAYERS)),
    gain: float = DEFAULT_GAIN,
    max_new_tokens: int = 40,
) -> DemoResult:
    """Answer ``prompts`` plain, with ``persona`` as a system prompt, and memory-steered."""
    from .bank_set import BankSet
    from .banks import MemoryBank
    from .chat import generate_chat
    from .kv_accounting import kv_footprint
    from .steering import steer

    prompts = list(prompts)
    banks = [MemoryBank.from_text(model, tokenizer, persona, role="target", name="persona",
                                  template="{text}", layers=layers, gain=gain)]
    if reference:
        banks.append(MemoryBank.from_text(model, tokenizer, reference, role="reference",
                                          name="reference", template="{text}", layers=layers,
                                          gain=gain))
    bank_set = BankSet(banks, model=model)
    answers, seconds = {}, {}
    for method in ("plain", "prompt", "memory"):
        start = time.perf_counter()
        if method == "memory":
            with steer(model, bank_set):
                answers[method] = generate_chat(model, tokenizer, prompts,
                                                max_new_tokens=max_new_tokens)
        else:
            answers[method] = generate_chat(model, tokenizer, prompts,
                                            max_new_tokens=max_new_tokens,
                                            system=persona if method == "prompt" else None)
        seconds[method] = time.perf_counter() - start
    descriptor_ids = tokenizer(persona, return_tensors="pt", add_special_tokens=False).input_ids
    footprint = kv_footprint(model, bank_set, descriptor_ids)
    return DemoResult(prompts, answers, footprint, seconds)


def format_demo(result: DemoResult) -> str:
    """Side-by-side text report of a :class:`DemoResult`."""
    fp = result.footprint
    labels = {
        "plain": "plain",
        "prompt": f"prompt (+{fp.prompt_kv_bytes / 1024:.0f} KiB KV over {fp.num_layers} layers)",
        "memory": f"memory (+{fp.bank_bytes / 1024:.0f} KiB bank at {fp.controlled_layers} layers)",
    }
    lines = []
    for i, prompt in enumerate(result.prompts):
        lines.append(f"\nUser: {prompt}")
        for method, label in labels.items():
            lines.append(f"  [{label}] {result.answers[method][i]}")
    lines.append(
        f"\nKV for the descriptor: visible prompt {fp.prompt_tokens} tokens x {fp.num_layers} "
        f"layers = {fp.prompt_kv_bytes:,} bytes; bank {fp.bank_slots} slots x "
        f"{fp.controlled_layers} layers = {fp.bank_bytes:,} bytes; ratio {fp.actual_ratio:.1f}x "
        f"(idealised L*T/(L_ctrl*S) = {fp.idealised_ratio:.1f}x)")
    lines.append("time: " + ", ".join(f"{k} {v:.1f}s" for k, v in result.seconds.items()))
    return "\n".join(lines)

