"""Calibration pairs as a user's file: JSON lines of ``{"prompt", "target", "reference"}``.

A behavioural selector (:meth:`~hf_memory.selection.selector.Selector.calibrate_behavioural`) is
calibrated on triples (prompt, a reply in the wanted style, a reply without it). Users write
them as JSON lines, or start from
:func:`~hf_memory.recipes.starter_pairs.starter_pairs`: the model's own replies to everyday
prompts with the target bank's text as a visible system prompt (the target reply) and without
it, or with the reference bank's text (the reference reply). Memory then learns to do what the
visible prompt did, without the prompt's tokens in the context.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from hf_memory.artifacts.atomic_files import write_text

__all__ = ["MIN_PAIRS", "PAIR_FIELDS", "PairsFileError", "RECOMMENDED_PAIRS", "read_pairs",
           "write_pairs"]

PAIR_FIELDS = ("prompt", "target", "reference")
# The search ranks sites by a lower confidence bound (mean shift − its standard error over the
# pairs); with fewer than 8 pairs that error is itself too noisy to rank by, and the shipped
# selectors showed that even 24 pairs can fail to generalise for some directions.
MIN_PAIRS = 8
RECOMMENDED_PAIRS = 24


class PairsFileError(ValueError):
    """A pairs file that cannot be used, with the line at fault."""


def read_pairs(path: str | os.PathLike) -> list[tuple[str, str, str]]:
    """The ``(prompt, target reply, reference reply)`` triples of a JSON-lines file.

    Blank lines are skipped; any other line must be a JSON object with exactly non-empty string
    fields ``prompt``, ``target`` and ``reference`` (``PairsFileError`` names the first bad line).
    Fewer than :data:`MIN_PAIRS` pairs is an error that says why.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise PairsFileError(f"{path} is not UTF-8 text") from None
    pairs = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise PairsFileError(f"{path}, line {number}: not JSON ({error.msg})") from None
        except RecursionError:
            raise PairsFileError(f"{path}, line {number}: not JSON (nested too deep)") from None
        if not isinstance(item, dict) or set(item) != set(PAIR_FIELDS):
            raise PairsFileError(f"{path}, line {number}: expected an object with exactly the "
                                 f"fields {', '.join(PAIR_FIELDS)}")
        empty = [k for k in PAIR_FIELDS if not isinstance(item[k], str) or not item[k].strip()]
        if empty:
            raise PairsFileError(f"{path}, line {number}: {', '.join(empty)} must be non-empty "
                                 "text")
        if item["target"].strip() == item["reference"].strip():
            raise PairsFileError(f"{path}, line {number}: the target and reference replies are "
                                 "the same, so the pair measures nothing")
        pairs.append(tuple(item[k] for k in PAIR_FIELDS))
    if len(pairs) < MIN_PAIRS:
        raise PairsFileError(
            f"{path} holds {len(pairs)} pairs; a selector needs at least {MIN_PAIRS} "
            f"({RECOMMENDED_PAIRS} recommended): sites are ranked by their mean shift minus its "
            "standard error over the pairs, which a handful of pairs cannot estimate")
    return pairs


def write_pairs(path: str | os.PathLike, pairs: Sequence[tuple[str, str, str]]) -> Path:
    """Write triples as JSON lines (atomically)."""
    text = "".join(json.dumps(dict(zip(PAIR_FIELDS, pair, strict=True)), ensure_ascii=False)
                   + "\n" for pair in pairs)
    return write_text(Path(path), text)

