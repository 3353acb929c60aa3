"""The rules a ``guidance`` run scores: the three shipped ones (``guidance_rules.json``) or a
user's rule file in the same form, checked so that a bad file gets one clear error naming the
rule and the field::

    {"rules": {"<name>": {"text": "<the rule as an instruction>",
                          "items": [{"question": ..., "compliant": ..., "violating": ...}, ...]}}}

``compliant`` is a reply to ``question`` that follows the rule and ``violating`` one that breaks
it (best with the same content). The first items calibrate the memory, the rest are held out; the
judge of a file's rules in generation is fitted on all of them.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

from ..user_files import read_user_json

__all__ = ["ITEM_FIELDS", "MIN_ITEMS", "check_rules", "load_rule_file", "shipped_rules"]

SHIPPED_PATH = Path(__file__).parent / "guidance_rules.json"
ITEM_FIELDS = ("question", "compliant", "violating")
MIN_ITEMS = 4  # one to calibrate and three held out at the least; a reply judge needs 4 pairs
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")  # it names selector folders and report rows


def check_rules(data: Any, source: str) -> dict[str, dict[str, Any]]:
    """``data``'s rules (``{name: {"text", "items"}}``), or one ``ValueError`` that names
    ``source``, the rule and what is wrong with it."""
    rules = data.get("rules") if isinstance(data, dict) else None
    if not isinstance(rules, dict) or not rules:
        raise ValueError(f"{source} must hold {{\"rules\": {{name: {{\"text\": ..., \"items\": "
                         "[...]}}}}}} with at least one rule")
    for name, rule in rules.items():
        if not _NAME.fullmatch(name):
            raise ValueError(f"{source}: rule name {name!r} must be letters, digits, '_' or '-'")
        if not isinstance(rule, dict):
            raise ValueError(f"{source}: rule {name!r} must be a mapping with text and items")
        if not isinstance(rule.get("text"), str) or not rule["text"].strip():
            raise ValueError(f"{source}: rule {name!r} has no text (the rule as an "
                             "instruction: the bank's text and the visible prompt)")
        items = rule.get("items")
        if not isinstance(items, list) or not items:
            raise ValueError(f"{source}: rule {name!r} has no examples: give \"items\", a list "
                             f"of at least {MIN_ITEMS} {{{', '.join(ITEM_FIELDS)}}} (a reply "
                             "that follows the rule and one that breaks it)")
        for number, item in enumerate(items, 1):
            if not isinstance(item, dict):
                raise ValueError(f"{source}: rule {name!r}, example {number} must be a mapping "
                                 f"with {', '.join(ITEM_FIELDS)}")
            for field in ITEM_FIELDS:
                if not isinstance(item.get(field), str) or not item[field].strip():
                    raise ValueError(f"{source}: rule {name!r}, example {number} has no "
                                     f"{field} (non-empty text)")
        if len(items) < MIN_ITEMS:
            raise ValueError(f"{source}: rule {name!r} has {len(items)} examples; give at least "
                             f"{MIN_ITEMS} (some calibrate the memory, the rest are held out)")
    return rules


@cache
def shipped_rules() -> dict[str, dict[str, Any]]:
    """The three answer-format rules written for the project."""
    return check_rules(json.loads(SHIPPED_PATH.read_text()), SHIPPED_PATH.name)


def load_rule_file(path: str | Path) -> dict[str, dict[str, Any]]:
    """A user's rules (``--rule-file``), checked by :func:`check_rules`."""
    data = read_user_json(path, "the rule file")
    return check_rules(data, str(path))
