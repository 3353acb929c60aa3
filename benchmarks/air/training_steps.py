"""AIR and Arith training steps per second on one device (run it on the CPU and on a GPU).

The same step as their trainers: AIRSolver (9x9-Sudoku shape, ACT segment forward, backward,
AdamATan2) and ArithTransformer (the paper's batch of 512, AdamW), with bf16 autocast on CUDA
and float32 on the CPU; median of the repeats after one warm-up.

Usage: python -m benchmarks.air.training_steps [--device cuda] [--repeats 10] [--threads 2]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.results import ResultLog, add_jsonl_argument
from benchmarks.timing import median_seconds
from modeling.air import AIRConfig, AIRSolver
from modeling.air.optim_air import AdamATan2
from modeling.arith import ArithConfig, ArithTransformer
from modeling.arith.data_arith import ArithTask, sample_batch


def air_step(device: torch.device, injection: str, batch: int):
    torch.manual_seed(0)
    model = AIRSolver(AIRConfig(vocab_size=11, seq_len=81, hidden_size=256, num_hidden_layers=2,
                                num_attention_heads=4, halt_max_steps=4,
                                injection=injection)).to(device)
    optimizer = AdamATan2(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randint(1, 11, (batch, 81), generator=gen).to(device)
    labels = torch.randint(1, 11, (batch, 81), generator=gen).to(device)
    ids = torch.zeros(batch, dtype=torch.long, device=device)
    carry = None

    def step() -> None:
        nonlocal carry
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            output = model(inputs, labels=labels, carry=carry, puzzle_identifiers=ids)
        carry = output.carry
        output.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def arith_step(device: torch.device, batch: int):
    torch.manual_seed(0)
    task = ArithTask()
    model = ArithTransformer(ArithConfig()).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = sample_batch(task, batch, torch.Generator().manual_seed(0))
    ids, labels = data["input_ids"].to(device), data["labels"].to(device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(ids, labels=labels, logits_to_keep=1).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    add_jsonl_argument(parser, "air")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"cpu x{args.threads}"
    print(f"# {name}, torch {torch.__version__}, "
          f"{'bf16 autocast' if device.type == 'cuda' else 'float32'}")
    log = ResultLog(args.jsonl, "air.training_steps", device=name, repeats=args.repeats)
    for label, step in (("air Lx_H  9x9, batch 64", air_step(device, "Lx_H", 64)),
                        ("air Lx_Hx 9x9, batch 64", air_step(device, "Lx_Hx", 64)),
                        ("arith, batch 512", arith_step(device, 512))):
        seconds = median_seconds(step, args.repeats, warmups=1, device=device)
        print(f"{label:<26} {1000 * seconds:9.1f} ms/step  {1 / seconds:8.1f} steps/s",
              flush=True)
        log.write(step=label, ms_per_step=1000 * seconds, steps_s=1 / seconds)


if __name__ == "__main__":
    main()
