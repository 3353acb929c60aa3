"""``hf-memory eval tradeoff``: its flags and config."""

from __future__ import annotations

from ..arguments import add_shared
from ..registry import EvalTask, config_run, lazy

__all__ = ["TASKS"]


def _config(args, out):
    from .task import TradeoffConfig

    capitals = {} if args.capitals is None else {"capitals": args.capitals}
    return TradeoffConfig(directions=args.directions, additions=args.additions,
                          passages=args.passages, num_bootstrap=args.bootstrap, **capitals,
                          seed=args.seed, max_delta_nll=args.max_delta_nll,
                          selectors_dir=args.selectors)


TASKS = (
    EvalTask("tradeoff", "steering movement against its capability cost at matched strength",
             lambda parser: add_shared(parser, "--directions", "--additions", "--capitals",
                                       "--passages", "--max-delta-nll", "--bootstrap",
                                       "--selectors", additions=4, passages=16),
             _config, config_run("eval_harness.tradeoff.task", "run_tradeoff"),
             lazy("eval_harness.tradeoff.report", "render_tradeoff")),
)
