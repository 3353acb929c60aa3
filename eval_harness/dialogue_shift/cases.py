"""The dialogue case bank: multi-turn user trajectories whose requested assistant style changes
mid-conversation (the paper's appendix D.3 structure, our own text).

``data/dialogue_cases.json`` holds six styles in three pairs (warm / assertive, formal /
cautious, dismissive / anxious), each style with a first-person descriptor (the text of its bank,
system prompt and CAA contrast) and a natural shift request. Per pair: 12 single-turn calibration
items (disjoint from every dialogue) and two scenario roots, one per direction of the pair, so the
six transitions warm→assertive, assertive→warm, formal→cautious, cautious→formal,
dismissive→anxious and anxious→dismissive each have one root. A root has two branches (same
scenario, different details), each a 24-turn user trajectory (premise, complication, resolution)
with, for every user turn, an assistant reply in each of the pair's two styles carrying the same
content: the held-out style-pair continuations the task scores.

A case is a root's branch cut to 8, 16 or 24 turns with the shift request prefixed to turn 5, 9
or 13 (1-based; the case's ``user`` list carries it): 6 roots × 2 branches × 3 lengths = 36 cases.

Your own styles (:mod:`~eval_harness.dialogue_shift.styles`, ``--styles``): the functions below
take them as ``book`` (None: the shipped bank).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from ..user_files import read_user_json

__all__ = ["SHIFT_TURN", "STYLES", "TRANSITIONS", "check_case", "dialogue_cases", "load_cases",
           "parse_transition", "shift_request", "style_descriptor", "style_pairs",
           "transition_calibration"]

CASES_PATH = Path(__file__).parent / "dialogue_cases.json"
SHIFT_TURN = {8: 5, 16: 9, 24: 13}
STYLES = ("warm", "assertive", "formal", "cautious", "dismissive", "anxious")
TRANSITIONS = ("warm_to_assertive", "assertive_to_warm", "formal_to_cautious",
               "cautious_to_formal", "dismissive_to_anxious", "anxious_to_dismissive")
CASE_FIELDS = ("id", "root", "family", "branch", "turns", "old", "new", "shift_turn", "user",
               "old_replies", "new_replies")


@cache
def _data() -> dict[str, Any]:
    return json.loads(CASES_PATH.read_text())


def parse_transition(name: str, book: Mapping[str, Any] | None = None) -> tuple[str, str]:
    """``"warm_to_assertive"`` → ("warm", "assertive"); with a user's ``book``, any two of its
    styles."""
    if book is None:
        if name not in TRANSITIONS:
            raise ValueError(f"unknown transition {name!r}; known: {', '.join(TRANSITIONS)}")
        old, new = name.split("_to_")
        return old, new
    old, _, new = name.partition("_to_")
    if old not in book["styles"] or new not in book["styles"] or old == new:
        raise ValueError(f"transition {name!r} must be <old>_to_<new>, two different styles of "
                         f"{sorted(book['styles'])}")
    return old, new


def style_descriptor(style: str, book: Mapping[str, Any] | None = None) -> str:
    """The style's first-person descriptor (bank text, system prompt, CAA contrast)."""
    styles = (book or _data())["styles"]
    if style not in styles:
        raise ValueError(f"unknown style {style!r}; known: {', '.join(styles)}")
    return styles[style]["descriptor"]


def shift_request(style: str) -> str:
    """The sentence the user says at the shift turn to ask for ``style``."""
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; known: {', '.join(STYLES)}")
    return _data()["styles"][style]["request"]


def style_pairs() -> list[dict[str, Any]]:
    """The three style pairs as shipped: ``pair`` (two style names), ``calibration`` items and
    ``roots`` (each with ``branches`` of turns carrying a reply per style)."""
    return _data()["pairs"]


