"""Fuzz every artifact and eval-set loader for N cases and tabulate (issue 80).

    .venv/bin/python -m experiments.fuzz_loaders --cases 2000

Runs the fuzzers of ``tests/loader_fuzz.py`` (the ones ``tests/test_fuzz_loaders.py`` runs with
fewer cases) and prints one JSON line per loader, then a markdown table: cases tried, how many
were refused and loaded, the distinct error classes and messages (folders, hashes and numbers
masked), crashes (an undocumented exception or an accepted corrupt artifact: must be 0) and the
slowest case in ms. The first crash of a loader is printed in full.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a registry's path must never reach the Hub

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests import loader_fuzz  # noqa: E402


def fuzz(loader, cases: int) -> dict:
    stats = {"loader": loader.name, "cases": 0, "refused": 0, "loaded": 0, "loaded_changed": 0,
             "error_classes": set(), "messages": set(), "crashes": 0, "slowest_ms": 0.0}
    first_crash: list[str] = []

    @settings(max_examples=cases, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def case(data):
        files = data.draw(loader_fuzz.mutated(loader))
        start = time.perf_counter()
        try:
            outcome = loader_fuzz.run_case(loader, files)
        except AssertionError as error:
            stats["crashes"] += 1
            if not first_crash:
                first_crash.append(str(error))
            return
        finally:
            stats["cases"] += 1
            stats["slowest_ms"] = max(stats["slowest_ms"], 1000 * (time.perf_counter() - start))
        if outcome.loaded:
            stats["loaded"] += 1
            stats["loaded_changed"] += outcome.changed
        else:
            stats["refused"] += 1
            stats["error_classes"].add(outcome.error)
            stats["messages"].add(outcome.kind)

    case()
    if loader.cleanup is not None:
        loader.cleanup()
    if first_crash:
        print(f"# first crash of {loader.name}: {first_crash[0]}", file=sys.stderr)
    return {**stats, "error_classes": sorted(stats["error_classes"]),
            "messages": len(stats["messages"]), "slowest_ms": round(stats["slowest_ms"], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=2000, help="cases per loader")
    parser.add_argument("--other-model-cases", type=int, default=200,
                        help="cases per bank set made for another model")
    parser.add_argument("--only", help="only loaders whose name contains this")
    args = parser.parse_args()
    loaders = [(loader, args.cases) for loader in loader_fuzz.LOADERS.values()]
    loaders += [(loader, args.other_model_cases) for loader in loader_fuzz.OTHER_MODEL_LOADERS]
    rows = []
    try:
        for loader, cases in loaders:
            if args.only and args.only not in loader.name:
                continue
            row = fuzz(loader, cases)
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        loader_fuzz.remove_case_dirs()
    print()
    print("| loader | cases | refused | loaded (of which mutated) | error classes | distinct "
          "messages | crashes | slowest case (ms) |")
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['loader']} | {row['cases']} | {row['refused']} | {row['loaded']} "
              f"({row['loaded_changed']}) | {', '.join(row['error_classes'])} | "
              f"{row['messages']} | {row['crashes']} | {row['slowest_ms']} |")
    if any(row["crashes"] for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
