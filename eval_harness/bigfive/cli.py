"""``hf-memory eval bigfive`` and ``bigfive-gen``: their flags and config."""

from __future__ import annotations

from ..arguments import add_shared, csv_choices, finite, layer_spec, non_negative
from ..names import METHODS
from ..registry import EvalTask, config_run, lazy

__all__ = ["TASKS"]


def _add_arguments(parser) -> None:
    parser.add_argument("--method", type=csv_choices(METHODS), default=list(METHODS),
                        help=f"comma-separated methods (default: {','.join(METHODS)})")
    add_shared(parser, "--traits", "--limit", "--top-layers")
    parser.add_argument("--memory-layers", type=layer_spec, metavar="SPEC",
                        help="steer these layers (all heads) instead of calibrating a selector")
    parser.add_argument("--gain", type=non_negative, default=2.0, help="bank gain lambda")
    add_shared(parser, "--caa-layer")
    parser.add_argument("--caa-scale", type=finite, default=2.0)


def _config(args, out):
    from .task import BigFiveConfig

    return BigFiveConfig(methods=args.method, traits=args.traits, limit=args.limit,
                         top_layers=args.top_layers, bank_gain=args.gain,
                         memory_layers=args.memory_layers, caa_layer=args.caa_layer,
                         caa_scale=args.caa_scale, seed=args.seed)


_RENDER = lazy("eval_harness.bigfive.report", "render_bigfive")
TASKS = (
    EvalTask("bigfive", "IPIP-50 self-evaluation with DAS for each steering method",
             _add_arguments, _config, config_run("eval_harness.bigfive.task", "run_bigfive"),
             _RENDER),
    EvalTask("bigfive-gen", "open-ended generations scored by the offline lexicon judge, GAS",
             _add_arguments, _config,
             config_run("eval_harness.bigfive.generation", "run_bigfive_generation"), _RENDER),
)
