"""A user's styles for ``dialogue-shift`` (``--styles``), in the shipped case bank's form, checked
so that a bad file gets one clear error naming the style, the pair or the item::

    {"styles": {"<name>": {"descriptor": "<first-person descriptor: bank text, system prompt,
                                          CAA contrast>"}, ...},
     "pairs": [{"pair": ["<a>", "<b>"],
                "calibration": [{"question": ..., "<a>": <reply in a>, "<b>": <reply in b>},
                                ...]}, ...]}

A transition ``a_to_b`` is calibrated on the items of the pair holding ``a`` and ``b`` (the
question with a reply in each style, the same content); every other pair gives drift items. The
cases to run come with ``--cases`` and name these styles.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..user_files import read_user_json

__all__ = ["MIN_CALIBRATION", "check_styles", "load_styles"]

MIN_CALIBRATION = 4  # a reply judge is fitted on at least 4 pairs (the generation form)
_NAME = re.compile(r"[a-z][a-z0-9]*")  # transitions are named <old>_to_<new>


def check_styles(data: Any, source: str) -> dict[str, Any]:
    """``data`` (``{"styles", "pairs"}``) as given, or one ``ValueError`` naming ``source`` and
    what is wrong."""
    if not isinstance(data, dict) or not isinstance(data.get("styles"), dict) \
            or not data["styles"]:
        raise ValueError(f"{source} must hold {{\"styles\": {{name: {{\"descriptor\": ...}}}}, "
                         "\"pairs\": [...]}} with at least two styles")
    styles = data["styles"]
    for name, style in styles.items():
        if not _NAME.fullmatch(name):
            raise ValueError(f"{source}: style name {name!r} must be lower-case letters and "
                             "digits (transitions are named <old>_to_<new>)")
        if not isinstance(style, dict) or not isinstance(style.get("descriptor"), str) \
                or not style["descriptor"].strip():
            raise ValueError(f"{source}: style {name!r} has no descriptor (the first-person "
                             "text of its bank, system prompt and CAA contrast)")
    pairs = data.get("pairs")
    if not isinstance(pairs, list) or not pairs:
        raise ValueError(f"{source} has no pairs: give \"pairs\", a list of {{\"pair\": [a, b], "
                         "\"calibration\": [{question, a: reply, b: reply}, ...]}")
    seen: set[frozenset] = set()
    for number, pair in enumerate(pairs, 1):
        names = pair.get("pair") if isinstance(pair, dict) else None
        if not isinstance(names, list) or len(names) != 2 or names[0] == names[1] \
                or any(n not in styles for n in names):
            raise ValueError(f"{source}: pair {number} must name two different styles of "
                             f"{sorted(styles)} as \"pair\", got {names!r}")
        if frozenset(names) in seen:
            raise ValueError(f"{source}: the styles {names} are paired twice")
        seen.add(frozenset(names))
        items = pair.get("calibration")
        label = "/".join(names)
        if not isinstance(items, list) or len(items) < MIN_CALIBRATION:
            raise ValueError(f"{source}: pair {label} needs \"calibration\", at least "
                             f"{MIN_CALIBRATION} items with question, {names[0]} and "
                             f"{names[1]} (the same reply in each style)")
        for index, item in enumerate(items, 1):
            for field in ("question", *names):
                if not isinstance(item, dict) or not isinstance(item.get(field), str) \
                        or not item[field].strip():
                    raise ValueError(f"{source}: pair {label}, calibration item {index} has no "
                                     f"{field} (non-empty text)")
    return data


def load_styles(path: str | Path) -> dict[str, Any]:
    """A user's styles file (``--styles``), checked by :func:`check_styles`."""
    data = read_user_json(path, "the styles")
    return check_styles(data, str(path))
