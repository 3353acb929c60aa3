"""What the vLLM plugin's hooks cost: their CPU time per steered run, its share of the run, and the
torch ops one steered layer issues.

Run in the vLLM environment (``make vllm-env``)::

    OMP_NUM_THREADS=1 .venv-vllm/bin/python -m benchmarks.vllm.hook_cost [--batches 1,8,32]

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the worker's hook
methods can be timed: the registry of ``steering.py`` (the anxious bank set at the shipped
N+ selector's sites), every request steered, greedy, ``--tokens`` each. Per batch size the best
of ``--repeats`` runs is reported (a plain run of the same requests before each): the run's wall
time, the milliseconds inside the query-capture hook and the attention-output hook (of which
:func:`bank_mixture_over` and the per-pass history bookkeeping), their share of the run, and the
aten ops one steered layer's hook dispatches in a decoding step (counted in a separate run,
under a counting dispatch mode), and steered/plain throughput on this engine. On a machine with
few cores this is a latency bound: the hooks run between vLLM's own ops, so their share of the
run is what steered requests lose.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import tempfile
import time
from pathlib import Path

from benchmarks.results import ResultLog, add_jsonl_argument
from benchmarks.timing import timed

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def add_up_time(owner, name: str, totals: dict[str, float], label: str) -> None:
    """Wrap ``owner.name`` so that its wall time adds up in ``totals[label]``."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def count_ops(worker_class, counts: collections.Counter, enabled: list[bool]) -> None:
    """Count the aten ops of ``_steer`` calls at decoding steps while ``enabled[0]``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    original = worker_class._steer

    def wrapper(self, layer, attention, args, output):
        if not enabled[0] or args[0].shape[0] != 1:  # one decoding token: the B 1 step
            return original(self, layer, attention, args, output)
        counts["(calls)"] += 1
        with Counting():
            return original(self, layer, attention, args, output)

    worker_class._steer = wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", default="1,8,32")
    add_jsonl_argument(parser, "vllm")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    import torch

    from benchmarks.vllm.steering import PROMPTS, build_registry, rate, start_engine
    from hf_memory.models.default_model import ensure_default_model_cached
    from hf_memory_vllm import worker

    totals: dict[str, float] = collections.defaultdict(float)
    add_up_time(worker.WorkerSteering, "_capture_query", totals, "capture")
    add_up_time(worker.WorkerSteering, "_steer", totals, "steer")
    add_up_time(worker, "bank_mixture_over", totals, "mixture")
    add_up_time(worker._Group, "history", totals, "history")
    counts: collections.Counter = collections.Counter()
    counting = [False]
    count_ops(worker.WorkerSteering, counts, counting)

    log = ResultLog(args.jsonl, "vllm.hook_cost", tokens=args.tokens, repeats=args.repeats)
    print(f"# {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; {args.tokens} new tokens per request, every request steered")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _model, _tokenizer, registry, _selector = build_registry(root)
        llm = start_engine(registry, Path(ensure_default_model_cached()), max(batches))
        tokenizer = llm.get_tokenizer()
        ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                             add_generation_prompt=True,
                                             return_dict=True)["input_ids"] for p in PROMPTS]
        rate(llm, ids, 1, 4, steered=True)  # warm-up: plans, shadow caches
        for batch in batches:
            best, plain = None, float("inf")
            for _ in range(args.repeats):
                plain = min(plain, timed(lambda b=batch: rate(llm, ids, b, args.tokens,
                                                              steered=False))[1])
                totals.clear()
                _, wall = timed(lambda b=batch: rate(llm, ids, b, args.tokens, steered=True))
                run = {"wall": wall, **totals}
                if best is None or wall < best["wall"]:
                    best = run
            hooks = best["capture"] + best["steer"]
            print(f"batch {batch:2d}: run {best['wall'] * 1e3:7.1f} ms; hooks {hooks * 1e3:6.1f} "
                  f"ms ({hooks / best['wall']:.1%}): capture {best['capture'] * 1e3:5.1f}, "
                  f"steer {best['steer'] * 1e3:6.1f} (mixture {best['mixture'] * 1e3:6.1f}, "
                  f"history {best['history'] * 1e3:5.1f}); plain run {plain * 1e3:7.1f} ms, "
                  f"steered/plain {plain / best['wall']:.3f}", flush=True)
            log.write(batch=batch, run_ms=best["wall"] * 1e3, hooks_ms=hooks * 1e3,
                      hooks_share=hooks / best["wall"],
                      **{f"{k}_ms": best[k] * 1e3 for k in ("capture", "steer", "mixture",
                                                            "history")},
                      plain_ms=plain * 1e3, ratio=plain / best["wall"])
        counting[0] = True
        rate(llm, ids, 1, 8, steered=True)
        calls = counts.pop("(calls)")
        total = sum(counts.values())
        top = ", ".join(f"{name.split('.')[-1]} {n / calls:.0f}"
                        for name, n in counts.most_common(8))
        print(f"aten ops per steered layer, one decoding request: {total / calls:.1f} ({top})")
        log.write(aten_ops_per_steered_layer=total / calls,
                  top_ops={name.split(".")[-1]: n / calls for name, n in counts.most_common(8)})
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
