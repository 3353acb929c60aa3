"""A training run for ``accelerate launch`` (``tests/test_multiprocess_training.py``): a tiny ASM
model on a learnable token stream, the configs of ``tests/test_asm_training.py``, its log written
to ``OUT/log.json`` by the loop itself. ``--interrupt-at-eval N`` stops every process at the N-th
validation (after the checkpoint before it), as a killed run would; ``--air`` trains a tiny AIR
solver instead (:func:`run_air`)."""

from __future__ import annotations

import argparse

import torch

import modeling.asm.training_asm as training
from modeling.asm import ASMConfig, ASMForCausalLM

CONFIG = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
              num_slots=4, slot_space_dim=8, max_position_embeddings=16, chunk_size=8,
              bos_token_id=0, eos_token_id=0, pad_token_id=0)
TRAIN = dict(steps=6, batch_size=4, lr=3e-3, warmup_steps=2, eval_every=1, save_every=3,
             progress=False, cpu=True)


def blocks(count: int, seed: int, length: int = 16, vocab: int = 300) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (count, 1), generator=generator)
    return (start + torch.arange(length)) % vocab


def fresh_model() -> ASMForCausalLM:
    torch.manual_seed(0)
    return ASMForCausalLM(ASMConfig(**CONFIG))


def run(out, interrupt_at_eval: int | None = None, **overrides) -> dict:
    if interrupt_at_eval is not None:
        real, calls = training.evaluate_nll, []

        def interrupted(*args, **kwargs):
            calls.append(1)
            if len(calls) == interrupt_at_eval:
                raise SystemExit(3)
            return real(*args, **kwargs)

        training.evaluate_nll = interrupted
    return training.train_lm(fresh_model(), blocks(40, seed=0), blocks(4, seed=1),
                             training.LMTrainConfig(**{**TRAIN, **overrides}), out=out)


def run_air(out, **overrides) -> dict:
    """A tiny AIR solver, 4 steps, every row's ACT carry kept across steps; no exploration (its
    random draws are each process's own), so two processes can equal one."""
    from modeling.air import AIRConfig, AIRSolver, sudoku_dataset
    from modeling.air.training_air import AIRTrainConfig, train_air

    torch.manual_seed(0)
    solver = AIRSolver(AIRConfig(vocab_size=6, seq_len=16, hidden_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, halt_max_steps=3,
                                 halt_exploration_prob=0.0))
    settings = {**dict(steps=4, batch_size=8, eval_every=1, progress=False, cpu=True),
                **overrides}
    return train_air(solver, sudoku_dataset(4, 32, "train", seed=3), None,
                     AIRTrainConfig(**settings), out=out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--interrupt-at-eval", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--air", action="store_true", help="train a tiny AIR solver instead")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.air:
        run_air(args.out, **({} if args.batch_size is None else {"batch_size": args.batch_size}))
    else:
        run(args.out, args.interrupt_at_eval, batch_size=args.batch_size or TRAIN["batch_size"])