def transition_calibration(old: str, new: str, count: int = 12, drift_count: int = 2,
                           book: Mapping[str, Any] | None = None
                           ) -> tuple[list[tuple[str, str, str]], dict[str, list]]:
    """Calibration triples (question, ``new``-style reply, ``old``-style reply) of the pair, and
    ``drift_count`` triples of each other pair (oriented to its first style) as drift groups.
    ``book``: a user's styles (None: the shipped bank)."""
    pairs = (book or _data())["pairs"]
    pair = next((p for p in pairs if {old, new} == set(p["pair"]) and old != new), None)
    if pair is None:
        hint = "" if book is None else (f' (add {{"pair": ["{old}", "{new}"], "calibration": '
                                         '[...]} to the styles)')
        raise ValueError(f"transition {old}_to_{new} has no calibration pairs: no pair holds "
                         f"{old!r} and {new!r}{hint}")
    items = pair["calibration"]
    for name, value in (("calibration pairs", count), ("drift pairs", drift_count)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= len(items):
            raise ValueError(f"{name} must be an integer between 1 and {len(items)} (the "
                             f"calibration items of {old}/{new}), got {value!r}")
    drift = {"_".join(p["pair"]): [(i["question"], i[p["pair"][0]], i[p["pair"][1]])
                                   for i in p["calibration"][:drift_count]]
             for p in pairs if p is not pair}
    return [(i["question"], i[new], i[old]) for i in items[:count]], drift


def check_case(case: Mapping[str, Any], context: int | None = None, tokenizer=None,
               book: Mapping[str, Any] | None = None) -> None:
    """Raise one clear ``ValueError`` if ``case`` cannot be run (missing fields, no valid shift
    turn, unknown styles — the shipped ones or ``book``'s —, turn lists of the wrong length,
    empty texts, or a conversation longer than a model ``context`` tokens, counted with
    ``tokenizer``)."""
    name = case.get("id", "<unnamed case>") if isinstance(case, Mapping) else "<not a mapping>"
    if not isinstance(case, Mapping):
        raise ValueError(f"a dialogue case is a mapping with {', '.join(CASE_FIELDS)}")
    missing = [f for f in CASE_FIELDS if f not in case]
    if "shift_turn" in missing or case.get("shift_turn") is None:
        raise ValueError(f"case {name}: no shift turn (give shift_turn, the 1-based user turn "
                         "at which the new style is requested)")
    if missing:
        raise ValueError(f"case {name}: missing {', '.join(missing)}")
    turns, shift = case["turns"], case["shift_turn"]
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 2:
        raise ValueError(f"case {name}: turns must be an integer >= 2, got {turns!r}")
    if isinstance(shift, bool) or not isinstance(shift, int) or not 2 <= shift <= turns:
        raise ValueError(f"case {name}: shift_turn must be a turn in [2, {turns}] (some turns "
                         f"before and at least one after the request), got {shift!r}")
    styles = STYLES if book is None else tuple(book["styles"])
    for style in (case["old"], case["new"]):
        if style not in styles:
            raise ValueError(f"case {name}: unknown style {style!r}; known: {', '.join(styles)}")
    if case["old"] == case["new"]:
        raise ValueError(f"case {name}: the old and the new style are the same")
    for field in ("user", "old_replies", "new_replies"):
        texts = case[field]
        if (not isinstance(texts, list) or len(texts) != turns
                or not all(isinstance(t, str) and t.strip() for t in texts)):
            raise ValueError(f"case {name}: {field} must be {turns} non-empty texts")
    if context is not None and tokenizer is not None:
        total = sum(len(tokenizer(t, add_special_tokens=False).input_ids) + 8
                    for t in (*case["user"], *case["old_replies"]))
        if total >= context:
            raise ValueError(f"case {name}: about {total} tokens do not fit the model's context "
                             f"of {context} tokens")


def load_cases(path: str | Path, book: Mapping[str, Any] | None = None
               ) -> list[dict[str, Any]]:
    """A user's cases (``--cases``): a JSON list of rows like :func:`dialogue_cases`'s, each
    checked by :func:`check_case` (against ``book``'s styles when given). One ``ValueError``
    names the file's or the case's problem."""
    cases = read_user_json(path, "the cases")
    if not isinstance(cases, list) or not cases:
        raise ValueError(f"{path} must hold a non-empty JSON list of cases")
    for case in cases:
        check_case(case, book=book)
    return cases


def dialogue_cases(transitions: Sequence[str] = TRANSITIONS,
                   lengths: Sequence[int] = (8, 16, 24), branches: Sequence[str] = ("a", "b")):
    """The shipped cases as a ``datasets.Dataset`` (one row per case; columns ``CASE_FIELDS``),
    filtered to ``transitions``, ``lengths`` (8, 16, 24) and ``branches`` ("a", "b")."""
    from datasets import Dataset

    for length in lengths:
        if length not in SHIFT_TURN:
            raise ValueError(f"lengths are among {sorted(SHIFT_TURN)}, got {length!r}")
    for branch in branches:
        if branch not in ("a", "b"):
            raise ValueError(f"branches are 'a' and 'b', got {branch!r}")
    wanted = [parse_transition(t) for t in transitions]
    rows = []
    for pair in _data()["pairs"]:
        for root in pair["roots"]:
            old, new = root["transition"]
            if (old, new) not in wanted:
                continue
            for branch in branches:
                turns = root["branches"][branch]
                for length in lengths:
                    shift = SHIFT_TURN[length]
                    user = [t["user"] for t in turns[:length]]
                    user[shift - 1] = f"{shift_request(new)} {user[shift - 1]}"
                    rows.append({
                        "id": f"{root['root']}-{length}-{branch}", "root": root["root"],
                        "family": root["family"], "branch": branch, "turns": length,
                        "old": old, "new": new, "shift_turn": shift, "user": user,
                        "old_replies": [t[old] for t in turns[:length]],
                        "new_replies": [t[new] for t in turns[:length]]})
    return Dataset.from_list(rows)
