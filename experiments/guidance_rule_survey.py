"""Which answer rules the embedded model follows when told: the visible prompt's own compliance.

Issue 78's first result for guidance banks: a bank can only be asked to carry a rule the model
follows at all, so each candidate rule is given as the system message and the model answers
16 neutral requests greedily (the 12 calibration prompts and the demo's 4), beside the plain
model's replies to the same requests. Each reply is checked by a program (a language detector
restricted to English and the rule's language, a regular expression, a count); the table lists
each rule's compliance with the prompt and without it, sorted by the lift. A rule the prompt
makes the model follow in at least half of the replies is a candidate for the guidance task.

Usage: python -m experiments.guidance_rule_survey [--model gemma3-270m] [--max-new-tokens 48]
    [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from hf_memory import PlainMethod, PromptMethod
from hf_memory.baselines.methods import generate_with
from hf_memory.models.default_model import DEFAULT_MODEL
from hf_memory.models.embedded import EMBEDDED_MODELS, load_embedded_model
from hf_memory.recipes.calibration_data import calibration_prompts
from hf_memory.recipes.demo import DEFAULT_PROMPTS

EMOJI = re.compile("[\U0001F300-\U0001FAFF\u2600-\u27BF]")


def language_is(code: str) -> Callable[[str], bool]:
    """True where langdetect, choosing between English and ``code`` only, says ``code``."""
    from langdetect.detector_factory import PROFILES_DIRECTORY, DetectorFactory
    from langdetect.lang_detect_exception import LangDetectException

    factory = DetectorFactory()
    factory.load_json_profile([Path(os.path.join(PROFILES_DIRECTORY, c)).read_text()
                               for c in ("en", code)])
    factory.seed = 0

    def check(reply: str) -> bool:
        detector = factory.create()
        detector.append(reply)
        try:
            return detector.detect() == code
        except LangDetectException:
            return False
    return check


def capitals(reply: str) -> bool:
    letters = [c for c in reply if c.isalpha()]
    return bool(letters) and sum(c.isupper() for c in letters) >= 0.9 * len(letters)


def sentences(reply: str) -> int:
    return len([s for s in re.split(r"[.!?]+(?:\s|$)", reply.strip()) if s.strip()])


RULES: dict[str, tuple[str, Callable[[str], bool]]] = {
    "french": ("Always answer in French.", language_is("fr")),
    "spanish": ("Always answer in Spanish.", language_is("es")),
    "german": ("Always answer in German.", language_is("de")),
    "capitals": ("Write your whole answer in capital letters.", capitals),
    "indeed": ("Begin every answer with the word 'Indeed'.",
               lambda r: r.strip().lower().startswith("indeed")),
    "bullets": ("Answer with a bulleted list.",
                lambda r: len(re.findall(r"^\s*(?:[-*•]|\d+\.)\s", r, re.M)) >= 2),
    "one_sentence": ("Answer in exactly one sentence.", lambda r: sentences(r) == 1),
    "short": ("Answer in fewer than ten words.", lambda r: 0 < len(r.split()) < 10),
    "emoji": ("Include at least one emoji in every answer.", lambda r: bool(EMOJI.search(r))),
    "question": ("Answer every message with a question.", lambda r: r.strip().endswith("?")),
    "blue": ("Always mention the color blue in your answer.", lambda r: "blue" in r.lower()),
    "humble": ("Refer to yourself as 'this humble assistant'.",
               lambda r: "this humble assistant" in r.lower()),
    "no_e": ("Never use the letter e.", lambda r: bool(r.strip()) and "e" not in r.lower()),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(EMBEDDED_MODELS), default=DEFAULT_MODEL,
                        help="an embedded model (gemma3-270m: the base model, no chat tuning)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/guidance_rules.jsonl"))
    args = parser.parse_args()
    model, tokenizer = load_embedded_model(args.model)
    prompts = calibration_prompts() + list(DEFAULT_PROMPTS)
    start = time.perf_counter()
    plain = generate_with(PlainMethod(), model, tokenizer, prompts,
                          max_new_tokens=args.max_new_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, (text, check) in RULES.items():
        replies = generate_with(PromptMethod(text, tokenizer=tokenizer), model, tokenizer,
                                prompts, max_new_tokens=args.max_new_tokens)
        row = {"model": args.model, "rule": name, "text": text, "prompts": len(prompts),
               "prompt": sum(map(check, replies)) / len(prompts),
               "plain": sum(map(check, plain)) / len(prompts),
               "example": replies[0], "replies": replies}
        rows.append(row)
        with args.out.open("a") as out:  # a row at a time, so a cut run keeps what it measured
            out.write(json.dumps(row) + "\n")
    print(f"# {len(prompts)} requests, greedy, {args.max_new_tokens} new tokens; "
          f"{time.perf_counter() - start:.0f} s")
    print("| rule | told | plain | lift | first reply when told |")
    print("| --- | --- | --- | --- | --- |")
    for row in sorted(rows, key=lambda r: r["plain"] - r["prompt"]):
        example = " ".join(row["example"].split())[:70]
        print(f"| {row['rule']} | {row['prompt']:.2f} | {row['plain']:.2f} | "
              f"{row['prompt'] - row['plain']:+.2f} | {example} |")


if __name__ == "__main__":
    main()
