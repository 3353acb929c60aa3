"""``hf-memory eval guidance``: its flags and config."""

from __future__ import annotations

from ..arguments import add_shared, csv_choices
from ..names import RULES
from ..registry import EvalTask, config_run, lazy

__all__ = ["TASKS"]


def _add_arguments(parser) -> None:
    parser.add_argument("--rules", type=csv_choices(RULES), default=list(RULES),
                        help=f"answer-format rules (default: {','.join(RULES)})")
    parser.add_argument("--no-generate", action="store_true",
                        help="likelihood compliance only (skip the judged generations)")
    add_shared(parser, "--top-layers", "--candidate-layers", "--bootstrap", "--selectors")


def _config(args, out):
    from .task import GuidanceConfig

    return GuidanceConfig(rules=args.rules, generate=not args.no_generate,
                          top_layers=args.top_layers, candidate_layers=args.candidate_layers,
                          num_bootstrap=args.bootstrap, seed=args.seed,
                          selectors_dir=args.selectors or str(out / "selectors"))


TASKS = (
    EvalTask("guidance", "answer-format rules by prompt, CAA and memory", _add_arguments,
             _config, config_run("eval_harness.guidance.task", "run_guidance"),
             lazy("eval_harness.guidance.report", "render_guidance")),
)
