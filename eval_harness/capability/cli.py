"""``hf-memory eval capability``: its flags and config."""

from __future__ import annotations

from ..arguments import add_shared, non_negative_floats
from ..registry import EvalTask, config_run, lazy

__all__ = ["TASKS"]


def _add_arguments(parser) -> None:
    add_shared(parser, "--directions", "--additions", "--capitals", "--passages", "--bootstrap",
               "--selectors", additions=40, passages=40)
    parser.add_argument("--memory-gains", type=non_negative_floats, default=[1.0],
                        metavar="S,S,...",
                        help="also score memory with its layer gains scaled by these (1 = as "
                             "calibrated; e.g. 1,0.5,0.25)")


def _config(args, out):
    from .task import CapabilityConfig

    capitals = {} if args.capitals is None else {"capitals": args.capitals}
    return CapabilityConfig(directions=args.directions, additions=args.additions,
                            passages=args.passages, num_bootstrap=args.bootstrap,
                            seed=args.seed, memory_gain_scales=args.memory_gains, **capitals,
                            selectors_dir=args.selectors or str(out / "selectors"))


TASKS = (
    EvalTask("capability", "what steering costs on questions it should not touch",
             _add_arguments, _config,
             config_run("eval_harness.capability.task", "run_capability"),
             lazy("eval_harness.capability.report", "render_capability")),
)
