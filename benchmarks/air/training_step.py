"""One AIRSolver training step, eager against ``torch.compile`` of the recurrent blocks, in this
process.

Two solvers with the same initial weights train on the same random 9×9-Sudoku-shaped batch
(forward over the ACT segment, backward, AdamATan2 step); the second has its recurrent block(s)
compiled as ``air-train --compile`` does (``compile_recurrent_blocks``, inductor). Steps
alternate so drift in the machine's load hits both; prints the compile time, the first step's
loss difference (the compiled path computes the same function: rounding only), the median step
times and the eager / compiled ratio.

Usage: python -m benchmarks.air.training_step [--hidden 256] [--layers 2] [--heads 4]
    [--batch 64] [--seq 81] [--injection Lx_H] [--repeats 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import platform
import statistics

import torch

from benchmarks.results import ResultLog, add_jsonl_argument
from benchmarks.timing import timed
from modeling.air import AIRConfig, AIRSolver
from modeling.air.optim_air import AdamATan2
from modeling.air.training_air import compile_recurrent_blocks


def _solver(args: argparse.Namespace) -> AIRSolver:
    torch.manual_seed(0)
    return AIRSolver(AIRConfig(vocab_size=11, seq_len=args.seq, hidden_size=args.hidden,
                               num_hidden_layers=args.layers, num_attention_heads=args.heads,
                               halt_max_steps=4, injection=args.injection))


def _stepper(model: AIRSolver, batch: dict[str, torch.Tensor]):
    optimizer = AdamATan2(model.parameters(), lr=1e-4)
    carry = None

    def step() -> float:
        nonlocal carry
        output = model(batch["inputs"], labels=batch["labels"], carry=carry,
                       puzzle_identifiers=batch["ids"])
        carry = output.carry
        output.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(output.loss.detach())

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=81)
    parser.add_argument("--injection", default="Lx_H")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    add_jsonl_argument(parser, "air")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    batch = {"inputs": torch.randint(1, 11, (args.batch, args.seq), generator=generator),
             "labels": torch.randint(1, 11, (args.batch, args.seq), generator=generator),
             "ids": torch.zeros(args.batch, dtype=torch.long)}
    eager, compiled = _solver(args), _solver(args)
    compile_recurrent_blocks(compiled)
    eager_step, compiled_step = _stepper(eager, batch), _stepper(compiled, batch)
    first_compiled, compile_s = timed(compiled_step)
    first_eager = eager_step()
    eager_times, compiled_times = [], []
    for _ in range(args.repeats):
        for step, times in ((eager_step, eager_times), (compiled_step, compiled_times)):
            times.append(timed(step)[1])
    eager_ms = 1000 * statistics.median(eager_times)
    compiled_ms = 1000 * statistics.median(compiled_times)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; AIR d={args.hidden}, {args.layers} layers, "
          f"{args.injection}, batch {args.batch} x {args.seq} tokens, {args.repeats} steps each")
    print(f"compile (first step) {compile_s:.1f} s; first-step loss eager {first_eager:.6f} "
          f"compiled {first_compiled:.6f} (|diff| {abs(first_eager - first_compiled):.1e})")
    print(f"median step: eager {eager_ms:.0f} ms, compiled {compiled_ms:.0f} ms, "
          f"eager / compiled {eager_ms / compiled_ms:.2f}")
    ResultLog(args.jsonl, "air.training_step").write(
        hidden=args.hidden, layers=args.layers, injection=args.injection, batch=args.batch,
        seq=args.seq, repeats=args.repeats, threads=args.threads, compile_s=compile_s,
        first_loss_diff=abs(first_eager - first_compiled), eager_ms=eager_ms,
        compiled_ms=compiled_ms, ratio=eager_ms / compiled_ms)


if __name__ == "__main__":
    main()
