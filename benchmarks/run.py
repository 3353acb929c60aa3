"""Run the CPU speed benchmarks (steering, ASM, AIR), each in its own process, in one command.

Every benchmark prints its table and appends its rows to ``benchmarks/out/<subject>.jsonl``.
At their defaults the set takes hours on a small machine; ``--quick`` runs each with small
arguments (fewer tokens, repeats, lengths and rounds; one model shape) and leaves out the four
that time whole persona calibrations or lm-eval runs (calibration_speed, persona_call_time,
probe_threads, lm_eval_cost), to check the set end to end (17 min on a shared 2-core machine,
most of it the steering set's model loads, serving shapes and torch.compile). The vLLM and GPU
benchmarks run in their own environments (``benchmarks/vllm``, ``benchmarks/gpu/run.sh``).

Usage: python -m benchmarks.run [--subject steering|asm|air] [--quick] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from benchmarks.results import ROOT
from benchmarks.timing import timed

# subject -> [(module under benchmarks/, its arguments under --quick, or None: left out)]
BENCHMARKS: dict[str, list[tuple[str, list[str] | None]]] = {
    "steering": [
        ("default_model", ["--new-tokens", "8", "--repeats", "1"]),
        ("generate", ["--new-tokens", "8", "--repeats", "1"]),
        ("serving_shapes", ["--quick", "--models", "smollm2-135m", "--new-tokens", "8",
                            "--repeats", "1"]),
        ("step_ratios", ["--models", "smollm2-135m", "--batches", "1", "--prompts", "16",
                         "--prefill-rounds", "1", "--decode-rounds", "3"]),
        ("step_ops", []),
        ("compile", ["--repeats", "3"]),
        ("per_row_directions", ["--directions", "N+", "A+", "--prompts", "1",
                                "--new-tokens", "4"]),
        ("calibration_speed", None),
        ("persona_call_time", None),
        ("probe_threads", None),
        ("lm_eval_cost", None),
    ],
    "asm": [
        ("scan", ["--lengths", "256", "1024", "--layers", "4", "--decode-steps", "8",
                  "--contexts", "64", "1024"]),
        ("decode", ["--contexts", "256", "1024", "--new-tokens", "8", "--repeats", "1",
                    "--layers", "4"]),
        ("training_step", ["--repeats", "3"]),
        ("block_ops", ["--repeats", "3"]),
    ],
    "air": [
        ("maze_generator", ["--count", "5", "--sizes", "12,10,8"]),
        ("sudoku_generator", ["--count", "5"]),
        ("training_step", ["--repeats", "2"]),
        ("training_steps", ["--repeats", "3"]),
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subject", choices=list(BENCHMARKS), action="append",
                        help="only this subject (repeatable; default: all three)")
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="only these benchmarks, as SUBJECT.NAME (e.g. asm.scan)")
    parser.add_argument("--quick", action="store_true",
                        help="small arguments, the four slowest left out (see above)")
    args = parser.parse_args()
    failed, times = [], []
    for subject in args.subject or list(BENCHMARKS):
        for name, quick in BENCHMARKS[subject]:
            module = f"{subject}.{name}"
            if (args.only and module not in args.only) or (args.quick and quick is None):
                continue
            command = [sys.executable, "-m", f"benchmarks.{module}", *(quick if args.quick
                                                                      else [])]
            print(f"\n## {module}: {' '.join(command[1:])}", flush=True)
            code, seconds = timed(lambda c=command: subprocess.run(c, cwd=ROOT).returncode)
            times.append((module, seconds, code))
            if code:
                failed.append(module)
    print("\n## wall time per benchmark")
    for module, seconds, code in times:
        print(f"{module:<30} {seconds:7.1f} s{'' if code == 0 else f'  (exit {code})'}")
    print(f"{'total':<30} {sum(s for _, s, _ in times):7.1f} s")
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
