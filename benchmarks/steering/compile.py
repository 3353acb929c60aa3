"""torch.compile with memory inception installed: graphs, breaks and forward time per condition.

A model of the embedded SmolLM2-135M's shape (random weights, ``--dtype``, CUDA where present,
``--mode reduce-overhead`` for CUDA graphs), a forward pass over a ``--batch`` × ``--prompt``
prompt, five conditions in one
process: plain eager; plain compiled (inductor); compiled with a steering (target + reference
bank of 24 slots at five layers) and a CAA handle installed but not live (what a server holding
handles runs for its plain requests); compiled with the steering live; eager steered. For each:
Dynamo's graph and break count (``torch._dynamo.explain``; its first distinct break reasons
printed below the row) and the median forward time after
warm-up, with the ratio to plain eager. Every compiled output is checked against its eager one.

Usage: python -m benchmarks.steering.compile [--model smollm2-135m] [--batch 1] [--prompt 64]
       [--dtype float32|bfloat16] [--mode default|reduce-overhead]
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch
import torch._dynamo as dynamo

from benchmarks.results import ResultLog, add_jsonl_argument
from benchmarks.steering.serving_shapes import MODELS, banks_for, build
from benchmarks.timing import median_seconds
from hf_memory import steer
from hf_memory.baselines.caa import CAAVectors, apply_caa


def graphs_and_breaks(model, ids: torch.Tensor) -> tuple[int, int, list[str]]:
    """Dynamo's graph and break counts for ``model(ids)``, and its distinct break reasons."""
    dynamo.reset()
    explained = dynamo.explain(model)(ids)
    reasons = list(dict.fromkeys(
        f"{reason.reason.splitlines()[0][:160]} (at {reason.user_stack[-1].filename}:"
        f"{reason.user_stack[-1].lineno})" if reason.user_stack else reason.reason[:160]
        for reason in explained.break_reasons))
    return explained.graph_count, explained.graph_break_count, reasons


def compiled_row(label: str, model, ids, expected, repeats: int, base: float, scope,
                 mode: str, log: ResultLog) -> None:
    """Explain, compile (inductor), time and check ``model`` under ``scope``; print and log one
    row."""
    with scope():
        graphs, breaks, reasons = graphs_and_breaks(model, ids)
        dynamo.reset()
        compiled = torch.compile(model, mode=mode)
        out = compiled(ids).logits  # compiles
        out = compiled(ids).logits.clone()  # (CUDA graphs record on the second call)
        seconds = median_seconds(lambda: compiled(ids).logits, repeats, device=ids.device)
    error = (out - expected).abs().max().item()
    log.write(condition=label, graphs=graphs, breaks=breaks, forward_ms=1e3 * seconds,
              ratio=base / seconds, max_error=error)
    print(f"| {label} | {graphs} | {breaks} | {1e3 * seconds:.1f} | {base / seconds:.2f}x | "
          f"{error:.1e} |")
    for reason in reasons[:5]:
        print(f"#   break: {reason}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=[m for m in MODELS if MODELS[m]])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--mode", default="default", choices=["default", "reduce-overhead"])
    add_jsonl_argument(parser, "steering")
    args = parser.parse_args()
    log = ResultLog(args.jsonl, "steering.compile", model=args.model, batch=args.batch,
                    prompt=args.prompt, dtype=args.dtype, mode=args.mode)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build(args.model, device, getattr(torch, args.dtype))
    ids = torch.randint(1, model.config.vocab_size, (args.batch, args.prompt), device=device)
    print(f"{args.model}, {device}, {args.dtype}, batch {args.batch} x {args.prompt} tokens, "
          f"torch.compile mode {args.mode}, torch {torch.__version__}")
    print("| condition | graphs | breaks | forward ms | / plain eager | max |compiled - eager| |")
    print("| --- | --- | --- | --- | --- | --- |")
    with torch.inference_mode():
        plain = model(ids).logits
        base = median_seconds(lambda: model(ids).logits, args.repeats, device=device)
        print(f"| plain, eager | - | - | {1e3 * base:.1f} | 1.00x | - |")
        log.write(condition="plain, eager", forward_ms=1e3 * base, ratio=1.0)
        compiled_row("plain, compiled", model, ids, plain, args.repeats, base, nullcontext,
                     args.mode, log)
        memory = steer(model, banks_for(model), active=False)
        vector = torch.randn(model.config.hidden_size, device=device, dtype=model.dtype)
        caa = apply_caa(model, CAAVectors({model.config.num_hidden_layers // 3: vector},
                                          scale=1.0), active=False)
        with memory.applied():
            steered = model(ids).logits
            seconds = median_seconds(lambda: model(ids).logits, args.repeats, device=device)
        print(f"| steering live, eager | - | - | {1e3 * seconds:.1f} | {base / seconds:.2f}x | - |")
        log.write(condition="steering live, eager", forward_ms=1e3 * seconds, ratio=base / seconds)
        compiled_row("compiled, steering and CAA installed, not live", model, ids, plain,
                     args.repeats, base, nullcontext, args.mode, log)
        compiled_row("compiled, steering live", model, ids, steered, args.repeats, base,
                     memory.applied, args.mode, log)
    memory.remove()
    caa.remove()
    dynamo.reset()


if __name__ == "__main__":
    main()
