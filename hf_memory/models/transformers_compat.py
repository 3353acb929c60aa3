"""The one place that knows the names the installed transformers uses for the KV cache.

transformers 5.24 renamed the cache keyword of every ``forward`` and the cache field of every
``ModelOutput`` from ``past_key_values`` to ``cache`` (the old keyword is still accepted with a
deprecation warning). Code in this package never spells either name: it passes a cache with
:func:`cache_kwargs`, reads it off an output with :func:`output_cache` and off a forward's
keyword arguments with :func:`cache_from_kwargs`. The name is detected from the installed
library's own output class, not from its version number.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from transformers.modeling_outputs import CausalLMOutputWithPast

__all__ = ["CACHE_NAME", "cache_from_kwargs", "cache_kwargs", "output_cache"]

LEGACY_CACHE_NAME = "past_key_values"
CACHE_NAME = ("cache" if "cache" in {f.name for f in fields(CausalLMOutputWithPast)}
              else LEGACY_CACHE_NAME)


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """Keyword arguments that hand ``cache`` to a model's ``forward`` or to ``generate()``."""
    return {CACHE_NAME: cache}


def cache_from_kwargs(kwargs: Mapping[str, Any]) -> Any:
    """The cache a ``forward`` was called with (a pre-hook's kwargs), under either name: callers
    on a renaming release may still pass the deprecated keyword. ``None`` when none was given."""
    cache = kwargs.get(CACHE_NAME)
    return kwargs.get(LEGACY_CACHE_NAME) if cache is None else cache


def output_cache(output: Any) -> Any:
    """The cache a model returned in ``output`` (``None`` when it returned none)."""
    return getattr(output, CACHE_NAME, None)
