"""``hf-memory eval kv-footprint``: its flags and config."""

from __future__ import annotations

from ..arguments import add_shared
from ..registry import EvalTask, lazy

__all__ = ["TASKS"]


def _run(model, tokenizer, config, seed):
    from .task import run_kv_footprint

    return run_kv_footprint(model, tokenizer, traits=config["traits"],
                            top_layers=config["top_layers"])


TASKS = (
    EvalTask("kv-footprint", "banks vs visible prompt, eq. 10",
             lambda parser: add_shared(parser, "--traits", "--top-layers"),
             lambda args, out: {"traits": args.traits, "top_layers": args.top_layers}, _run,
             lazy("eval_harness.kv_footprint.report", "render_kv_footprint")),
)
