"""``hf-memory eval persona-ab``: its flags and config."""

from __future__ import annotations

from ..arguments import add_shared, csv_choices, layer_spec, positive_int
from ..names import PERSONA_SETS
from ..registry import EvalTask, config_run, lazy

__all__ = ["TASKS"]


def _add_arguments(parser) -> None:
    parser.add_argument("--sets", type=csv_choices(PERSONA_SETS), default=list(PERSONA_SETS),
                        metavar="S,S,...",
                        help=f"persona A/B sets among {', '.join(PERSONA_SETS)} (default: all "
                             "twelve)")
    parser.add_argument("--calibration-items", type=positive_int, default=32, metavar="N",
                        help="calibration items per set, for CAA's layer and scale and memory's "
                             "selector (default: 32)")
    parser.add_argument("--heldout-items", type=positive_int, default=200, metavar="N",
                        help="held-out items per set, disjoint from the calibration ones "
                             "(default: 200)")
    parser.add_argument("--caa-layers", type=layer_spec, metavar="SPEC",
                        help="CAA's candidate layers (default: a third, two fifths and half of "
                             "the depth)")
    add_shared(parser, "--top-layers", "--max-delta-nll", "--bootstrap", top_layers=3)


def _config(args, out):
    """Each finished set is saved in ``out/sets.partial.json``, and a rerun resumes from it."""
    from .task import PersonaABConfig

    return PersonaABConfig(sets=args.sets, calibration_items=args.calibration_items,
                           heldout_items=args.heldout_items, caa_layers=args.caa_layers,
                           top_layers=args.top_layers, cost_budget=args.max_delta_nll,
                           num_bootstrap=args.bootstrap, seed=args.seed,
                           checkpoint=str(out / "sets.partial.json"))


TASKS = (
    EvalTask("persona-ab", "steering-bench's persona A/B sets, propensity shift, steerability "
             "and wrong-way fraction of prompt, CAA and memory at matched cost",
             _add_arguments, _config, config_run("eval_harness.persona_ab.task", "run_persona_ab"),
             lazy("eval_harness.persona_ab.report", "render_persona_ab"),
             record=lambda config, args: {**vars(config), "model": args.model}),
)
