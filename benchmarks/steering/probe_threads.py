"""The default persona call with its independent probes in one thread and in two, in one process:
the call's and the recipe screen's wall time at each ``workers`` setting, in turn (the first
call in a process also pays for warming up, so the order is the caller's: ``--order 1,2,1``),
and whether every call kept the same recipe, sites and scores.

Usage: python -m benchmarks.steering.probe_threads [--direction caution+] [--order 1,2,1]
"""

from __future__ import annotations

import argparse
from unittest import mock

from benchmarks.results import ResultLog, add_jsonl_argument
from benchmarks.timing import timed
from experiments.mi_user_persona import direction_items
from hf_memory import load_default_model
from hf_memory.recipes import persona


def timing_screen(screen, seconds: dict[str, float]):
    """``screen`` (the persona call's recipe screen), its wall time kept in ``seconds``."""
    def timed_screen(*args, **kwargs):
        result, seconds["screen"] = timed(lambda: screen(*args, **kwargs))
        return result
    return timed_screen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--direction", default="caution+")
    parser.add_argument("--order", default="1,2,1",
                        help="the workers setting of each call, in turn (default 1,2,1)")
    add_jsonl_argument(parser, "steering")
    args = parser.parse_args()
    order = [int(w) for w in args.order.split(",")]
    log = ResultLog(args.jsonl, "steering.probe_threads", direction=args.direction)
    model, tokenizer = load_default_model()
    text, items = direction_items(args.direction)
    screen = persona._screened
    choices, times = [], {}
    for workers in order:
        seconds: dict[str, float] = {}
        with mock.patch.object(persona, "_screened", timing_screen(screen, seconds)):
            found, call = timed(lambda w=workers: persona.calibrate_persona(
                model, tokenizer, text, items[:20], progress=False, workers=w))
        best = found.selector.config["best"]
        choices.append((found.recipe, found.selector.layers, found.selector.strength,
                        best["score"], [t.get("screened") for t in found.trials]))
        times.setdefault(workers, []).append(call)
        log.write(workers=workers, call_s=call, screen_s=seconds["screen"],
                  recipe=found.recipe, layers=found.selector.layers, score=best["score"])
        print(f"# workers={workers}: call {call:.0f} s, screen {seconds['screen']:.0f} s; kept "
              f"{found.recipe} at {found.selector.layers}, score {best['score']:+.6f}",
              flush=True)
    if 1 in times and 2 in times:
        ratio = (sum(times[2]) / len(times[2])) / (sum(times[1]) / len(times[1]))
        print(f"# two threads / one: {ratio:.2f}x the call; the same choice and scores in every "
              f"call: {all(c == choices[0] for c in choices)}")


if __name__ == "__main__":
    main()
