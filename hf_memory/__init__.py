"""Memory inception on stock Llama / Qwen models, and memory analysis tools.

Typical use::

    model, tokenizer = load_default_model()
    bank = MemoryBank.from_text(model, tokenizer, "I worry about everything.", role="target")
    with steer(model, BankSet([bank], model=model), layers=[10, 11, 12]):
        model.generate(**inputs)

Names are imported on first access, so ``import hf_memory`` (and ``hf-memory --help``) does not
pay for torch and transformers until they are needed.
"""

from __future__ import annotations

import importlib
import importlib.metadata as _metadata
from typing import Any

try:
    __version__ = _metadata.version("hf-memory")
except _metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

_EXPORTS = {  # the module (by folder: see README.md beside this file) -> the names it exports
    "models.adapters": ["SUPPORTED_MODEL_TYPES", "UnsupportedModelError"],
    "models.default_model": ["DEFAULT_MODEL_ID", "DefaultModelUnavailableError",
                             "ensure_default_model_cached", "load_default_model"],
    "models.embedded": ["EMBEDDED_MODELS", "EmbeddedModelUnavailableError", "load_embedded_model"],
    "models.fingerprint": ["FingerprintMismatchError", "model_fingerprint"],
    "chat.generation": ["chat_messages", "generate_chat", "generate_conversations"],
    "chat.allowed_tokens": ["AllowedTokensProcessor"],
    "banks.bank": ["DEFAULT_TEMPLATES", "MemoryBank"],
    "banks.bank_set": ["BankSet", "BankSetFormatError"],
    "metrics.kv_accounting": ["KVFootprint", "kv_footprint"],
    "metrics.reply_judge": ["JudgeTooWeakError", "ReplyJudge", "judge_methods"],
    "metrics.text_quality": ["distinct_n", "lexicon_rate", "repeated_ngram_fraction", "repetition"],
    "steering.handle": ["RowSteering", "SteeringHandle", "steer", "steered_generate"],
    "steering.controller": ["BankController", "Switch"],
    "steering.conversation": ["Conversation"],
    "baselines.caa": ["CAAVectors", "apply_caa", "export_control_vector", "load_control_vector"],
    "baselines.caa_gguf": ["ControlVectorFormatError"],
    "baselines.caa_lm_eval": ["export_lm_eval_steer"],
    "baselines.methods": ["CAAMethod", "MemoryMethod", "Method", "PlainMethod", "PromptMethod",
                          "generate_with", "generate_with_each"],
    "selection.selector": ["Selector"],
    "recipes.persona": ["PersonaSteering", "calibrate_persona", "persona_banks"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(["__version__", *_WHERE])


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'hf_memory' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
