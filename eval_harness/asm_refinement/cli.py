"""``hf-memory eval asm-refinement``: its flags and config (the model loads as the family
tasks' do)."""

from __future__ import annotations

from ..arguments import non_negative_floats, positive_int
from ..family.cli import family_task
from ..registry import lazy

__all__ = ["TASKS"]


def _add_arguments(parser) -> None:
    parser.add_argument("--blocks", type=positive_int, default=128, metavar="N",
                        help="held-out blocks of the model's context (default: 128)")
    parser.add_argument("--samples", type=positive_int, default=200_000, metavar="N",
                        help="positions sampled for the geometry histograms (default: 200000, "
                             "as the paper)")
    parser.add_argument("--betas", type=non_negative_floats,
                        default=[0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0], metavar="B,B,...",
                        help="scales of the orthogonal part to sweep")


def _run(model, tokenizer, config, seed):
    from .task import run_asm_refinement

    return run_asm_refinement(model, tokenizer, blocks=config["blocks"],
                              samples=config["samples"], betas=config["betas"], seed=seed)


TASKS = (
    family_task("asm-refinement", "an ASM model's refinement geometry and interventions",
                _add_arguments,
                lambda args, out: {"blocks": args.blocks, "samples": args.samples,
                                   "betas": args.betas, "model": args.model},
                _run, lazy("eval_harness.asm_refinement.report", "render_asm_refinement")),
)
